//! Resumption that real servers survive. Each behaviour comes from a shipping SDK and is
//! reproduced with the pinned ones: questions the TypeScript SDK pushes on the session's
//! GET stream between rounds, a store that forgets a call's events once its result is
//! sent (and answers a later resumption with an empty stream), and the Python SDK's
//! shared store under load. Every flow runs through two replicas with every request on
//! the other one, driven by the official Python and TypeScript clients.

use crate::common::*;
use crate::scripted::{
    legacy_basics, Answer, FirstRefused, Gate, OneQuestionCalls, ScriptedUpstream, Seen,
};
use mrtr_gateway::config::UpstreamEra;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Runs `scenario` with both official clients through replicas `a` and `b`, each
/// request to the other replica, `times` times each.
fn both_clients_alternating(a: &TestGateway, b: &TestGateway, scenario: &str, times: usize) {
    for i in 0..times {
        let lines = python_modern(&[&a.url, scenario, &b.url]);
        assert_modern_call(&lines, &format!("Python client, {scenario} #{i}"));
        let lines = ts_modern(&[&a.url, scenario, &b.url]);
        assert_modern_call(&lines, &format!("TypeScript client, {scenario} #{i}"));
    }
}

#[test]
fn questions_pushed_on_the_get_stream_in_sequence_complete_across_replicas() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    both_clients_alternating(&a, &b, "getstream-multi", 2);
    both_clients_alternating(&a, &b, "getstream", 1);
    println!(
        "two questions in sequence on the GET stream: both clients, rounds on alternating replicas"
    );
}

#[test]
fn a_server_that_forgets_a_calls_events_at_its_result_loses_no_flow() {
    let (_upstream, url) = start_upstream(Upstream::PythonForgetfulEventStore);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    both_clients_alternating(&a, &b, "elicit", 6);
    both_clients_alternating(&a, &b, "multi", 3);
    println!("a store that drops a call's events at its result: 18 flows, none lost");
}

/// The TypeScript SDK server sends no priming event on a resumed stream. The first retry a
/// replica takes to it waits to learn that (`mrtr_gateway_resumptions_unprimed_total`
/// counts the wait); the states it seals from then on say so, and a replica that has not
/// learnt it yet takes their word: the retries on the other replica never wait.
#[test]
fn whether_the_upstream_primes_travels_in_the_state_to_the_replica_taking_the_retry() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    let unprimed = |g: &TestGateway| {
        metric_with(
            &g.admin,
            "mrtr_gateway_resumptions_unprimed_total",
            "\"default\"",
        )
    };
    assert_eq!((unprimed(&a), unprimed(&b)), (Some(0.0), Some(0.0)));
    let lines = python_modern(&[&a.url, "elicit"]);
    assert_modern_call(&lines, "Python client, elicit on one replica");
    assert_eq!(
        unprimed(&a),
        Some(1.0),
        "the first retry waited to learn it"
    );
    both_clients_alternating(&a, &b, "elicit", 2);
    both_clients_alternating(&a, &b, "multi", 1);
    assert_eq!(
        (unprimed(&a), unprimed(&b)),
        (Some(1.0), Some(0.0)),
        "a retry waited for a priming event the states said would not come"
    );
}

/// Whether the group's store keeps sessions apart travels the same way: the replica that
/// probed it seals its verdict, and a replica taking a retry without one takes it rather
/// than opening two throwaway sessions to probe again. Where the store keeps sessions
/// apart that replica then resumes the session's GET stream from its position; where it
/// is shared, it reopens the stream fresh.
#[test]
fn whether_the_store_keeps_sessions_apart_travels_in_the_state_instead_of_a_second_probe() {
    for scoped in [true, false] {
        let upstream = resumable_server(Resumes::Primed, scoped, Asks::OnGetStreamAfterEvent);
        let a = TestGateway::start(&[&upstream.url()], &test_keys());
        let b = TestGateway::start(&[&upstream.url()], &test_keys());
        let (on_a, on_b) = (Raw::new(&a.url), Raw::new(&b.url));
        let done = |status: u16, reply: &Value| {
            assert_eq!(
                (status, &reply["result"]["content"][0]["text"]),
                (200, &json!("done")),
                "scoped store: {scoped}: {reply}"
            );
        };
        // A flow on `a` alone: its retry probes the store.
        let (_, first) = call_hostile(&on_a, 1, json!({}));
        let (status, reply) = call_hostile(&on_a, 2, answer(&first, json!({"name": "x"})));
        done(status, &reply);
        assert_eq!(foreign_probes(&upstream), 1, "scoped store: {scoped}");
        // Its first round on `a`, its retry on `b`, which has probed nothing.
        let (sid, before, status, reply) = round_then_retry(&upstream, &on_a, &on_b, 3);
        done(status, &reply);
        assert_eq!(
            foreign_probes(&upstream),
            1,
            "scoped store: {scoped}: the second replica probed again"
        );
        let get_stream_from = get_stream_positions(&upstream, &sid, before);
        let expected = match scoped {
            true => Some(format!("{sid}-g0")),
            false => None,
        };
        assert_eq!(get_stream_from, [expected], "scoped store: {scoped}");
    }
}

/// A store probe whose foreign resumption meets a 503 (a proxy in front, an upstream
/// restarting), or a stream cut before any event, learns nothing: the GET stream is
/// reopened fresh, as for a store that may be shared, not resumed after its position,
/// which on a shared store would replay other sessions' questions.
#[test]
fn a_store_probe_that_meets_a_5xx_or_a_cut_does_not_take_the_store_as_keeping_sessions_apart() {
    let busy = || Answer::status(503, &[], b"busy");
    let cut = || Answer::sse(&[]).then_reset();
    for (what, foreign) in [("5xx", busy as fn() -> Answer), ("cut", cut)] {
        let script = resumable_script(Resumes::Primed, false, Asks::OnGetStreamAfterEvent);
        let upstream = ScriptedUpstream::start(move |seen: &Seen| {
            if is_foreign_resumption(seen) {
                return foreign();
            }
            script(seen)
        });
        let gw = TestGateway::start(&[&upstream.url()], &test_keys());
        let raw = Raw::new(&gw.url);
        let (sid, before, status, reply) = round_then_retry(&upstream, &raw, &raw, 1);
        assert_eq!(
            (status, &reply["result"]["content"][0]["text"]),
            (200, &json!("done")),
            "{what}: {reply}"
        );
        assert_eq!(foreign_probes(&upstream), 1, "{what}: the store was probed");
        let get_stream_from = get_stream_positions(&upstream, &sid, before);
        assert_eq!(
            get_stream_from,
            [None],
            "{what}: the GET stream was resumed"
        );
    }
}

/// A flow's first round through `first_on` and its retry through `retry_on` (request
/// ids `id` and `id + 1`): the call's upstream session, how many requests the upstream
/// had read before the retry, and the retry's status and reply.
pub(crate) fn round_then_retry(
    upstream: &ScriptedUpstream,
    first_on: &Raw,
    retry_on: &Raw,
    id: u64,
) -> (String, usize, u16, Value) {
    let (_, first) = call_hostile(first_on, id, json!({}));
    let sid = call_sessions(upstream)
        .pop()
        .expect("the call went upstream");
    let before = upstream.requests().len();
    let (status, reply) = call_hostile(retry_on, id + 1, answer(&first, json!({"name": "x"})));
    (sid, before, status, reply)
}

/// How many store probes (resumptions after another session's event id) the upstream got.
pub(crate) fn foreign_probes(upstream: &ScriptedUpstream) -> usize {
    let requests = upstream.requests();
    requests.iter().filter(|s| is_foreign_resumption(s)).count()
}

/// Where session `sid`'s GET streams opened after the upstream's `before`th request
/// resumed from (`None`: opened fresh); the call's own stream's resumptions left out.
pub(crate) fn get_stream_positions(
    upstream: &ScriptedUpstream,
    sid: &str,
    before: usize,
) -> Vec<Option<String>> {
    upstream.requests()[before..]
        .iter()
        .filter(|s| s.method == "GET" && s.header("mcp-session-id") == Some(sid))
        .filter(|s| !s.header("last-event-id").unwrap_or_default().contains("-c"))
        .map(|s| s.header("last-event-id").map(str::to_string))
        .collect()
}

/// A probe's resumption: a GET resuming after an event id of a session other than its own.
fn is_foreign_resumption(seen: &Seen) -> bool {
    let sid = seen.header("mcp-session-id").unwrap_or_default();
    seen.method == "GET"
        && seen
            .header("last-event-id")
            .is_some_and(|after| !after.starts_with(&format!("{sid}-")))
}

