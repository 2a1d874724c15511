//! Hold mode: a legacy server without an event store cannot resume streams, so the replica
//! that ran a round keeps its upstream streams open and retries that land elsewhere are
//! forwarded to it over the peer listener. Official clients against the Python SDK server
//! run without an event store, rounds on alternating replicas, a dead owner, questions
//! left unanswered, single use across replicas, and load shedding by held flows.

use crate::common::*;
use crate::scripted::{
    assert_call_cancelled_in_its_session, holding_script, holding_server, legacy_basics, Answer,
    FirstRefused, ScriptedUpstream, Seen, IDLE_LIMIT,
};
use mrtr_gateway::config::{Config, UpstreamEra};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Replicas in front of `url`, each with a peer listener, all knowing each other.
fn peered(url: &str, count: usize, tweak: impl Fn(&mut Config)) -> Vec<TestGateway> {
    let peer_ports: Vec<u16> = (0..count).map(|_| free_port()).collect();
    peered_on(url, &peer_ports, tweak)
}

/// [`peered`] with the replicas' peer listeners on `peer_ports`.
fn peered_on(url: &str, peer_ports: &[u16], tweak: impl Fn(&mut Config)) -> Vec<TestGateway> {
    let members: Vec<String> = peer_ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    peer_ports
        .iter()
        .map(|port| {
            TestGateway::start_with(&[url], &test_keys(), |c| {
                c.upstreams[0].era = UpstreamEra::Legacy;
                c.peers.listen = Some(format!("127.0.0.1:{port}"));
                c.peers.members = members.clone();
                tweak(c);
            })
        })
        .collect()
}

fn held_event(gw: &TestGateway, event: &str) -> f64 {
    let label = format!("event=\"{event}\"");
    metric_with(&gw.admin, "mrtr_gateway_held_flow_events_total", &label).unwrap()
}

/// Every round the replicas ended was held, taken up by its retry, and none was lost.
fn assert_every_round_held_and_resumed(replicas: &[TestGateway]) {
    let rounds = sum(replicas, input_required_calls);
    let held = sum(replicas, |g| held_event(g, "held"));
    assert!(rounds > 0.0, "the flows asked");
    assert_eq!(held, rounds, "every round of every flow was held");
    assert_eq!(sum(replicas, |g| held_event(g, "resumed")), held);
    assert_eq!(sum(replicas, |g| held_event(g, "lost")), 0.0);
}

fn forwards(gw: &TestGateway, outcome: &str) -> f64 {
    let label = format!("outcome=\"{outcome}\"");
    metric_with(&gw.admin, "mrtr_gateway_peer_forwards_total", &label).unwrap()
}

/// The retry answering every question of `first` from `answers` (by question text).
fn answer_all(first: &Value, answers: &[(&str, Value)]) -> Value {
    let result = &first["result"];
    assert_eq!(result["resultType"], "input_required", "{first}");
    let mut responses = serde_json::Map::new();
    for (key, request) in result["inputRequests"].as_object().unwrap() {
        let message = request["params"]["message"].as_str().unwrap();
        let content = answers
            .iter()
            .find(|(m, _)| *m == message)
            .map(|(_, c)| c.clone())
            .unwrap_or_else(|| panic!("no answer for {message}"));
        responses.insert(key.clone(), json!({"action": "accept", "content": content}));
    }
    json!({"inputResponses": responses, "requestState": result["requestState"]})
}

#[test]
fn official_clients_complete_held_flows_with_rounds_on_alternating_replicas() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let replicas = peered(&url, 2, |_| {});
    let (a, b) = (&replicas[0].url, &replicas[1].url);
    for scenario in ["elicit", "multi", "two"] {
        assert_modern_call(&python_modern(&[a, scenario, b]), scenario);
        println!("Python modern client, requests alternating over two replicas, held flows: {scenario} ok");
        assert_modern_call(&ts_modern(&[a, scenario, b]), scenario);
        println!("TypeScript modern client, requests alternating over two replicas, held flows: {scenario} ok");
    }
    // plan_trip's rounds sent by hand: the first to A, the second to B.
    let lines = python_modern(&[a, "alternate", b]);
    let replicas_asked: Vec<&str> = lines.iter().filter_map(|l| l["replica"].as_str()).collect();
    assert_eq!(replicas_asked, ["A", "B"], "{lines:?}");
    assert_eq!(lines.last().unwrap()["text"], "Trip to Lisbon for 3 nights");
    let forwarded = sum(&replicas, |g| forwards(g, "ok"));
    println!("retries forwarded to their owner {forwarded}");
    // Ten rounds in all, or one more for each client whose run of `two` got the Python
    // server's second parallel question after the quiet window, asked in a round of its
    // own (both clients run `two`).
    let rounds = sum(&replicas, input_required_calls);
    assert!((10.0..=12.0).contains(&rounds), "{rounds} rounds");
    assert_every_round_held_and_resumed(&replicas);
    assert!(forwarded >= 4.0, "retries crossed replicas: {forwarded}");
    assert_eq!(sum(&replicas, |g| forwards(g, "owner_gone")), 0.0);
    // Forwards are timed under one label, not one series per replica address.
    let latency = "mrtr_gateway_upstream_request_duration_seconds_count";
    let by_peer = sum(&replicas, |g| {
        metric_with(&g.admin, latency, "upstream=\"peer\"").unwrap_or(0.0)
    });
    assert!(by_peer >= forwarded, "{by_peer} forwards timed as peer");
    for gw in &replicas {
        let text = ureq::get(&format!("{}/metrics", gw.admin)).call().unwrap();
        let text = text.into_string().unwrap();
        let series = text.lines().filter(|l| l.starts_with(latency)).count();
        assert!(series <= 2, "the upstream's series and the peers': {text}");
        assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 0.0);
        assert_resumable(gw, false, "the Python SDK server without an event store");
    }
}

