//! No result crosses flows. The Python fixture's event store behaves as the SDK's example
//! store does in the field: one store for every session, keyed by stream id only, with
//! the SDK naming a call's stream after the call's JSON-RPC id. A resumption after one
//! session's event then replays every session's later events on that stream, and old
//! events are evicted per stream. A flow must still get only its own call's result.

use crate::common::*;
use serde_json::{json, Value};

/// `ask_name` as `who` (their own `Authorization`), with `extra` retry params.
fn ask_name_as(raw: &Raw, who: &str, id: u64, extra: Value) -> Value {
    let params = tool_params("ask_name", extra);
    let bearer = format!("Bearer {who}");
    raw.modern_with(
        id,
        "tools/call",
        params,
        json!({"elicitation": {}}),
        &[("authorization", bearer.as_str())],
    )
    .json()
}

fn result_text(body: &Value) -> &str {
    body["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text result: {body}"))
}

pub fn interleaved_principals_case() -> usize {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let alice = ask_name_as(&raw, "alice", 1, json!({}));
    let bob = ask_name_as(&raw, "bob", 1, json!({}));
    let alice_done = ask_name_as(
        &raw,
        "alice",
        2,
        answer(&alice, json!({"name": "ALICE-SECRET"})),
    );
    assert_eq!(result_text(&alice_done), "Hello, ALICE-SECRET!");
    let bob_done = ask_name_as(&raw, "bob", 2, answer(&bob, json!({"name": "bob"})));
    assert_eq!(
        result_text(&bob_done),
        "Hello, bob!",
        "Bob received another flow's result"
    );
    2
}

#[test]
fn two_principals_interleaved_each_get_their_own_result() {
    interleaved_principals_case();
}

pub fn parked_flows_case() -> usize {
    // The SDK's store keeps 100 events per stream; a flow's first round stores two on its
    // call's stream (the priming event and the question), so 150 parked flows that shared
    // one stream would evict the first ones' events.
    const FLOWS: usize = 150;
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    let raw = Raw::new(&gw.url);
    let parked: Vec<Value> = (0..FLOWS)
        .map(|i| ask_name_as(&raw, &format!("user-{i}"), 1, json!({})))
        .collect();
    for i in [0, 1, FLOWS / 2, FLOWS - 1] {
        let name = format!("name-of-user-{i}");
        let done = ask_name_as(
            &raw,
            &format!("user-{i}"),
            2,
            answer(&parked[i], json!({"name": name})),
        );
        assert_eq!(result_text(&done), format!("Hello, {name}!"), "flow {i}");
    }
    println!(
        "{FLOWS} parked flows on one shared event store: each sampled retry got its own result"
    );
    FLOWS
}

#[test]
fn many_parked_flows_each_complete_with_their_own_answer() {
    parked_flows_case();
}

/// A server that names its caller in its `serverInfo` (a tenant, a user): each caller's
/// results carry its own, never the one the group's latest session was opened with for
/// someone else.
#[test]
fn a_server_info_naming_its_caller_is_shown_to_that_caller_only() {
    use crate::scripted::{legacy_basics, Answer, ScriptedUpstream, Seen};
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let who = seen.header("authorization").unwrap_or("nobody").to_string();
        let session = format!("s-{}", who.replace(' ', "-"));
        let body = seen.json().unwrap_or_default();
        if body["method"] == "initialize" {
            let result = json!({"jsonrpc": "2.0", "id": body["id"], "result": {
                "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                "serverInfo": {"name": "tenant-server", "version": "1", "title": who}}});
            return Answer::json_with(200, &[("mcp-session-id", &session)], &result);
        }
        if let Some(reply) = legacy_basics(seen, &session) {
            return reply;
        }
        let tools = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        Answer::json(200, &tools)
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let list_as = |who: &str, id: u64| {
        let bearer = format!("Bearer {who}");
        let headers = [("authorization", bearer.as_str())];
        let reply = raw.modern_with(id, "tools/list", json!({}), json!({}), &headers);
        let body = reply.json();
        body["result"]["_meta"]["io.modelcontextprotocol/serverInfo"]["title"]
            .as_str()
            .unwrap_or_else(|| panic!("no serverInfo title: {body}"))
            .to_string()
    };
    assert_eq!(list_as("ada", 1), "Bearer ada");
    assert_eq!(list_as("bob", 2), "Bearer bob");
    // Ada's next request runs on her kept session; Bob's session was opened last.
    assert_eq!(
        list_as("ada", 3),
        "Bearer ada",
        "Ada was shown Bob's serverInfo"
    );
}
