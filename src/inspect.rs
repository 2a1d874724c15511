//! `mrtr-gateway inspect`: what a sealed token says, for an operator debugging a flow.
//! It opens a `requestState`, a session token or a data-layer session cookie with the configured keys, without the
//! request it belongs to, and lists its fields. Without the key that sealed it, it says
//! which key id that was and refuses.

use crate::keys::KeyRing;
use crate::mrtr::data_session::DataSession;
use crate::mrtr::state::{FlowState, Waiting};
use crate::protocol::session_token::SessionToken;
use crate::seal::{self, OpenError};
use std::fmt::Write;

/// The report for `token`, or why it cannot be opened.
pub fn inspect(ring: &KeyRing, token: &str, now: u64) -> Result<String, String> {
    let kid = seal::peek_kid(token).ok_or("not a sealed token: the envelope does not parse")?;
    if ring.find(kid.as_bytes()).is_none() {
        let held: Vec<&str> = ring.kids().collect();
        return Err(format!(
            "sealed under key '{kid}', which the configured keys ({}) do not hold",
            held.join(", ")
        ));
    }
    if let Ok((bound, state)) = FlowState::open_unbound(ring, token) {
        return Ok(state_report(&kid, &bound, &state, now));
    }
    if let Ok((bound, session)) = SessionToken::open_unbound(ring, token) {
        return Ok(session_report(&kid, &bound, &session));
    }
    if let Ok((bound, cookie)) = DataSession::open_unbound(ring, token) {
        return Ok(cookie_report(&kid, &bound, &cookie, now));
    }
    Err(format!(
        "does not open under key '{kid}' as a requestState, a session token or a session cookie ({}): tampered, or sealed with another secret under the same key id",
        OpenError::Rejected
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn expiry(at: u64, now: u64) -> String {
    if at > now {
        format!("{at} (valid for {} s more)", at - now)
    } else {
        format!("{at} (expired {} s ago)", now - at)
    }
}

fn state_report(kid: &str, bound: &[u8; 32], s: &FlowState, now: u64) -> String {
    let pending: Vec<String> = s
        .waiting
        .pending()
        .iter()
        .map(|p| format!("{}={}", p.key, p.upstream_id.to_json()))
        .collect();
    let call = s.waiting.call();
    let field =
        |f: fn(&crate::mrtr::state::UpstreamCall) -> String| call.map(f).unwrap_or_default();
    let positions = match &s.waiting {
        Waiting::Resumable { positions, .. } => positions.clone(),
        _ => Default::default(),
    };
    let fields = [
        ("kind", "requestState".to_string()),
        ("key id", kid.to_string()),
        ("flow id", format!("{:016x}", s.flow_id)),
        ("group", s.group.clone()),
        ("waits", waits(&s.waiting)),
        ("endpoint", field(|c| c.endpoint.to_string())),
        ("upstream session", field(|c| c.session.clone())),
        ("upstream revision", field(|c| c.version.to_string())),
        ("upstream call id", field(|c| c.id.to_json().to_string())),
        ("data session", s.waiting.data_session().to_string()),
        ("pending", pending.join(", ")),
        ("round", s.round.to_string()),
        ("last event id", positions.last_event_id.unwrap_or_default()),
        ("round start", positions.round_start.unwrap_or_default()),
        (
            "session stream from",
            positions.session_from.unwrap_or_default(),
        ),
        (
            "resumes primed",
            known(positions.upstream.primes).to_string(),
        ),
        (
            "sessions apart",
            known(positions.upstream.sessions_kept_apart).to_string(),
        ),
        ("known answers", s.known.len().to_string()),
        ("expires", expiry(s.expires_at, now)),
        ("flow deadline", expiry(s.flow_deadline, now)),
        ("principal tag", hex(&bound[..16])),
        ("request tag", hex(&bound[16..])),
    ];
    table(&fields)
}

/// A fact the sealing replica had learnt, or had not.
fn known(fact: Option<bool>) -> &'static str {
    match fact {
        Some(true) => "yes",
        Some(false) => "no",
        None => "not known",
    }
}

/// What a flow waits as, and for a held one, where: its owner's peer address and slot.
fn waits(waiting: &Waiting) -> String {
    match waiting {
        Waiting::Deferred { .. } => "deferred (the retry starts the call)".into(),
        Waiting::Resumable { .. } => "resumable".into(),
        Waiting::Reissue { .. } => "reissue (the retry posts the call again)".into(),
        Waiting::Held { at, .. } => {
            let owner = at
                .owner
                .map_or("the replica that ran it (no peer listener)".into(), |o| {
                    o.to_string()
                });
            format!("held by {owner}, slot {:016x}", at.slot)
        }
    }
}

fn session_report(kid: &str, bound: &[u8], s: &SessionToken) -> String {
    let fields = [
        ("kind", "session token (Mcp-Session-Id)".to_string()),
        ("key id", kid.to_string()),
        ("group", s.group.clone()),
        ("endpoint", s.endpoint.to_string()),
        ("upstream session", s.upstream_session.clone()),
        ("issued at", s.issued_at.to_string()),
        ("principal tag", hex(bound)),
    ];
    table(&fields)
}

fn cookie_report(kid: &str, bound: &[u8], s: &DataSession, now: u64) -> String {
    let fields = [
        (
            "kind",
            "data-layer session cookie (mcp/session)".to_string(),
        ),
        ("key id", kid.to_string()),
        ("session id", s.log_id()),
        ("group", s.group.clone()),
        ("endpoint", s.endpoint.to_string()),
        ("upstream session", s.upstream_session.clone()),
        ("upstream revision", s.version.to_string()),
        ("expires", expiry(s.expires_at, now)),
        ("principal tag", hex(bound)),
    ];
    table(&fields)
}

fn table(fields: &[(&str, String)]) -> String {
    fields
        .iter()
        .map(|(k, v)| format!("{k:<17} {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mrtr::state::{
        binding, Pending, Positions, UpstreamCall, UpstreamFacts, UpstreamId,
    };
    use crate::protocol::revision::Revision;

    fn ring(text: &str) -> KeyRing {
        KeyRing::parse(text).unwrap()
    }

    const K1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8";

    #[test]
    fn a_state_shows_its_fields_and_a_foreign_one_is_refused() {
        let state = FlowState {
            group: "default".into(),
            flow_id: 0xabc,
            started_ms: 1_000_000,
            flow_deadline: 2_000,
            expires_at: 1_000,
            round: 2,
            known: Vec::new(),
            waiting: Waiting::Resumable {
                call: UpstreamCall {
                    endpoint: "10.0.0.7:3001".parse().unwrap(),
                    session: "sess-1".into(),
                    id: UpstreamId::Number(1),
                    data_session: false,
                    version: Revision::parse("2025-06-18").unwrap(),
                },
                pending: vec![Pending {
                    key: "elicitation_0".into(),
                    upstream_id: UpstreamId::Number(0),
                    fingerprint: None,
                    asked: Default::default(),
                }],
                positions: Positions {
                    last_event_id: Some("ev-3".into()),
                    round_start: Some("ev-2".into()),
                    upstream: UpstreamFacts {
                        primes: Some(false),
                        sessions_kept_apart: None,
                    },
                    ..Positions::default()
                },
            },
        };
        let bind = binding(&[9; 32], "tools/call", Some("t"), None);
        let sealed = state.seal(&ring(K1), &bind);
        let report = inspect(&ring(K1), &sealed, 400).unwrap();
        for expected in [
            "requestState",
            "key id            k1",
            "10.0.0.7:3001",
            "sess-1",
            "upstream revision 2025-06-18",
            "elicitation_0=0",
            "round             2",
            "ev-3",
            "resumes primed    no",
            "sessions apart    not known",
            "1000 (valid for 600 s more)",
            "0000000000000abc",
            "09090909090909090909090909090909",
        ] {
            assert!(report.contains(expected), "{expected} in\n{report}");
        }
        let other = ring("k2:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8");
        let err = inspect(&other, &sealed, 400).unwrap_err();
        assert!(err.contains("key 'k1'") && err.contains("(k2)"), "{err}");
        let same_kid = ring("k1:AQECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8");
        assert!(inspect(&same_kid, &sealed, 400).is_err());
        assert!(inspect(&ring(K1), "garbage!", 400).is_err());
    }

    #[test]
    fn a_session_token_shows_its_upstream() {
        let token = SessionToken {
            group: "g".into(),
            endpoint: "127.0.0.1:9".parse().unwrap(),
            upstream_session: "up-1".into(),
            issued_at: 5,
        }
        .seal(&ring(K1), &[7; 32]);
        let report = inspect(&ring(K1), &token, 0).unwrap();
        assert!(
            report.contains("session token") && report.contains("up-1"),
            "{report}"
        );
        assert!(
            report.contains("07070707070707070707070707070707"),
            "{report}"
        );
    }
}
