//! The token opener on hostile text. Arbitrary text never panics and never opens as a
//! session token, a `requestState` or a data-layer session cookie. A genuine token with one fuzzer-chosen change (a
//! byte replaced, bytes cut or appended) opens only if the change was no change at all.
#![no_main]

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use libfuzzer_sys::fuzz_target;
use mrtr_gateway::keys::{KeyRing, Purpose};
use mrtr_gateway::mrtr::data_session::DataSession;
use mrtr_gateway::mrtr::state::{FlowState, Positions, UpstreamCall, UpstreamId, Waiting};
use mrtr_gateway::protocol::revision::Revision;
use mrtr_gateway::protocol::session_token::SessionToken;
use mrtr_gateway::seal;
use std::sync::OnceLock;

const KEYS: &str = "fuzz:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8";
const BIND: [u8; 32] = [3; 32];

struct Genuine {
    ring: KeyRing,
    state: String,
    session: String,
    cookie: String,
}

fn genuine() -> &'static Genuine {
    static G: OnceLock<Genuine> = OnceLock::new();
    G.get_or_init(|| {
        let ring = KeyRing::parse(KEYS).unwrap();
        let flow = FlowState {
            group: "default".into(),
            flow_id: 1,
            started_ms: 0,
            flow_deadline: u64::MAX,
            expires_at: u64::MAX,
            round: 1,
            known: Vec::new(),
            waiting: Waiting::Resumable {
                call: UpstreamCall {
                    endpoint: "127.0.0.1:3001".parse().unwrap(),
                    session: "s-1".into(),
                    id: UpstreamId::Number(1),
                    data_session: false,
                    version: Revision::default(),
                },
                pending: Vec::new(),
                positions: Positions {
                    last_event_id: Some("1:2".into()),
                    ..Positions::default()
                },
            },
        };
        let state = flow.seal(&ring, &BIND);
        let token = SessionToken {
            group: "default".into(),
            endpoint: "127.0.0.1:3001".parse().unwrap(),
            upstream_session: "s-1".into(),
            issued_at: 0,
        };
        let session = token.seal(&ring, &BIND);
        let cookie = DataSession {
            group: "default".into(),
            endpoint: "127.0.0.1:3001".parse().unwrap(),
            upstream_session: "s-1".into(),
            expires_at: u64::MAX,
            session_id: 1,
            version: Revision::default(),
        }
        .seal(&ring, &BIND);
        Genuine {
            ring,
            state,
            session,
            cookie,
        }
    })
}

fn opens(ring: &KeyRing, text: &str) -> bool {
    FlowState::open(ring, &BIND, text, 0).is_ok()
        || SessionToken::open(ring, &BIND, text).is_ok()
        || DataSession::open(ring, &BIND, text, 0).is_ok()
}

/// Applies one change to the raw bytes of `token`, chosen by `how`.
fn mutate(token: &str, how: &[u8]) -> Option<Vec<u8>> {
    let mut raw = URL_SAFE_NO_PAD.decode(token).ok()?;
    let (&op, rest) = how.split_first()?;
    let (&at, rest) = rest.split_first()?;
    let at = usize::from(at) % raw.len();
    match op % 3 {
        0 => raw[at] = rest.first().copied().unwrap_or(0),
        1 => raw.truncate(at),
        _ => raw.extend_from_slice(rest),
    }
    Some(raw)
}

fuzz_target!(|input: &[u8]| {
    let g = genuine();
    let text = String::from_utf8_lossy(input);
    for purpose in Purpose::ALL {
        let _ = seal::open(&g.ring, purpose, b"", &text, 1 << 16);
    }
    assert!(!opens(&g.ring, &text), "arbitrary text opened");
    for original in [&g.state, &g.session, &g.cookie] {
        let Some(changed) = mutate(original, input) else {
            continue;
        };
        let same = URL_SAFE_NO_PAD.decode(original.as_str()).ok() == Some(changed.clone());
        let encoded = URL_SAFE_NO_PAD.encode(&changed);
        assert_eq!(opens(&g.ring, &encoded), same, "a changed token opened");
    }
});
