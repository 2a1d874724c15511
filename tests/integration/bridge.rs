//! The MRTR bridge: 2026-07-28 clients against unchanged legacy servers through the
//! gateway, with official clients, rounds on different replicas, a killed replica, and
//! hostile `requestState` values that must reach no upstream.

use crate::common::*;
use mrtr_gateway::keys::KeyRing;
use mrtr_gateway::mrtr::state::{binding, FlowState};
use mrtr_gateway::principal::PrincipalSource;
use serde_json::{json, Value};
use std::time::Duration;

#[test]
fn the_python_modern_client_completes_flows_against_a_legacy_server() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    for scenario in ["elicit", "multi", "two", "sample", "roots"] {
        let lines = python_modern(&[&gw.url, scenario]);
        assert_modern_call(&lines, scenario);
        println!("Python modern client -> gateway -> Python legacy server: {scenario} ok");
    }
}

#[test]
fn the_typescript_modern_client_completes_flows_against_a_legacy_server() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let gw = TestGateway::start(&[&url], &test_keys());
    for scenario in ["elicit", "multi", "two", "sample", "roots", "getstream"] {
        let lines = ts_modern(&[&gw.url, scenario]);
        assert_modern_call(&lines, scenario);
        println!("TypeScript modern client -> gateway -> TypeScript legacy server: {scenario} ok");
    }
}

/// The Rust SDK (`rmcp`) sends every server request on the session's GET stream, opens
/// every stream with an event whose id is `0` (0.16: the call's stream too; 2.2: the GET
/// stream, whose messages it also numbers from `0`), resolves `0` to the GET stream, and
/// replays from the named event itself: resumed, a round would wait for a result that
/// never comes (0.16) or ask answered questions again until the client gives up (2.2).
/// The gateway sees an event id come twice in the first round and, with the default
/// `resume: auto`, holds the group's flows. 3.11 asks on the call's own stream with ids
/// that do not repeat: its rounds are resumable. Both official modern clients complete
/// every kind of question against all three releases.
#[test]
fn modern_clients_complete_flows_against_the_rust_sdk_servers() {
    for (server, resumable) in [
        (Upstream::Rust016, false),
        (Upstream::Rust22, false),
        (Upstream::Rust311, true),
    ] {
        let (_upstream, url) = start_upstream(server);
        let gw = TestGateway::start(&[&url], &test_keys());
        for scenario in ["elicit", "multi", "two", "sample", "roots"] {
            assert_modern_call(&python_modern(&[&gw.url, scenario]), scenario);
            assert_modern_call(&ts_modern(&[&gw.url, scenario]), scenario);
            println!("modern clients -> gateway -> {server:?}: {scenario} ok");
        }
        assert_resumable(&gw, resumable, &format!("{server:?}"));
    }
}

/// FastMCP (`fastmcp==4.2.3`) with its own event store, which it scopes to each session:
/// its rounds resume, so requests alternating over two replicas that share only their
/// keys complete every flow, one asking after the server closed the call's stream
/// (SEP-1699) among them: the round follows the stream's `retry` and finds the question
/// on the stream it resumed. FastMCP speaks 2026-07-28 itself, where its tools cannot
/// ask; `era: auto` bridges it all the same.
#[test]
fn modern_clients_complete_flows_across_replicas_against_a_fastmcp_server() {
    let (_upstream, url) = start_upstream(Upstream::FastMcpWithEventStore);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    for scenario in ["elicit", "multi", "two", "reconnect"] {
        assert_modern_call(&python_modern(&[&a.url, scenario, &b.url]), scenario);
        assert_modern_call(&ts_modern(&[&a.url, scenario, &b.url]), scenario);
        println!("modern clients, requests alternating over two replicas, FastMCP with its event store: {scenario} ok");
    }
    for gw in [&a, &b] {
        assert_resumable(gw, true, "FastMCP with its event store");
    }
    let rounds = sum([&a, &b], input_required_calls);
    assert!(rounds >= 10.0, "every flow asked: {rounds} rounds");
}

/// A server on an SDK release before 2025-11-25 (TypeScript SDK 1.17.5) negotiates
/// 2025-06-18 and refuses a request naming any other revision with 400. Every later
/// round resumes its session, on this replica or another, naming the revision the session
/// negotiated (sealed in the state): both official modern clients complete every kind of
/// question, and a flow whose rounds alternate replicas completes too.
#[test]
fn rounds_name_the_revision_their_session_negotiated() {
    let (_upstream, url) = start_upstream(Upstream::TypeScriptSdk117);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    for scenario in ["elicit", "multi", "sample", "roots"] {
        assert_modern_call(&python_modern(&[&a.url, scenario]), scenario);
        assert_modern_call(&ts_modern(&[&a.url, scenario]), scenario);
        println!("modern clients -> gateway -> TypeScript SDK 1.17.5: {scenario} ok");
    }
    let lines = python_modern(&[&a.url, "alternate", &b.url]);
    let replicas: Vec<&str> = lines.iter().filter_map(|l| l["replica"].as_str()).collect();
    assert_eq!(replicas, ["A", "B"], "{lines:?}");
    assert_eq!(lines.last().unwrap()["text"], "Trip to Lisbon for 3 nights");
}