/// FastMCP for TypeScript asks every question on the session's GET stream, never on the
/// call's, and waits a second on every `initialize`: both official clients complete one
/// question, two in turn and two at once (`Promise.all`), every request on the other of
/// two replicas, every round resumable (none held) and every resumption answered.
#[test]
fn a_typescript_fastmcp_server_asking_on_the_get_stream_completes_every_flow_across_replicas() {
    let (_upstream, url) = start_upstream(Upstream::TypeScriptFastMcp);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    both_clients_alternating(&a, &b, "elicit", 2);
    both_clients_alternating(&a, &b, "multi", 1);
    both_clients_alternating(&a, &b, "two", 1);
    let replicas = [&a, &b];
    // Per client: two one-question flows, two rounds of one, and the pair in one round
    // (or two, when one question misses the first).
    let rounds = sum(replicas, input_required_calls);
    assert!((10.0..=12.0).contains(&rounds), "{rounds} rounds asked");
    let held = |g: &TestGateway| {
        metric_with(&g.admin, "mrtr_gateway_held_flow_events_total", "\"held\"").unwrap_or(0.0)
    };
    assert_eq!(sum(replicas, held), 0.0, "a round was held");
    let failed = |g: &TestGateway| {
        metric_with(
            &g.admin,
            "mrtr_gateway_upstream_resumptions_total",
            "failed",
        )
        .unwrap_or(0.0)
    };
    assert_eq!(sum(replicas, failed), 0.0, "a resumption failed");
    assert_resumable(&a, true, "FastMCP for TypeScript");
}

#[test]
fn the_python_sdk_store_under_load_completes_every_flow_across_replicas() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    // Parallel flows from other clients keep the server and its shared store busy.
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| both_clients_alternating(&a, &b, "two", 3));
        }
        both_clients_alternating(&a, &b, "multi", 3);
    });
}

/// A tool that asks the user (on the call's POST stream) and the client's model (on the
/// session's GET stream, as the Python SDK sends an unrelated request) at once, on a
/// server whose store is shared by sessions: the retry reopens the GET stream fresh, so a
/// round that ended on the first question would lose the second, and the call would hang
/// until the silence limit. Every flow completes, rounds on alternating replicas.
#[test]
fn a_question_on_the_get_stream_beside_one_on_the_call_stream_is_never_lost() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    std::thread::scope(|scope| {
        scope.spawn(|| both_clients_alternating(&a, &b, "ask-and-sample", 3));
        both_clients_alternating(&a, &b, "ask-and-sample", 3);
    });
}

#[test]
fn official_clients_show_the_gateways_error_for_an_upstream_failure() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "session-1") {
            return answer;
        }
        match seen.jsonrpc_method().as_deref() {
            Some("tools/call") => Answer::status(500, &[], b"internal error"),
            Some("tools/list") => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": [
                    {"name": "broken", "inputSchema": {"type": "object"}}]}}),
            ),
            _ => Answer::status(405, &[], b""),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    for (client, lines) in [
        ("Python", python_modern(&[&gw.url, "failing"])),
        ("TypeScript", ts_modern(&[&gw.url, "failing"])),
    ] {
        let error = lines
            .iter()
            .find(|l| l["step"] == "error")
            .unwrap_or_else(|| panic!("{client}: no error reported: {lines:?}"));
        let message = error["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("upstream group 'default' failed") && message.contains("HTTP 500"),
            "{client} hid the gateway's message: {error}"
        );
        assert_eq!(error["code"], -32603, "{client}: {error}");
        println!("{client} client shows: {message}");
    }
}

/// How the scripted server answers a `Last-Event-ID` resumption of a call's stream.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Resumes {
    /// Replays nothing new, primes the stream, and sends the result once the answer is in.
    Primed,
    /// 200 and a stream that ends at once: its store forgot the call.
    Empty,
    /// Primes the stream, then says nothing more.
    Silent,
    /// Resets the connection before any answer, once (an upstream restarting); primed
    /// after that.
    CutOnce,
}

/// Where the scripted server's call asks its question.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Asks {
    /// On the call's stream, after its priming event.
    AfterPriming,
    /// On the call's stream, as its first event (a server that sends no priming event).
    FirstEvent,
    /// On the session's GET stream, as its first event.
    OnGetStream,
    /// On the session's GET stream, after an event (`{session}-g0`) it replays from.
    OnGetStreamAfterEvent,
}

/// A scripted legacy server with sessions `s0`, `s1`, …: the call asks one question on
/// its stream (event ids `{session}-c1` priming, unless `Asks::FirstEvent`, and
/// `{session}-c2` the question), or on the session's GET stream (`{session}-g1`, after
/// `{session}-g0` with `Asks::OnGetStreamAfterEvent`); a
/// `ping` is primed with `{session}-p`. A resumption after another session's event id is refused when `scoped`,
/// and resolved (a live, primed stream) when not, as a shared store does.
pub(crate) fn resumable_server(resumes: Resumes, scoped: bool, asks: Asks) -> ScriptedUpstream {
    ScriptedUpstream::start(resumable_script(resumes, scoped, asks))
}

/// `resumable_server`'s answer to each request.
pub(crate) fn resumable_script(
    resumes: Resumes,
    scoped: bool,
    asks: Asks,
) -> impl Fn(&Seen) -> Answer + Send + Sync + 'static {
    let sessions = AtomicUsize::new(0);
    let answered = Gate::new();
    let call_id = Mutex::new(Value::Null);
    let cut = AtomicBool::new(false);
    move |seen: &Seen| {
        let sid = seen
            .header("mcp-session-id")
            .unwrap_or_default()
            .to_string();
        let question = |id: u64| {
            json!({"jsonrpc": "2.0", "id": id, "method": "elicitation/create", "params": {
                "mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}})
        };
        if seen.method == "GET" {
            let Some(after) = seen.header("last-event-id") else {
                let stream = Answer::sse(&[]);
                return match asks {
                    Asks::OnGetStream => stream.event(Some(&format!("{sid}-g1")), &question(1)),
                    Asks::OnGetStreamAfterEvent => stream
                        .event(Some(&format!("{sid}-g0")), &json!(""))
                        .event(Some(&format!("{sid}-g1")), &question(1)),
                    _ => stream,
                };
            };
            if !after.starts_with(&format!("{sid}-")) {
                return match scoped {
                    true => Answer::status(400, &[], b"unknown event id"),
                    false => Answer::sse(&[]).event(Some(&format!("{sid}-x")), &json!("")),
                };
            }
            if after == format!("{sid}-g0") {
                return Answer::sse(&[]).event(Some(&format!("{sid}-g1")), &question(1));
            }
            if after.starts_with(&format!("{sid}-g")) {
                return Answer::sse(&[]);
            }
            let result = json!({"jsonrpc": "2.0", "id": *call_id.lock().unwrap(), "result": {
                "content": [{"type": "text", "text": "done"}]}});
            let primed = Answer::sse(&[]).event(Some(&format!("{sid}-c3")), &json!(""));
            return match resumes {
                Resumes::CutOnce if !cut.swap(true, Ordering::SeqCst) => {
                    Answer::silent().then_reset()
                }
                Resumes::Primed | Resumes::CutOnce => {
                    primed.wait(&answered).event(None, &result).end()
                }
                Resumes::Empty => Answer::sse(&[]).end(),
                Resumes::Silent => primed,
            };
        }
        let body = seen.json().unwrap_or_default();
        if body.get("method").is_none() && body.get("result").is_some() {
            answered.open();
            return Answer::status(202, &[], b"");
        }
        match body["method"].as_str() {
            Some("initialize") => {
                let n = sessions.fetch_add(1, Ordering::SeqCst);
                legacy_basics(seen, &format!("s{n}")).expect("initialize")
            }
            Some("ping") => Answer::sse(&[])
                .event(Some(&format!("{sid}-p")), &json!(""))
                .event(
                    None,
                    &json!({"jsonrpc": "2.0", "id": body["id"], "result": {}}),
                )
                .end(),
            Some("tools/call") => {
                *call_id.lock().unwrap() = body["id"].clone();
                let primed = Answer::sse(&[]).event(Some(&format!("{sid}-c1")), &json!(""));
                let asked = |stream: Answer| stream.event(Some(&format!("{sid}-c2")), &question(0));
                match asks {
                    Asks::AfterPriming => asked(primed),
                    Asks::FirstEvent => asked(Answer::sse(&[])),
                    Asks::OnGetStream | Asks::OnGetStreamAfterEvent => primed,
                }
            }
            _ => legacy_basics(seen, "unused").unwrap_or_else(|| Answer::status(405, &[], b"")),
        }
    }
}

pub(crate) fn call_hostile(raw: &Raw, id: u64, extra: Value) -> (u16, Value) {
    let params = tool_params("hostile", extra);
    let reply = raw.modern(id, "tools/call", params, json!({"elicitation": {}}));
    (reply.status, reply.json())
}

/// Index in the upstream's log of the first request matching `what`.
fn first_index(upstream: &ScriptedUpstream, what: impl Fn(&Seen) -> bool) -> Option<usize> {
    upstream.requests().iter().position(what)
}

/// The upstream session the call ran in.
fn call_session(upstream: &ScriptedUpstream) -> String {
    let first = call_sessions(upstream).into_iter().next();
    first.expect("the call went upstream")
}

/// The upstream sessions the calls ran in, in the order they went upstream.
fn call_sessions(upstream: &ScriptedUpstream) -> Vec<String> {
    let requests = upstream.requests();
    let calls = requests
        .iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("tools/call"));
    calls
        .filter_map(|s| s.header("mcp-session-id").map(str::to_string))
        .collect()
}

/// A retry refused with -32602 (HTTP 400) for want of the answer under `key`.
fn assert_told_missing(status: u16, reply: &Value, key: &str) {
    assert_eq!(
        (status, &reply["error"]["code"]),
        (400, &json!(-32602)),
        "{reply}"
    );
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("no answer for \"{key}\"")),
        "{reply}"
    );
}