/// A `FastMCP` server on the Python SDK's 1.x line, run as it runs by default (no event
/// store; `list_roots()` on the session's GET stream): both official clients complete
/// every interactive scenario with each request on the other replica, every round held.
#[test]
fn official_clients_complete_held_flows_against_a_fastmcp_server_on_the_1x_line() {
    let (_upstream, url) = start_upstream(Upstream::PythonMcp1);
    let replicas = peered(&url, 2, |_| {});
    let (a, b) = (&replicas[0].url, &replicas[1].url);
    for scenario in ["elicit", "multi", "two", "sample", "roots"] {
        assert_modern_call(&python_modern(&[a, scenario, b]), scenario);
        assert_modern_call(&ts_modern(&[a, scenario, b]), scenario);
        println!(
            "modern clients, requests alternating over two replicas, FastMCP 1.30: {scenario} ok"
        );
    }
    assert_every_round_held_and_resumed(&replicas);
}

/// A server on FastMCP (`fastmcp==4.2.3`) run as it runs by default, without an event
/// store: both official clients complete every interactive scenario it has tools for with
/// each request on the other replica, every round held (closing the call's stream is a
/// no-op there, so the question after it comes on the held stream).
#[test]
fn official_clients_complete_held_flows_against_a_fastmcp_server() {
    let (_upstream, url) = start_upstream(Upstream::FastMcp);
    let replicas = peered(&url, 2, |_| {});
    let (a, b) = (&replicas[0].url, &replicas[1].url);
    for scenario in ["elicit", "multi", "two", "reconnect"] {
        assert_modern_call(&python_modern(&[a, scenario, b]), scenario);
        assert_modern_call(&ts_modern(&[a, scenario, b]), scenario);
        println!("modern clients, requests alternating over two replicas, FastMCP: {scenario} ok");
    }
    assert_every_round_held_and_resumed(&replicas);
}

/// A TypeScript SDK server with `enableJsonResponse` answers a POST with one JSON body
/// once its result is ready, so a call's answer comes only with its result. Questions it
/// asks on the session's GET stream come while that answer is awaited: each round is
/// held with the call's POST, and both official modern clients complete them with each
/// request on the other replica. A call that asks nothing gets its JSON result. A
/// question tied to the call has no stream to go on there (the SDK drops it, as it does
/// for a client connected directly): the call ends with the gateway's error once the
/// group's `response_timeout_ms` has passed, instead of never.
#[test]
fn flows_against_a_typescript_server_answering_in_json() {
    let (_upstream, url) =
        start_upstream_with(Upstream::TypeScript, free_port(), &["--json-response"]);
    let replicas = peered(&url, 2, |c| c.upstreams[0].response_timeout_ms = 2_000);
    let (a, b) = (&replicas[0].url, &replicas[1].url);
    for scenario in ["getstream", "getstream-multi"] {
        assert_modern_call(&python_modern(&[a, scenario, b]), scenario);
        assert_modern_call(&ts_modern(&[a, scenario, b]), scenario);
        println!("modern clients, requests alternating over two replicas, TypeScript server answering in JSON: {scenario} ok");
    }
    assert_every_round_held_and_resumed(&replicas);
    let raw = Raw::new(a);
    let added = call_tool(&raw, 1, "add", json!({"arguments": {"a": 2, "b": 3}}));
    assert_eq!(added["result"]["content"][0]["text"], "2+3=5", "{added}");
    let started = Instant::now();
    let dropped = call_tool(&raw, 2, "ask_name", json!({}));
    assert_eq!(dropped["error"]["code"], -32603, "{dropped}");
    let message = dropped["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("did not answer the call in time"),
        "{dropped}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the call was not ended at the response timeout"
    );
}

#[test]
fn a_dead_owner_gives_the_documented_error_promptly_and_a_fresh_call_succeeds() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let mut replicas = peered(&url, 2, |_| {});
    let first = ask_name(&Raw::new(&replicas[0].url), 1, json!({}));
    assert_eq!(metric(&replicas[0].admin, "mrtr_gateway_held_flows"), 1.0);
    replicas[0].kill();
    let b = &replicas[1];
    let started = Instant::now();
    let reply = ask_name(&Raw::new(&b.url), 2, answer(&first, json!({"name": "Kim"})));
    let took = started.elapsed();
    assert_eq!(reply["error"]["code"], -32012, "{reply}");
    let text = reply["error"]["message"].as_str().unwrap();
    assert!(text.contains("replica holding this call"), "{text}");
    assert!(text.contains("issue the call again"), "{text}");
    assert!(
        !text.contains("may have run"),
        "nothing reached the dead owner: {text}"
    );
    assert!(took < Duration::from_secs(3), "the error took {took:?}");
    assert_eq!(forwards(b, "owner_gone"), 1.0);
    println!("a dead owner: -32012 after {took:?}: {text}");
    let fresh = ask_name(&Raw::new(&b.url), 3, json!({}));
    let done = ask_name(&Raw::new(&b.url), 4, answer(&fresh, json!({"name": "Kim"})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Kim!",
        "{done}"
    );
}

