//! Probing whether a group's event store keeps sessions apart, before a session's GET
//! stream is resumed with `Last-Event-ID`.
//!
//! A call's stream is safe to resume: every call goes upstream under a fresh random id,
//! and SDKs name a call's stream after its id. The GET stream is not: SDKs give every
//! session's GET stream the same name (`_GET_stream`), so a store shared by all sessions
//! and keyed by stream (as the SDKs' example stores are) replays every session's GET
//! events after the position, other users' questions among them. So once per endpoint
//! of a group (whose endpoints may run different servers), the gateway asks one
//! throwaway session to resume after an event id another throwaway session was given. A
//! store that keeps sessions apart refuses it or replays nothing; one that is shared
//! resolves it.

use crate::gateway::learnt::SessionReplay;
use crate::gateway::UpstreamSide;
use crate::mrtr::flow::FailureKind;
use crate::protocol::sse;
use crate::protocol::trace::TraceContext;
use crate::upstream::exchange::{Connection, Response};
use crate::upstream::legacy_session::{Caller, LegacySession, SessionFailure};
use crate::upstream::{Endpoint, UpstreamGroup};
use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;

/// Longest wait for the probing session's first event id.
const FIRST_ID_LIMIT: Duration = Duration::from_secs(1);
/// How long the foreign resumption is watched: a store that keeps sessions apart ends it
/// (or refuses it) at once.
const FOREIGN_WATCH: Duration = Duration::from_millis(300);
/// Longest a probe runs before its verdict is taken as unknown (the throwaway sessions it
/// opened then deleted within `ABANDON_LIMIT` each; one whose opening was cut, after its
/// `initialize` was answered, is left to the upstream's expiry): every first resumption
/// of the group waits for it, and an upstream that stopped answering would hold them for
/// its response timeout at each step. A probe takes milliseconds on most servers, about
/// 2.5 s on a FastMCP server that waits a second before answering each `initialize`.
const PROBE_LIMIT: Duration = Duration::from_secs(10);
/// How long after a failed probe (a throwaway session that did not open) the group's
/// store is taken as unknown without probing again, so that a stream of resumptions
/// does not cost the upstream two sessions each while it cannot open them.
const RETRY_AFTER_FAILED_PROBE: Duration = Duration::from_secs(30);

/// Whether the store at `endpoint` of `group` keeps sessions apart (each endpoint's own:
/// a group's endpoints may run different servers), probing it the first time with the
/// credentials of `caller` (the request that needs to know). One probe runs at a time
/// per group; requests that waited for it take its verdict, `Unknown` included, so a
/// crowd of first resumptions probes once. After a failed probe the next runs
/// `RETRY_AFTER_FAILED_PROBE` later at the earliest. Where this replica does not know and
/// the retry's state says what the replica that sealed it had learnt (`sealed`, from its
/// own probe or from a state before), that is taken, kept, and nothing is probed: our
/// keys sealed it, as this replica's own memory would keep it.
pub(crate) async fn session_replay(
    upstreams: &UpstreamSide,
    group: &UpstreamGroup,
    endpoint: &Endpoint,
    caller: &Caller,
    sealed: Option<bool>,
) -> SessionReplay {
    let (learnt, at) = (&upstreams.learnt, endpoint.addr);
    let before = learnt.store(&group.name, at);
    if before.session_replay != SessionReplay::Unknown {
        return before.session_replay;
    }
    if let Some(kept_apart) = sealed {
        return take_sealed(upstreams, group, at, kept_apart);
    }
    if before.retry_at.is_some_and(|at| Instant::now() < at) {
        return SessionReplay::Unknown;
    }
    let turn = learnt.probe_turn(&group.name, at);
    let _turn = turn.lock().await;
    let now = learnt.store(&group.name, at);
    if now.probes != before.probes {
        return now.session_replay;
    }
    let verdict = probe(upstreams, group, endpoint, caller).await;
    learnt.update_store(&group.name, at, |facts| {
        facts.session_replay = verdict;
        facts.probes = facts.probes.wrapping_add(1);
        facts.retry_at =
            (verdict == SessionReplay::Unknown).then(|| Instant::now() + RETRY_AFTER_FAILED_PROBE);
    });
    if verdict == SessionReplay::Unknown {
        tracing::info!(group = %group.name, endpoint = %at, retry_in = ?RETRY_AFTER_FAILED_PROBE, "could not probe whether the upstream's event store keeps sessions apart; GET streams reopen fresh meanwhile");
    } else {
        tracing::info!(group = %group.name, endpoint = %at, verdict = ?verdict, "probed whether the upstream's event store keeps sessions apart");
    }
    verdict
}

/// Takes the verdict a retry's state carries for its endpoint, as a probe's (requests
/// waiting for a probe of the group take it too), unless a probe here has given one
/// meanwhile.
fn take_sealed(
    upstreams: &UpstreamSide,
    group: &UpstreamGroup,
    at: SocketAddr,
    kept_apart: bool,
) -> SessionReplay {
    let mut verdict = SessionReplay::of_kept_apart(kept_apart);
    let before = upstreams.learnt.update_store(&group.name, at, |facts| {
        if facts.session_replay != SessionReplay::Unknown {
            verdict = facts.session_replay;
            return;
        }
        facts.session_replay = verdict;
        facts.probes = facts.probes.wrapping_add(1);
        facts.retry_at = None;
    });
    if before.session_replay == SessionReplay::Unknown {
        tracing::info!(group = %group.name, endpoint = %at, verdict = ?verdict, "took whether the upstream's event store keeps sessions apart from the state another replica sealed");
    }
    verdict
}