fn is_answer(seen: &Seen) -> bool {
    seen.json()
        .is_some_and(|m| m.get("method").is_none() && m.get("result").is_some())
}

#[test]
fn a_retry_reopens_the_call_stream_before_it_posts_the_answers() {
    let upstream = resumable_server(Resumes::Primed, true, Asks::AfterPriming);
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    let (status, done) = call_hostile(&raw, 2, answer(&first, json!({"name": "x"})));
    assert_eq!(
        (status, &done["result"]["content"][0]["text"]),
        (200, &json!("done")),
        "{done}"
    );
    let sid = call_session(&upstream);
    let question = format!("{sid}-c2");
    let resumed = first_index(&upstream, |s| {
        s.header("last-event-id") == Some(question.as_str())
    });
    let answered = first_index(&upstream, is_answer);
    assert!(
        resumed.is_some() && resumed < answered,
        "the answer went up before the call's stream was reopened: {:?}",
        upstream.requests()
    );
}

/// The question that opened the call's stream cannot be replayed: a retry without its
/// answer is told at once which answer is missing (not left waiting for a question that
/// never comes again), nothing goes upstream, and the same state with the answer
/// completes the call.
#[test]
fn a_retry_missing_the_answer_to_an_unreplayable_question_is_told_and_may_retry() {
    let upstream = resumable_server(Resumes::Primed, true, Asks::FirstEvent);
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    let state = first["result"]["requestState"].clone();
    let before = upstream.requests().len();
    let (status, refused) = call_hostile(
        &raw,
        2,
        json!({"inputResponses": {}, "requestState": state}),
    );
    assert_told_missing(status, &refused, "elicitation_0");
    assert_eq!(upstream.requests().len(), before, "nothing went upstream");
    let (status, done) = call_hostile(&raw, 3, answer(&first, json!({"name": "x"})));
    assert_eq!(
        (status, &done["result"]["content"][0]["text"]),
        (200, &json!("done")),
        "{done}"
    );
    let answers = upstream.requests().iter().filter(|s| is_answer(s)).count();
    assert_eq!(answers, 1, "one answer upstream");
}

/// A question the session's GET stream sent after another event there: a retry that
/// leaves it unanswered resumes that stream from before it, where the group's store keeps
/// sessions apart, and the client is asked it again; with a store shared across sessions
/// (the stream reopens fresh) the client is told which answer is missing and nothing goes
/// upstream. The answer then completes the call.
#[test]
fn an_unanswered_question_from_the_get_stream_is_asked_again_where_it_can_be() {
    for scoped in [true, false] {
        let upstream = resumable_server(Resumes::Primed, scoped, Asks::OnGetStreamAfterEvent);
        let gw = TestGateway::start(&[&upstream.url()], &test_keys());
        let raw = Raw::new(&gw.url);
        let (_, first) = call_hostile(&raw, 1, json!({}));
        assert_eq!(first["result"]["resultType"], "input_required", "{first}");
        let state = first["result"]["requestState"].clone();
        let before = upstream.requests().len();
        let (status, again) = call_hostile(
            &raw,
            2,
            json!({"inputResponses": {}, "requestState": state}),
        );
        let next = match scoped {
            true => {
                assert_eq!(
                    again["result"]["inputRequests"], first["result"]["inputRequests"],
                    "asked again: {again}"
                );
                again
            }
            false => {
                assert_told_missing(status, &again, "elicitation_1");
                let after: Vec<_> = upstream.requests()[before..]
                    .iter()
                    .filter(|s| {
                        s.header("mcp-session-id") == Some(call_session(&upstream).as_str())
                    })
                    .map(|s| s.method.clone())
                    .collect();
                assert!(
                    after.is_empty(),
                    "nothing went to the call's session: {after:?}"
                );
                first
            }
        };
        let (status, done) = call_hostile(&raw, 3, answer(&next, json!({"name": "x"})));
        assert_eq!(
            (status, &done["result"]["content"][0]["text"]),
            (200, &json!("done")),
            "scoped store: {scoped}: {done}"
        );
        let answers = upstream.requests().iter().filter(|s| is_answer(s)).count();
        assert_eq!(answers, 1, "one answer upstream");
    }
}

#[test]
fn an_empty_resumption_loses_the_flow_clearly_and_holds_the_groups_later_flows() {
    let upstream = resumable_server(Resumes::Empty, true, Asks::AfterPriming);
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    let resumable = || metric_with(&gw.admin, "mrtr_gateway_upstream_resumable", "default");
    assert_eq!(resumable(), Some(1.0), "the first round waits resumable");
    let (status, lost) = call_hostile(&raw, 2, answer(&first, json!({"name": "x"})));
    assert_eq!(status, 200, "{lost}");
    assert_eq!(lost["error"]["code"], -32012, "{lost}");
    let message = lost["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("no longer has this call's events"),
        "{lost}"
    );
    assert_eq!(resumable(), Some(0.0), "the group's later flows are held");
    assert!(
        !upstream.requests().iter().any(is_answer),
        "an answer was posted into a call whose events are gone"
    );
    wait_until(
        "the dead call's session deleted",
        Duration::from_secs(5),
        || upstream.requests().iter().any(|s| s.method == "DELETE"),
    );
}

/// A resumption whose connection is cut before any answer (an upstream restarting) says
/// nothing of the group's store: the retry fails with its state still good, the same state
/// then completes, and the group's flows stay resumable.
#[test]
fn a_resumption_cut_by_a_restarting_upstream_leaves_the_group_resumable() {
    let upstream = resumable_server(Resumes::CutOnce, true, Asks::AfterPriming);
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let retry = answer(&first_round_resumable(&gw), json!({"name": "x"}));
    let (status, cut) = call_hostile(&raw, 2, retry.clone());
    assert_eq!(status, 200, "{cut}");
    let message = cut["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("resuming the call's stream"), "{cut}");
    assert_the_same_state_goes_on(&gw, &upstream, retry);
}

/// A retry whose own headers are too large for the upstream (Node's 16 KiB limit, below
/// the gateway's 32 KiB) earns a 431 on its resumption: the client is told, the state
/// stays good for a retry that fits, and the group's later flows stay resumable, since
/// one caller's request says nothing of the upstream's store.
#[test]
fn a_retry_too_large_for_the_upstream_leaves_the_group_resumable() {
    let script = resumable_script(Resumes::Primed, true, Asks::AfterPriming);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let bytes: usize = seen.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        if bytes > 16 << 10 {
            return Answer::status(431, &[], b"Request Header Fields Too Large");
        }
        script(seen)
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let retry = answer(&first_round_resumable(&gw), json!({"name": "x"}));
    let padding = "p".repeat(20 << 10);
    let params = tool_params("hostile", retry.clone());
    let caps = json!({"elicitation": {}});
    let padded = raw.modern_with(2, "tools/call", params, caps, &[("x-padding", &padding)]);
    let refused = padded.json();
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("HTTP 431"), "{refused}");
    assert_the_same_state_goes_on(&gw, &upstream, retry);
}

fn group_resumable(gw: &TestGateway) -> Option<f64> {
    metric_with(&gw.admin, "mrtr_gateway_upstream_resumable", "default")
}

/// The first round of a call of `hostile`, which waits resumable.
fn first_round_resumable(gw: &TestGateway) -> Value {
    let (_, first) = call_hostile(&Raw::new(&gw.url), 1, json!({}));
    assert_eq!(
        group_resumable(gw),
        Some(1.0),
        "the first round waits resumable"
    );
    first
}

/// After a retry refused before it reached the call: the group's flows stay resumable,
/// no answer went up, and the same `retry` completes the call.
fn assert_the_same_state_goes_on(gw: &TestGateway, upstream: &ScriptedUpstream, retry: Value) {
    assert_eq!(
        group_resumable(gw),
        Some(1.0),
        "the group's flows stay resumable"
    );
    assert!(!upstream.requests().iter().any(is_answer), "nothing posted");
    let (status, done) = call_hostile(&Raw::new(&gw.url), 3, retry);
    assert_eq!(
        (status, &done["result"]["content"][0]["text"]),
        (200, &json!("done")),
        "the same state goes on: {done}"
    );
}