#[test]
fn a_retry_that_leaves_a_question_unanswered_is_asked_it_again() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    // Both parallel questions must land in round 1: a window they always fit in.
    let replicas = peered(&url, 2, |c| c.bridge.quiet_window_ms = 10);
    let (ra, rb) = (Raw::new(&replicas[0].url), Raw::new(&replicas[1].url));
    let first = call_tool(&ra, 1, "ask_two", json!({}));
    let questions = first["result"]["inputRequests"]
        .as_object()
        .unwrap()
        .clone();
    assert_eq!(questions.len(), 2, "{first}");
    let (color_key, _) = questions
        .iter()
        .find(|(_, q)| q["params"]["message"] == "Which color?")
        .unwrap();
    let (size_key, size_question) = questions
        .iter()
        .find(|(_, q)| q["params"]["message"] == "Which size?")
        .unwrap();
    let only_color = json!({
        "inputResponses": {color_key: {"action": "accept", "content": {"color": "red"}}},
        "requestState": first["result"]["requestState"]});
    let second = call_tool(&rb, 2, "ask_two", only_color);
    let again = second["result"]["inputRequests"].as_object().unwrap();
    assert_eq!(again.keys().collect::<Vec<_>>(), [size_key], "{second}");
    assert_eq!(&again[size_key], size_question);
    let third = call_tool(
        &ra,
        3,
        "ask_two",
        answer_all(&second, &[("Which size?", json!({"size": "M"}))]),
    );
    assert_eq!(
        third["result"]["content"][0]["text"], "color=red size=M",
        "{third}"
    );
}

#[test]
fn a_held_state_is_single_use_across_replicas() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let replicas = peered(&url, 2, |_| {});
    let (ra, rb) = (Raw::new(&replicas[0].url), Raw::new(&replicas[1].url));
    let first = ask_name(&ra, 1, json!({}));
    let state = first["result"]["requestState"].as_str().unwrap();
    println!(
        "a held one-elicitation requestState from the Python fixture: {} bytes",
        state.len()
    );
    assert!(state.len() <= 400, "a held state of {} bytes", state.len());
    let retry = answer(&first, json!({"name": "Kim"}));
    let done = ask_name(&rb, 2, retry.clone());
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Kim!",
        "{done}"
    );
    for (raw, id) in [(&rb, 3), (&ra, 4)] {
        let replayed = ask_name(raw, id, retry.clone());
        assert_eq!(replayed["error"]["code"], -32602, "{replayed}");
        assert_eq!(
            replayed["error"]["message"],
            "Invalid or expired requestState"
        );
    }
    let replays = metric_with(
        &replicas[0].admin,
        "mrtr_gateway_request_state_rejections_total",
        "replayed",
    );
    assert_eq!(replays, Some(2.0), "the owner refused both replays");
}

#[test]
fn a_held_state_runs_at_most_once_where_its_owner_is_not() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let peer_ports = [free_port(), free_port()];
    let mut replicas = peered_on(&url, &peer_ports, |_| {});
    // A client reaching B's peer listener with a flow A holds: refused there, and the
    // flow is still A's to finish.
    let first = ask_name(&Raw::new(&replicas[0].url), 1, json!({}));
    let retry = answer(&first, json!({"name": "Kim"}));
    let b_peer = Raw::new(&format!("http://127.0.0.1:{}/mcp", peer_ports[1]));
    let params = tool_params("ask_name", retry.clone());
    let stray = b_peer.modern(2, "tools/call", params, json!({"elicitation": {}}));
    assert_eq!(stray.status, 403);
    assert_eq!(metric(&replicas[0].admin, "mrtr_gateway_held_flows"), 1.0);
    let done = ask_name(&Raw::new(&replicas[0].url), 3, retry);
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Kim!",
        "{done}"
    );

    // The owner gone: B ends the flow once, and refuses the same state again.
    let second = ask_name(&Raw::new(&replicas[0].url), 4, json!({}));
    replicas[0].kill();
    let b = Raw::new(&replicas[1].url);
    let retry = answer(&second, json!({"name": "Kim"}));
    let lost = ask_name(&b, 5, retry.clone());
    assert_eq!(lost["error"]["code"], -32012, "{lost}");
    let again = ask_name(&b, 6, retry);
    assert_eq!(
        again["error"]["message"], "Invalid or expired requestState",
        "{again}"
    );
}