/// TypeScript SDK 1.17.5 sends a POST stream's header only with its first event, and
/// `elicitInput` without `relatedRequestId` (its default) asks on the session's GET
/// stream: the question comes while the call's answer is still awaited. The round reads
/// the GET stream meanwhile, is held with the call's POST, and the retry's answer lets
/// the tool finish.
#[test]
fn a_question_asked_while_the_calls_answer_is_withheld_reaches_the_client() {
    let (_upstream, url) = start_upstream(Upstream::TypeScriptSdk117);
    let gw = TestGateway::start(&[&url], &test_keys());
    assert_modern_call(&python_modern(&[&gw.url, "getstream"]), "getstream");
    assert_modern_call(&ts_modern(&[&gw.url, "getstream"]), "getstream");
}

/// The reaper's DELETE of an abandoned flow's session names the revision the session
/// negotiated: a server that refuses any other (TypeScript SDK 1.17.5) would keep it.
#[test]
fn an_abandoned_flow_on_an_older_revision_is_deleted_at_its_deadline() {
    let (_upstream, url) = start_upstream(Upstream::TypeScriptSdk117);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.bridge.request_state_ttl_seconds = 1;
        c.bridge.max_flow_seconds = 2;
    });
    let first = ask_name(&Raw::new(&gw.url), 1, json!({}));
    assert_eq!(first["result"]["resultType"], "input_required", "{first}");
    wait_until(
        "the reaper to delete the abandoned session",
        Duration::from_secs(15),
        || metric_with(&gw.admin, "mrtr_gateway_upstream_sessions_total", "reaped") == Some(1.0),
    );
}

#[test]
fn server_everything_serves_modern_clients_through_the_gateway() {
    let (_upstream, url) = start_upstream(Upstream::Everything);
    let gw = TestGateway::start(&[&url], &test_keys());
    let lines = python_modern(&[&gw.url, "everything"]);
    let texts: Vec<&str> = lines.iter().filter_map(|l| l["text"].as_str()).collect();
    assert_eq!(texts.len(), 3, "{lines:?}");
    assert_eq!(texts[0], "Echo: hi");
    assert!(texts[1].contains("declined"), "{}", texts[1]);
    assert!(texts[2].contains("\"text\": \"short\""), "{}", texts[2]);

    // Its 2025-11-25 tasks capability is not advertised: the wire form is not 2026-07-28's.
    let raw = Raw::new(&gw.url);
    let discover = raw
        .modern(1, "server/discover", json!({}), json!({}))
        .json();
    let capabilities = &discover["result"]["capabilities"];
    assert!(capabilities["tools"].is_object(), "{discover}");
    assert!(capabilities.get("tasks").is_none(), "{discover}");
}

/// `server/discover` and every result's `serverInfo` describe the upstream as it is now:
/// an upstream restarted as another server (a deploy) is described as that one, without
/// restarting the gateway.
#[test]
fn discovery_follows_an_upstream_restarted_as_another_server() {
    let port = free_port();
    let (mut first, url) = start_upstream_on(Upstream::Conformance, port);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let name = |id: u64| {
        let discover = raw
            .modern(id, "server/discover", json!({}), json!({}))
            .json();
        discover["result"]["_meta"]["io.modelcontextprotocol/serverInfo"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("no serverInfo: {discover}"))
            .to_string()
    };
    let before = name(1);
    first.kill();
    let (_second, _) = start_upstream_on(Upstream::Python, port);
    let after = name(2);
    assert_ne!(
        before, after,
        "still described as the server before the restart"
    );
    let listed = raw.modern(3, "tools/list", json!({}), json!({})).json();
    assert_eq!(
        listed["result"]["_meta"]["io.modelcontextprotocol/serverInfo"]["name"], after,
        "{listed}"
    );
}

#[test]
fn every_round_can_land_on_another_replica() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    let lines = python_modern(&[&a.url, "alternate", &b.url]);
    let replicas: Vec<&str> = lines.iter().filter_map(|l| l["replica"].as_str()).collect();
    assert_eq!(replicas, ["A", "B"], "{lines:?}");
    let result = lines.last().unwrap();
    assert_eq!(result["text"], "Trip to Lisbon for 3 nights");
    for l in lines.iter().filter(|l| l["step"] == "input_required") {
        println!(
            "a one-elicitation requestState from the Python fixture: {} bytes",
            l["stateBytes"]
        );
        assert!(
            l["stateBytes"].as_u64().unwrap() <= 400,
            "a one-elicitation state over 400 bytes: {l}"
        );
    }
}

#[test]
fn a_replica_killed_between_rounds_loses_nothing() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let mut a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    let first = ask_name(&Raw::new(&a.url), 1, json!({}));
    let result = &first["result"];
    assert_eq!(result["resultType"], "input_required", "{first}");
    let (key, question) = result["inputRequests"]
        .as_object()
        .unwrap()
        .iter()
        .next()
        .unwrap();
    assert_eq!(question["method"], "elicitation/create");
    assert!(question.get("id").is_none() && question.get("jsonrpc").is_none());
    a.kill();
    let answers = json!({"inputResponses": {key: {"action": "accept", "content": {"name": "Kim"}}}, "requestState": result["requestState"]});
    let second = ask_name(&Raw::new(&b.url), 2, answers);
    assert_eq!(second["id"], 2, "the retry's own id");
    assert_eq!(second["result"]["resultType"], "complete", "{second}");
    assert_eq!(second["result"]["content"][0]["text"], "Hello, Kim!");
}

/// A request that must be refused: name, headers, body, HTTP status, JSON-RPC code.
type RefusalCase<'a> = (&'a str, Vec<(&'a str, &'a str)>, Value, u16, i64);

