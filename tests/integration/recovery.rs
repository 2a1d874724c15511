//! Recovery when the upstream loses a call between rounds (the server restarts): a tool
//! marked `restartable` runs again in a new session, its repeated questions answered from
//! the answers kept in the sealed state, so the client is asked only what is new; any
//! other tool gets the documented `FLOW_LOST` error, and a fresh call works.

use crate::common::*;
use mrtr_gateway::config::{ToolPolicy, UpstreamEra};
use serde_json::{json, Value};
use std::time::Duration;

fn call(raw: &Raw, id: u64, tool: &str, extra: Value) -> (u16, Value) {
    let params = tool_params(tool, extra);
    let reply = raw.modern(id, "tools/call", params, json!({"elicitation": {}}));
    (reply.status, reply.json())
}

/// The messages of the questions an InputRequiredResult asks.
fn questions(response: &Value) -> Vec<String> {
    let asked = response["result"]["inputRequests"]
        .as_object()
        .unwrap_or_else(|| panic!("no inputRequests: {response}"));
    asked
        .values()
        .map(|r| r["params"]["message"].as_str().unwrap().to_string())
        .collect()
}

/// Kills the upstream and starts a new one on the same port: every session is gone.
fn restart(upstream: &mut Proc, port: u16) -> Proc {
    restart_as(Upstream::Python, upstream, port)
}

fn restart_as(kind: Upstream, upstream: &mut Proc, port: u16) -> Proc {
    upstream.kill();
    wait_until("the upstream to stop", Duration::from_secs(10), || {
        !port_open(port)
    });
    start_upstream_on(kind, port).0
}