/// A client that leaves while its retry is forwarded to the owner cancels the call as a
/// client of the owner's own would: the forwarding replica drops the exchange, and the
/// owner, seeing its connection close, deletes the call's session, here while the
/// upstream still works on the answer.
#[test]
fn a_client_that_leaves_a_forwarded_retry_cancels_the_call_at_the_owner() {
    let upstream = holding_server();
    let replicas = peered(&upstream.url(), 2, |_| {});
    let caps = json!({"elicitation": {}});
    let params = held_ask_retry(&replicas[0], &caps, &[]);
    let client = send_and_stay(replicas[1].port, 2, params, caps);
    let answered = |s: &Seen| s.json().is_some_and(|m| m.get("result").is_some());
    wait_until("the answer upstream", Duration::from_secs(10), || {
        upstream.requests().iter().any(answered)
    });
    drop(client);
    wait_until(
        "the call's session deleted",
        Duration::from_secs(10),
        || upstream.requests().iter().any(|s| s.method == "DELETE"),
    );
}

/// A held flow's retry whose client has already gone when the owner reads it (a
/// forwarding replica that gave up on a frozen owner and told its client the call was
/// lost, to issue it again) is not continued: no answer goes up, and the held call ends.
#[test]
fn a_held_flows_retry_from_a_client_already_gone_is_not_continued() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let upstream = holding_server();
    let replicas = peered(&upstream.url(), 1, |_| {});
    let gw = &replicas[0];
    let caps = json!({"elicitation": {}});
    // With a credential: the held call's end upstream carries it.
    let params = held_ask_retry(gw, &caps, &[("x-api-key", "k-9")]);
    let request = raw_modern_request(2, "tools/call", params, caps, "");
    // The request and the client's close arrive together: corked, the data waits, and the
    // shutdown sends it with the FIN.
    let mut client = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    let on: libc::c_int = 1;
    // SAFETY: setsockopt(2) on this socket, reading `on`, an int as TCP_CORK takes.
    let corked = unsafe {
        libc::setsockopt(
            client.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CORK,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(corked, 0);
    client.write_all(request.as_bytes()).unwrap();
    client.shutdown(std::net::Shutdown::Write).unwrap();
    wait_until("the held call ended", Duration::from_secs(10), || {
        upstream.requests().iter().any(|s| s.method == "DELETE")
    });
    let delete = upstream
        .requests()
        .into_iter()
        .find(|s| s.method == "DELETE");
    let key_sent = delete.as_ref().and_then(|d| d.header("x-api-key"));
    assert_eq!(
        key_sent,
        Some("k-9"),
        "the DELETE carries the held round's credential"
    );
    let answered = |s: &Seen| s.json().is_some_and(|m| m.get("result").is_some());
    assert!(
        !upstream.requests().iter().any(answered),
        "an answer went up"
    );
    let abandoned = "event=\"abandoned\"";
    let events = "mrtr_gateway_held_flow_events_total";
    assert_eq!(metric_with(&gw.admin, events, abandoned), Some(1.0));
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 0.0);
}

#[test]
fn the_peer_listener_serves_only_retries_of_held_flows() {
    // A group that relays to a 2026-07-28 server holds no flow either: nothing is
    // relayed from the peer listener (whose Host, Origin and connections are not checked).
    for era in [UpstreamEra::Legacy, UpstreamEra::Modern] {
        peer_listener_serves_only_retries_of_held_flows(era);
    }
}

fn peer_listener_serves_only_retries_of_held_flows(era: UpstreamEra) {
    let tripwire = Tripwire::start();
    let peer_port = free_port();
    let gw = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        c.upstreams[0].era = era;
        c.peers.listen = Some(format!("127.0.0.1:{peer_port}"));
    });
    let peer = Raw::new(&format!("http://127.0.0.1:{peer_port}/mcp"));
    let list = peer.modern(1, "tools/list", json!({}), json!({}));
    assert_eq!(list.status, 403);
    let init = legacy_initialize("x");
    assert_eq!(peer.post(None, &init).status, 403);
    let first_call = peer.modern(2, "tools/call", json!({"name": "t"}), json!({}));
    assert_eq!(first_call.status, 403);
    let forged = peer.modern(
        3,
        "tools/call",
        json!({"name": "t", "requestState": "AAAA", "inputResponses": {}}),
        json!({}),
    );
    assert_eq!(forged.json()["error"]["code"], -32602, "{era:?}");
    // No discovery document either (the Host and Origin of its requests are not
    // checked): nothing is fetched upstream for it.
    let base = format!("http://127.0.0.1:{peer_port}");
    for path in [
        "/.well-known/oauth-protected-resource/mcp",
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-authorization-server",
    ] {
        let reply =
            Raw::new(&format!("{base}{path}")).request("GET", &[("host", "evil.example")], None);
        assert_eq!(reply.status, 403, "{path}");
    }
    assert_eq!(tripwire.count(), 0, "nothing reached an upstream");
    drop(gw);
}