#[test]
fn the_modern_surface_refuses_bad_requests_in_the_spec_form() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let base = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
    ];
    let post = |extra: &[(&str, &str)], body: Value| {
        let mut headers = base.to_vec();
        headers.extend_from_slice(extra);
        raw.request("POST", &headers, Some(&body.to_string()))
    };
    let meta = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}});
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "_meta": meta}});
    let cases: Vec<RefusalCase> = vec![
        (
            "Mcp-Name mismatch",
            vec![
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/call"),
                ("mcp-name", "u"),
            ],
            call.clone(),
            400,
            -32020,
        ),
        (
            "Mcp-Method mismatch",
            vec![
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/list"),
                ("mcp-name", "t"),
            ],
            call.clone(),
            400,
            -32020,
        ),
        (
            "no _meta",
            vec![
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/list"),
            ],
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}),
            400,
            -32602,
        ),
        (
            "unsupported version",
            vec![
                ("mcp-protocol-version", "2099-01-01"),
                ("mcp-method", "tools/list"),
            ],
            json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": "2099-01-01", "io.modelcontextprotocol/clientCapabilities": {}}}}),
            400,
            -32022,
        ),
        (
            // The version is told first, whatever the method: `initialize` is not one of
            // 2026-07-28, but a future one is not this revision's to judge.
            "unsupported version, initialize",
            vec![("mcp-protocol-version", "2099-01-01")],
            json!({"jsonrpc": "2.0", "id": 5, "method": "initialize", "params": {
                "protocolVersion": "2099-01-01", "capabilities": {},
                "clientInfo": {"name": "future", "version": "1"}}}),
            400,
            -32022,
        ),
        (
            "unknown method",
            vec![
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "no/such"),
            ],
            json!({"jsonrpc": "2.0", "id": 4, "method": "no/such", "params": {"_meta": meta}}),
            404,
            -32601,
        ),
    ];
    for (case, headers, body, status, code) in cases {
        let reply = post(&headers, body);
        assert_eq!(reply.status, status, "{case}");
        let body = reply.json();
        assert_eq!(body["error"]["code"], code, "{case}: {body}");
        if code == -32022 {
            assert_eq!(body["error"]["data"]["supported"], json!(["2026-07-28"]));
        }
    }
    let get = raw.request(
        "GET",
        &[
            ("accept", "text/event-stream"),
            ("mcp-protocol-version", "2026-07-28"),
        ],
        None,
    );
    assert_eq!(get.status, 405);
    assert!(get
        .headers
        .iter()
        .any(|(n, v)| n == "allow" && v.starts_with("POST")));
    assert_eq!(
        tripwire.count(),
        0,
        "a refused modern request reached the upstream"
    );
}

#[test]
fn an_abandoned_flow_has_its_upstream_session_deleted_at_its_deadline() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.bridge.request_state_ttl_seconds = 1;
        c.bridge.max_flow_seconds = 2;
    });
    let first = ask_name(&Raw::new(&gw.url), 1, json!({}));
    let sealed = first["result"]["requestState"]
        .as_str()
        .expect("a requestState")
        .to_string();
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let principal = PrincipalSource::Authorization.digest(None);
    let bind = binding(&principal, "tools/call", Some("ask_name"), Some(&json!({})));
    let flow = FlowState::open(&ring, &bind, &sealed, 0).expect("the gateway's own state");
    assert!(
        flow.expires_at <= flow.flow_deadline,
        "a round outlives its flow"
    );
    // Ask the upstream directly whether the session still exists.
    let upstream = Raw::new(&url);
    let alive = || {
        upstream
            .post(
                flow.waiting.call().map(|c| c.session.as_str()),
                &json!({"jsonrpc":"2.0","id":5,"method":"tools/list"}),
            )
            .status
            == 200
    };
    assert!(
        alive(),
        "the pending flow's session must stay open until its deadline"
    );
    wait_until(
        "the reaper to delete the abandoned session",
        Duration::from_secs(15),
        || !alive(),
    );
}

#[test]
fn a_group_forced_resumable_whose_upstream_cannot_resume_gets_a_clear_error_not_a_hang() {
    let (_upstream, url) = start_upstream(Upstream::PythonWithoutEventStore);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].resume = mrtr_gateway::config::ResumeMode::Resumable;
    });
    let resumable = || metric_with(&gw.admin, "mrtr_gateway_upstream_resumable", "default");
    assert_eq!(resumable(), Some(-1.0), "not known before a round");
    let started = std::time::Instant::now();
    let reply = Raw::new(&gw.url).modern(
        1,
        "tools/call",
        json!({"name": "ask_name", "arguments": {}}),
        json!({"elicitation": {}}),
    );
    // A failure reaches a 2026-07-28 client as HTTP 200 carrying the JSON-RPC error.
    assert_eq!(reply.status, 200);
    let body = reply.json();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("configured `resume: resumable`, but its SSE events carry no ids"),
        "{body}"
    );
    assert_eq!(resumable(), Some(-1.0), "no round waited");
    assert!(started.elapsed() < Duration::from_secs(10));
    // A call that asks nothing still works through the same upstream.
    let plain = Raw::new(&gw.url).modern(
        2,
        "tools/call",
        json!({"name": "add", "arguments": {"a": 2, "b": 3}}),
        json!({}),
    );
    assert_eq!(plain.status, 200);
    assert_eq!(plain.json()["result"]["content"][0]["text"], "2+3=5");
}

