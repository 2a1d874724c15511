//! Upstream sessions initialized ahead of demand (`bridge.warm_sessions_per_shape`): a
//! call of a shape that came back runs on a session already open; a session is never used
//! by a call of another shape (other credentials, other capabilities); a warm session the
//! upstream forgot costs a fresh one, and the call runs once; idle ones are deleted. A
//! warm session's GET stream is opened with it, so its call goes up at once; its
//! replacement opens once the call has its answer, not beside it.

use crate::common::*;
use crate::scripted::{legacy_basics, Answer, Gate, ScriptedUpstream, Seen};
use mrtr_gateway::config::{Config, UpstreamEra};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A legacy upstream that numbers its sessions (`s1`, `s2`, ...), answers `tools/call`
/// with JSON at once (or, in a session it was told to hold, once the test opens a gate),
/// answers 404 to any request in a session it was told to forget, and 503 to the first
/// DELETE of a session it was told is caught restarting.
struct Numbered {
    upstream: ScriptedUpstream,
    forgotten: Arc<Mutex<HashSet<String>>>,
    held: Arc<Mutex<Option<(String, Gate)>>>,
    restarting: Arc<Mutex<HashSet<String>>>,
}

impl Numbered {
    fn start() -> Numbered {
        let opened = Arc::new(AtomicUsize::new(0));
        let forgotten: Arc<Mutex<HashSet<String>>> = Arc::default();
        let held: Arc<Mutex<Option<(String, Gate)>>> = Arc::default();
        let restarting: Arc<Mutex<HashSet<String>>> = Arc::default();
        let gone = forgotten.clone();
        let holding = held.clone();
        let refusing = restarting.clone();
        let upstream = ScriptedUpstream::start(move |seen: &Seen| {
            let session = seen.header("mcp-session-id").map(str::to_string);
            if session
                .as_ref()
                .is_some_and(|s| gone.lock().unwrap().contains(s))
            {
                return Answer::status(404, &[], b"");
            }
            let refused = |s: &String| refusing.lock().unwrap().remove(s);
            if seen.method == "DELETE" && session.as_ref().is_some_and(refused) {
                return Answer::status(503, &[], b"restarting");
            }
            if seen.method == "GET" {
                return Answer::sse(&[]);
            }
            if seen.jsonrpc_method().as_deref() == Some("initialize") {
                let n = opened.fetch_add(1, Ordering::SeqCst) + 1;
                return legacy_basics(seen, &format!("s{n}")).expect("an initialize");
            }
            if seen.jsonrpc_method().as_deref() == Some("tools/call") {
                let sid = seen.header("mcp-session-id").unwrap_or("-");
                let text = format!("ran in {sid}");
                let answer = Answer::json(
                    200,
                    &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                        "content": [{"type": "text", "text": text}]}}),
                );
                return match holding.lock().unwrap().as_ref() {
                    Some((held, gate)) if held == sid => {
                        Answer::silent().wait(gate).bytes(answer.pieces_bytes())
                    }
                    _ => answer,
                };
            }
            legacy_basics(seen, "-").unwrap_or_else(|| Answer::status(405, &[], b""))
        });
        Numbered {
            upstream,
            forgotten,
            held,
            restarting,
        }
    }

    /// Answers the first DELETE of session `sid` 503, as a server restarting does.
    fn refuse_first_delete_of(&self, sid: &str) {
        self.restarting.lock().unwrap().insert(sid.to_string());
    }

    /// How many DELETEs of session `sid` came.
    fn deletes_of(&self, sid: &str) -> usize {
        let requests = self.upstream.requests();
        let of = |s: &&Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some(sid);
        requests.iter().filter(of).count()
    }

    /// Holds the answer to the call in session `sid` until the gate returned opens.
    fn hold_calls_in(&self, sid: &str) -> Gate {
        let gate = Gate::new();
        *self.held.lock().unwrap() = Some((sid.to_string(), gate.clone()));
        gate
    }

    /// How many sessions were initialized.
    fn initialized(&self) -> usize {
        let requests = self.upstream.requests();
        let initialize = |s: &&Seen| s.jsonrpc_method().as_deref() == Some("initialize");
        requests.iter().filter(initialize).count()
    }

    /// The headers the `initialize` of session `sid` carried.
    fn initialize_of(&self, sid: &str) -> Seen {
        let requests = self.upstream.requests();
        let sessions_before = |i: usize| {
            requests[..i]
                .iter()
                .filter(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
                .count()
        };
        let n: usize = sid[1..].parse().expect("a numbered session");
        requests
            .iter()
            .enumerate()
            .find(|(i, s)| {
                s.jsonrpc_method().as_deref() == Some("initialize") && sessions_before(*i) == n - 1
            })
            .map(|(_, s)| s.clone())
            .expect("the session was initialized")
    }

    /// The `tools/call` requests, with the session each went out in.
    fn calls(&self) -> Vec<String> {
        self.upstream
            .requests()
            .iter()
            .filter(|s| s.jsonrpc_method().as_deref() == Some("tools/call"))
            .map(|s| s.header("mcp-session-id").unwrap_or("-").to_string())
            .collect()
    }
}