/// A genuine state of a resumable round, which no replica holds, sent to the peer
/// listener: refused there and left unclaimed, so its retry on the MCP listener goes on.
#[test]
fn the_peer_listener_refuses_the_retry_of_a_flow_no_replica_holds() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let peer_port = free_port();
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.peers.listen = Some(format!("127.0.0.1:{peer_port}"));
    });
    let (raw, peer) = (
        Raw::new(&gw.url),
        Raw::new(&format!("http://127.0.0.1:{peer_port}/mcp")),
    );
    let first = ask_name(&raw, 1, json!({}));
    assert!(
        first["result"]["requestState"].is_string(),
        "a resumable round: {first}"
    );
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 0.0);
    let retry = answer(&first, json!({"name": "Alice"}));
    let params = tool_params("ask_name", retry.clone());
    let on_peer = peer.modern(2, "tools/call", params, json!({"elicitation": {}}));
    assert_eq!(on_peer.status, 403);
    let done = ask_name(&raw, 3, retry);
    let text = &done["result"]["content"][0]["text"];
    assert!(text.as_str().is_some_and(|t| t.contains("Alice")), "{done}");
}

#[test]
fn held_flows_above_the_limit_shed_new_calls_whose_retries_start_them() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let replicas = peered(&url, 1, |c| c.bridge.shed_above_held_flows = 1);
    let gw = &replicas[0];
    let raw = Raw::new(&gw.url);
    let first = ask_name(&raw, 1, json!({}));
    let second = ask_name(&raw, 2, json!({}));
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 2.0);
    let shed = ask_name(&raw, 3, json!({}));
    let result = &shed["result"];
    assert_eq!(result["resultType"], "input_required", "{shed}");
    assert!(result.get("inputRequests").is_none(), "state only: {shed}");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_shed_total"), 1.0);
    for (id, held) in [(4, &first), (5, &second)] {
        let done = ask_name(&raw, id, answer(held, json!({"name": "Kim"})));
        assert_eq!(done["result"]["content"][0]["text"], "Hello, Kim!");
    }
    let retry = json!({"requestState": result["requestState"]});
    let started = ask_name(&raw, 6, retry);
    let done = ask_name(&raw, 7, answer(&started, json!({"name": "Ada"})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Ada!",
        "{done}"
    );
}

#[test]
fn a_silent_call_without_event_ids_is_waited_for_not_polled() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let replicas = peered(&url, 1, |c| c.bridge.resume_poll_ms = 200);
    let raw = Raw::new(&replicas[0].url);
    let args = json!({"text": "late", "ms": 1000});
    let reply = raw
        .modern(
            1,
            "tools/call",
            json!({"name": "slow_echo", "arguments": args}),
            json!({}),
        )
        .json();
    assert_eq!(
        reply["result"]["content"][0]["text"], "echo: late",
        "{reply}"
    );
}

#[test]
fn a_held_round_inside_a_data_layer_session_keeps_the_session() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let replicas = peered(&url, 2, |_| {});
    let (ra, rb) = (Raw::new(&replicas[0].url), Raw::new(&replicas[1].url));
    let caps = json!({"elicitation": {}});
    let created = ra
        .modern(1, "session/create", json!({"hints": {}}), caps.clone())
        .json();
    let in_session = |cookie: &Value, extra: Value| {
        let mut params = json!({"_meta": {"mcp/session": {"id": cookie["id"]}}});
        params
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        params
    };
    let cookie = created["result"]["_meta"]["mcp/session"].clone();
    let ask = json!({"name": "notebook_ask", "arguments": {"label": "held"}});
    let asked = ra
        .modern(
            2,
            "tools/call",
            in_session(&cookie, ask.clone()),
            caps.clone(),
        )
        .json();
    assert_eq!(metric(&replicas[0].admin, "mrtr_gateway_held_flows"), 1.0);
    let mut retry = ask.clone();
    retry.as_object_mut().unwrap().extend(
        answer(&asked, json!({"text": "typed"}))
            .as_object()
            .unwrap()
            .clone(),
    );
    let cookie = asked["result"]["_meta"]["mcp/session"].clone();
    let done = rb
        .modern(3, "tools/call", in_session(&cookie, retry), caps.clone())
        .json();
    assert_eq!(
        done["result"]["content"][0]["text"], "held: typed",
        "{done}"
    );
    // A forward is counted once its response is relayed: the client may read first.
    wait_until("the forward counted", Duration::from_secs(5), || {
        forwards(&replicas[1], "ok") == 1.0
    });
    let cookie = done["result"]["_meta"]["mcp/session"].clone();
    let read = json!({"name": "notebook_read", "arguments": {}});
    let pages = rb
        .modern(4, "tools/call", in_session(&cookie, read), caps)
        .json();
    assert_eq!(
        pages["result"]["content"][0]["text"], "[\"held: typed\"]",
        "{pages}"
    );
}

/// One replica in front of `url` whose states expire after a second, and the cookie of
/// a data-layer session created through it.
fn expiring_replica_and_session(url: &str) -> (Vec<TestGateway>, Value) {
    let replicas = peered(url, 1, |c| c.bridge.request_state_ttl_seconds = 1);
    let raw = Raw::new(&replicas[0].url);
    let caps = json!({"elicitation": {}});
    let created = raw
        .modern(1, "session/create", json!({"hints": {}}), caps)
        .json();
    let cookie = created["result"]["_meta"]["mcp/session"]["id"].clone();
    (replicas, cookie)
}