#[test]
fn a_round_the_upstream_leaves_silent_ends_with_a_clear_error() {
    let upstream = resumable_server(Resumes::Silent, true, Asks::AfterPriming);
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.bridge.round_silence_seconds = 1;
        c.bridge.resume_poll_ms = 200;
    });
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    let started = Instant::now();
    // Keep-alive comments keep the client's read alive, so the wait is bounded here.
    let (sent, answered) = std::sync::mpsc::channel();
    let retry = answer(&first, json!({"name": "x"}));
    let url = gw.url.clone();
    std::thread::spawn(move || {
        let _ = sent.send(call_hostile(&Raw::new(&url), 2, retry));
    });
    let (status, body) = answered
        .recv_timeout(Duration::from_secs(10))
        .expect("the silent round ended within 10 s");
    assert_eq!(status, 200, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("upstream group 'default' sent nothing for 1 s")
            && message.contains("tools/call 'hostile'"),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn the_get_stream_is_resumed_only_where_the_store_keeps_sessions_apart() {
    for scoped in [true, false] {
        let upstream = resumable_server(Resumes::Primed, scoped, Asks::OnGetStream);
        let gw = TestGateway::start(&[&upstream.url()], &test_keys());
        let raw = Raw::new(&gw.url);
        let (_, first) = call_hostile(&raw, 1, json!({}));
        assert_eq!(first["result"]["resultType"], "input_required", "{first}");
        let (_, _done) = call_hostile(&raw, 2, answer(&first, json!({"name": "x"})));
        let sid = call_session(&upstream);
        let session_gets: Vec<Option<String>> = upstream
            .requests()
            .iter()
            .filter(|s| s.method == "GET" && s.header("mcp-session-id") == Some(sid.as_str()))
            .map(|s| s.header("last-event-id").map(str::to_string))
            .filter(|after| {
                !after
                    .as_deref()
                    .is_some_and(|a| a.starts_with(&format!("{sid}-c")))
            })
            .collect();
        let want = scoped.then(|| format!("{sid}-g1"));
        assert_eq!(
            session_gets.last(),
            Some(&want),
            "scoped store: {scoped}; the flow's GET streams: {session_gets:?}"
        );
    }
}

/// One caller's resumable flows take at most `bridge.max_watched_sessions_per_principal`
/// of the replica's table of flows waiting for answers, so a client that abandons its
/// flows cannot lock the others out; requests without a credential share only the
/// table's bound; a flow that ends gives its caller's slot back.
#[test]
fn one_caller_parks_at_most_its_share_of_the_waiting_flows() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.bridge.max_watched_sessions_per_principal = 2
    });
    let raw = Raw::new(&gw.url);
    let ask_as = |id: u64, who: &str, extra: Value| ask_name_as(&raw, id, who, extra);
    let asked = |reply: &Value| reply["result"]["resultType"] == "input_required";
    let first = ask_as(1, "mallory", json!({}));
    let second = ask_as(2, "mallory", json!({}));
    assert!(asked(&first) && asked(&second), "{first} {second}");
    let refused = ask_as(3, "mallory", json!({}));
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("bridge.max_watched_sessions_per_principal"),
        "{refused}"
    );
    let alice = ask_as(4, "alice", json!({}));
    assert!(asked(&alice), "another caller's flow waits: {alice}");
    for id in [5, 6, 7] {
        let anonymous = ask_name(&raw, id, json!({}));
        assert!(asked(&anonymous), "{anonymous}");
    }
    assert_eq!(metric(&gw.admin, "mrtr_gateway_pending_flows"), 6.0);
    let done = ask_as(8, "mallory", answer(&first, json!({"name": "Ann"})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Ann!",
        "{done}"
    );
    let again = ask_as(9, "mallory", json!({}));
    assert!(asked(&again), "the slot came back: {again}");
}

/// Every `server/discover` opens a session of its caller's shape; lists of that shape run
/// at the same time on the session kept for it. The new session must not replace the kept
/// one while lists run on it: deleting it cut them ("ended its stream without a message").
#[test]
fn lists_running_on_a_kept_session_are_not_cut_by_a_discovery_of_their_shape() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let failures = AtomicUsize::new(0);
    for round in 0..8u64 {
        std::thread::scope(|scope| {
            scope.spawn(|| {
                raw.modern(round, "server/discover", json!({}), json!({}))
                    .json()
            });
            for n in 0..6 {
                let (raw, failures) = (&raw, &failures);
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_millis(2 * n));
                    let listed = raw.modern(n, "tools/list", json!({}), json!({})).json();
                    if !listed["result"]["tools"].is_array() {
                        eprintln!("round {round}: {listed}");
                        failures.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
    }
    assert_eq!(failures.load(Ordering::SeqCst), 0, "lists failed");
}

/// The replica that opened a flow watches its session until the flow's deadline, and
/// cannot know that another replica ended the flow (and deleted the session). When those
/// entries fill its table, it asks the upstream which sessions are gone and frees them,
/// rather than refuse new calls as if flows were waiting for input.
#[test]
fn flows_that_ended_on_another_replica_free_their_watch_when_the_table_fills() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let small = |c: &mut mrtr_gateway::config::Config| {
        c.bridge.max_watched_sessions = 3;
    };
    let a = TestGateway::start_with(&[&url], &test_keys(), small);
    let b = TestGateway::start_with(&[&url], &test_keys(), small);
    for id in 0..8 {
        let first = ask_name(&Raw::new(&a.url), 2 * id, json!({}));
        let done = ask_name(
            &Raw::new(&b.url),
            2 * id + 1,
            answer(&first, json!({"name": "Kim"})),
        );
        assert_eq!(
            done["result"]["content"][0]["text"], "Hello, Kim!",
            "flow {id}: {done}"
        );
    }
    assert!(metric(&a.admin, "mrtr_gateway_pending_flows") <= 3.0);
}

/// A kept one-shot session whose endpoint went down serves no one: a list that finds its
/// endpoint refusing connections goes on a new session on the group's other endpoint,
/// rather than fail for as long as clients keep listing.
#[test]
fn lists_go_to_another_endpoint_when_the_kept_sessions_one_is_down() {
    let (port_a, port_b) = (free_port(), free_port());
    let (mut a, url_a) = start_upstream_on(Upstream::Python, port_a);
    let (mut b, url_b) = start_upstream_on(Upstream::Python, port_b);
    let gw = TestGateway::start(&[&url_a, &url_b], &test_keys());
    let raw = Raw::new(&gw.url);
    let list = |id: u64| {
        let listed = raw.modern(id, "tools/list", json!({}), json!({})).json();
        assert!(listed["result"]["tools"].is_array(), "list {id}: {listed}");
    };
    list(1);
    // Whichever endpoint holds the kept session, one of the two stops finds it there.
    a.kill();
    list(2);
    list(3);
    let (_a_again, _) = start_upstream_on(Upstream::Python, port_a);
    b.kill();
    list(4);
    list(5);
}

/// A reclaim asks its sessions at once, each within its own bound: one whose server never
/// answers the ping holds up no other, and a session the upstream no longer has is freed.
#[test]
fn a_session_that_never_answers_a_reclaim_holds_up_no_other() {
    let calls = OneQuestionCalls::default();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let body = seen.json().unwrap_or_default();
        if body["method"] == "ping" && body["id"] == "mrtr-gateway-reaper" {
            // The first session's server hangs (it is asked first: due first, then by
            // id); the second's forgot it.
            return match seen.header("mcp-session-id") {
                Some("s0") => Answer::silent(),
                _ => Answer::status(404, &[], b"session not found"),
            };
        }
        if body["method"] == "ping" {
            return Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": body["id"], "result": {}}),
            );
        }
        if seen.method == "GET" {
            return Answer::sse(&[]);
        }
        calls.post(seen)
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.max_watched_sessions = 2;
    });
    let raw = Raw::new(&gw.url);
    for id in 0..3 {
        let asked = ask_name(&raw, id, json!({}));
        assert_eq!(
            asked["result"]["resultType"], "input_required",
            "call {id}: {asked}"
        );
    }
}

/// A kept one-shot session that idles out is deleted upstream, though its shape sends
/// nothing more; not left until the table overflows.
#[test]
fn an_idle_kept_session_is_deleted_without_another_request() {
    let upstream = ScriptedUpstream::start(tools_list_only);
    let _gw = kept_session_left_idle(&upstream);
    wait_until("the idle session deleted", Duration::from_secs(15), || {
        upstream.requests().iter().any(|s| s.method == "DELETE")
    });
}

/// An idle kept session's DELETE that the upstream cannot take (it is restarting: a 503)
/// is sent again later: the SDK servers keep a session until it is deleted.
#[test]
fn an_idle_kept_sessions_delete_that_failed_is_sent_again() {
    let (upstream, deletes) = FirstRefused::deletes_in_front_of(tools_list_only);
    let gw = kept_session_left_idle(&upstream);
    deletes.assert_deleted_at_second_attempt(&gw, &upstream);
}

/// A kept one-shot session found idle by a request whose own new session then fails to
/// open (the upstream restarting: 503 to `initialize`) is deleted all the same: taken out
/// of the table, no sweep would ever find it again.
#[test]
fn an_idle_kept_session_let_go_by_a_request_that_fails_is_deleted() {
    let initialized = AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let initialize = seen.jsonrpc_method().as_deref() == Some("initialize");
        if initialize && initialized.fetch_add(1, Ordering::SeqCst) > 0 {
            return Answer::status(503, &[], b"restarting");
        }
        tools_list_only(seen)
    });
    let gw = kept_session_left_idle(&upstream);
    // Past the one-second idle time, before the sweep's next pass (every 5 s).
    std::thread::sleep(Duration::from_millis(1100));
    let failed = Raw::new(&gw.url)
        .modern(2, "tools/list", json!({}), json!({}))
        .json();
    assert!(failed["error"]["message"].is_string(), "{failed}");
    wait_until("the idle session deleted", Duration::from_secs(10), || {
        upstream
            .requests()
            .iter()
            .any(|s| s.method == "DELETE" && s.header("mcp-session-id") == Some("s1"))
    });
}

/// A legacy server in session `s1` whose only tool list is empty.
fn tools_list_only(seen: &Seen) -> Answer {
    if seen.jsonrpc_method().as_deref() == Some("tools/list") {
        let tools = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        return Answer::json(200, &tools);
    }
    legacy_basics(seen, "s1").unwrap_or_else(|| Answer::status(405, &[], b""))
}

