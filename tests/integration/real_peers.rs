//! Real MCP servers behind the gateway (Python `mcp==2.3.0`, TypeScript SDK 1.32.2,
//! server-everything), driven by the real legacy clients of both SDKs and by raw HTTP
//! where the wire itself is the point (resumption, replicas).

use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

const CLIENT_LIMIT: Duration = Duration::from_secs(60);

/// Every string anywhere in the client's output lines.
fn strings(lines: &[Value]) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            Value::Object(o) => o.values().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    lines.iter().for_each(|l| walk(l, &mut out));
    out
}

fn assert_saw(lines: &[Value], needle: &str, what: &str) {
    assert!(
        strings(lines).iter().any(|s| s.contains(needle)),
        "{what}: no output contains {needle:?}; got {lines:#?}"
    );
}

#[derive(Clone, Copy, Debug)]
enum Client {
    Python,
    TypeScript,
}

fn run_scenario(client: Client, url: &str, scenario: &str) -> Vec<Value> {
    let out = match client {
        Client::Python => {
            let script = root().join("tests/clients/py_legacy_client.py");
            run_client(
                python(),
                &[script.to_str().unwrap(), url, scenario],
                CLIENT_LIMIT,
            )
        }
        Client::TypeScript => {
            let script = root().join("tests/clients/ts_legacy_client.mjs");
            run_client(
                node(),
                &[script.to_str().unwrap(), url, scenario],
                CLIENT_LIMIT,
            )
        }
    };
    json_lines(&out)
}

/// The legacy client scenarios every fixture server supports, with what must be seen.
const SCENARIOS: &[(&str, &str)] = &[
    ("basic", "5"),
    ("elicit", "Hello, Alice!"),
    ("multi", "Trip to Lisbon for 3 nights"),
    ("sample", "summary: short"),
    ("roots", "file:///tmp/project"),
    ("progress", "counted 3"),
    ("delete", "delete"),
];

fn clients_through_gateway(server: Upstream) {
    let (_upstream, url) = start_upstream(server);
    let gw = TestGateway::start(&[&url], &test_keys());
    for client in [Client::Python, Client::TypeScript] {
        for (scenario, needle) in SCENARIOS {
            let lines = run_scenario(client, &gw.url, scenario);
            assert_saw(
                &lines,
                needle,
                &format!("{client:?} client, {scenario}, {server:?} server"),
            );
            if *scenario == "progress" {
                let progress = lines.iter().filter(|l| l["step"] == "progress").count();
                assert_eq!(
                    progress, 3,
                    "{client:?}: progress notifications before the result: {lines:#?}"
                );
            }
            println!("{client:?} client -> gateway -> {server:?} server: {scenario} ok");
        }
    }
}

#[test]
fn legacy_clients_through_the_gateway_to_the_python_server() {
    clients_through_gateway(Upstream::Python);
}

#[test]
fn legacy_clients_through_the_gateway_to_the_typescript_server() {
    clients_through_gateway(Upstream::TypeScript);
}

/// Both SDKs' legacy clients through pass-through to the Rust SDK servers (`rmcp` 0.16.0,
/// 2.2.0 and 3.11.0; the first two send their questions on the session's GET stream). 0.16 negotiates
/// 2025-03-26, under which the Python client refuses `elicitation/create` (talking to the
/// server directly, too): against it, the Python client runs the scenarios without one.
#[test]
fn legacy_clients_through_the_gateway_to_the_rust_sdk_servers() {
    let every = &["basic", "elicit", "multi", "sample", "roots", "delete"][..];
    let runs = [
        (Upstream::Rust016, Client::TypeScript, every),
        (
            Upstream::Rust016,
            Client::Python,
            &["basic", "sample", "roots", "delete"][..],
        ),
        (Upstream::Rust22, Client::TypeScript, every),
        (Upstream::Rust22, Client::Python, every),
        (Upstream::Rust311, Client::TypeScript, every),
        (Upstream::Rust311, Client::Python, every),
    ];
    for (server, client, scenarios) in runs {
        let (_upstream, url) = start_upstream(server);
        let gw = TestGateway::start(&[&url], &test_keys());
        for scenario in scenarios {
            let needle = SCENARIOS
                .iter()
                .find(|(name, _)| name == scenario)
                .map(|(_, needle)| *needle)
                .expect("a known scenario");
            let lines = run_scenario(client, &gw.url, scenario);
            assert_saw(
                &lines,
                needle,
                &format!("{client:?} client, {scenario}, {server:?}"),
            );
            println!("{client:?} client -> gateway -> {server:?}: {scenario} ok");
        }
    }
}