#[test]
fn an_expired_held_flow_ends_but_its_data_layer_session_lives_on() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let (replicas, cookie) = expiring_replica_and_session(&url);
    let (gw, raw) = (&replicas[0], Raw::new(&replicas[0].url));
    let caps = json!({"elicitation": {}});
    let meta = json!({"mcp/session": {"id": cookie}});
    let ask = json!({"name": "notebook_ask", "arguments": {"label": "never"}, "_meta": meta});
    let asked = raw.modern(2, "tools/call", ask, caps.clone()).json();
    assert_eq!(asked["result"]["resultType"], "input_required", "{asked}");
    wait_until("the held flow to expire", Duration::from_secs(10), || {
        held_event(gw, "expired") == 1.0
    });
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 0.0);
    let append =
        json!({"name": "notebook_append", "arguments": {"text": "still here"}, "_meta": meta});
    let appended = raw.modern(3, "tools/call", append, caps).json();
    assert_eq!(
        appended["result"]["content"][0]["text"], "appended 'still here': 1 entries",
        "{appended}"
    );
}

/// The retry of a held `ask_name` flow whose sealed state names `owner` as its holder
/// and the upstream on `upstream_port`: answers and state, as a client sends them.
fn retry_held_by(owner: std::net::SocketAddr, upstream_port: u16) -> Value {
    use mrtr_gateway::keys::KeyRing;
    use mrtr_gateway::mrtr::state::{
        binding, now_secs, FlowState, HeldAt, Pending, UpstreamCall, UpstreamId, Waiting,
    };
    use mrtr_gateway::principal::PrincipalSource;
    let flow = FlowState {
        group: "default".into(),
        flow_id: 7,
        started_ms: 0,
        flow_deadline: now_secs() + 60,
        expires_at: now_secs() + 60,
        round: 1,
        known: Vec::new(),
        waiting: Waiting::Held {
            call: UpstreamCall {
                endpoint: format!("127.0.0.1:{upstream_port}").parse().unwrap(),
                session: "s".into(),
                id: UpstreamId::Number(1),
                data_session: false,
                version: Default::default(),
            },
            pending: vec![Pending {
                key: "elicitation_0".into(),
                upstream_id: UpstreamId::Number(0),
                fingerprint: None,
                asked: Default::default(),
            }],
            at: HeldAt {
                owner: Some(owner),
                slot: 1,
            },
        },
    };
    let principal = PrincipalSource::Authorization.digest(None);
    let bind = binding(&principal, "tools/call", Some("ask_name"), Some(&json!({})));
    let state = flow.seal(&KeyRing::parse(&test_keys()).unwrap(), &bind);
    json!({"inputResponses": {"elicitation_0": {"action": "accept", "content": {"name": "x"}}}, "requestState": state})
}

/// A state naming an owner outside the peer set (a replica scaled away) is never
/// forwarded there: the flow is lost, and since nobody else will end the call, the
/// session its state names is deleted (nothing else goes upstream: no answer).
#[test]
fn a_state_naming_an_owner_outside_the_peer_set_is_never_forwarded() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        legacy_basics(seen, "s").unwrap_or_else(|| Answer::status(405, &[], b""))
    });
    let outsider = Tripwire::start();
    let replicas = peered(&upstream.url(), 2, |_| {});
    let owner = format!("127.0.0.1:{}", outsider.port).parse().unwrap();
    let answers = retry_held_by(owner, upstream.port);
    let reply = ask_name(&Raw::new(&replicas[0].url), 1, answers);
    assert_eq!(reply["error"]["code"], -32012, "{reply}");
    assert_eq!(forwards(&replicas[0], "owner_gone"), 1.0);
    assert_eq!(
        outsider.count(),
        0,
        "nothing went to the address in the state"
    );
    wait_until("the named session deleted", Duration::from_secs(5), || {
        !upstream.requests().is_empty()
    });
    let sent: Vec<(String, Option<String>)> = upstream
        .requests()
        .iter()
        .map(|s| {
            (
                s.method.clone(),
                s.header("mcp-session-id").map(str::to_string),
            )
        })
        .collect();
    assert_eq!(sent, [("DELETE".to_string(), Some("s".to_string()))]);
}

/// A replica whose DNS peer set has not answered yet (at its start, while the resolver
/// fails) cannot tell an owner missing from it from one that is gone: the retry is
/// refused for now (send it again), unclaimed, and the flow is not taken for lost.
#[test]
fn a_replica_that_does_not_know_its_peers_yet_loses_none_of_their_flows() {
    let (upstream, owner) = (Tripwire::start(), Tripwire::start());
    let silent_resolver = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let resolver = silent_resolver.local_addr().unwrap().to_string();
    let peer_port = free_port();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.dns_resolver = Some(resolver);
        c.peers.listen = Some(format!("127.0.0.1:{peer_port}"));
        c.peers.advertise = Some(format!("127.0.0.1:{peer_port}"));
        c.peers.discovery = mrtr_gateway::config::Discovery::Dns;
        c.peers.members = vec![format!("replicas.test:{peer_port}")];
    });
    let owner_addr = format!("127.0.0.1:{}", owner.port).parse().unwrap();
    let params = tool_params("ask_name", retry_held_by(owner_addr, upstream.port));
    let reply = Raw::new(&gw.url).modern(1, "tools/call", params, json!({"elicitation": {}}));
    let refused = reply.json();
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("does not know its peers yet"), "{refused}");
    assert_eq!(forwards(&gw, "owner_gone"), 0.0, "the flow was not lost");
    assert_eq!(
        (owner.count(), upstream.count()),
        (0, 0),
        "nothing was sent"
    );
}