/// A gateway in front of `upstream` whose one-shot sessions idle out after a second,
/// after one `tools/list` has opened one.
fn kept_session_left_idle(upstream: &ScriptedUpstream) -> TestGateway {
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.one_shot_session_idle_seconds = 1;
    });
    let listed = Raw::new(&gw.url)
        .modern(1, "tools/list", json!({}), json!({}))
        .json();
    assert!(listed["result"]["tools"].is_array(), "{listed}");
    gw
}

#[test]
fn one_shot_methods_reuse_a_kept_session_per_shape() {
    // A server that takes its time over `initialize` (one framework waits a second for
    // the client's capabilities): only the first list of a shape may pay for it.
    let lists = AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let sid = seen
            .header("mcp-session-id")
            .unwrap_or_default()
            .to_string();
        match seen.jsonrpc_method().as_deref() {
            Some("initialize") => {
                let n = seen.index;
                return legacy_basics(seen, &format!("s{n}"))
                    .expect("initialize")
                    .pause(Duration::from_millis(1));
            }
            Some("tools/list") => {
                // The upstream forgets the first kept session at the fourth list.
                if lists.fetch_add(1, Ordering::SeqCst) == 3 {
                    return Answer::status(404, &[], b"session not found");
                }
                let tools = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                    "tools": [{"name": format!("from-{sid}"), "inputSchema": {"type": "object"}}]}});
                return Answer::json(200, &tools);
            }
            _ => {}
        }
        legacy_basics(seen, "unused").unwrap_or_else(|| Answer::status(405, &[], b""))
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let list = |caps: Value| {
        let body = raw.modern(1, "tools/list", json!({}), caps).json();
        body["result"]["tools"][0]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("no tools: {body}"))
            .to_string()
    };
    let initializes = || {
        upstream
            .requests()
            .iter()
            .filter(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
            .count()
    };
    let first = list(json!({}));
    // The session opened to learn the upstream's era is the one the list ran on.
    assert_eq!(initializes(), 1, "the era probe's session serves its shape");
    assert_eq!(list(json!({})), first, "the same shape, the same session");
    assert_eq!(initializes(), 1);
    let other = list(json!({"elicitation": {}}));
    assert_ne!(other, first, "another shape, another session");
    assert_eq!(initializes(), 2);
    // The upstream forgot the first shape's session: the list goes again on a new one.
    let renewed = list(json!({}));
    assert_ne!(renewed, first);
    assert_eq!(initializes(), 3);
    assert_eq!(list(json!({})), renewed);
    assert_eq!(initializes(), 3);
}

#[test]
fn the_client_has_its_result_before_the_upstream_session_is_deleted() {
    let delete_answered = Gate::new();
    let gate = delete_answered.clone();
    let called = Arc::new(AtomicBool::new(false));
    let seen_call = called.clone();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if seen.method == "DELETE" && seen_call.load(Ordering::SeqCst) {
            // The upstream takes its time over the call session's DELETE.
            return Answer::silent()
                .wait(&gate)
                .bytes(Answer::status(200, &[], b"").pieces_bytes());
        }
        if seen.method == "GET" {
            return Answer::sse(&[]);
        }
        match seen.jsonrpc_method().as_deref() {
            Some("tools/call") => {
                seen_call.store(true, Ordering::SeqCst);
                Answer::json(
                    200,
                    &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                        "content": [{"type": "text", "text": "done"}]}}),
                )
            }
            _ => legacy_basics(seen, "s1").unwrap_or_else(|| Answer::status(405, &[], b"")),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let (answered, answer) = std::sync::mpsc::channel();
    let raw = Raw::new(&gw.url);
    std::thread::spawn(move || {
        let _ = answered.send(call_hostile(&raw, 1, json!({})));
    });
    wait_until(
        "the call's session DELETE upstream",
        Duration::from_secs(10),
        || {
            let requests = upstream.requests();
            let call = requests
                .iter()
                .position(|s| s.jsonrpc_method().as_deref() == Some("tools/call"));
            call.is_some_and(|call| requests[call..].iter().any(|s| s.method == "DELETE"))
        },
    );
    // The DELETE is unanswered; the client has its result all the same.
    let (status, done) = answer
        .recv_timeout(Duration::from_secs(5))
        .expect("the result reaches the client while the upstream holds the DELETE");
    delete_answered.open();
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["result"]["content"][0]["text"], "done");
}

/// A server that holds each session's first GET stream for good and answers every later
/// GET in the session with `refusal`, as a server that notices a closed stream only when
/// it next writes to it answers; the call asks one question, and its resumed stream
/// sends the result once the answer is in.
fn keeps_its_first_get_stream(refusal: Answer) -> ScriptedUpstream {
    let with_get: Mutex<HashSet<String>> = Mutex::default();
    let calls = OneQuestionCalls::default();
    ScriptedUpstream::start(move |seen: &Seen| {
        let sid = seen.header("mcp-session-id").unwrap_or_default();
        if seen.method != "GET" {
            return calls.post(seen);
        }
        let Some(after) = seen.header("last-event-id") else {
            return match with_get.lock().unwrap().insert(sid.to_string()) {
                true => Answer::sse(&[]),
                false => refusal.clone(),
            };
        };
        Answer::sse(&[])
            .event(Some(&format!("{sid}-c3")), &json!(""))
            .wait(&calls.answered(sid))
            .event(None, &calls.result(sid, &format!("done after {after}")))
            .end()
    })
}

/// The messages of a bridged reply, in order: the events of an SSE answer, or the one
/// JSON body.
fn reply_messages(mut reply: Reply) -> Vec<Value> {
    if !reply.content_type.starts_with("text/event-stream") {
        return vec![reply.json()];
    }
    std::iter::from_fn(|| reply.next_message().map(|(_, m)| m)).collect()
}

/// Progress belongs to the request that is running when it comes, under that request's
/// own token: a retry's stream carries the call's progress under the retry's
/// `progressToken`, and none when the retry asked for none, whatever the first round's
/// request asked. The server reports progress after the answer, on the resumed stream,
/// echoing the token the call went up with (as SDK servers do).
#[test]
fn progress_after_a_question_goes_to_the_retry_under_its_own_token() {
    let calls = OneQuestionCalls::default();
    let tokens: Mutex<HashMap<String, Value>> = Mutex::default();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let sid = seen
            .header("mcp-session-id")
            .unwrap_or_default()
            .to_string();
        if seen.method != "GET" {
            if seen.jsonrpc_method().as_deref() == Some("tools/call") {
                let body = seen.json().unwrap_or_default();
                let token = body["params"]["_meta"]["progressToken"].clone();
                tokens.lock().unwrap().insert(sid, token);
            }
            return calls.post(seen);
        }
        if seen.header("last-event-id").is_none() {
            return Answer::sse(&[]);
        }
        let token = tokens
            .lock()
            .unwrap()
            .get(&sid)
            .cloned()
            .unwrap_or_default();
        let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": token, "progress": 1, "total": 2}});
        Answer::sse(&[])
            .event(Some(&format!("{sid}-c3")), &json!(""))
            .wait(&calls.answered(&sid))
            .event(Some(&format!("{sid}-c4")), &progress)
            .event(None, &calls.result(&sid, "done"))
            .end()
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let with_token = |token: Option<&str>, mut extra: Value| {
        if let Some(token) = token {
            extra["_meta"] = json!({"progressToken": token});
        }
        tool_params("hostile", extra)
    };
    let caps = json!({"elicitation": {}});
    for (n, retry_token) in [(0u64, Some("retry-token")), (1, None)] {
        let first = raw.modern(
            10 * n + 1,
            "tools/call",
            with_token(Some("first-token"), json!({})),
            caps.clone(),
        );
        let first = first.json();
        let retry = with_token(retry_token, accepting_the_question(&first));
        let messages = reply_messages(raw.modern(10 * n + 2, "tools/call", retry, caps.clone()));
        let (last, notes) = messages.split_last().expect("an answer");
        assert_eq!(last["result"]["content"][0]["text"], "done", "{last}");
        let progress: Vec<&Value> = notes
            .iter()
            .filter(|m| m["method"] == "notifications/progress")
            .collect();
        match retry_token {
            Some(token) => {
                assert_eq!(progress.len(), 1, "{messages:?}");
                assert_eq!(
                    progress[0]["params"]["progressToken"], token,
                    "{messages:?}"
                );
                assert_eq!(progress[0]["params"]["progress"], 1);
            }
            None => assert!(
                progress.is_empty(),
                "the retry asked for none: {messages:?}"
            ),
        }
    }
    for call in upstream
        .requests()
        .iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("tools/call"))
    {
        let body = call.json().unwrap_or_default();
        assert_eq!(
            body["params"]["_meta"]["progressToken"], body["id"],
            "the call goes up with its own id as its progress token"
        );
    }
}