#[test]
fn server_everything_url_elicitation_its_error_path_and_roots_through_the_bridge() {
    let (_upstream, url) = start_upstream(Upstream::Everything);
    let gw = TestGateway::start(&[&url], &test_keys());
    let lines = python_modern(&[&gw.url, "everything-url-roots"]);
    let texts: Vec<&str> = lines.iter().filter_map(|l| l["text"].as_str()).collect();
    assert_eq!(texts.len(), 3, "{lines:#?}");
    assert!(
        texts[0].contains("User completed the URL elicitation flow"),
        "{}",
        texts[0]
    );
    // errorPath: the upstream's -32042 became a URL-mode input request for its
    // prerequisite; the retry re-issued the call, which then asked its own URL.
    let urls: Vec<&str> = lines
        .iter()
        .filter(|l| l["step"] == "url_elicitation")
        .filter_map(|l| l["url"].as_str())
        .collect();
    assert_eq!(
        urls,
        [
            "https://example.com/consent",
            "https://modelcontextprotocol.io",
            "https://example.com/consent"
        ],
        "{lines:#?}"
    );
    assert!(
        texts[1].contains("User completed the URL elicitation flow"),
        "{}",
        texts[1]
    );
    assert!(
        texts[2].contains("file:///tmp/project"),
        "get-roots-list: {}",
        texts[2]
    );
}

/// A 2026-07-28 client's `task` param means nothing on its wire (servers of that
/// revision ignore it): it does not reach a 2025-11-25 server, which would take it for
/// a legacy task (server-everything refuses it on a tool without task support).
#[test]
fn a_clients_task_param_does_not_reach_a_legacy_server() {
    let (_upstream, url) = start_upstream(Upstream::Everything);
    let gw = TestGateway::start(&[&url], &test_keys());
    let params = json!({"name": "echo", "arguments": {"message": "hi"}, "task": {"ttl": 60000}});
    let reply = Raw::new(&gw.url).modern(1, "tools/call", params, json!({}));
    let body = reply.json();
    assert_eq!(body["result"]["resultType"], "complete", "{body}");
    assert_eq!(body["result"]["content"][0]["text"], "Echo: hi", "{body}");
}

/// server-everything's URL elicitation whose error path (-32042) the user declines: the
/// call is not issued again (it would ask again, now for its own URL) and the client
/// hears that the user declined what the server needs.
#[test]
fn a_declined_url_elicitation_required_error_ends_the_call_without_issuing_it_again() {
    let (_upstream, url) = start_upstream(Upstream::Everything);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let caps = json!({"elicitation": {"form": {}, "url": {}}});
    let arguments = json!({"url": "https://modelcontextprotocol.io", "errorPath": true});
    let params = |extra: Value| {
        let mut params = json!({"name": "trigger-url-elicitation", "arguments": arguments});
        params
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        params
    };
    let asked = raw
        .modern(1, "tools/call", params(json!({})), caps.clone())
        .json();
    let result = &asked["result"];
    assert_eq!(result["resultType"], "input_required", "{asked}");
    let requests = result["inputRequests"].as_object().unwrap();
    assert_eq!(requests.len(), 1, "{asked}");
    let (key, question) = requests.iter().next().unwrap();
    assert_eq!(question["params"]["mode"], "url", "{asked}");
    let declined = json!({"inputResponses": {key: {"action": "decline"}}, "requestState": result["requestState"]});
    let reply = raw.modern(2, "tools/call", params(declined), caps).json();
    assert_eq!(reply["id"], 2);
    assert_eq!(reply["error"]["code"], -32603, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("declined the URL-mode elicitation"),
        "{reply}"
    );
}

/// Reads an SSE response to its end: the notifications, then the final message.
fn notifications_then_result(reply: &mut Reply) -> (Vec<Value>, Value) {
    let mut messages = Vec::new();
    while let Some((_, m)) = reply.next_message() {
        messages.push(m);
    }
    let last = messages.pop().expect("a final message");
    (messages, last)
}

#[test]
fn progress_streams_to_the_client_and_logs_only_when_asked() {
    let (_upstream, url) = start_upstream(Upstream::Conformance);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let progress = json!({"name": "test_tool_with_progress", "arguments": {}, "_meta": {"progressToken": "p-7"}});
    let mut reply = raw.modern(1, "tools/call", progress, json!({}));
    assert!(
        reply.content_type.starts_with("text/event-stream"),
        "{}",
        reply.content_type
    );
    let (notes, last) = notifications_then_result(&mut reply);
    assert_eq!(notes.len(), 3, "{notes:?}");
    for (n, want) in notes.iter().zip([0, 50, 100]) {
        assert_eq!(n["method"], "notifications/progress");
        assert_eq!(
            n["params"]["progressToken"], "p-7",
            "the client's own token"
        );
        assert_eq!(n["params"]["progress"], want);
    }
    assert_eq!(last["id"], 1);
    assert_eq!(last["result"]["resultType"], "complete");

    let silent = raw.modern(
        2,
        "tools/call",
        json!({"name": "test_tool_with_logging", "arguments": {}}),
        json!({}),
    );
    assert!(
        silent.content_type.starts_with("application/json"),
        "no logLevel, so nothing streams"
    );
    assert_eq!(silent.json()["result"]["resultType"], "complete");

    let asked = json!({"name": "test_tool_with_logging", "arguments": {}, "_meta": {"io.modelcontextprotocol/logLevel": "info"}});
    let mut reply = raw.modern(3, "tools/call", asked, json!({}));
    let (notes, last) = notifications_then_result(&mut reply);
    let logs: Vec<&str> = notes
        .iter()
        .filter(|n| n["method"] == "notifications/message")
        .filter_map(|n| n["params"]["data"].as_str())
        .collect();
    assert_eq!(
        logs,
        [
            "Tool execution started",
            "Tool processing data",
            "Tool execution completed"
        ]
    );
    assert_eq!(last["result"]["resultType"], "complete");

    // The tool logs at `info`: a request for `warning` and above gets none of it.
    let above = json!({"name": "test_tool_with_logging", "arguments": {}, "_meta": {"io.modelcontextprotocol/logLevel": "warning"}});
    let reply = raw.modern(4, "tools/call", above, json!({}));
    assert!(
        reply.content_type.starts_with("application/json"),
        "nothing at warning or above, so nothing streams"
    );
    assert_eq!(reply.json()["result"]["resultType"], "complete");
}

