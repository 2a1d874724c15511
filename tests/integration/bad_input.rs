//! Hostile and broken input: forged session tokens, bad bodies, dead upstreams. Each
//! case gets a clear JSON-RPC error and, where it must, provably reaches no upstream.

use crate::common::*;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use mrtr_gateway::keys::{KeyRing, Purpose};
use mrtr_gateway::principal::PrincipalSource;
use mrtr_gateway::protocol::session_token::SessionToken;
use mrtr_gateway::seal;
use serde_json::{json, Value};
use std::time::Duration;

fn token_for(ring: &KeyRing, port: u16, authorization: Option<&[u8]>) -> String {
    let binding = PrincipalSource::Authorization.digest(authorization);
    SessionToken {
        group: "default".into(),
        endpoint: format!("127.0.0.1:{port}").parse().unwrap(),
        upstream_session: "upstream-session-1".into(),
        issued_at: 0,
    }
    .seal(ring, &binding)
}

fn flip_bit(token: &str, bit: usize) -> String {
    let mut raw = URL_SAFE_NO_PAD.decode(token).unwrap();
    let i = bit % (raw.len() * 8);
    raw[i / 8] ^= 1 << (i % 8);
    URL_SAFE_NO_PAD.encode(raw)
}

/// A 404 naming the lost session, in answer to the request with JSON-RPC id `id`.
fn assert_session_not_found(reply: Reply, id: Value, case: &str) {
    assert_eq!(reply.status, 404, "{case}: status");
    let body = reply.json();
    assert_eq!(body["jsonrpc"], "2.0", "{case}: {body}");
    assert_eq!(body["id"], id, "{case}: the request's own id: {body}");
    assert_eq!(body["error"]["code"], -32600, "{case}: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("Session not found"), "{case}: {message}");
}

#[test]
fn forged_session_ids_get_404_and_reach_no_upstream() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let good = token_for(&ring, tripwire.port, None);
    let other_ring = KeyRing::parse("test1:AQECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap();
    let plain = postcard::to_allocvec(&SessionToken {
        group: "default".into(),
        endpoint: format!("127.0.0.1:{}", tripwire.port).parse().unwrap(),
        upstream_session: "s".into(),
        issued_at: 0,
    })
    .unwrap();
    let binding = PrincipalSource::Authorization.digest(None);
    let mut cases: Vec<(String, String)> = vec![
        ("truncated".into(), good[..good.len() - 5].to_string()),
        ("extended".into(), format!("{good}AAAA")),
        ("base64 garbage".into(), "!!!not-a-token!!!".into()),
        ("empty-looking".into(), "A".into()),
        (
            "foreign key, same key id".into(),
            token_for(&other_ring, tripwire.port, None),
        ),
        (
            "other principal".into(),
            token_for(&ring, tripwire.port, Some(b"Bearer someone-else")),
        ),
        (
            "wrong purpose".into(),
            seal::seal(&ring, Purpose::RequestState, &binding, &plain),
        ),
        ("oversized".into(), "A".repeat(5000)),
    ];
    for bit in (0..good.len() * 6).step_by(37) {
        cases.push((format!("bit {bit} flipped"), flip_bit(&good, bit)));
    }
    let raw = Raw::new(&gw.url);
    let call = json!({"jsonrpc":"2.0","id":7,"method":"tools/list"});
    for (case, token) in &cases {
        assert_session_not_found(raw.post(Some(token), &call), json!(7), case);
        let get = raw.request(
            "GET",
            &[("accept", "text/event-stream"), ("mcp-session-id", token)],
            None,
        );
        assert_session_not_found(get, Value::Null, &format!("GET {case}"));
        let delete = raw.request("DELETE", &[("mcp-session-id", token)], None);
        assert_session_not_found(delete, Value::Null, &format!("DELETE {case}"));
    }
    assert_eq!(tripwire.count(), 0, "a forged token reached the upstream");
    println!(
        "forged session ids refused without reaching the upstream: {} cases x 3 methods",
        cases.len()
    );

    // Control: the genuine token is forwarded, so the tripwire can count.
    let reply = raw.post(Some(&good), &call);
    assert_eq!(
        reply.status, 502,
        "the tripwire closes connections without answering"
    );
    assert!(tripwire.count() >= 1, "the genuine token was not forwarded");
}

#[test]
fn oversized_and_malformed_bodies_get_clear_4xx() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        // A retry must fit its state, so states are held under the small body limit.
        c.limits.max_request_state_bytes = 512;
        c.limits.max_body_bytes = 2048;
    });
    let raw = Raw::new(&gw.url);
    let big = json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"text":"x".repeat(4096)}}});
    let reply = raw.post(None, &big);
    assert_eq!(reply.status, 413);
    let body = reply.json();
    assert!(
        body["error"]["message"].as_str().unwrap().contains("2048"),
        "{body}"
    );

    let cases: &[(&str, i64)] = &[
        ("{not json", -32700),
        ("[]", -32600),
        ("42", -32600),
        (r#"{"id":1,"method":"tools/list"}"#, -32600),
        (
            r#"{"jsonrpc":"2.0","id":{"x":1},"method":"tools/list"}"#,
            -32600,
        ),
        (r#"{"jsonrpc":"2.0","id":1}"#, -32600),
    ];
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
    ];
    for (body, code) in cases {
        let reply = raw.request("POST", &headers, Some(body));
        assert_eq!(reply.status, 400, "{body}");
        let error: Value = reply.json();
        assert_eq!(error["error"]["code"], *code, "{body}: {error}");
        assert!(!error["error"]["message"].as_str().unwrap().is_empty());
    }
    let reply = raw.request("PUT", &headers, Some("{}"));
    assert_eq!(reply.status, 405);
    let allow = reply.headers.iter().find(|(name, _)| name == "allow");
    assert_eq!(
        allow.map(|(_, v)| v.as_str()),
        Some("POST, GET, DELETE, OPTIONS"),
        "a 405 names what the endpoint serves (RFC 9110 §15.5.6)"
    );
    assert_eq!(tripwire.count(), 0, "a refused body reached the upstream");
    // The gateway's own refusals are counted, their method not read yet: the 413, the
    // six malformed bodies and the 405.
    let requests = "mrtr_gateway_requests_total";
    for (outcome, n) in [("too_large", 1.0), ("bad_request", 7.0)] {
        let labels = format!("era=\"legacy\",method=\"other\",outcome=\"{outcome}\"");
        wait_until(&labels, Duration::from_secs(5), || {
            metric_with(&gw.admin, requests, &labels) == Some(n)
        });
    }
}