/// A client that sends its retry and leaves before the answers went up, here while the
/// resumed stream has not primed yet, cancels the call as a client that leaves later
/// does: its round ends at once (it used to wait on, woken by the closed connection
/// without end), no answer goes up, the session is deleted, and the state is spent.
#[test]
fn a_client_that_leaves_its_retry_before_the_answers_went_up_cancels_the_call() {
    let primes = Gate::new();
    let calls = OneQuestionCalls::default();
    let upstream = ScriptedUpstream::start({
        let primes = primes.clone();
        move |seen: &Seen| {
            let sid = seen.header("mcp-session-id").unwrap_or_default();
            if seen.method != "GET" {
                return calls.post(seen);
            }
            if seen.header("last-event-id").is_none() {
                return Answer::sse(&[]);
            }
            Answer::sse(&[])
                .wait(&primes)
                .event(Some(&format!("{sid}-c3")), &json!(""))
                .wait(&calls.answered(sid))
                .event(None, &calls.result(sid, "done"))
                .end()
        }
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    let retry = accepting_the_question(&first);
    let params = tool_params("hostile", retry.clone());
    send_and_leave(gw.port, 2, params, json!({"elicitation": {}}));
    let session = call_session(&upstream);
    let deleted = |s: &Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some(&session);
    wait_until(
        "the call's session deleted",
        Duration::from_secs(10),
        || upstream.requests().iter().any(deleted),
    );
    wait_until("the left round ended", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_active_rounds") == 0.0
    });
    primes.open();
    let (status, again) = call_hostile(&raw, 3, retry);
    assert_eq!(status, 400, "the state is spent: {again}");
    assert_eq!(again["error"]["code"], -32602, "{again}");
    let answers = upstream.requests().iter().filter(|s| is_answer(s)).count();
    assert_eq!(answers, 0, "no answer went up");
}

/// The same against the Python SDK's server, the client closing as soon as its retry is
/// sent: the call's session is deleted, the round ends, and the next call is served.
#[test]
fn a_client_that_leaves_its_retry_at_once_frees_its_round() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let first = ask_name(&raw, 1, json!({}));
    let retry = answer(&first, json!({"name": "Alice"}));
    let params = tool_params("ask_name", retry);
    let deleted =
        || metric_with(&gw.admin, "mrtr_gateway_upstream_sessions_total", "deleted").unwrap();
    let before = deleted();
    send_and_leave(gw.port, 2, params, json!({"elicitation": {}}));
    wait_until(
        "the call's session deleted",
        Duration::from_secs(10),
        || deleted() > before,
    );
    wait_until("the left round ended", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_active_rounds") == 0.0
    });
    let first = ask_name(&raw, 3, json!({}));
    let done = ask_name(&raw, 4, answer(&first, json!({"name": "Bob"})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Bob!",
        "{done}"
    );
}

/// A GET that opens a session's stream afresh (no `Last-Event-ID`).
fn is_fresh_get(seen: &Seen) -> bool {
    seen.method == "GET" && seen.header("last-event-id").is_none()
}

/// The retry of `first`'s one question, accepted with empty content.
fn accepting_the_question(first: &Value) -> Value {
    let key = first["result"]["inputRequests"]
        .as_object()
        .and_then(|q| q.keys().next().cloned())
        .unwrap_or_else(|| panic!("a question: {first}"));
    json!({"inputResponses": {key: {"action": "accept", "content": {}}},
        "requestState": first["result"]["requestState"]})
}

#[test]
fn an_upstream_that_keeps_a_closed_get_stream_is_not_waited_for_twice() {
    // Every GET after a session's first gets a whole 409.
    let upstream = keeps_its_first_get_stream(Answer::status(
        409,
        &[],
        b"Conflict: one GET stream per session",
    ));
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.warm_sessions_per_shape = 0;
    });
    let raw = Raw::new(&gw.url);
    let fresh_gets = || {
        upstream
            .requests()
            .iter()
            .filter(|s| is_fresh_get(s))
            .count()
    };
    let mut after_each = Vec::new();
    for flow in 0..2u64 {
        let (status, first) = call_hostile(&raw, 2 * flow + 1, json!({}));
        assert_eq!(status, 200, "{first}");
        let retry = accepting_the_question(&first);
        let (status, done) = call_hostile(&raw, 2 * flow + 2, retry);
        assert_eq!(status, 200, "{done}");
        assert!(done["result"]["content"][0]["text"].is_string(), "{done}");
        after_each.push(fresh_gets());
    }
    // Flow 1: the round's GET, then the retry's tried eight times (seven retries on 409).
    assert_eq!(after_each[0], 1 + 8, "the first retry waits for the server");
    // Flow 2: the round's GET, and the retry's once: waiting never paid.
    assert_eq!(
        after_each[1] - after_each[0],
        1 + 1,
        "the second retry does not wait"
    );
    // A refused GET's connection is read to its end and serves a later exchange: each
    // session's fresh GET after its first was refused with 409.
    let requests = upstream.requests();
    let mut sessions_with_get = HashSet::new();
    let refused: Vec<&Seen> = requests
        .iter()
        .filter(|s| is_fresh_get(s))
        .filter(|s| !sessions_with_get.insert(s.header("mcp-session-id")))
        .collect();
    assert_eq!(refused.len(), 8 + 1, "the two retries' GETs");
    let carried_more = |r: &&Seen| {
        (requests.iter()).any(|s| s.connection == r.connection && s.on_connection > r.on_connection)
    };
    assert!(
        refused.iter().any(carried_more),
        "a refused GET's connection served the next exchange"
    );
}

/// A stream that replaces one closed moments before goes out on a new connection: a
/// retry's resumed call stream and reopened session stream, and a legacy client's GET
/// through pass-through. A server answers a second GET stream of a session 409 (or a
/// resumption with an empty stream) until it has read the close of the first, which its
/// event loop does before it reads a connection accepted after that close, but not
/// always before a request on a connection it already had.
#[test]
fn streams_that_replace_a_closed_one_go_out_on_new_connections() {
    // Every GET is served: which connection each came on is all that is looked at.
    let upstream = keeps_its_first_get_stream(Answer::sse(&[]));
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.warm_sessions_per_shape = 0;
    });
    let raw = Raw::new(&gw.url);
    const FLOWS: u64 = 3;
    for flow in 0..FLOWS {
        let (status, first) = call_hostile(&raw, 2 * flow + 1, json!({}));
        assert_eq!(status, 200, "{first}");
        let (status, done) = call_hostile(&raw, 2 * flow + 2, accepting_the_question(&first));
        assert_eq!(status, 200, "{done}");
        assert!(done["result"]["content"][0]["text"].is_string(), "{done}");
    }
    let requests = upstream.requests();
    let mut sessions_with_get = HashSet::new();
    let replacing: Vec<&Seen> = requests
        .iter()
        .filter(|s| s.method == "GET")
        .filter(|s| {
            let first_of_session = sessions_with_get.insert(s.header("mcp-session-id"));
            s.header("last-event-id").is_some() || !first_of_session
        })
        .collect();
    assert_eq!(
        replacing.len(),
        2 * FLOWS as usize,
        "each retry resumes the call's stream and reopens the session's"
    );
    for get in &replacing {
        assert_eq!(
            get.on_connection, 0,
            "a replacing GET on a used connection: {get:?}"
        );
    }
    // The pool had connections to offer: the calls' sessions' POSTs shared them.
    assert!(
        requests
            .iter()
            .any(|s| s.method == "POST" && s.on_connection > 0),
        "no connection was ever reused"
    );
    // A legacy client's GET through pass-through, after its session's POSTs.
    let session = raw.initialize(json!({}));
    let stream_headers = [
        ("accept", "text/event-stream"),
        ("mcp-session-id", session.as_str()),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    let reply = raw.request("GET", &stream_headers, None);
    assert_eq!(reply.status, 200);
    let requests = upstream.requests();
    let get = requests.last().expect("the client's GET");
    assert_eq!(get.method, "GET");
    assert_eq!(
        get.on_connection, 0,
        "the client's GET on a used connection: {get:?}"
    );
}

#[test]
fn a_refusal_whose_body_never_ends_does_not_hold_the_retry() {
    // The server refuses a second GET stream with 409 and a body it never finishes (its
    // Content-Length promises more than it sends). The retry reads no more of it than a
    // refusal's body takes to arrive; it does not wait out the response timeout.
    let upstream = keeps_its_first_get_stream(Answer::raw(
        "HTTP/1.1 409 Conflict\r\ncontent-length: 64\r\n\r\nConflict",
    ));
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.upstreams[0].response_timeout_ms = 120_000;
        c.bridge.warm_sessions_per_shape = 0;
    });
    let url = gw.url.clone();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let raw = Raw::new(&url);
        let (status, first) = call_hostile(&raw, 1, json!({}));
        assert_eq!(status, 200, "{first}");
        let retry = accepting_the_question(&first);
        let _ = done_tx.send(call_hostile(&raw, 2, retry));
    });
    // Eight refused GETs (the first retry tries seven times more) at a 120 s response
    // timeout each would take sixteen minutes.
    let (status, done) = done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the retry is answered while the refusals' bodies are still owed");
    assert_eq!(status, 200, "{done}");
    assert!(done["result"]["content"][0]["text"].is_string(), "{done}");
}

/// Whether a request is the gateway's own probe session opening (`initialize` from
/// `mrtr-gateway-probe`).
fn is_probe_initialize(seen: &Seen) -> bool {
    seen.json().is_some_and(|body| {
        body["method"] == "initialize"
            && body["params"]["clientInfo"]["name"] == "mrtr-gateway-probe"
    })
}