async fn probe(
    upstreams: &UpstreamSide,
    group: &UpstreamGroup,
    endpoint: &Endpoint,
    caller: &Caller,
) -> SessionReplay {
    let caller = Caller {
        trace: TraceContext::default(),
        headers: caller.headers.clone(),
    };
    let open = || {
        let info = json!({"name": "mrtr-gateway-probe", "version": env!("CARGO_PKG_VERSION")});
        let caller = &caller;
        async move {
            LegacySession::open(
                &upstreams.client,
                endpoint.clone(),
                &group.timeouts,
                &json!({}),
                &info,
                caller,
            )
            .await
            .ok()
            .map(|(session, _)| session)
        }
    };
    let deadline = Instant::now() + PROBE_LIMIT;
    let Ok(Some(first)) = tokio::time::timeout_at(deadline, open()).await else {
        return SessionReplay::Unknown;
    };
    let verdict = match tokio::time::timeout_at(deadline, first_event_id(&first)).await {
        Err(_) | Ok(Err(PingFailed)) => SessionReplay::Unknown,
        Ok(Ok(None)) => SessionReplay::Unavailable,
        Ok(Ok(Some(id))) => match tokio::time::timeout_at(deadline, open()).await {
            Ok(Some(second)) => {
                let resumed = tokio::time::timeout_at(deadline, resumes_foreign(&second, &id));
                let verdict = resumed.await.unwrap_or(SessionReplay::Unknown);
                second.abandon().await;
                verdict
            }
            _ => SessionReplay::Unknown,
        },
    };
    first.abandon().await;
    verdict
}

/// The probe's `ping` failed (cut, refused, a server error): that says nothing of the
/// upstream's event ids.
struct PingFailed;

/// The first event id of a `ping`'s SSE answer (SDKs prime POST streams with one); `None`
/// when the upstream answers in JSON or gives no ids.
async fn first_event_id(session: &LegacySession<'_>) -> Result<Option<String>, PingFailed> {
    let id = crate::gateway::bridge::fresh_call_id();
    let mut response = session.ping(id).await.map_err(|_| PingFailed)?;
    let id = if response.is_sse() {
        tokio::time::timeout(FIRST_ID_LIMIT, first_id(&mut response))
            .await
            .ok()
            .flatten()
    } else {
        None
    };
    session.client.finish(response).await;
    Ok(id)
}

async fn first_id(response: &mut Response) -> Option<String> {
    let mut parser = sse::Parser::new(response.max_message());
    let mut events = Vec::new();
    while let Ok(Some(chunk)) = response.next_chunk().await {
        parser.push(&chunk, &mut events).ok()?;
        if let Some(id) = events.iter().find_map(|e| e.id.clone()) {
            return Some(id);
        }
    }
    None
}

/// Resumes `session`'s GET stream after another session's event id: refused, or ended
/// without an event, means sessions are kept apart; an event, that they are not. No
/// answer, a 5xx, a status the request itself earned (denied, too large, too many), or
/// a stream cut before any event says nothing of the store: unknown, so GET streams
/// reopen fresh meanwhile.
async fn resumes_foreign(session: &LegacySession<'_>, foreign: &str) -> SessionReplay {
    let mut response = match session.get_stream(Some(foreign), Connection::Pooled).await {
        Ok(response) => response,
        Err(e) if says_nothing_of_the_store(e.failure()) => return SessionReplay::Unknown,
        Err(_) => return SessionReplay::Scoped,
    };
    let deadline = Instant::now() + FOREIGN_WATCH;
    let mut parser = sse::Parser::new(response.max_message());
    let mut events = Vec::new();
    let verdict = loop {
        match tokio::time::timeout_at(deadline, response.next_chunk()).await {
            // Still open: the store resolved the id and the stream is live.
            Err(_) => break SessionReplay::Shared,
            Ok(Ok(None)) => break SessionReplay::Scoped,
            Ok(Err(_)) => break SessionReplay::Unknown,
            Ok(Ok(Some(chunk))) => {
                let _ = parser.push(&chunk, &mut events);
                // An event (replayed, or priming the live stream): the id was resolved.
                // Comments and blank lines say nothing.
                if !events.is_empty() {
                    break SessionReplay::Shared;
                }
            }
        }
    };
    session.client.finish(response).await;
    verdict
}

/// Whether a failed resumption says nothing of whether the store resolved the id: only
/// a refusal of the request as such (`FailureKind::refused_for_good`), a session the
/// upstream no longer has, or an answer against the protocol is the store's word.
fn says_nothing_of_the_store(failure: &SessionFailure) -> bool {
    !matches!(failure, SessionFailure::Protocol(_) | SessionFailure::Gone)
        && !FailureKind::from(failure).refused_for_good()
}
