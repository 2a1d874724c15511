//! Load shedding: above `bridge.shed_above_active_rounds` interactive requests in progress,
//! a replica defers a new call with a `requestState`-only `InputRequiredResult` instead of
//! starting it; the retry, on any replica, starts the call. The official Python and
//! TypeScript clients retry such results on their own and complete.

use crate::common::*;
use mrtr_gateway::config::{Config, UpstreamEra};
use serde_json::{json, Value};
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

fn shedding_gateway(url: &str) -> TestGateway {
    TestGateway::start_with(&[url], &test_keys(), |c: &mut Config| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.shed_above_active_rounds = 1;
    })
}

/// Holds one interactive request in progress on `gw` (a slow call) until the returned
/// connection is dropped, which cancels it.
fn hold_a_round(gw: &TestGateway) -> TcpStream {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "slow_echo", "arguments": {"text": "busy", "ms": 60000},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {}}}})
    .to_string();
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\n\
         Mcp-Method: tools/call\r\nMcp-Name: slow_echo\r\nContent-Length: {}\r\n\r\n{body}",
        gw.port,
        body.len()
    );
    let opened =
        || metric_with(&gw.admin, "mrtr_gateway_upstream_sessions_total", "opened").unwrap();
    let before = opened();
    let mut stream = TcpStream::connect(("127.0.0.1", gw.port)).expect("connect");
    stream.write_all(request.as_bytes()).expect("send");
    wait_until(
        "a round in progress upstream",
        Duration::from_secs(10),
        || metric(&gw.admin, "mrtr_gateway_active_rounds") == 1.0 && opened() > before,
    );
    stream
}

fn release(gw: &TestGateway, holder: TcpStream) {
    drop(holder);
    wait_until("no round in progress", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_active_rounds") == 0.0
    });
}

#[test]
fn a_shed_call_gets_a_state_only_result_whose_retry_starts_it_on_any_replica() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let (a, b) = (shedding_gateway(&url), shedding_gateway(&url));
    let (ra, rb) = (Raw::new(&a.url), Raw::new(&b.url));
    let holder = hold_a_round(&a);
    let opened = || metric_with(&a.admin, "mrtr_gateway_upstream_sessions_total", "opened");
    let before = opened();

    let shed = ask_name(&ra, 1, json!({}));
    let result = &shed["result"];
    assert_eq!(result["resultType"], "input_required", "{shed}");
    assert!(result.get("inputRequests").is_none(), "{shed}");
    assert!(result["requestState"].is_string(), "{shed}");
    assert_eq!(metric(&a.admin, "mrtr_gateway_shed_total"), 1.0);
    assert_eq!(opened(), before, "a shed call opened an upstream session");

    // The retry, on the other replica, starts the call: the question comes.
    let state = json!({"requestState": result["requestState"]});
    let asked = ask_name(&rb, 2, state.clone());
    assert!(asked["result"]["inputRequests"].is_object(), "{asked}");
    // A retry that carries answers is never shed: A, still loaded, completes the flow.
    let done = ask_name(&ra, 3, answer(&asked, json!({"name": "Ada"})));
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Ada!",
        "{done}"
    );
    // The deferred state was used once.
    let again = ask_name(&rb, 4, state);
    assert_eq!(again["error"]["code"], -32602, "{again}");
    release(&a, holder);
}

#[test]
fn official_clients_retry_a_shed_call_and_complete() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = shedding_gateway(&url);
    let python_client = root().join("tests/clients/py_modern_client.py");
    let ts_client = root().join("tests/clients/ts_modern_client.mjs");
    let clients = [
        ("Python", python(), python_client),
        ("TypeScript", node(), ts_client),
    ];
    for (name, program, script) in clients {
        let holder = hold_a_round(&gw);
        let before = metric(&gw.admin, "mrtr_gateway_shed_total");
        let url = gw.url.clone();
        let run = std::thread::spawn(move || {
            let args = [script.to_str().unwrap(), url.as_str(), "elicit"];
            json_lines(&run_client(program, &args, Duration::from_secs(60)))
        });
        wait_until(
            "the client's call to be shed",
            Duration::from_secs(30),
            || metric(&gw.admin, "mrtr_gateway_shed_total") > before,
        );
        release(&gw, holder);
        let lines: Vec<Value> = run.join().expect("client thread");
        let call = lines.iter().find(|l| l["step"] == "call");
        assert_eq!(
            call.map(|c| c["text"].clone()),
            Some(json!("Hello, Alice!")),
            "{name}: {lines:?}"
        );
        println!(
            "{name} modern client: shed {} time(s), then completed",
            metric(&gw.admin, "mrtr_gateway_shed_total") - before
        );
    }
}

/// A shed call of a tool that runs only in a data-layer session goes on in one: its retry
/// without the session's cookie is refused, not started outside any session.
#[test]
fn a_shed_call_in_a_session_is_not_started_outside_it() {
    use mrtr_gateway::config::{SessionPolicy, ToolPolicy};
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c: &mut Config| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.shed_above_active_rounds = 1;
        let policy = ToolPolicy {
            session: SessionPolicy::Required,
            ..ToolPolicy::default()
        };
        c.upstreams[0]
            .tools
            .insert("notebook_append".into(), policy);
    });
    let raw = Raw::new(&gw.url);
    let caps = json!({"elicitation": {}});
    let created = raw.modern(1, "session/create", json!({"hints": {}}), caps.clone());
    let cookie = created.json()["result"]["_meta"]["mcp/session"]["id"].clone();
    assert!(cookie.is_string(), "no cookie");
    let holder = hold_a_round(&gw);
    let in_session = json!({"name": "notebook_append", "arguments": {"text": "x"},
        "_meta": {"mcp/session": {"id": cookie}}});
    let shed = raw.modern(2, "tools/call", in_session, caps.clone()).json();
    let state = shed["result"]["requestState"].clone();
    assert!(state.is_string(), "not shed: {shed}");
    release(&gw, holder);
    let outside = json!({"name": "notebook_append", "arguments": {"text": "x"},
        "requestState": state});
    let refused = raw.modern(3, "tools/call", outside, caps).json();
    assert_eq!(refused["error"]["code"], -32602, "{refused}");
}