/// A 2026-07-28 server ignores an incoming `Mcp-Session-Id` (the revision removed it):
/// a request that declares 2026-07-28 and carries a stale one is served like any other.
#[test]
fn a_stray_session_id_on_a_2026_request_is_ignored() {
    let (_upstream, url) = start_upstream(Upstream::Conformance);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let call = json!({"name": "test_simple_text", "arguments": {}});
    let stale = [("mcp-session-id", "stale-session-id")];
    let reply = raw.modern_with(101, "tools/call", call, json!({}), &stale);
    assert_eq!(reply.status, 200);
    let body = reply.json();
    assert_eq!(body["id"], 101, "{body}");
    assert_eq!(body["result"]["resultType"], "complete", "{body}");
}

#[test]
fn an_upstream_that_answers_mrtr_itself_is_relayed_unchanged_when_configured() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    // The gateway's own states are its sealed envelope under the test key id.
    let ours = |state: &str| mrtr_gateway::seal::peek_kid(state).as_deref() == Some("test1");
    // era: modern, the upstream's own InputRequiredResult and state reach the client.
    let relay = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Modern
    });
    let lines = python_modern(&[&relay.url, "relayed"]);
    let asked = &lines[0];
    let keys = asked["keys"].as_array().unwrap();
    assert!(
        !keys
            .iter()
            .any(|k| k.as_str().unwrap().starts_with("elicitation_")),
        "bridged, not relayed: {asked}"
    );
    assert!(
        !ours(asked["requestState"].as_str().unwrap()),
        "the state is the gateway's, not the upstream's: {asked}"
    );
    assert_eq!(lines.last().unwrap()["text"], "City: Lisbon");
    // era: auto, the same dual-era upstream speaks the 2025 transport, so it is bridged.
    let bridged = TestGateway::start(&[&url], &test_keys());
    let lines = python_modern(&[&bridged.url, "relayed"]);
    let keys = lines[0]["keys"].as_array().unwrap();
    assert!(
        keys.len() == 1 && keys[0].as_str().unwrap().starts_with("elicitation_"),
        "{lines:?}"
    );
    assert!(ours(lines[0]["requestState"].as_str().unwrap()));
    assert_eq!(lines.last().unwrap()["text"], "City: Lisbon");
}

/// A group relayed to a 2026-07-28 server gets every message unchanged: a notification
/// and a method the bridge does not know (`subscriptions/listen`) reach the server, which
/// answers them itself. The gateway's own failures reach the client as 200 carrying the
/// error, as a bridged one's do. A retry carrying a state the gateway sealed when the
/// group was bridged (the upstream redeployed as a 2026-07-28 server) is the gateway's to
/// answer: the call is lost (-32012), and the server never sees the state.
#[test]
fn a_relayed_group_gets_every_message_and_the_gateways_own_states_stay_home() {
    use crate::resumption::{call_hostile, resumable_server, Asks, Resumes};
    use crate::scripted::{Answer, ScriptedUpstream, Seen};
    let modern = ScriptedUpstream::start(|seen: &Seen| {
        let message = seen.json().unwrap_or_default();
        match message.get("id") {
            Some(id) => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": id, "result": {"relayed": message["method"]}}),
            ),
            None => Answer::status(202, &[], b""),
        }
    });
    let relay = |url: &str| {
        TestGateway::start_with(&[url], &test_keys(), |c| {
            c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Modern;
            c.upstreams[0].health_check_interval_ms = 0;
        })
    };
    let gw = relay(&modern.url());
    let raw = Raw::new(&gw.url);
    let listen = raw.modern(1, "subscriptions/listen", json!({}), json!({}));
    assert_eq!(listen.status, 200);
    assert_eq!(listen.json()["result"]["relayed"], "subscriptions/listen");
    let (mut headers, mut note) = modern_request(
        0,
        "notifications/cancelled",
        json!({"requestId": 1}),
        json!({}),
    );
    note.as_object_mut().unwrap().remove("id");
    headers.retain(|(name, _)| *name != "accept");
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(
        raw.request("POST", &headers, Some(&note.to_string()))
            .status,
        202
    );
    let reached = |method: &str| {
        modern
            .requests()
            .iter()
            .any(|s| s.json().is_some_and(|m| m["method"] == method))
    };
    assert!(reached("subscriptions/listen") && reached("notifications/cancelled"));

    let down = relay(&format!("http://127.0.0.1:{}/mcp", free_port()));
    let failed = Raw::new(&down.url).modern(2, "tools/list", json!({}), json!({}));
    assert_eq!(failed.status, 200, "a 2026-07-28 client reads the error");
    assert_eq!(failed.json()["error"]["code"], -32603);

    let legacy = resumable_server(Resumes::Primed, true, Asks::AfterPriming);
    let bridged = TestGateway::start(&[&legacy.url()], &test_keys());
    let (_, first) = call_hostile(&Raw::new(&bridged.url), 3, json!({}));
    let retry = answer(&first, json!({"name": "Ada"}));
    let (status, lost) = call_hostile(&raw, 4, retry);
    assert_eq!(
        (status, &lost["error"]["code"]),
        (200, &json!(-32012)),
        "{lost}"
    );
    assert!(
        !reached("tools/call"),
        "the gateway's state reached the server"
    );
}