/// A retry forwarded to an owner that takes the connection but answers nothing (a frozen
/// process: the kernel still completes the handshake) loses the flow within seconds, not
/// when the flow's deadline ends the wait half an hour later. The retry reached the owner,
/// which may have posted its answers before it froze: the client is told the call may
/// have run, not to issue it again blindly.
#[test]
fn a_retry_forwarded_to_an_owner_that_stopped_answering_ends_within_seconds() {
    let upstream = Tripwire::start();
    // Listening, never accepting: connections complete in the backlog and stay unread.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let frozen_at = frozen.local_addr().unwrap();
    let replicas = peered(&upstream.url(), 1, |c| {
        c.peers.members.push(frozen_at.to_string())
    });
    let answers = retry_held_by(frozen_at, upstream.port);
    let started = Instant::now();
    let reply = ask_name(&Raw::new(&replicas[0].url), 1, answers);
    let took = started.elapsed();
    assert_eq!(reply["error"]["code"], -32012, "{reply}");
    let text = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(text.contains("may have run to its end"), "{text}");
    assert!(text.contains("check whether it ran"), "{text}");
    assert!(took < Duration::from_secs(13), "the error took {took:?}");
    assert_eq!(forwards(&replicas[0], "owner_gone"), 1.0);
    assert_eq!(upstream.count(), 0, "nothing went upstream");
    drop(frozen);
}

/// A retry forwarded to an owner that sends its answer's header and first event, then
/// freezes with the connection open (and its peer listener taking checks it never
/// answers): the liveness checks go on while the answer streams, and the client's answer
/// is cut within seconds, not kept open by this replica's keep-alive comments for ever.
#[test]
fn a_forwarded_answer_whose_owner_freezes_midway_is_cut() {
    let upstream = Tripwire::start();
    let owner = ScriptedUpstream::start(|seen: &Seen| {
        if seen.path.starts_with("/.mrtr-gateway/alive") {
            return Answer::silent();
        }
        let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": 1, "progress": 1}});
        Answer::sse(&[]).event(None, &progress)
    });
    let owner_at = format!("127.0.0.1:{}", owner.port);
    let replicas = peered(&upstream.url(), 1, |c| {
        c.peers.members.push(owner_at.clone())
    });
    let answers = retry_held_by(owner_at.parse().unwrap(), upstream.port);
    let params = tool_params("ask_name", answers);
    let raw = Raw::new(&replicas[0].url);
    let started = Instant::now();
    let mut reply = raw.modern(1, "tools/call", params, json!({"elicitation": {}}));
    assert_eq!(reply.status, 200);
    let (_, first) = reply.next_message().expect("the owner's first event");
    assert_eq!(first["method"], "notifications/progress", "{first}");
    assert_eq!(reply.next_message(), None, "the answer went on");
    // Cut by the replica, before the scripted owner's own idle limit closes its end.
    let took = started.elapsed();
    assert!(took < IDLE_LIMIT, "the answer was cut after {took:?}");
    wait_until(
        "the forward counted as cut",
        Duration::from_secs(10),
        || forwards(&replicas[0], "owner_gone") == 1.0,
    );
    assert_eq!(forwards(&replicas[0], "ok"), 0.0);
    assert_eq!(upstream.count(), 0, "nothing went upstream");
}

/// One caller holds at most `bridge.max_held_flows_per_principal` flows on a replica, so
/// a client that abandons its flows cannot take every slot from the others; requests
/// without a credential share only the table's bound; a flow that ends gives its
/// caller's slot back.
#[test]
fn one_caller_holds_at_most_its_share_of_the_held_flows() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let replicas = peered(&url, 1, |c| c.bridge.max_held_flows_per_principal = 1);
    let gw = &replicas[0];
    let raw = Raw::new(&gw.url);
    let ask_as = |id: u64, who: &str, extra: Value| ask_name_as(&raw, id, who, extra);
    let asked = |reply: &Value| reply["result"]["resultType"] == "input_required";
    let alice = ask_as(1, "alice", json!({}));
    assert!(asked(&alice), "{alice}");
    let refused = ask_as(2, "alice", json!({}));
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("bridge.max_held_flows_per_principal"),
        "{refused}"
    );
    let bob = ask_as(3, "bob", json!({}));
    assert!(asked(&bob), "another caller is held: {bob}");
    for id in [4, 5] {
        let anonymous = ask_name(&raw, id, json!({}));
        assert!(asked(&anonymous), "{anonymous}");
    }
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 4.0);
    let done = ask_as(6, "alice", answer(&alice, json!({"name": "Ann"})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Ann!",
        "{done}"
    );
    let again = ask_as(7, "alice", json!({}));
    assert!(asked(&again), "her slot came back: {again}");
}