#[test]
fn stopped_upstream_gets_502_with_a_jsonrpc_error() {
    let dead = format!("http://127.0.0.1:{}/mcp", free_port());
    let gw = TestGateway::start(&[&dead], &test_keys());
    let raw = Raw::new(&gw.url);
    let started = std::time::Instant::now();
    let reply = raw.post(
        None,
        &json!({"jsonrpc":"2.0","id":"init-1","method":"initialize","params":{}}),
    );
    assert_eq!(reply.status, 502);
    let body = reply.json();
    assert_eq!(body["id"], "init-1");
    assert_eq!(body["error"]["code"], -32603);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unreachable"),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a dead upstream must not hang the client"
    );
}

#[test]
fn foreign_origins_are_refused_on_a_loopback_listener() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#;
    let headers = [
        ("content-type", "application/json"),
        ("origin", "http://evil.example.com"),
    ];
    let reply = raw.request("POST", &headers, Some(init));
    assert_eq!(reply.status, 403);
    let body = reply.json();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("evil.example.com"),
        "{body}"
    );
    assert_eq!(
        tripwire.count(),
        0,
        "a request from a foreign origin reached the upstream"
    );
    let local = [
        ("content-type", "application/json"),
        ("origin", "http://localhost:3000"),
    ];
    raw.request("POST", &local, Some(init));
    assert!(tripwire.count() >= 1, "a local origin was not forwarded");
}

#[test]
fn a_silent_upstream_gets_504_within_the_response_timeout() {
    // Accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/mcp", silent.local_addr().unwrap());
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].response_timeout_ms = 300
    });
    let started = std::time::Instant::now();
    let reply = Raw::new(&gw.url).post(
        None,
        &json!({"jsonrpc":"2.0","id":5,"method":"initialize","params":{}}),
    );
    assert_eq!(reply.status, 504);
    let body = reply.json();
    assert_eq!(body["id"], 5);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not answer in time"),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the response timeout was not applied"
    );
    // A bridged call is told which step waited, and which limit ended the wait.
    let modern = ask_name(&Raw::new(&gw.url), 6, json!({}));
    let message = modern["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("opening a session (initialize)")
            && message.contains("response_timeout_ms"),
        "{modern}"
    );
    drop(silent);
}