/// A crowd of legacy clients resuming their GET streams at once on a replica that has
/// not yet probed the group's event store (after a deploy, say) waits for one probe: the
/// upstream sees one probe's two throwaway sessions, not two per client, and every
/// client is served by its verdict.
#[test]
fn a_crowd_of_first_get_stream_resumptions_probes_the_store_once() {
    const CLIENTS: usize = 6;
    let crowd_in = Gate::new();
    let probe_waits = crowd_in.clone();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        let event = |id: &str| {
            Answer::sse(&[]).event(
                Some(id),
                &json!({"jsonrpc": "2.0",
            "method": "notifications/message", "params": {"level": "info", "data": id}}),
            )
        };
        match (seen.method.as_str(), seen.header("last-event-id")) {
            // The probe's ping: its answer primes the stream with an id.
            ("POST", _) => {
                let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {}});
                Answer::sse(&[]).event(Some("p1"), &result).end()
            }
            // The probe resuming the other throwaway session's id: once every client is
            // in, an empty stream, as from a store keeping sessions apart.
            ("GET", Some("p1")) => Answer::raw(b"")
                .wait(&probe_waits)
                .bytes(Answer::sse(&[]).end().pieces_bytes()),
            // A client's GET stream, fresh or resumed.
            ("GET", None) => event("g1").end(),
            ("GET", Some(_)) => event("g2").end(),
            _ => Answer::status(405, &[], b""),
        }
    });
    let first = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&first.url);
    let session = raw.initialize(json!({}));
    let get = |raw: &Raw, position: Option<&str>| {
        let mut headers = vec![
            ("accept", "text/event-stream"),
            ("mcp-session-id", session.as_str()),
            ("mcp-protocol-version", "2025-11-25"),
        ];
        headers.extend(position.map(|p| ("last-event-id", p)));
        raw.request("GET", &headers, None)
    };
    let mut stream = get(&raw, None);
    let (position, _) = stream.next_message().expect("the GET stream's event");
    let position = position.expect("an event id");
    assert!(!upstream.requests().iter().any(is_probe_initialize));
    // Another replica, with nothing learnt yet, takes every client's resumption at once.
    let second = TestGateway::start(&[&upstream.url()], &test_keys());
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| {
                    let mut reply = get(&Raw::new(&second.url), Some(&position));
                    let status = reply.status;
                    (
                        status,
                        reply.next_message().map(|(_, m)| m).unwrap_or_default(),
                    )
                })
            })
            .collect();
        wait_until("every client connected", Duration::from_secs(10), || {
            metric(&second.admin, "mrtr_gateway_client_connections") >= CLIENTS as f64
        });
        crowd_in.open();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for (status, message) in &answers {
        assert_eq!(*status, 200, "{message}");
        assert_eq!(message["params"]["data"], "g2", "not resumed: {message}");
    }
    let probes = upstream
        .requests()
        .into_iter()
        .filter(is_probe_initialize)
        .count();
    assert_eq!(
        probes, 2,
        "one probe opens two sessions; {CLIENTS} clients came"
    );
}

/// An upstream that cannot open the probe's throwaway sessions (at its session limit,
/// here: every `initialize` after the client's is refused) leaves the store's verdict
/// unknown, and GET streams reopen fresh; the resumptions that follow do not each try
/// the probe again, which would cost the upstream a refused session per client request.
#[test]
fn a_failed_store_probe_is_not_retried_by_every_resumption() {
    const RESUMPTIONS: usize = 4;
    let sessions = AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let initialize = seen.jsonrpc_method().as_deref() == Some("initialize");
        if initialize && sessions.fetch_add(1, Ordering::SeqCst) > 0 {
            return Answer::status(503, &[], b"too many sessions");
        }
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        let event = |id: &str| {
            let log = json!({"jsonrpc": "2.0", "method": "notifications/message",
                "params": {"level": "info", "data": id}});
            Answer::sse(&[]).event(Some(id), &log).end()
        };
        match (seen.method.as_str(), seen.header("last-event-id")) {
            ("GET", None) => event("g1"),
            ("GET", Some(_)) => event("g2"),
            _ => Answer::status(405, &[], b""),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    let get = |position: Option<&str>| first_session_event(&raw, &session, position);
    let (position, _) = get(None);
    let position = position.expect("an event id");
    for _ in 0..RESUMPTIONS {
        let (_, message) = get(Some(&position));
        assert_eq!(
            message["params"]["data"], "g1",
            "not reopened fresh: {message}"
        );
    }
    let probes = upstream
        .requests()
        .into_iter()
        .filter(is_probe_initialize)
        .count();
    assert_eq!(probes, 1, "{RESUMPTIONS} resumptions each probed again");
}

/// An upstream that stops answering in the middle of the store probe (its second
/// throwaway session's `initialize` is never answered) does not hold the resumption that
/// waits for the probe for its response timeout: the probe gives up within seconds, the
/// verdict is unknown, the GET stream reopens fresh, and the session the probe opened is
/// deleted.
#[test]
fn a_store_probe_that_stops_being_answered_gives_up_within_seconds() {
    let initializes = AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let initialize = seen.jsonrpc_method().as_deref() == Some("initialize");
        if initialize && initializes.fetch_add(1, Ordering::SeqCst) == 2 {
            return Answer::silent();
        }
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        let log = |id: &str| {
            json!({"jsonrpc": "2.0", "method": "notifications/message",
                "params": {"level": "info", "data": id}})
        };
        match (seen.method.as_str(), seen.header("last-event-id")) {
            // The probe's ping: its answer primes the stream with an id.
            ("POST", _) => {
                let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {}});
                Answer::sse(&[]).event(Some("p1"), &result).end()
            }
            ("GET", None) => Answer::sse(&[]).event(Some("g1"), &log("g1")).end(),
            ("GET", Some(_)) => Answer::sse(&[]).event(Some("g2"), &log("g2")).end(),
            _ => Answer::status(405, &[], b""),
        }
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].response_timeout_ms = 60_000;
    });
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    let get = |position: Option<&str>| first_session_event(&raw, &session, position);
    let (position, _) = get(None);
    let started = Instant::now();
    let (_, message) = get(Some(&position.expect("an event id")));
    assert_eq!(message["params"]["data"], "g1", "reopened fresh: {message}");
    assert!(
        started.elapsed() < Duration::from_secs(14),
        "the resumption waited {:?} for the probe",
        started.elapsed()
    );
    wait_until(
        "the probe's session deleted",
        Duration::from_secs(5),
        || upstream.requests().iter().any(|s| s.method == "DELETE"),
    );
}

/// The first event of a legacy session's GET stream, opened fresh or resumed after
/// `position`: its id and message.
fn first_session_event(
    raw: &Raw,
    session: &str,
    position: Option<&str>,
) -> (Option<String>, Value) {
    let mut headers = vec![
        ("accept", "text/event-stream"),
        ("mcp-session-id", session),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    headers.extend(position.map(|p| ("last-event-id", p)));
    let mut reply = raw.request("GET", &headers, None);
    assert_eq!(reply.status, 200);
    reply.next_message().expect("the GET stream's event")
}

/// A scripted server whose `tools/call` streams what `call` gives, whose resumptions
/// (GETs with `Last-Event-ID`) the upstream takes and never answers, and whose session
/// GET stream is open and empty.
fn resumptions_hang(call: fn() -> Answer) -> ScriptedUpstream {
    ScriptedUpstream::start(move |seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        if seen.method == "GET" {
            return match seen.header("last-event-id") {
                Some(_) => Answer::silent(),
                None => Answer::sse(&[]),
            };
        }
        let body = seen.json().unwrap_or_default();
        match body["method"].as_str() {
            Some("tools/call") => call(),
            Some("ping") => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": body["id"], "result": {}}),
            ),
            _ => Answer::status(405, &[], b""),
        }
    })
}

/// A call's stream: a priming event (`c1`), then a question (`c2`), left open.
fn asks_a_name() -> Answer {
    let question = json!({"jsonrpc": "2.0", "id": 0, "method": "elicitation/create",
        "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}});
    Answer::sse(&[])
        .event(Some("c1"), &json!(""))
        .event(Some("c2"), &question)
}

/// A gateway whose flows last 3 s, in front of `upstream`, whose exchanges may take 30 s.
fn three_second_flows(upstream: &ScriptedUpstream) -> TestGateway {
    TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.upstreams[0].response_timeout_ms = 30_000;
        c.bridge.request_state_ttl_seconds = 3;
        c.bridge.max_flow_seconds = 3;
    })
}

/// The reply names the flow's deadline, and the upstream session was deleted.
fn assert_ended_at_the_deadline(upstream: &ScriptedUpstream, status: u16, ended: &Value) {
    let message = ended["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("bridge.max_flow_seconds"),
        "{status} {ended}"
    );
    let resumed = |s: &Seen| s.method == "GET" && s.header("last-event-id").is_some();
    assert!(
        upstream.requests().iter().any(resumed),
        "a stream was resumed"
    );
    assert!(
        !upstream.requests().iter().any(is_answer),
        "no answer went up"
    );
    wait_until("the session deleted", Duration::from_secs(5), || {
        upstream.requests().iter().any(|s| s.method == "DELETE")
    });
}