/// An `era: auto` group whose upstream is redeployed as a server of the other era (a
/// legacy server upgraded to a 2026-07-28-only SDK, or back) follows it: what the
/// upstream answers puts the verdict in doubt once it is ten seconds old, and the next
/// request probes again. It used to keep the first verdict until the gateway restarted,
/// failing every request.
#[test]
fn an_auto_group_follows_its_upstream_redeployed_to_the_other_era() {
    let port = free_port();
    let (mut legacy, url) = start_upstream_on(Upstream::TypeScript, port);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let tools = |id: u64| -> Vec<String> {
        let listed = raw.modern(id, "tools/list", json!({}), json!({})).json();
        let names = listed["result"]["tools"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        names
            .iter()
            .filter_map(|t| t["name"].as_str().map(str::to_string))
            .collect()
    };
    assert!(
        tools(1).contains(&"ask_name".to_string()),
        "bridged at first"
    );
    legacy.kill();
    let (mut modern, _) = start_upstream_on(Upstream::TypeScriptModern, port);
    let mut id = 10;
    wait_until(
        "relayed to the 2026-07-28 server",
        Duration::from_secs(40),
        || {
            id += 1;
            tools(id).contains(&"native_city".to_string())
        },
    );
    modern.kill();
    let (_legacy, _) = start_upstream_on(Upstream::TypeScript, port);
    wait_until(
        "bridged to the legacy server again",
        Duration::from_secs(40),
        || {
            id += 1;
            tools(id).contains(&"ask_name".to_string())
        },
    );
}

/// The era probe decides on an answer only: a `server/discover` the upstream throttles
/// for the asking caller (429) decides nothing for the group, and the next caller's
/// request probes again and is relayed to the 2026-07-28 server. It used to cache
/// "legacy" for everyone, bridging every request to a server that refuses `initialize`.
#[test]
fn a_discover_throttled_for_one_caller_does_not_make_the_group_legacy() {
    use crate::scripted::{Answer, ScriptedUpstream, Seen};
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let id = seen.jsonrpc_id();
        match seen.jsonrpc_method().as_deref() {
            Some("server/discover") if seen.header("x-throttled").is_some() => {
                Answer::status(429, &[("retry-after", "1")], b"slow down")
            }
            Some("server/discover") => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": id, "result": {
                "resultType": "complete", "supportedVersions": ["2026-07-28"],
                "capabilities": {"tools": {}}, "serverInfo": {"name": "modern", "version": "1"},
                "ttlMs": 0, "cacheScope": "private"}}),
            ),
            Some("tools/list")
                if seen.header("mcp-session-id").is_none()
                    && seen.header("mcp-protocol-version") == Some("2026-07-28") =>
            {
                Answer::json(
                    200,
                    &json!({"jsonrpc": "2.0", "id": id, "result": {
                    "resultType": "complete", "tools": [{"name": "native", "inputSchema": {"type": "object"}}],
                    "ttlMs": 0, "cacheScope": "private"}}),
                )
            }
            _ => Answer::json(
                404,
                &json!({"jsonrpc": "2.0", "id": id,
                "error": {"code": -32601, "message": "Method not found"}}),
            ),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let throttled = [("x-throttled", "1")];
    let _ = raw.modern_with(1, "tools/list", json!({}), json!({}), &throttled);
    let listed = raw.modern(2, "tools/list", json!({}), json!({})).json();
    assert_eq!(listed["result"]["tools"][0]["name"], "native", "{listed}");
}

#[test]
fn an_upstream_that_speaks_only_2026_07_28_is_detected_and_relayed() {
    let (_upstream, url) = start_upstream(Upstream::TypeScriptModern);
    let gw = TestGateway::start(&[&url], &test_keys());
    let lines = python_modern(&[&gw.url, "relayed"]);
    assert_eq!(
        lines[0]["keys"],
        json!(["city"]),
        "the upstream's own key: {lines:?}"
    );
    let state = lines[0]["requestState"].as_str();
    assert!(
        state.is_none_or(|s| mrtr_gateway::seal::peek_kid(s).is_none()),
        "the gateway sealed a state for a relayed flow: {lines:?}"
    );
    assert_eq!(lines.last().unwrap()["text"], "City: Lisbon");
}

#[test]
fn hostile_requests_cannot_make_an_auto_group_probe_its_upstream_repeatedly() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    for i in 0..10 {
        let params = json!({"name": "ask_name", "arguments": {}, "inputResponses": {}, "requestState": format!("garbage-{i}")});
        let reply = raw.modern(i, "tools/call", params, json!({"elicitation": {}}));
        assert_eq!(reply.status, 400, "request {i}");
    }
    assert!(
        tripwire.count() <= 1,
        "{} upstream connections for 10 refused requests",
        tripwire.count()
    );
}

