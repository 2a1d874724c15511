//! Browser clients (a web page on another origin) through the gateway: with
//! `cors_allowed_origins` the gateway answers preflights and grants every answer to a
//! listed origin, its bridged ones and its errors included; without, CORS stays the
//! upstream's and passes through untouched.

use crate::common::*;
use crate::scripted::{legacy_basics, Answer, ScriptedUpstream, Seen};
use serde_json::json;
use std::time::Duration;

const APP: &str = "http://app.example";
const MCP_HEADERS: &str = "content-type, mcp-protocol-version, mcp-method, mcp-name, authorization";

fn preflight(raw: &Raw, origin: &str) -> Reply {
    raw.request(
        "OPTIONS",
        &[
            ("origin", origin),
            ("access-control-request-method", "POST"),
            ("access-control-request-headers", MCP_HEADERS),
        ],
        None,
    )
}

/// Asserts a response is granted to `origin` alone, with the MCP headers readable.
fn assert_granted(reply: &Reply, origin: &str, what: &str) {
    assert_eq!(
        reply.header_values("access-control-allow-origin"),
        [origin],
        "{what}: {:?}",
        reply.headers
    );
    let exposed = reply
        .header_values("access-control-expose-headers")
        .join(",");
    for name in ["Mcp-Session-Id", "WWW-Authenticate"] {
        assert!(
            exposed.contains(name),
            "{what}: {name} not exposed: {exposed}"
        );
    }
    assert!(
        reply
            .header_values("vary")
            .iter()
            .any(|v| v.contains("Origin")),
        "{what}: no Vary: Origin"
    );
}

#[test]
fn a_listed_origin_gets_its_preflights_answered_and_every_answer_granted() {
    let (_server, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.cors_allowed_origins = vec![APP.into()];
    });
    let raw = Raw::new(&gw.url);

    let answered = preflight(&raw, APP);
    assert_eq!(answered.status, 204, "{:?}", answered.headers);
    assert_eq!(answered.header_values("access-control-allow-origin"), [APP]);
    assert_eq!(
        answered.header_values("access-control-allow-headers"),
        [MCP_HEADERS]
    );
    let methods = answered
        .header_values("access-control-allow-methods")
        .join(",");
    for method in ["GET", "POST", "DELETE"] {
        assert!(methods.contains(method), "{methods}");
    }

    // A bridged flow's answer is the gateway's own: granted too. The listed origin is not
    // a loopback one, yet passes this loopback listener's Origin check.
    let origin = [("origin", APP)];
    let call = raw.modern_with(
        1,
        "tools/call",
        json!({"name": "ask_name", "arguments": {}}),
        json!({"elicitation": {}}),
        &origin,
    );
    if call.status != 200 {
        let status = call.status;
        panic!("{status}: {}", call.text());
    }
    assert_granted(&call, APP, "bridged round");
    let body = call.json();
    assert_eq!(body["result"]["resultType"], "input_required", "{body}");

    // A legacy session through pass-through, and the gateway's own refusal.
    let init = legacy_initialize("t");
    let mut headers = vec![
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
    ];
    headers.extend_from_slice(&origin);
    let legacy = raw.request("POST", &headers, Some(&init.to_string()));
    assert_eq!(legacy.status, 200);
    assert!(legacy.session.is_some());
    assert_granted(&legacy, APP, "legacy initialize");
    let unknown = raw.request(
        "GET",
        &[("origin", APP), ("mcp-session-id", "not-a-token")],
        None,
    );
    assert_eq!(unknown.status, 404);
    assert_granted(&unknown, APP, "the gateway's 404");

    // Another origin: its preflight is refused, saying why, and its requests still meet
    // the Origin check.
    let foreign = preflight(&raw, "http://evil.example");
    assert_eq!(foreign.status, 403);
    assert!(foreign
        .header_values("access-control-allow-origin")
        .is_empty());
    assert!(foreign.text().contains("cors_allowed_origins"));
    let call = raw.modern_with(
        2,
        "tools/call",
        json!({"name": "ask_name", "arguments": {}}),
        json!({"elicitation": {}}),
        &[("origin", "http://evil.example")],
    );
    assert_eq!(call.status, 403);
}