#[test]
fn a_restartable_tool_survives_an_upstream_restart_asking_only_what_is_new() {
    let port = free_port();
    let (mut upstream, url) = start_upstream_on(Upstream::Python, port);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        let restartable = ToolPolicy {
            restartable: true,
            ..ToolPolicy::default()
        };
        c.upstreams[0].tools.insert("plan_trip".into(), restartable);
    });
    let raw = Raw::new(&gw.url);

    // Restart before the first answer: the re-run's first question is answered from the
    // retry, and only the second, new one reaches the client.
    let (_, first) = call(&raw, 1, "plan_trip", json!({}));
    assert_eq!(questions(&first), ["Where do you want to go?"]);
    upstream = restart(&mut upstream, port);
    let (_, second) = call(
        &raw,
        2,
        "plan_trip",
        answer(&first, json!({"destination": "Lisbon"})),
    );
    assert_eq!(
        questions(&second),
        ["How many nights in Lisbon?"],
        "{second}"
    );
    assert_eq!(metric(&gw.admin, "mrtr_gateway_call_restarts_total"), 1.0);
    let (_, done) = call(&raw, 3, "plan_trip", answer(&second, json!({"nights": 3})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Trip to Lisbon for 3 nights",
        "{done}"
    );

    // Restart before the last answer: both questions come again upstream, and both are
    // answered from the state (the first) and the retry (the second); nothing is asked.
    let (_, first) = call(&raw, 4, "plan_trip", json!({}));
    let (_, second) = call(
        &raw,
        5,
        "plan_trip",
        answer(&first, json!({"destination": "Porto"})),
    );
    assert_eq!(questions(&second), ["How many nights in Porto?"]);
    let _upstream = restart(&mut upstream, port);
    let (_, done) = call(&raw, 6, "plan_trip", answer(&second, json!({"nights": 2})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Trip to Porto for 2 nights",
        "{done}"
    );
    assert_eq!(metric(&gw.admin, "mrtr_gateway_call_restarts_total"), 2.0);
}

/// A flow parked on an endpoint that has since left the group (a replica started with
/// another endpoint list, as a rolling update that replaces a backend leaves it) is lost
/// with it, not refused as a bad state: a restartable tool runs again on an endpoint of
/// the group now, asking only what is new.
#[test]
fn a_restartable_tool_whose_endpoint_left_the_group_runs_again_on_one_in_it() {
    let (_old, old_url) = start_upstream(Upstream::Python);
    let (_new, new_url) = start_upstream(Upstream::Python);
    let gateway_to = |url: &str| {
        TestGateway::start_with(&[url], &test_keys(), |c| {
            c.upstreams[0].era = UpstreamEra::Legacy;
            let restartable = ToolPolicy {
                restartable: true,
                ..ToolPolicy::default()
            };
            c.upstreams[0].tools.insert("plan_trip".into(), restartable);
        })
    };
    let (before, after) = (gateway_to(&old_url), gateway_to(&new_url));
    let (_, first) = call(&Raw::new(&before.url), 1, "plan_trip", json!({}));
    assert_eq!(questions(&first), ["Where do you want to go?"]);
    let raw = Raw::new(&after.url);
    let retry = answer(&first, json!({"destination": "Oslo"}));
    let (_, second) = call(&raw, 2, "plan_trip", retry);
    assert_eq!(questions(&second), ["How many nights in Oslo?"], "{second}");
    assert_eq!(
        metric(&after.admin, "mrtr_gateway_call_restarts_total"),
        1.0
    );
    let (_, done) = call(&raw, 3, "plan_trip", answer(&second, json!({"nights": 4})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Trip to Oslo for 4 nights",
        "{done}"
    );
}

#[test]
fn a_tool_not_marked_restartable_gets_flow_lost_and_a_fresh_call_works() {
    let port = free_port();
    let (mut upstream, url) = start_upstream_on(Upstream::Python, port);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let (_, first) = call(&raw, 1, "ask_name", json!({}));
    assert_eq!(questions(&first), ["What is your name?"]);
    let _upstream = restart(&mut upstream, port);
    let (status, lost) = call(&raw, 2, "ask_name", answer(&first, json!({"name": "Ada"})));
    assert_eq!(status, 200, "{lost}");
    assert_eq!(lost["error"]["code"], -32012, "{lost}");
    let message = lost["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("not marked restartable") && message.contains("issue the call again"),
        "{message}"
    );
    assert_eq!(metric(&gw.admin, "mrtr_gateway_call_restarts_total"), 0.0);
    let (_, again) = call(&raw, 3, "ask_name", json!({}));
    let (_, done) = call(&raw, 4, "ask_name", answer(&again, json!({"name": "Ada"})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Ada!",
        "{done}"
    );
}

/// rmcp 0.16 answers a request in a session it does not know with a bare 401 (no
/// `WWW-Authenticate`: "Unauthorized: Session not found"), 2.2 and 3.11 with 404. After the
/// server restarts, the sessions the gateway keeps for one-shot methods and opens ahead
/// of calls are gone: they are replaced, and clients see answers, not a demand for
/// credentials the server never asked for.
#[test]
fn sessions_a_restarted_rust_sdk_server_forgot_are_replaced_not_taken_for_a_denial() {
    for kind in [Upstream::Rust016, Upstream::Rust22, Upstream::Rust311] {
        let port = free_port();
        let (mut upstream, url) = start_upstream_on(kind, port);
        let gw = TestGateway::start(&[&url], &test_keys());
        let raw = Raw::new(&gw.url);
        let list = |id| raw.modern(id, "tools/list", json!({}), json!({"elicitation": {}}));
        let before = list(1);
        assert_eq!(before.status, 200, "{kind:?}");
        // Two calls, so that the call's shape recurs and sessions are opened ahead of it.
        for id in [2, 3] {
            let (_, asked) = call(&raw, id, "ask_name", json!({}));
            let (_, done) = call(
                &raw,
                id + 10,
                "ask_name",
                answer(&asked, json!({"name": "Ada"})),
            );
            assert_eq!(
                done["result"]["content"][0]["text"], "Hello, Ada!",
                "{kind:?}: {done}"
            );
        }
        let _upstream = restart_as(kind, &mut upstream, port);
        let after = list(4);
        assert_eq!(after.status, 200, "{kind:?}: tools/list after the restart");
        let (status, asked) = call(&raw, 5, "ask_name", json!({}));
        assert_eq!(status, 200, "{kind:?}: {asked}");
        assert_eq!(questions(&asked), ["What is your name?"], "{kind:?}");
        let (_, done) = call(&raw, 6, "ask_name", answer(&asked, json!({"name": "Ada"})));
        assert_eq!(
            done["result"]["content"][0]["text"], "Hello, Ada!",
            "{kind:?}: {done}"
        );
    }
}

/// Replicas share no store of used states, so a retry sent a second time to another
/// replica after the first one completed the call finds the call's session deleted, as if
/// the upstream had lost it. A tool not marked restartable is not run again: the second
/// retry gets `FLOW_LOST`, whose message says an earlier retry may have completed the call.
/// A restartable tool, declared safe to run twice, runs again (README, "Replays").
#[test]
fn a_retry_replayed_to_another_replica_after_the_call_completed_reruns_only_a_restartable_tool() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let legacy_with_plan_trip_restartable = |c: &mut mrtr_gateway::config::Config| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        let restartable = ToolPolicy {
            restartable: true,
            ..ToolPolicy::default()
        };
        c.upstreams[0].tools.insert("plan_trip".into(), restartable);
    };
    let a = TestGateway::start_with(&[&url], &test_keys(), legacy_with_plan_trip_restartable);
    let b = TestGateway::start_with(&[&url], &test_keys(), legacy_with_plan_trip_restartable);
    let (on_a, on_b) = (Raw::new(&a.url), Raw::new(&b.url));
    // Completes a call on `a` with its last retry, and waits for its session's DELETE.
    let complete_on_a = |id: u64, tool: &str, retry: &Value, text: &str, calls: f64| {
        let (_, done) = call(&on_a, id, tool, retry.clone());
        assert_eq!(done["result"]["content"][0]["text"], text, "{done}");
        wait_until(
            "the call's session deleted",
            Duration::from_secs(10),
            || {
                let deleted =
                    metric_with(&a.admin, "mrtr_gateway_upstream_sessions_total", "deleted");
                deleted.unwrap_or(0.0) >= calls
            },
        );
    };

    let (_, first) = call(&on_a, 1, "ask_name", json!({}));
    let retry = answer(&first, json!({"name": "Ada"}));
    complete_on_a(2, "ask_name", &retry, "Hello, Ada!", 1.0);
    let (status, again) = call(&on_b, 3, "ask_name", retry);
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["error"]["code"], -32012, "{again}");
    let message = again["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("an earlier retry of this requestState completed on another replica")
            && message.contains("not run again"),
        "{message}"
    );

    let (_, first) = call(&on_a, 4, "plan_trip", json!({}));
    let (_, second) = call(
        &on_a,
        5,
        "plan_trip",
        answer(&first, json!({"destination": "Lisbon"})),
    );
    let last = answer(&second, json!({"nights": 3}));
    complete_on_a(6, "plan_trip", &last, "Trip to Lisbon for 3 nights", 2.0);
    let (_, rerun) = call(&on_b, 7, "plan_trip", last);
    assert_eq!(
        rerun["result"]["content"][0]["text"], "Trip to Lisbon for 3 nights",
        "the restartable tool ran again, its questions answered from the state: {rerun}"
    );
    assert_eq!(metric(&b.admin, "mrtr_gateway_call_restarts_total"), 1.0);
    assert_eq!(metric(&a.admin, "mrtr_gateway_call_restarts_total"), 0.0);
}