#[test]
fn a_pending_flow_holds_no_stream_only_its_reaper_entry() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let gw = TestGateway::start(&[&url], &test_keys());
    let first = ask_name(&Raw::new(&gw.url), 1, json!({}));
    assert_eq!(first["result"]["resultType"], "input_required");
    assert_eq!(
        metric(&gw.admin, "mrtr_gateway_active_client_streams"),
        0.0,
        "a stream is still held"
    );
    assert_eq!(
        metric(&gw.admin, "mrtr_gateway_pending_flows"),
        1.0,
        "the reaper watches the flow"
    );
    let (key, _) = first["result"]["inputRequests"]
        .as_object()
        .unwrap()
        .iter()
        .next()
        .unwrap();
    let answers = json!({"inputResponses": {key: {"action": "accept", "content": {"name": "Lu"}}}, "requestState": first["result"]["requestState"]});
    let done = ask_name(&Raw::new(&gw.url), 2, answers);
    assert_eq!(done["result"]["content"][0]["text"], "Hello, Lu!");
    // The session is deleted, and forgotten, once the client has its answer.
    wait_until(
        "a completed flow is forgotten",
        Duration::from_secs(5),
        || metric(&gw.admin, "mrtr_gateway_pending_flows") == 0.0,
    );
}

#[test]
fn a_state_sealed_by_the_previous_release_completes_on_this_one() {
    // A rolling upgrade: the first round ran on a replica of the previous release, which
    // sealed its state in the previous layout (format version 1); the retry reaches this
    // release.
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let first = ask_name(&raw, 1, json!({}));
    let sealed = first["result"]["requestState"].as_str().expect("a state");
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let principal = PrincipalSource::Authorization.digest(None);
    let bind = binding(&principal, "tools/call", Some("ask_name"), Some(&json!({})));
    let (_, state) = FlowState::open_unbound(&ring, sealed).expect("the gateway's own state");
    let previous = state.seal_previous(&ring, &bind);
    assert_eq!(
        mrtr_gateway::seal::open_version(
            &ring,
            mrtr_gateway::keys::Purpose::RequestState,
            b"",
            &previous,
            1 << 16
        )
        .map(|(version, _)| version),
        Ok(mrtr_gateway::seal::OLDEST_VERSION),
        "sealed as the previous release did"
    );
    let mut retry = answer(&first, json!({"name": "Ada"}));
    retry["requestState"] = json!(previous);
    let done = ask_name(&raw, 2, retry);
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Ada!",
        "{done}"
    );

    // During the first phase of the upgrade an upgraded replica seals the previous layout
    // too, for replicas not yet upgraded.
    let compat = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.bridge.seal_previous_version = true;
    });
    let raw = Raw::new(&compat.url);
    let first = ask_name(&raw, 1, json!({}));
    let sealed = first["result"]["requestState"].as_str().expect("a state");
    let version = mrtr_gateway::seal::open_version(
        &ring,
        mrtr_gateway::keys::Purpose::RequestState,
        b"",
        sealed,
        1 << 16,
    )
    .map(|(version, _)| version);
    assert_eq!(version, Ok(mrtr_gateway::seal::OLDEST_VERSION));
    let done = ask_name(&raw, 2, answer(&first, json!({"name": "Bo"})));
    assert_eq!(done["result"]["content"][0]["text"], "Hello, Bo!", "{done}");
    // So are a legacy client's session id and a data-layer session's cookie, which the
    // replicas not yet upgraded open too; both still serve their client here.
    let version_of = |purpose, sealed: &str| {
        mrtr_gateway::seal::open_version(&ring, purpose, b"", sealed, 1 << 16)
            .map(|(version, _)| version)
    };
    let previous = Ok(mrtr_gateway::seal::OLDEST_VERSION);
    let sid = raw.initialize(json!({}));
    assert_eq!(
        version_of(mrtr_gateway::keys::Purpose::Session, &sid),
        previous
    );
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    assert_eq!(raw.post(Some(&sid), &list).status, 200);
    let created = raw.modern(3, "session/create", json!({}), json!({})).json();
    let cookie = &created["result"]["_meta"]["mcp/session"];
    let id = cookie["id"].as_str().unwrap_or_else(|| panic!("{created}"));
    assert_eq!(
        version_of(mrtr_gateway::keys::Purpose::DataSession, id),
        previous
    );
    let params = json!({"_meta": {"mcp/session": cookie}});
    let listed = raw.modern(4, "tools/list", params, json!({})).json();
    assert!(listed["result"]["tools"].is_array(), "{listed}");
    let refreshed = listed["result"]["_meta"]["mcp/session"]["id"]
        .as_str()
        .unwrap();
    assert_eq!(
        version_of(mrtr_gateway::keys::Purpose::DataSession, refreshed),
        previous
    );
}

/// An answer that is not the result its question asks for (an elicitation's answer to
/// the Python SDK server's sampling request) is refused naming its key before it goes
/// upstream, where the server would fail the tool on it, whether the flow waits
/// resumable or held; the same state with a sampling result completes the call.
/// A `requestState` presented to another group's path is refused (and reaches nothing)
/// and counted as what it is, `other_group`; it still completes on its own group.
#[test]
fn a_state_presented_to_another_group_is_refused_as_such() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        let mut other = mrtr_gateway::config::UpstreamGroupConfig::new("other", vec![url.clone()]);
        other.path = "/other".into();
        other.health_check_interval_ms = 0;
        c.upstreams.push(other);
    });
    let raw = Raw::new(&gw.url);
    let first = ask_name(&raw, 1, json!({}));
    let retry = answer(&first, json!({"name": "Io"}));
    let elsewhere = ask_name(
        &Raw::new(&gw.url.replace("/mcp", "/other")),
        2,
        retry.clone(),
    );
    assert_eq!(elsewhere["error"]["code"], -32602, "{elsewhere}");
    let reason = |r: &str| {
        metric_with(&gw.admin, "mrtr_gateway_request_state_rejections_total", r).unwrap_or(0.0)
    };
    assert_eq!(
        (reason("other_group"), reason("unknown_endpoint")),
        (1.0, 0.0)
    );
    let done = ask_name(&raw, 3, retry);
    assert_eq!(done["result"]["content"][0]["text"], "Hello, Io!", "{done}");
}