#[test]
fn a_modern_body_that_fails_the_full_parse_gets_the_reason() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", "2026-07-28"),
        ("mcp-method", "tools/call"),
        ("mcp-name", "add"),
    ];
    // Params nested past the JSON parser's depth limit pass the envelope check.
    let deep = format!(
        r#"{{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {{"name": "add", "arguments": {{"x": {}{}}}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let body = raw.request("POST", &headers, Some(&deep)).json();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("recursion limit"), "{body}");
    assert!(message.contains("nested at most 128 deep"), "{body}");
    assert_eq!(body["id"], 1, "the id the envelope check read: {body}");
    assert!(!message.contains("responses"), "{body}");
    let batch =
        json!([{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "add"}}]);
    let body = raw
        .request("POST", &headers, Some(&batch.to_string()))
        .json();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("batches"), "{body}");
    assert_eq!(tripwire.count(), 0, "a refused body reached the upstream");
}

/// A request target longer than 8 KiB is refused 414 before anything goes upstream: with
/// the endpoint's own query added, one near the 64 KiB a URI may have could not be sent
/// on, and building it failed where it could not fail.
#[test]
fn an_overlong_request_target_gets_414_and_reaches_no_upstream() {
    let tripwire = Tripwire::start();
    let endpoint = format!("{}?apiKey=0per4tor-k3y", tripwire.url());
    let gw = TestGateway::start(&[&endpoint], &test_keys());
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"c","version":"1"}}}"#;
    for length in [9_000, 65_400] {
        let request = format!(
            "POST /mcp?q={} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
             accept: application/json, text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
            "a".repeat(length),
            body.len()
        );
        let answer = raw_exchange(gw.port, request.as_bytes(), Duration::from_secs(5));
        assert!(answer.starts_with("HTTP/1.1 414"), "{length}: {answer}");
        let json = &answer[answer.find("\r\n\r\n").expect("a body") + 4..];
        let error: Value = serde_json::from_str(json).expect("a JSON-RPC error");
        assert_eq!(error["error"]["code"], -32600, "{error}");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("8192"), "{message}");
    }
    assert_eq!(
        tripwire.count(),
        0,
        "an overlong target reached the upstream"
    );
    let reply = Raw::new(&gw.url).post(None, &serde_json::from_str(body).unwrap());
    assert_eq!(reply.status, 502, "the gateway still serves");
}

/// A 2026-07-28 body of many small values (4 MiB of numbers builds into some 130 MB) is
/// refused 413 naming `limits.max_json_values` before it is built, under the request's
/// id; a body as large whose
/// values are few (one long string) is read.
#[test]
fn a_body_of_too_many_json_values_is_refused_unbuilt() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let many = vec![0; 300_000];
    let params = json!({"name": "echo", "arguments": {"numbers": many}});
    let reply = raw.modern(1, "tools/call", params, json!({}));
    assert_eq!(reply.status, 413);
    let body = reply.json();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("limits.max_json_values"), "{body}");
    assert_eq!(body["id"], 1, "under the request's own id");
    assert_eq!(tripwire.count(), 0, "a refused body reached the upstream");
    let long = "x".repeat(1 << 20);
    let params = json!({"name": "echo", "arguments": {"text": long}});
    let reply = raw.modern(2, "tools/call", params, json!({}));
    assert_ne!(reply.status, 413, "one long string is one value");
}

/// A request answered before its body was read (here at a path with no endpoint; a
/// missing credential's 401 is answered the same way) has what it still sends of its
/// body read off before the connection closes: the client reads the whole answer, then
/// the close, not a reset.
#[test]
fn a_request_refused_before_its_body_is_read_gets_its_answer_then_a_close_not_a_reset() {
    use std::io::{Read, Write};
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let head = "POST /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 200000\r\n\r\n";
    let mut client = raw_send(gw.port, head.as_bytes(), READ_LIMIT);
    client
        .write_all(&[b' '; 100_000])
        .expect("half the body sent");
    let (head, body) = read_response(&mut client);
    assert!(head.starts_with("http/1.1 404"), "{head}");
    assert!(body.contains("no MCP endpoint at /nowhere"), "{body}");
    // The client, still sending its body (as a client library writing it in pieces
    // does), is not reset under its writes, nor after them.
    for piece in 0..10 {
        let sent = client.write_all(&[b' '; 10_000]);
        assert!(
            sent.is_ok(),
            "piece {piece}: the connection was reset: {sent:?}"
        );
    }
    let mut rest = Vec::new();
    let end = client.read_to_end(&mut rest);
    assert!(end.is_ok(), "the connection was reset: {end:?}");
    assert_eq!(tripwire.count(), 0);
}