/// Both SDKs' legacy clients through pass-through to a server on TypeScript SDK 1.17.5,
/// which negotiates 2025-06-18 and refuses any other `MCP-Protocol-Version`: the clients'
/// own headers pass unchanged.
#[test]
fn legacy_clients_through_the_gateway_to_a_server_on_an_older_sdk_release() {
    let (_upstream, url) = start_upstream(Upstream::TypeScriptSdk117);
    let gw = TestGateway::start(&[&url], &test_keys());
    for client in [Client::Python, Client::TypeScript] {
        for scenario in ["basic", "elicit", "multi", "sample", "roots", "delete"] {
            let needle = SCENARIOS
                .iter()
                .find(|(name, _)| *name == scenario)
                .map(|(_, needle)| *needle)
                .expect("a known scenario");
            let lines = run_scenario(client, &gw.url, scenario);
            assert_saw(&lines, needle, &format!("{client:?} client, {scenario}"));
            println!("{client:?} client -> gateway -> TypeScript SDK 1.17.5: {scenario} ok");
        }
    }
}

/// Both SDKs' legacy clients through pass-through to a `FastMCP` server on the Python
/// SDK's 1.x line, run as it runs by default. Its `list_roots()` goes on the session's GET
/// stream, which both clients open in the background after `initialize`, and the server
/// drops a GET-stream message while none is open: talking to it directly, too, a call
/// made before that stream is up never completes; so `roots` is run through the bridge
/// only (`hold::official_clients_complete_held_flows_against_a_fastmcp_server_on_the_1x_line`),
/// which opens the GET stream before the call.
#[test]
fn legacy_clients_through_the_gateway_to_a_fastmcp_server_on_the_1x_line() {
    let (_upstream, url) = start_upstream(Upstream::PythonMcp1);
    let gw = TestGateway::start(&[&url], &test_keys());
    for client in [Client::Python, Client::TypeScript] {
        for (scenario, needle) in SCENARIOS.iter().filter(|(s, _)| *s != "roots") {
            let lines = run_scenario(client, &gw.url, scenario);
            assert_saw(&lines, needle, &format!("{client:?} client, {scenario}"));
            println!("{client:?} client -> gateway -> FastMCP 1.30: {scenario} ok");
        }
    }
}

/// A server on FastMCP (`fastmcp==4.2.3`), with and without its own event store: every
/// scenario it has tools for (FastMCP 4 has no sampling or roots), and a question asked
/// after the server closed the call's stream, which the client's transport resumes
/// through the gateway (with the store) or which comes on the open stream (without).
#[test]
fn legacy_clients_through_the_gateway_to_a_fastmcp_server() {
    for server in [Upstream::FastMcpWithEventStore, Upstream::FastMcp] {
        let (_upstream, url) = start_upstream(server);
        let gw = TestGateway::start(&[&url], &test_keys());
        let scenarios = SCENARIOS
            .iter()
            .filter(|(s, _)| !["sample", "roots"].contains(s))
            .chain(&[("reconnect", "Hello, Alice!")]);
        for client in [Client::Python, Client::TypeScript] {
            for (scenario, needle) in scenarios.clone() {
                let lines = run_scenario(client, &gw.url, scenario);
                assert_saw(&lines, needle, &format!("{client:?} client, {scenario}"));
                println!("{client:?} client -> gateway -> {server:?}: {scenario} ok");
            }
        }
    }
}