#[test]
fn an_answer_of_the_wrong_kind_is_refused_before_it_goes_upstream() {
    for backend in [Upstream::Python, Upstream::PythonWithoutEventStore] {
        let (_upstream, url) = start_upstream(backend);
        let gw = TestGateway::start(&[&url], &test_keys());
        let raw = Raw::new(&gw.url);
        let summarize = |id: u64, extra: Value| {
            let mut params = tool_params("summarize", extra);
            params["arguments"] = json!({"text": "a long text"});
            raw.modern(id, "tools/call", params, json!({"sampling": {}}))
                .json()
        };
        let first = summarize(1, json!({}));
        let inputs = first["result"]["inputRequests"].as_object().expect("asked");
        let (key, question) = inputs.iter().next().expect("one question");
        assert_eq!(question["method"], "sampling/createMessage", "{first}");
        let state = &first["result"]["requestState"];
        let retry = |id: u64, answer: Value| {
            summarize(
                id,
                json!({"inputResponses": {key: answer}, "requestState": state}),
            )
        };
        let wrong = retry(2, json!({"action": "accept", "content": {"summary": "x"}}));
        assert_eq!(wrong["error"]["code"], -32602, "{wrong}");
        let message = wrong["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!(
                "inputResponses[\"{key}\"] answers sampling/createMessage"
            )),
            "{wrong}"
        );
        let sampled = json!({"role": "assistant", "model": "m",
            "content": {"type": "text", "text": "short"}});
        let done = retry(3, sampled);
        assert_eq!(
            done["result"]["content"][0]["text"], "summary: short",
            "{done}"
        );
    }
}

/// A finished flow's upstream streams are read to their end once its session is
/// deleted (the SDK servers end a session's streams with it), so their connections serve
/// the next flows instead of being closed: per one-question flow, only the two streams
/// held when the first round ended cost a new connection.
#[test]
fn a_finished_flows_streams_keep_their_connections() {
    const FLOWS: usize = 8;
    for kind in [Upstream::TypeScript, Upstream::Python] {
        let (_upstream, url) = start_upstream(kind);
        let port: u16 = url
            .trim_start_matches("http://127.0.0.1:")
            .split('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let relay = crate::pki::CountingRelay::start(port);
        let gw = TestGateway::start(
            &[&format!("http://127.0.0.1:{}/mcp", relay.port)],
            &test_keys(),
        );
        let raw = Raw::new(&gw.url);
        let flow = |id: u64| {
            let first = ask_name(&raw, id, json!({}));
            let done = ask_name(&raw, id + 1, answer(&first, json!({"name": "Lu"})));
            assert_eq!(done["result"]["content"][0]["text"], "Hello, Lu!", "{done}");
        };
        flow(1);
        wait_until(
            "the first flow's session deleted",
            Duration::from_secs(5),
            || metric(&gw.admin, "mrtr_gateway_upstream_connections") == 0.0,
        );
        let before = relay.count();
        for i in 0..FLOWS as u64 {
            flow(10 + 2 * i);
        }
        let per_flow = (relay.count() - before) as f64 / FLOWS as f64;
        // Two, and at most one more while the pool fills.
        assert!(
            per_flow <= 3.0,
            "{kind:?}: {per_flow} new upstream connections per flow"
        );
    }
}

/// One caller's retries take at most its share of the replay guard: past it, its retries
/// are refused as overloaded naming the bound, while another caller's still complete.
#[test]
fn one_caller_takes_at_most_its_share_of_the_replay_guard() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.bridge.max_used_states_per_principal = 1;
    });
    let raw = Raw::new(&gw.url);
    let ask_as = |id: u64, who: &str, extra: Value| ask_name_as(&raw, id, who, extra);
    let (first, second, bobs) = (
        ask_as(1, "alice", json!({})),
        ask_as(2, "alice", json!({})),
        ask_as(3, "bob", json!({})),
    );
    let done = ask_as(4, "alice", answer(&first, json!({"name": "Kim"})));
    assert!(done["result"].get("content").is_some(), "{done}");
    let refused = ask_as(5, "alice", answer(&second, json!({"name": "Ada"})));
    assert_eq!(refused["error"]["code"], -32603, "{refused}");
    let text = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("bridge.max_used_states_per_principal"),
        "{refused}"
    );
    let done = ask_as(6, "bob", answer(&bobs, json!({"name": "Bo"})));
    assert!(
        done["result"].get("content").is_some(),
        "another caller: {done}"
    );
}

/// A replica whose replay guard is full (every state it acted on is remembered until it
/// expires) refuses a retry as overloaded, saying which bound is full, and lets nothing
/// through unguarded; the same state completes once there is room.
#[test]
fn a_full_replay_guard_refuses_retries_naming_its_bound() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.bridge.max_used_states = 1;
    });
    let raw = Raw::new(&gw.url);
    let first = call_tool(&raw, 1, "ask_name", json!({}));
    let second = call_tool(&raw, 2, "ask_name", json!({}));
    let done = call_tool(&raw, 3, "ask_name", answer(&first, json!({"name": "Kim"})));
    assert!(done["result"].get("content").is_some(), "{done}");
    let refused = call_tool(&raw, 4, "ask_name", answer(&second, json!({"name": "Ada"})));
    assert_eq!(refused["error"]["code"], -32603, "{refused}");
    let text = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("replay guard is full") && text.contains("bridge.max_used_states"),
        "{refused}"
    );
}