fn call(raw: &Raw, id: u64, capabilities: Value, headers: &[(&str, &str)]) -> String {
    let params = json!({"name": "work", "arguments": {}});
    let reply = raw.modern_with(id, "tools/call", params, capabilities, headers);
    assert_eq!(reply.status, 200);
    let done = reply.json();
    done["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("a result: {done}"))
        .to_string()
}

/// A gateway in front of `numbered`, known to be legacy (no era probe opens a session).
fn gateway(numbered: &Numbered, tweak: impl FnOnce(&mut Config)) -> TestGateway {
    TestGateway::start_with(&[&numbered.upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        tweak(c);
    })
}

fn warm_ready(gw: &TestGateway, n: f64) {
    wait_until(
        &format!("{n} warm sessions ready"),
        Duration::from_secs(10),
        || metric(&gw.admin, "mrtr_gateway_warm_sessions") == n,
    );
}

#[test]
fn a_call_of_a_shape_seen_before_runs_on_a_session_opened_ahead_of_it() {
    let numbered = Numbered::start();
    let gw = gateway(&numbered, |_| {});
    let raw = Raw::new(&gw.url);
    let alice = [("authorization", "Bearer alice")];
    assert_eq!(call(&raw, 1, json!({}), &alice), "ran in s1");
    // The shape comes back: s3 is opened for its next call.
    assert_eq!(call(&raw, 2, json!({}), &alice), "ran in s2");
    warm_ready(&gw, 1.0);
    let requests_before = numbered.upstream.count();
    // The next call of the shape takes s3, initialized before the call was made.
    assert_eq!(call(&raw, 3, json!({}), &alice), "ran in s3");
    assert!(numbered.initialize_of("s3").index < requests_before);
    // Its GET stream was opened with it: the call went up without opening another.
    let gets: Vec<usize> = numbered
        .upstream
        .requests()
        .iter()
        .filter(|s| s.method == "GET" && s.header("mcp-session-id") == Some("s3"))
        .map(|s| s.index)
        .collect();
    assert_eq!(gets.len(), 1, "{gets:?}");
    assert!(gets[0] < requests_before);
    assert_eq!(
        metric_with(
            &gw.admin,
            "mrtr_gateway_upstream_sessions_total",
            "event=\"warm\""
        ),
        Some(1.0)
    );
    // The warm session was opened with the caller's credentials.
    assert_eq!(
        numbered.initialize_of("s3").header("authorization"),
        Some("Bearer alice")
    );
    // Its replacement is opened; the used one is deleted after its call.
    warm_ready(&gw, 1.0);
    wait_until("s3 deleted", Duration::from_secs(5), || {
        numbered
            .upstream
            .requests()
            .iter()
            .any(|s| s.method == "DELETE" && s.header("mcp-session-id") == Some("s3"))
    });
}

#[test]
fn the_replacement_of_a_warm_session_opens_after_the_call_not_beside_it() {
    let numbered = Numbered::start();
    let gw = gateway(&numbered, |_| {});
    let alice = [("authorization", "Bearer alice")];
    warmed(&gw, &Raw::new(&gw.url), &alice);
    let gate = numbered.hold_calls_in("s3");
    let url = gw.url.clone();
    let caller = std::thread::spawn(move || call(&Raw::new(&url), 3, json!({}), &alice));
    wait_until("the call in s3", Duration::from_secs(10), || {
        numbered.calls().iter().any(|s| s == "s3")
    });
    // While the upstream works on the call, no session is initialized beside it: its
    // `initialize` would queue behind the call at a server that serves one at a time.
    let watched_until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < watched_until {
        assert_eq!(
            numbered.initialized(),
            3,
            "a session opened beside the call"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    gate.open();
    assert_eq!(caller.join().unwrap(), "ran in s3");
    // Once the client has its answer, the replacement opens.
    warm_ready(&gw, 1.0);
    assert_eq!(numbered.initialized(), 4);
}

/// Two calls of one shape (`headers`, no capabilities): the shape comes back, and
/// session s3 is opened ahead of its next call.
fn warmed(gw: &TestGateway, raw: &Raw, headers: &[(&str, &str)]) {
    assert_eq!(call(raw, 1, json!({}), headers), "ran in s1");
    assert_eq!(call(raw, 2, json!({}), headers), "ran in s2");
    warm_ready(gw, 1.0);
}

#[test]
fn a_warm_session_serves_only_calls_of_its_own_shape() {
    let numbered = Numbered::start();
    let gw = gateway(&numbered, |_| {});
    let raw = Raw::new(&gw.url);
    warmed(&gw, &raw, &[("authorization", "Bearer alice")]);
    // Other credentials, other capabilities: each opens a session of its own.
    let bob = call(&raw, 3, json!({}), &[("authorization", "Bearer bob")]);
    let eliciting = call(
        &raw,
        4,
        json!({"elicitation": {}}),
        &[("authorization", "Bearer alice")],
    );
    for ran_in in [&bob, &eliciting] {
        assert_ne!(
            ran_in, "ran in s3",
            "alice's warm session served another shape"
        );
    }
    let bob_session = bob.trim_start_matches("ran in ");
    assert_eq!(
        numbered.initialize_of(bob_session).header("authorization"),
        Some("Bearer bob")
    );
    assert_eq!(
        metric_with(
            &gw.admin,
            "mrtr_gateway_upstream_sessions_total",
            "event=\"warm\""
        ),
        Some(0.0)
    );
}

#[test]
fn a_shape_that_never_recurs_opens_nothing_ahead() {
    let numbered = Numbered::start();
    let gw = gateway(&numbered, |_| {});
    let raw = Raw::new(&gw.url);
    // A request id makes every request its own shape.
    for (n, id) in ["r1", "r2", "r3"].into_iter().enumerate() {
        let ran_in = call(&raw, n as u64 + 1, json!({}), &[("x-request-id", id)]);
        assert_eq!(ran_in, format!("ran in s{}", n + 1));
    }
    let initializes = numbered
        .upstream
        .requests()
        .iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
        .count();
    assert_eq!(initializes, 3, "one session per call, none ahead of demand");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_warm_sessions"), 0.0);
}

#[test]
fn a_warm_session_the_upstream_forgot_is_replaced_and_the_call_runs_once() {
    let numbered = Numbered::start();
    let gw = gateway(&numbered, |_| {});
    let raw = Raw::new(&gw.url);
    warmed(&gw, &raw, &[]);
    // The upstream restarts its session table: s3 is gone.
    numbered.forgotten.lock().unwrap().insert("s3".into());
    let ran_in = call(&raw, 3, json!({}), &[]);
    assert_ne!(ran_in, "ran in s3");
    let calls = numbered.calls();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert_eq!(
        calls[2], "s3",
        "the call was refused in the forgotten session"
    );
    assert_eq!(
        format!("ran in {}", calls[3]),
        ran_in,
        "then ran once, in a fresh one"
    );
}

#[test]
fn warm_sessions_that_idle_out_are_deleted() {
    let numbered = Numbered::start();
    let gw = gateway(&numbered, |c| {
        c.bridge.warm_session_idle_seconds = 1;
    });
    let raw = Raw::new(&gw.url);
    warmed(&gw, &raw, &[]);
    wait_until(
        "the idle warm session deleted",
        Duration::from_secs(10),
        || {
            numbered
                .upstream
                .requests()
                .iter()
                .any(|s| s.method == "DELETE" && s.header("mcp-session-id") == Some("s3"))
        },
    );
    warm_ready(&gw, 0.0);
    // The next call opens a session of its own.
    assert_eq!(call(&raw, 3, json!({}), &[]), "ran in s4");
}

/// An idle warm session's DELETE the upstream cannot take (it is restarting: a 503) is
/// sent again later: the SDK servers keep a session until it is deleted.
#[test]
fn a_warm_sessions_delete_that_failed_is_sent_again() {
    let numbered = Numbered::start();
    numbered.refuse_first_delete_of("s3");
    let gw = gateway(&numbered, |c| {
        c.bridge.warm_session_idle_seconds = 1;
    });
    warmed(&gw, &Raw::new(&gw.url), &[]);
    wait_until(
        "the warm session's DELETE sent again",
        Duration::from_secs(30),
        || numbered.deletes_of("s3") == 2,
    );
    let reaped = || metric_with(&gw.admin, "mrtr_gateway_upstream_sessions_total", "reaped");
    wait_until("the second DELETE taken", Duration::from_secs(5), || {
        reaped() == Some(1.0)
    });
    warm_ready(&gw, 0.0);
}

#[test]
fn a_server_without_sessions_is_not_warmed() {
    // Stateless: `initialize` answers without an Mcp-Session-Id.
    let upstream = ScriptedUpstream::start(|seen: &Seen| match seen.jsonrpc_method().as_deref() {
        Some("initialize") => Answer::json(
            200,
            &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                "serverInfo": {"name": "stateless", "version": "1"}}}),
        ),
        Some("tools/call") => Answer::json(
            200,
            &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                "content": [{"type": "text", "text": "done"}]}}),
        ),
        _ => legacy_basics(seen, "-").unwrap_or_else(|| Answer::status(405, &[], b"")),
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    for id in 1..=3 {
        assert_eq!(call(&raw, id, json!({}), &[]), "done");
    }
    let initializes = upstream
        .requests()
        .iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
        .count();
    assert_eq!(initializes, 3, "one per call, none ahead of demand");
}

#[test]
fn with_warm_sessions_off_every_call_opens_its_own() {
    let numbered = Numbered::start();
    let gw = gateway(&numbered, |c| {
        c.bridge.warm_sessions_per_shape = 0;
    });
    let raw = Raw::new(&gw.url);
    for n in 1..=3 {
        assert_eq!(call(&raw, n, json!({}), &[]), format!("ran in s{n}"));
    }
    assert_eq!(metric(&gw.admin, "mrtr_gateway_warm_sessions"), 0.0);
}