/// A TypeScript SDK server with `enableJsonResponse` answers a POST with one JSON body
/// once its result is ready: both legacy clients' calls and session ends pass through,
/// and a question it asks on the session's GET stream while the call's answer is awaited
/// reaches the TypeScript client, whose answer lets the call end.
#[test]
fn legacy_clients_through_the_gateway_to_a_typescript_server_answering_in_json() {
    let (_upstream, url) =
        start_upstream_with(Upstream::TypeScript, free_port(), &["--json-response"]);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "add", "arguments": {"a": 2, "b": 3}}});
    let reply = raw.post(Some(&session), &call);
    assert!(
        reply.content_type.starts_with("application/json"),
        "the call's answer comes as JSON: {}",
        reply.content_type
    );
    assert_eq!(reply.json()["result"]["content"][0]["text"], "2+3=5");
    let runs = [
        (Client::Python, "basic", "2+3=5"),
        (Client::Python, "delete", "delete"),
        (Client::TypeScript, "basic", "2+3=5"),
        (Client::TypeScript, "delete", "delete"),
        (Client::TypeScript, "getstream", "Hello, Bob!"),
    ];
    for (client, scenario, needle) in runs {
        let lines = run_scenario(client, &gw.url, scenario);
        assert_saw(&lines, needle, &format!("{client:?} client, {scenario}"));
        println!(
            "{client:?} client -> gateway -> TypeScript server answering in JSON: {scenario} ok"
        );
    }
}