/// A call whose stream the upstream ends after its priming event, and whose resumption
/// it then takes and never answers, ends at the flow's deadline, naming it, not a
/// response timeout later.
#[test]
fn a_call_whose_resumed_stream_never_comes_back_ends_at_the_flows_deadline() {
    let upstream = resumptions_hang(|| Answer::sse(&[]).event(Some("c1"), &json!("")).end());
    let gw = three_second_flows(&upstream);
    let (status, ended) = call_hostile(&Raw::new(&gw.url), 1, json!({}));
    assert_ended_at_the_deadline(&upstream, status, &ended);
}

/// A retry whose streams the upstream takes and never answers ends at the flow's
/// deadline (`bridge.max_flow_seconds`), naming it, and its upstream session is deleted:
/// not a response timeout later (30 s here), long after the flow's state stopped opening.
#[test]
fn a_retry_whose_streams_never_come_back_ends_at_the_flows_deadline() {
    let upstream = resumptions_hang(asks_a_name);
    let gw = three_second_flows(&upstream);
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    let (status, ended) = call_hostile(&raw, 2, answer(&first, json!({"name": "x"})));
    assert_ended_at_the_deadline(&upstream, status, &ended);
}

/// A session GET stream the upstream takes and never opens (no response header) holds
/// neither a new call nor a retry whose call stream is back: each goes on without it after
/// a few seconds, not the response timeout (30 s here), and the call completes.
#[test]
fn a_session_stream_that_never_opens_is_gone_on_without() {
    let calls = OneQuestionCalls::default();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let sid = seen.header("mcp-session-id").unwrap_or_default();
        if seen.method != "GET" {
            return calls.post(seen);
        }
        if seen.header("last-event-id").is_none() {
            return Answer::silent();
        }
        calls.resumed(sid, "done")
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.upstreams[0].response_timeout_ms = 30_000;
    });
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    assert_eq!(first["result"]["resultType"], "input_required", "{first}");
    let (_, done) = call_hostile(&raw, 2, answer(&first, json!({"name": "x"})));
    assert_eq!(done["result"]["content"][0]["text"], "done", "{done}");
}

/// A client that leaves while its retry's resumption hangs upstream ends the call at once
/// (the GET is cut): its session is deleted, long before the round's silence or the
/// flow's deadline, and nothing goes up.
#[test]
fn a_client_that_leaves_while_its_resumption_hangs_ends_the_call_at_once() {
    let upstream = resumptions_hang(asks_a_name);
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.upstreams[0].response_timeout_ms = 60_000;
    });
    let (_, first) = call_hostile(&Raw::new(&gw.url), 1, json!({}));
    let params = tool_params("hostile", answer(&first, json!({"name": "x"})));
    let client = send_and_stay(gw.port, 2, params, json!({"elicitation": {}}));
    let resumed = |s: &Seen| s.method == "GET" && s.header("last-event-id").is_some();
    wait_until("the resumption sent", Duration::from_secs(10), || {
        upstream.requests().iter().any(resumed)
    });
    drop(client);
    wait_until("the session deleted", Duration::from_secs(5), || {
        upstream.requests().iter().any(|s| s.method == "DELETE")
    });
    assert!(
        !upstream.requests().iter().any(is_answer),
        "no answer went up"
    );
    wait_until("the round freed", Duration::from_secs(5), || {
        metric(&gw.admin, "mrtr_gateway_active_rounds") == 0.0
    });
}

/// A session GET stream the upstream is slow to open (its header after 6 s, past the
/// gateway's 5 s patience), on which the tool asks its question: the call goes up without
/// waiting for it, the stream joins the round when it opens, and the question is asked,
/// not lost.
#[test]
fn a_question_on_a_session_stream_slow_to_open_is_asked() {
    let calls = OneQuestionCalls::default();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let sid = seen.header("mcp-session-id").unwrap_or_default();
        let question = json!({"jsonrpc": "2.0", "id": 7, "method": "elicitation/create",
            "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}});
        if seen.jsonrpc_method().as_deref() == Some("tools/call") {
            // The call's stream: primed, the question goes on the GET stream.
            let _ = calls.post(seen);
            return Answer::sse(&[]).event(Some(&format!("{sid}-c1")), &json!(""));
        }
        if seen.method != "GET" {
            return calls.post(seen);
        }
        if seen.header("last-event-id").is_none() {
            let head = Answer::sse(&[]).pieces_bytes();
            return Answer::silent()
                .pause(Duration::from_secs(6))
                .bytes(head)
                .event(Some(&format!("{sid}-g1")), &question);
        }
        calls.resumed(sid, "done")
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let (_, first) = call_hostile(&raw, 1, json!({}));
    assert_eq!(first["result"]["resultType"], "input_required", "{first}");
    let (_, done) = call_hostile(&raw, 2, answer(&first, json!({"name": "x"})));
    assert_eq!(done["result"]["content"][0]["text"], "done", "{done}");
}

/// A server whose calls ask one question (`OneQuestionCalls`, resumed with "done") and
/// whose first DELETE is refused with 503, as while it restarts.
fn one_question_upstream_refusing_first_delete() -> (ScriptedUpstream, Arc<FirstRefused>) {
    let calls = OneQuestionCalls::default();
    FirstRefused::deletes_in_front_of(move |seen: &Seen| match seen.method.as_str() {
        "GET" if seen.header("last-event-id").is_some() => {
            calls.resumed(seen.header("mcp-session-id").unwrap_or_default(), "done")
        }
        "GET" => Answer::sse(&[]),
        _ => calls.post(seen),
    })
}

/// A completed flow's DELETE that the upstream cannot take (it is restarting: a 503) is
/// sent again later: the SDK servers keep a session until it is deleted.
#[test]
fn a_completed_flows_delete_that_failed_is_sent_again() {
    let (upstream, deletes) = one_question_upstream_refusing_first_delete();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let first = call_tool(&raw, 1, "ask", json!({}));
    assert_eq!(first["result"]["resultType"], "input_required", "{first}");
    let done = call_tool(&raw, 2, "ask", answer(&first, json!({"name": "x"})));
    assert_eq!(done["result"]["content"][0]["text"], "done", "{done}");
    deletes.assert_deleted_at_second_attempt(&gw, &upstream);
}

/// An abandoned flow's DELETE that the upstream cannot take at the flow's deadline (it is
/// restarting: a 503) is sent again later: the SDK servers keep a session until it is
/// deleted, so one failed attempt would leave it there for good.
#[test]
fn an_abandoned_flows_delete_that_failed_is_sent_again() {
    let (upstream, deletes) = one_question_upstream_refusing_first_delete();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.request_state_ttl_seconds = 1;
        c.bridge.max_flow_seconds = 2;
    });
    let first = call_tool(&Raw::new(&gw.url), 1, "ask", json!({}));
    assert_eq!(first["result"]["resultType"], "input_required", "{first}");
    deletes.assert_deleted_at_second_attempt(&gw, &upstream);
}

/// A legacy server without sessions (no `Mcp-Session-Id`) whose call asks one question
/// on its primed stream and resumes it after `Last-Event-ID`; it serves no GET stream
/// of its own and takes no DELETE (405), as stateless SDK servers answer.
fn stateless_resumable_server() -> ScriptedUpstream {
    let call_id = Mutex::new(Value::Null);
    ScriptedUpstream::start(move |seen: &Seen| {
        if seen.method == "GET" {
            return match seen.header("last-event-id") {
                Some("c2") => {
                    let id = call_id.lock().unwrap().clone();
                    let done = json!({"jsonrpc": "2.0", "id": id,
                        "result": {"content": [{"type": "text", "text": "done"}]}});
                    Answer::sse(&[]).event(Some("c3"), &done).end()
                }
                _ => Answer::status(405, &[], b""),
            };
        }
        if seen.method == "DELETE" {
            return Answer::status(405, &[], b"");
        }
        let body = seen.json().unwrap_or_default();
        match body["method"].as_str() {
            Some("initialize") => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": body["id"], "result": {
                    "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                    "serverInfo": {"name": "stateless", "version": "1"}}}),
            ),
            Some("tools/call") => {
                *call_id.lock().unwrap() = body["id"].clone();
                let question = json!({"jsonrpc": "2.0", "id": 1, "method": "elicitation/create",
                    "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}});
                Answer::sse(&[])
                    .event(Some("c1"), &json!(""))
                    .event(Some("c2"), &question)
            }
            _ => Answer::status(202, &[], b""),
        }
    })
}

/// A flow on a server without sessions resumes without a session id: no request of
/// its retry carries an empty `Mcp-Session-Id`, and no DELETE names an empty one.
#[test]
fn a_flow_on_a_server_without_sessions_never_sends_an_empty_session_id() {
    let upstream = stateless_resumable_server();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let first = ask_name(&raw, 1, json!({}));
    assert_eq!(first["result"]["resultType"], "input_required", "{first}");
    let done = ask_name(&raw, 2, answer(&first, json!({"name": "Ada"})));
    assert_eq!(done["result"]["content"][0]["text"], "done", "{done}");
    let with_ids: Vec<String> = upstream
        .requests()
        .iter()
        .filter(|s| s.header("mcp-session-id").is_some())
        .map(|s| format!("{} {:?}", s.method, s.header("mcp-session-id")))
        .collect();
    assert!(with_ids.is_empty(), "{with_ids:?}");
}