/// An expired held flow's DELETE that the upstream cannot take (it is restarting: a 503)
/// is sent again later: the SDK servers keep a session until it is deleted.
#[test]
fn an_expired_held_flows_delete_that_failed_is_sent_again() {
    let (upstream, deletes) = FirstRefused::deletes_in_front_of(holding_script);
    let replicas = peered(&upstream.url(), 1, |c| {
        c.bridge.request_state_ttl_seconds = 1;
    });
    let gw = &replicas[0];
    let asked = call_tool(&Raw::new(&gw.url), 1, "ask", json!({}));
    assert_eq!(asked["result"]["resultType"], "input_required", "{asked}");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 1.0, "held");
    deletes.assert_deleted_at_second_attempt(gw, &upstream);
    assert_eq!(held_event(gw, "expired"), 1.0);
}

/// Held flows that expire together each end on their own: an upstream that takes the
/// first one's DELETE and never answers it does not keep the second's waiting (nor the
/// sweep, nor the flows expiring after).
#[test]
fn held_flows_expiring_together_end_apart() {
    let deletes = std::sync::atomic::AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let first_delete = seen.method == "DELETE"
            && deletes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        match first_delete {
            true => Answer::silent(),
            false => holding_script(seen),
        }
    });
    let replicas = peered(&upstream.url(), 1, |c| {
        c.bridge.request_state_ttl_seconds = 1;
        c.upstreams[0].response_timeout_ms = 30_000;
    });
    let gw = &replicas[0];
    let raw = Raw::new(&gw.url);
    for id in [1, 2] {
        let asked = call_tool(&raw, id, "ask", json!({}));
        assert_eq!(asked["result"]["resultType"], "input_required", "{asked}");
    }
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 2.0, "held");
    wait_until(
        "both sessions' DELETEs sent",
        Duration::from_secs(10),
        || {
            let requests = upstream.requests();
            requests.iter().filter(|s| s.method == "DELETE").count() >= 2
        },
    );
    assert_eq!(held_event(gw, "expired"), 2.0);
}

/// A held call in a data-layer session whose client never continues it is cancelled by
/// id when its flow expires, in its session, which lives on: the tool stops waiting for
/// an answer that cannot come any more.
#[test]
fn an_expired_held_call_in_a_data_layer_session_is_cancelled_upstream() {
    let upstream = holding_server();
    let gw = held_call_in_a_data_layer_session(&upstream);
    assert_call_cancelled_in_its_session(&upstream, &gw.admin, "abandoned");
}

/// That cancellation, when the upstream cannot take it (it is restarting: a 503), is sent
/// again later, as a DELETE is.
#[test]
fn an_expired_held_calls_cancellation_that_failed_is_sent_again() {
    let (upstream, cancellations) = FirstRefused::cancellations_in_front_of(holding_script);
    let gw = held_call_in_a_data_layer_session(&upstream);
    cancellations.assert_cancelled_again_the_same(&upstream);
    assert_call_cancelled_in_its_session(&upstream, &gw.admin, "abandoned");
}

/// A replica whose flows expire in a second, holding a call in a data-layer session of
/// `upstream` (`holding_script`) that its client will not continue.
fn held_call_in_a_data_layer_session(upstream: &ScriptedUpstream) -> TestGateway {
    let (mut replicas, cookie) = expiring_replica_and_session(&upstream.url());
    let gw = replicas.remove(0);
    let raw = Raw::new(&gw.url);
    let caps = json!({"elicitation": {}});
    let ask = json!({"name": "ask", "arguments": {}, "_meta": {"mcp/session": {"id": cookie}}});
    let asked = raw.modern(2, "tools/call", ask, caps).json();
    assert_eq!(asked["result"]["resultType"], "input_required", "{asked}");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 1.0);
    gw
}

/// A held flow's retry whose credential the upstream denies (a token that expired while
/// the client was away) ends the held call upstream with the credential of the round that
/// held it: the retry's own, just refused, would leave the session to the upstream's
/// expiry.
#[test]
fn a_held_retry_the_upstream_denies_ends_the_call_as_the_holding_round() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if seen.header("x-api-key") == Some("k-expired") {
            let challenge = [("www-authenticate", "Bearer realm=\"mcp\"")];
            return Answer::status(401, &challenge, b"");
        }
        holding_script(seen)
    });
    let replicas = peered(&upstream.url(), 1, |_| {});
    let gw = &replicas[0];
    let caps = json!({"elicitation": {}});
    let params = held_ask_retry(gw, &caps, &[("x-api-key", "k-9")]);
    let expired = [("x-api-key", "k-expired")];
    let denied = Raw::new(&gw.url).modern_with(2, "tools/call", params, caps, &expired);
    assert_eq!(denied.status, 401, "the client hears the denial");
    wait_until("the held call ended", Duration::from_secs(10), || {
        upstream
            .requests()
            .iter()
            .any(|s| s.method == "DELETE" && s.header("x-api-key") == Some("k-9"))
    });
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 0.0);
}