/// A stateless server (the Python SDK's `stateless_http=True`: no `Mcp-Session-Id`, a
/// fresh transport per request) serves both eras through the gateway: legacy clients'
/// calls and a modern call that asks nothing complete, and a tool that asks gets the
/// server's own error, as a client connected directly does (a stateless transport has no
/// channel for server requests), not a hang or a gateway error of its own.
#[test]
fn a_stateless_server_serves_both_eras_and_gives_its_own_errors_through_the_gateway() {
    let (_upstream, url) = start_upstream_with(Upstream::Python, free_port(), &["--stateless"]);
    let gw = TestGateway::start(&[&url], &test_keys());
    for client in [Client::Python, Client::TypeScript] {
        let lines = run_scenario(client, &gw.url, "basic");
        assert_saw(&lines, "2+3=5", &format!("{client:?} client, basic"));
    }
    let (direct_raw, gw_raw) = (Raw::new(&url), Raw::new(&gw.url));
    let added = call_tool(&gw_raw, 1, "add", json!({"arguments": {"a": 2, "b": 3}}));
    assert_eq!(added["result"]["content"][0]["text"], "2+3=5", "{added}");
    let direct = ask_name(&direct_raw, 2, json!({}));
    let through = ask_name(&gw_raw, 2, json!({}));
    let message = direct["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("no back-channel"), "{direct}");
    assert_eq!(
        through["error"], direct["error"],
        "through the gateway: {through}"
    );
}

/// A server request sent on the session's GET stream reaches the client through the
/// gateway, and the answer reaches the server. The GET stream is opened, and its response
/// header awaited, before the call: a legacy server drops a GET-stream message sent while
/// no GET stream is registered, so a client that opens it in the background races.
#[test]
fn an_elicitation_on_the_session_get_stream_reaches_the_client() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let sid = raw.initialize(json!({"elicitation": {}}));
    let get_headers = [
        ("accept", "text/event-stream"),
        ("mcp-session-id", sid.as_str()),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    let mut get_stream = raw.request("GET", &get_headers, None);
    assert_eq!(get_stream.status, 200, "the GET stream");
    let call = json!({"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"ask_name_get_stream","arguments":{}}});
    let mut call_stream = raw.post(Some(&sid), &call);
    let question = Raw::messages_until(&mut get_stream, |m| m["method"] == "elicitation/create")
        .pop()
        .unwrap()
        .1;
    let answer = json!({"jsonrpc":"2.0","id":question["id"],"result":{"action":"accept","content":{"name":"Bob"}}});
    assert_eq!(raw.post(Some(&sid), &answer).status, 202);
    let result = Raw::messages_until(&mut call_stream, |m| m["id"] == 5)
        .pop()
        .unwrap()
        .1;
    assert_eq!(
        result["result"]["content"][0]["text"], "Hello, Bob!",
        "{result}"
    );
}

#[test]
fn legacy_clients_through_the_gateway_to_server_everything() {
    let (_upstream, url) = start_upstream(Upstream::Everything);
    let gw = TestGateway::start(&[&url], &test_keys());
    for client in [Client::Python, Client::TypeScript] {
        let lines = run_scenario(client, &gw.url, "everything");
        assert_saw(
            &lines,
            "trigger-elicitation-request",
            &format!("{client:?} tools/list"),
        );
        assert_saw(
            &lines,
            "hello from the gateway test",
            &format!("{client:?} echo"),
        );
        println!("{client:?} client -> gateway -> server-everything: ok");
    }
}

/// Calls an eliciting tool, drops the stream after the question, answers it, and resumes
/// with GET + Last-Event-ID through the gateway.
fn resume_after_disconnect(server: Upstream, tool: &str, answer: Value, expect: &str) {
    let (_upstream, url) = start_upstream(server);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let sid = raw.initialize(json!({"elicitation": {}}));
    let call = json!({"jsonrpc":"2.0","id":42,"method":"tools/call","params":{"name":tool,"arguments":{}}});
    let mut stream = raw.post(Some(&sid), &call);
    assert!(
        stream.content_type.starts_with("text/event-stream"),
        "{server:?}: {}",
        stream.content_type
    );
    let seen = Raw::messages_until(&mut stream, |m| m["method"] == "elicitation/create");
    let (event_id, question) = seen.last().cloned().unwrap();
    let event_id =
        event_id.unwrap_or_else(|| panic!("{server:?} sent the question without an event id"));
    drop(stream);

    let reply = raw.post(
        Some(&sid),
        &json!({"jsonrpc":"2.0","id":question["id"],"result":answer}),
    );
    assert_eq!(reply.status, 202, "{server:?}: answer not accepted");
    let mut resumed = raw.resume(&sid, &event_id);
    assert_eq!(resumed.status, 200, "{server:?}: resumption refused");
    let seen = Raw::messages_until(&mut resumed, |m| m["id"] == 42);
    let result = &seen.last().unwrap().1;
    assert!(result.to_string().contains(expect), "{server:?}: {result}");
    assert!(
        seen.iter()
            .all(|(_, m)| m["method"] != "elicitation/create" || m["id"] != question["id"]),
        "{server:?}: the answered question was replayed"
    );

    let delete = raw.request("DELETE", &[("mcp-session-id", sid.as_str())], None);
    assert!(
        matches!(delete.status, 200 | 202 | 204),
        "{server:?}: DELETE gave {}",
        delete.status
    );
    let after = raw.post(
        Some(&sid),
        &json!({"jsonrpc":"2.0","id":43,"method":"tools/list"}),
    );
    // The SDK servers answer 404 for a terminated session; server-everything answers 400
    // ("No valid session ID provided"). The gateway passes the upstream's verdict through.
    let status = after.status;
    assert!(
        matches!(status, 400 | 404),
        "{server:?}: the session outlived DELETE ({status})"
    );
    assert!(
        after.json()["error"].is_object(),
        "{server:?}: no JSON-RPC error after DELETE"
    );
    println!("{server:?}: Last-Event-ID resumption and DELETE through the gateway ok");
}

#[test]
fn last_event_id_resumption_through_the_gateway_python() {
    let answer = json!({"action":"accept","content":{"name":"Resumer"}});
    resume_after_disconnect(Upstream::Python, "ask_name", answer, "Hello, Resumer!");
}

#[test]
fn last_event_id_resumption_through_the_gateway_typescript() {
    let answer = json!({"action":"accept","content":{"name":"Resumer"}});
    resume_after_disconnect(Upstream::TypeScript, "ask_name", answer, "Hello, Resumer!");
}

#[test]
fn last_event_id_resumption_through_the_gateway_server_everything() {
    resume_after_disconnect(
        Upstream::Everything,
        "trigger-elicitation-request",
        json!({"action":"decline"}),
        "decline",
    );
}

/// Two users' legacy sessions whose calls share an id (SDK clients number their requests
/// alike), on a server whose event store is shared by sessions as the SDK's examples are:
/// the one resuming its call's stream after its question is replayed its own result, not
/// the other user's.
#[test]
fn a_legacy_resumption_from_a_shared_event_store_replays_only_its_own_sessions_events() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    let (alice, bob) = (Raw::new(&gw.url), Raw::new(&gw.url));
    let alices = alice.initialize(json!({"elicitation": {}}));
    let bobs = bob.initialize(json!({"elicitation": {}}));
    let call = json!({"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"ask_name","arguments":{}}});
    let answer = |question: &Value, name: &str| json!({"jsonrpc":"2.0","id":question["id"],"result":{"action":"accept","content":{"name":name}}});
    let asked = |m: &Value| m["method"] == "elicitation/create";

    // Alice's stream breaks after her question.
    let mut stream = alice.post(Some(&alices), &call);
    let (event_id, question) = Raw::messages_until(&mut stream, asked).pop().unwrap();
    let event_id = event_id.expect("the question has an event id");
    drop(stream);
    // Bob's call, with the same id, runs to its end meanwhile.
    let mut stream = bob.post(Some(&bobs), &call);
    let (_, bobs_question) = Raw::messages_until(&mut stream, asked).pop().unwrap();
    let reply = bob.post(Some(&bobs), &answer(&bobs_question, "Bob"));
    assert_eq!(reply.status, 202);
    let (_, result) = Raw::messages_until(&mut stream, |m| m["id"] == 2)
        .pop()
        .unwrap();
    assert!(result.to_string().contains("Hello, Bob!"), "{result}");

    // Alice answers and resumes her call's stream.
    let reply = alice.post(Some(&alices), &answer(&question, "Alice"));
    assert_eq!(reply.status, 202);
    let mut resumed = alice.resume(&alices, &event_id);
    assert_eq!(resumed.status, 200);
    let seen = Raw::messages_until(&mut resumed, |m| m["id"] == 2);
    let replayed: Vec<String> = seen.iter().map(|(_, m)| m.to_string()).collect();
    assert!(
        replayed.iter().all(|m| !m.contains("Bob")),
        "another session's events replayed: {replayed:?}"
    );
    assert!(
        replayed.last().unwrap().contains("Hello, Alice!"),
        "{replayed:?}"
    );
}

/// Calls the Python fixture's `announce`, which sends `text` on the session's GET stream;
/// returns the call's own stream (its result, with event ids).
fn announce(raw: &Raw, session: &str, text: &str) -> Vec<(Option<String>, Value)> {
    let call = json!({"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"announce","arguments":{"text":text}}});
    let mut reply = raw.post(Some(session), &call);
    assert_eq!(reply.status, 200, "announce {text}");
    Raw::messages_until(&mut reply, |m| m["id"] == 7)
}

/// Opens `session`'s GET stream, from `position` if given. The SDK refuses a second GET
/// stream (409) until it has seen the first one's client leave, so a reconnection is
/// retried until it is taken, within a bound.
fn open_get_stream(raw: &Raw, session: &str, position: Option<&str>) -> Reply {
    let mut headers = vec![
        ("accept", "text/event-stream"),
        ("mcp-session-id", session),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    headers.extend(position.map(|p| ("last-event-id", p)));
    let mut stream = None;
    wait_until("the GET stream is taken", Duration::from_secs(10), || {
        let reply = raw.request("GET", &headers, None);
        let conflict = reply.status == 409;
        stream = Some(reply);
        !conflict
    });
    let stream = stream.expect("a GET was sent");
    assert_eq!(stream.status, 200, "the GET stream");
    stream
}

fn logged(text: &str) -> impl Fn(&Value) -> bool + '_ {
    move |m: &Value| m["method"] == "notifications/message" && m["params"]["data"] == text
}

/// The Python SDK keeps every session's GET stream under one name, `_GET_stream`, in a
/// store shared by sessions: resuming one replays what every session's GET stream was
/// sent since. A legacy client that reconnects its GET stream through the gateway, as
/// clients do after an idle timeout, gets its own session's messages only.
#[test]
fn a_legacy_get_stream_reconnects_without_other_sessions_messages() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    let (alice, bob) = (Raw::new(&gw.url), Raw::new(&gw.url));
    let alices = alice.initialize(json!({}));
    let bobs = bob.initialize(json!({}));

    let mut stream = open_get_stream(&alice, &alices, None);
    announce(&alice, &alices, "for Alice");
    let (position, _) = Raw::messages_until(&mut stream, logged("for Alice"))
        .pop()
        .unwrap();
    drop(stream);
    announce(&bob, &bobs, "for Bob");

    // Alice reconnects as SDK clients do: from her last position, if she was given one.
    let mut stream = open_get_stream(&alice, &alices, position.as_deref());
    announce(&alice, &alices, "Alice again");
    let seen = Raw::messages_until(&mut stream, logged("Alice again"));
    let seen: Vec<String> = seen.iter().map(|(_, m)| m.to_string()).collect();
    assert!(
        seen.iter().all(|m| !m.contains("for Bob")),
        "another session's GET-stream message reached Alice: {seen:?}"
    );
}

/// Where the upstream's store keeps sessions apart (the TypeScript fixture's, one per
/// session), a legacy client's GET stream resumes from its position: a question sent
/// while it was disconnected is replayed, not lost.
#[test]
fn a_legacy_get_stream_resumes_where_the_store_keeps_sessions_apart() {
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let sid = raw.initialize(json!({"elicitation": {}}));
    let asked = |m: &Value| m["method"] == "elicitation/create";
    let mut stream = open_get_stream(&raw, &sid, None);
    let call = json!({"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"plan_trip_get_stream","arguments":{}}});
    let mut call_stream = raw.post(Some(&sid), &call);
    let (position, first) = Raw::messages_until(&mut stream, asked).pop().unwrap();
    let position = position.expect("the question has an event id");
    drop(stream);
    let answer = |q: &Value, content: Value| json!({"jsonrpc":"2.0","id":q["id"],"result":{"action":"accept","content":content}});
    let reply = raw.post(
        Some(&sid),
        &answer(&first, json!({"destination": "Lisbon"})),
    );
    assert_eq!(reply.status, 202);

    let mut stream = open_get_stream(&raw, &sid, Some(&position));
    let (_, second) = Raw::messages_until(&mut stream, asked).pop().unwrap();
    assert!(
        second.to_string().contains("How many nights in Lisbon?"),
        "{second}"
    );
    let reply = raw.post(Some(&sid), &answer(&second, json!({"nights": 3})));
    assert_eq!(reply.status, 202);
    let (_, result) = Raw::messages_until(&mut call_stream, |m| m["id"] == 5)
        .pop()
        .unwrap();
    assert!(
        result.to_string().contains("Trip to Lisbon for 3 nights"),
        "{result}"
    );
}

/// `Last-Event-ID` points into the upstream's store, which may be shared by sessions and
/// have ids anyone can learn: the gateway forwards only positions it gave the same
/// session, and answers any other with a JSON-RPC error, reaching no upstream.
#[test]
fn a_last_event_id_the_gateway_did_not_give_the_session_is_refused() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    // Bob talks to the server directly and learns his GET stream's event ids.
    let bob = Raw::new(&url);
    let bobs = bob.initialize(json!({}));
    let mut bobs_stream = open_get_stream(&bob, &bobs, None);
    announce(&bob, &bobs, "Bob's first");
    let (bobs_position, _) = Raw::messages_until(&mut bobs_stream, logged("Bob's first"))
        .pop()
        .unwrap();
    let bobs_position = bobs_position.expect("the server gives GET-stream events ids");
    announce(&bob, &bobs, "Bob's second");
    Raw::messages_until(&mut bobs_stream, logged("Bob's second"));

    let (alice, carol) = (Raw::new(&gw.url), Raw::new(&gw.url));
    let alices = alice.initialize(json!({}));
    let carols = carol.initialize(json!({}));
    let (alices_position, _) = announce(&alice, &alices, "Alice's").pop().unwrap();
    let alices_position = alices_position.expect("the call's result has an event id");
    let cases = [
        (
            "an upstream event id",
            &alice,
            &alices,
            bobs_position.as_str(),
        ),
        ("an id made up", &alice, &alices, "0"),
        (
            "another session's id",
            &carol,
            &carols,
            alices_position.as_str(),
        ),
    ];
    for (case, raw, session, position) in cases {
        let reply = raw.resume(session, position);
        assert_eq!(reply.status, 400, "{case}");
        let body = reply.json();
        assert_eq!(body["error"]["code"], -32600, "{case}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Last-Event-ID"),
            "{case}: {body}"
        );
    }
    // Counted by reason: the first two do not decode as sealed, the third is not this
    // session's.
    let refused = |reason: &str| {
        let name = "mrtr_gateway_last_event_id_rejections_total";
        metric_with(&gw.admin, name, &format!("reason=\"{reason}\""))
    };
    assert_eq!(
        (refused("malformed"), refused("tampered")),
        (Some(2.0), Some(1.0))
    );
    // Alice's own position goes up (its replay is `last_event_id_resumption_*`'s).
    assert_eq!(alice.resume(&alices, &alices_position).status, 200);
}

#[test]
fn a_session_opened_on_one_replica_continues_on_another() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let a = TestGateway::start(&[&url], &test_keys());
    let b = TestGateway::start(&[&url], &test_keys());
    let foreign = TestGateway::start(&[&url], "other:AQECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8");
    let (via_a, via_b) = (Raw::new(&a.url), Raw::new(&b.url));

    let sid = via_a.initialize(json!({"elicitation": {}}));
    let tools = via_b.post(
        Some(&sid),
        &json!({"jsonrpc":"2.0","id":2,"method":"tools/list"}),
    );
    assert_eq!(tools.status, 200, "replica B does not know the session");

    let call = json!({"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"ask_name","arguments":{}}});
    let mut stream_on_a = via_a.post(Some(&sid), &call);
    let question = Raw::messages_until(&mut stream_on_a, |m| m["method"] == "elicitation/create")
        .pop()
        .unwrap()
        .1;
    let answer = json!({"jsonrpc":"2.0","id":question["id"],"result":{"action":"accept","content":{"name":"Bea"}}});
    assert_eq!(
        via_b.post(Some(&sid), &answer).status,
        202,
        "replica B did not route the answer"
    );
    let result = Raw::messages_until(&mut stream_on_a, |m| m["id"] == 3)
        .pop()
        .unwrap()
        .1;
    assert!(result.to_string().contains("Hello, Bea!"), "{result}");

    let refused = Raw::new(&foreign.url).post(
        Some(&sid),
        &json!({"jsonrpc":"2.0","id":4,"method":"tools/list"}),
    );
    assert_eq!(
        refused.status, 404,
        "a replica with other keys accepted the session"
    );
}

/// SEP-1699 polling through the gateway: the server closes the call's SSE stream after a
/// priming event with `retry`, and the client resumes with GET + Last-Event-ID.
#[test]
fn sse_polling_resumes_through_the_gateway() {
    let (_upstream, url) = start_upstream(Upstream::Conformance);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let sid = raw.initialize(json!({}));
    let call = json!({"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"test_reconnection","arguments":{}}});
    let mut stream = raw.post(Some(&sid), &call);
    let priming = stream.next_event().expect("a priming event");
    assert!(
        priming.data.is_empty() && priming.id.is_some(),
        "{priming:?}"
    );
    assert_eq!(
        priming.retry,
        Some(1000),
        "the retry field must pass through"
    );
    let mut last_id = priming.id.clone().unwrap();
    while let Some(event) = stream.next_event() {
        assert!(
            !event.data.contains("\"id\":9"),
            "the server did not close the stream mid-call"
        );
        if let Some(id) = event.id {
            last_id = id;
        }
    }
    let mut resumed = raw.resume(&sid, &last_id);
    assert_eq!(resumed.status, 200);
    let result = Raw::messages_until(&mut resumed, |m| m["id"] == 9)
        .pop()
        .unwrap()
        .1;
    assert!(
        result
            .to_string()
            .contains("Reconnection test completed successfully"),
        "{result}"
    );
}

#[test]
fn new_sessions_balance_over_healthy_endpoints() {
    let (_a, url_a) = start_upstream(Upstream::TypeScript);
    let (mut b, url_b) = start_upstream(Upstream::TypeScript);
    let gw = TestGateway::start_with(&[&url_a, &url_b], &test_keys(), |c| {
        c.upstreams[0].health_check_interval_ms = 100;
    });
    let raw = Raw::new(&gw.url);
    let port = |url: &str| {
        url.split(':')
            .nth(2)
            .unwrap()
            .trim_end_matches("/mcp")
            .parse::<u16>()
            .unwrap()
    };
    let ports: Vec<u16> = (0..4)
        .map(|_| endpoint_of(&raw.initialize(json!({}))).port())
        .collect();
    for url in [&url_a, &url_b] {
        assert_eq!(
            ports.iter().filter(|p| **p == port(url)).count(),
            2,
            "not round-robin: {ports:?}"
        );
    }
    b.kill();
    // Once a health check has marked B down, every new session lands on A.
    wait_until(
        "sessions to avoid the dead endpoint",
        Duration::from_secs(10),
        || {
            (0..3).all(|_| {
            let init = json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"1"}}});
            let reply = raw.post(None, &init);
            reply.status == 200 && reply.session.as_deref().map(endpoint_of).map(|a| a.port()) == Some(port(&url_a))
        })
        },
    );
}

/// Two requests written back to back on one keep-alive connection (HTTP/1.1 pipelining,
/// and what a fast client's next request looks like while the gateway still relays the
/// previous response): both are answered, in order, and no byte of the second is lost.
#[test]
fn pipelined_requests_on_one_connection_are_answered_in_order() {
    use std::io::{Read, Write};
    let (_upstream, url) = start_upstream(Upstream::TypeScript);
    let gw = TestGateway::start(&[&url], &test_keys());
    let session = Raw::new(&gw.url).initialize(json!({}));
    let authority = gw
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/mcp");
    let request = |id: u64, method: &str, last: bool| {
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method}).to_string();
        let connection = if last { "close" } else { "keep-alive" };
        format!("POST /mcp HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMcp-Protocol-Version: 2025-11-25\r\nMcp-Session-Id: {session}\r\nConnection: {connection}\r\nContent-Length: {}\r\n\r\n{body}", body.len())
    };
    let mut tcp = std::net::TcpStream::connect(authority).expect("connect to the gateway");
    tcp.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let both = request(101, "ping", false) + &request(102, "tools/list", true);
    tcp.write_all(both.as_bytes()).expect("write both requests");
    let mut received = Vec::new();
    tcp.read_to_end(&mut received)
        .expect("the gateway closes after the second response");
    let text = String::from_utf8_lossy(&received);
    assert_eq!(
        text.matches("HTTP/1.1 200").count(),
        2,
        "two responses: {text}"
    );
    let first = text.find(r#""id":101"#).expect("the ping's response");
    let second = text.find(r#""id":102"#).expect("the tools/list response");
    assert!(first < second, "in order: {text}");

    // The same behind a bridged call, whose client the gateway watches for leaving
    // while the round runs: the pipelined request is no client gone, and is answered
    // after the round's InputRequiredResult.
    let modern = |id: u64, method: &str, params: Value, last: bool| {
        let (headers, body) = modern_request(id, method, params, json!({"elicitation": {}}));
        let body = body.to_string();
        let connection = if last { "close" } else { "keep-alive" };
        let mut head =
            format!("POST /mcp HTTP/1.1\r\nHost: {authority}\r\nConnection: {connection}\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        format!("{head}Content-Length: {}\r\n\r\n{body}", body.len())
    };
    let mut tcp = std::net::TcpStream::connect(authority).expect("connect to the gateway");
    tcp.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let ask = json!({"name": "ask_name", "arguments": {}});
    let both = modern(201, "tools/call", ask, false) + &modern(202, "tools/list", json!({}), true);
    tcp.write_all(both.as_bytes()).expect("write both requests");
    let mut received = Vec::new();
    tcp.read_to_end(&mut received)
        .expect("the gateway closes after the second response");
    let text = String::from_utf8_lossy(&received);
    let first = text
        .find(r#""id":201"#)
        .unwrap_or_else(|| panic!("the call's answer: {text}"));
    let second = text
        .find(r#""id":202"#)
        .unwrap_or_else(|| panic!("the list: {text}"));
    assert!(first < second, "in order: {text}");
    assert!(text.contains("input_required"), "the round asked: {text}");
}