/// An endpoint that refuses connections (its process died, and no health check has
/// marked it down yet) costs a request outside any session nothing: the request ran
/// nowhere, so the group's next endpoint takes it, a legacy `initialize` and a
/// 2026-07-28 call alike. It used to fail every request the round-robin sent there.
#[test]
fn a_request_refused_a_connection_goes_to_the_next_endpoint() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let dead = format!("http://127.0.0.1:{}/mcp", free_port());
    let gw = TestGateway::start_with(&[&dead, &url], &test_keys(), |c| {
        c.upstreams[0].health_check_interval_ms = 0;
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    for i in 0..4 {
        let session = raw.initialize(json!({}));
        assert!(!session.is_empty(), "initialize {i}");
        let first = ask_name(&raw, 10 + i, json!({}));
        let retry = answer(&first, json!({"name": "Io"}));
        let done = ask_name(&raw, 20 + i, retry);
        assert_eq!(
            done["result"]["content"][0]["text"], "Hello, Io!",
            "call {i}: {done}"
        );
    }
}

/// server-everything, like the servers built on the TypeScript SDK's examples, answers a
/// request in a session it does not know with 400 "Bad Request: No valid session ID
/// provided". After it restarts, the sessions the gateway keeps for one-shot methods and
/// opens ahead of calls are replaced: clients see answers, not that bad request.
#[test]
fn sessions_a_restarted_server_answering_400_forgot_are_replaced() {
    let port = free_port();
    let (mut upstream, url) = start_upstream_on(Upstream::Everything, port);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let list = |id| raw.modern(id, "tools/list", json!({}), json!({}));
    let echo = |id| {
        let params = json!({"name": "echo", "arguments": {"message": "hi"}});
        let reply = raw.modern(id, "tools/call", params, json!({}));
        (reply.status, reply.json())
    };
    assert_eq!(list(1).status, 200);
    // Two calls, so that the call's shape recurs and sessions are opened ahead of it.
    for id in [2, 3] {
        let (status, done) = echo(id);
        assert_eq!(status, 200, "{done}");
        assert!(done.to_string().contains("hi"), "{done}");
    }
    let _upstream = restart_as(Upstream::Everything, &mut upstream, port);
    let after = list(4);
    assert_eq!(after.status, 200, "tools/list after the restart");
    let body = after.json();
    assert!(body["result"]["tools"].is_array(), "{body}");
    let (status, done) = echo(5);
    assert_eq!(status, 200, "{done}");
    assert!(
        done.to_string().contains("hi"),
        "a call after the restart: {done}"
    );
}