/// `cors_allowed_origins: ["*"]` grants any origin with a host, but not an opaque one
/// (`Origin: null` from a sandboxed frame, a `file://` page): on a loopback listener
/// those are refused 403, preflight and request alike, as without a policy.
#[test]
fn a_star_grants_no_opaque_origin() {
    let (_server, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.cors_allowed_origins = vec!["*".into()];
    });
    let raw = Raw::new(&gw.url);
    let answered = preflight(&raw, APP);
    assert_eq!(answered.status, 204);
    assert_eq!(answered.header_values("access-control-allow-origin"), [APP]);
    let init = legacy_initialize("page").to_string();
    for opaque in ["null", "file://"] {
        let preflighted = preflight(&raw, opaque);
        assert_eq!(preflighted.status, 403, "preflight from {opaque}");
        assert!(preflighted
            .header_values("access-control-allow-origin")
            .is_empty());
        let headers = [
            ("origin", opaque),
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
        ];
        let posted = raw.request("POST", &headers, Some(&init));
        assert_eq!(posted.status, 403, "initialize from {opaque}");
    }
}

#[test]
fn without_a_policy_preflights_and_the_upstreams_cors_headers_pass_through_and_with_one_are_replaced(
) {
    // An upstream doing CORS itself, as Express's `cors()` does.
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let cors = [("access-control-allow-origin", "*")];
        if seen.method == "OPTIONS" {
            let origin = seen.header("origin").unwrap_or("*").to_string();
            return Answer::status(
                204,
                &[
                    ("access-control-allow-origin", origin.as_str()),
                    ("access-control-allow-headers", "x-upstream-allowed"),
                ],
                b"",
            );
        }
        if let Some(basics) = legacy_basics(seen, "s1") {
            return basics;
        }
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {}});
        Answer::json_with(200, &cors, &result)
    });
    let local = "http://localhost:3000";
    let list = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"}).to_string();
    let post = |raw: &Raw| {
        let headers = [
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("origin", local),
        ];
        raw.request("POST", &headers, Some(&list))
    };

    let relaying = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&relaying.url);
    let relayed = preflight(&raw, local);
    assert_eq!(relayed.status, 204);
    assert_eq!(
        relayed.header_values("access-control-allow-headers"),
        ["x-upstream-allowed"],
        "the upstream's preflight answer"
    );
    let seen = upstream.wait_for(1, Duration::from_secs(5));
    assert_eq!(seen[0].method, "OPTIONS");
    assert_eq!(seen[0].header("origin"), Some(local));
    assert_eq!(
        post(&raw).header_values("access-control-allow-origin"),
        ["*"]
    );
    // A preflight carries no credentials, so it cannot address a session opened with them.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}});
    let opened = raw.request(
        "POST",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer user-a"),
        ],
        Some(&init.to_string()),
    );
    let token = opened.session.expect("a session token");
    let before = upstream.count();
    let headers = [("origin", local), ("mcp-session-id", token.as_str())];
    assert_eq!(raw.request("OPTIONS", &headers, None).status, 404);
    assert_eq!(
        upstream.count(),
        before,
        "an anonymous OPTIONS reached a session"
    );

    let owning = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.cors_allowed_origins = vec![local.into()];
    });
    let raw = Raw::new(&owning.url);
    let before = upstream.count();
    let answered = preflight(&raw, local);
    assert_eq!(answered.status, 204);
    assert_eq!(
        answered.header_values("access-control-allow-headers"),
        [MCP_HEADERS]
    );
    let answer = post(&raw);
    assert_eq!(answer.status, 200);
    assert_granted(&answer, local, "relayed answer");
    let methods: Vec<String> = upstream.requests()[before..]
        .iter()
        .map(|s| s.method.clone())
        .collect();
    assert_eq!(methods, ["POST"], "the preflight reached the upstream");
}
