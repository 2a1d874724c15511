//! The hostile-input corpus: every class of bad input the sealed-state issue names, each
//! case checked for its documented error, while a tripwire upstream proves nothing was
//! forwarded and a real upstream on another path proves the gateway kept serving. The
//! test prints the corpus as a table: class, cases, expected answer. A second corpus
//! prints the transport's classes (request smuggling, framing, 1xx, duplicate POSTs,
//! upstream aborts, forwarding headers, the connection cap), each a case of
//! `transport.rs` against raw clients and scripted upstreams.

use crate::common::*;
use crate::scripted::{legacy_basics, Answer, Gate, ScriptedUpstream, Seen};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use mrtr_gateway::config::{UpstreamEra, UpstreamGroupConfig};
use mrtr_gateway::keys::KeyRing;
use mrtr_gateway::mrtr::state::{
    binding, now_secs, FlowState, Pending, Positions, UpstreamCall, UpstreamId, Waiting,
};
use mrtr_gateway::principal::PrincipalSource;
use mrtr_gateway::protocol::session_token::SessionToken;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const UNIFORM: &str = "Invalid or expired requestState";

/// The corpus's table.
#[derive(Default)]
struct Table(Vec<(String, usize, &'static str)>);

impl Table {
    fn row(&mut self, class: &str, cases: usize, expected: &'static str) {
        assert!(cases > 0, "{class}: no cases ran");
        self.0.push((class.to_string(), cases, expected));
    }

    fn print(&self, title: &str) {
        let total: usize = self.0.iter().map(|r| r.1).sum();
        println!("\n{title}: {total} cases in {} classes", self.0.len());
        println!("| class | cases | answer |");
        println!("| --- | ---: | --- |");
        for (class, cases, expected) in &self.0 {
            println!("| {class} | {cases} | {expected} |");
        }
    }
}

/// The regions of a sealed envelope: version, kid length, kid, nonce, ciphertext, tag.
fn regions(raw_len: usize, kid_len: usize) -> [(&'static str, std::ops::Range<usize>); 6] {
    let nonce = 2 + kid_len;
    let body = nonce + 24;
    [
        ("version", 0..1),
        ("key id length", 1..2),
        ("key id", 2..nonce),
        ("nonce", nonce..body),
        ("ciphertext", body..raw_len - 16),
        ("tag", raw_len - 16..raw_len),
    ]
}

/// One token per byte of `region`, each with one bit of that byte flipped.
fn bit_flips(token: &str, region: std::ops::Range<usize>) -> Vec<String> {
    let raw = URL_SAFE_NO_PAD.decode(token).unwrap();
    region
        .map(|i| {
            let mut flipped = raw.clone();
            flipped[i] ^= 1 << (i % 8);
            URL_SAFE_NO_PAD.encode(flipped)
        })
        .collect()
}

fn truncations_and_extensions(token: &str) -> Vec<String> {
    let mut out: Vec<String> = (0..token.len()).map(|n| token[..n].to_string()).collect();
    for tail in [
        "A",
        "AA",
        "AAA",
        "AAAA",
        "_",
        "-",
        "=",
        "==",
        "AAAAAAAAAAAAAAAAAAAAAA",
    ] {
        out.push(format!("{token}{tail}"));
    }
    out
}

const GARBAGE: &[&str] = &[
    "!",
    "%%%%",
    "not a token",
    "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@",
    "AAAA====",
    "+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/+/",
    "Zm9v.YmFy",
    "ÿÿÿÿ",
    "A",
];

struct Fixture {
    ring: KeyRing,
    other_secret: KeyRing,
    unknown_kid: KeyRing,
    tripwire_port: u16,
}

impl Fixture {
    fn session_token(&self, ring: &KeyRing, authorization: Option<&[u8]>) -> String {
        SessionToken {
            group: "default".into(),
            endpoint: format!("127.0.0.1:{}", self.tripwire_port).parse().unwrap(),
            upstream_session: "upstream-session-1".into(),
            issued_at: 0,
        }
        .seal(ring, &PrincipalSource::Authorization.digest(authorization))
    }

    fn flow(&self, expires_at: u64) -> FlowState {
        self.flow_at(self.tripwire_port, expires_at)
    }

    fn flow_at(&self, port: u16, expires_at: u64) -> FlowState {
        FlowState {
            group: "default".into(),
            flow_id: rand::random(),
            started_ms: 1_000_000,
            flow_deadline: expires_at,
            expires_at,
            round: 1,
            known: Vec::new(),
            waiting: Waiting::Resumable {
                call: UpstreamCall {
                    endpoint: format!("127.0.0.1:{port}").parse().unwrap(),
                    session: "upstream-session".into(),
                    id: UpstreamId::Number(1),
                    data_session: false,
                    version: Default::default(),
                },
                pending: vec![Pending {
                    key: "user_name".into(),
                    upstream_id: UpstreamId::Number(0),
                    fingerprint: None,
                    asked: Default::default(),
                }],
                positions: Positions {
                    last_event_id: Some("s_1".into()),
                    round_start: Some("s_0".into()),
                    ..Positions::default()
                },
            },
        }
    }

    /// A state for `ask_name {}` by the anonymous principal, unless told otherwise.
    fn state(
        &self,
        ring: &KeyRing,
        authorization: Option<&[u8]>,
        tool: &str,
        args: Value,
        expires_at: u64,
    ) -> String {
        let principal = PrincipalSource::Authorization.digest(authorization);
        let bind = binding(&principal, "tools/call", Some(tool), Some(&args));
        self.flow(expires_at).seal(ring, &bind)
    }

    fn good_state(&self) -> String {
        self.state(&self.ring, None, "ask_name", json!({}), now_secs() + 600)
    }
}

fn answers() -> Value {
    json!({"user_name": {"action": "accept", "content": {"name": "x"}}})
}

/// Posts `ask_name` retried with `state`; returns status and body.
fn retry(raw: &Raw, state: &Value, responses: Value) -> (u16, Value) {
    let params = json!({"name": "ask_name", "arguments": {}, "inputResponses": responses, "requestState": state});
    let reply = raw.modern(3, "tools/call", params, json!({"elicitation": {}}));
    (reply.status, reply.json())
}

fn assert_uniform(raw: &Raw, state: &str, case: &str) {
    let (status, body) = retry(raw, &json!(state), answers());
    assert_eq!(status, 400, "{case}: {body}");
    assert_eq!(body["error"]["code"], -32602, "{case}: {body}");
    assert_eq!(body["error"]["message"], UNIFORM, "{case}: {body}");
}

fn assert_session_refused(raw: &Raw, token: &str, case: &str) {
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"});
    let replies = [
        raw.post(Some(token), &call),
        raw.request(
            "GET",
            &[("accept", "text/event-stream"), ("mcp-session-id", token)],
            None,
        ),
        raw.request("DELETE", &[("mcp-session-id", token)], None),
    ];
    for reply in replies {
        assert_eq!(reply.status, 404, "{case}");
        let body = reply.json();
        assert_eq!(body["error"]["code"], -32600, "{case}: {body}");
    }
}

/// A request on the real upstream's path must still work.
fn still_serving(ok: &Raw, after: &str) {
    let session = ok.initialize(json!({}));
    let reply = ok.post(
        Some(&session),
        &json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
    );
    assert_eq!(
        reply.status, 200,
        "the gateway stopped serving after {after}"
    );
}

/// An upstream that takes the corpus's one genuine retry: it resumes the call's stream
/// (primed), takes the answer, then sends the call's result.
fn acting_upstream() -> ScriptedUpstream {
    let answered = Gate::new();
    ScriptedUpstream::start(move |seen: &Seen| {
        if seen.method == "GET" && seen.header("last-event-id").is_some() {
            let result = json!({"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "Hello, x!"}]}});
            return Answer::sse(&[])
                .event(Some("s_2"), &json!(""))
                .wait(&answered)
                .event(None, &result)
                .end();
        }
        if seen.method == "GET" {
            return Answer::sse(&[]);
        }
        if is_response(seen) {
            answered.open();
        }
        legacy_basics(seen, "upstream-session").unwrap_or_else(|| Answer::status(405, &[], b""))
    })
}

/// Whether a request carries a JSON-RPC response (an answer to a server request).
fn is_response(seen: &Seen) -> bool {
    seen.json()
        .is_some_and(|m| m.get("method").is_none() && m.get("result").is_some())
}

#[test]
fn the_hostile_input_corpus_gets_documented_errors_and_reaches_no_upstream() {
    let tripwire = Tripwire::start();
    let (_python, python_url) = start_upstream(Upstream::Python);
    let acting = acting_upstream();
    let gw = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        // Reached only by the state that names it (the replay case below).
        c.upstreams[0].endpoints.push(acting.url());
        let mut ok = UpstreamGroupConfig::new("ok", vec![python_url.clone()]);
        ok.path = "/ok".into();
        ok.health_check_interval_ms = 0;
        c.upstreams.push(ok);
        c.limits.max_body_bytes = 64 << 10;
        c.limits.max_input_responses_bytes = 2048;
        c.limits.max_input_requests_per_round = 4;
        c.limits.max_header_count = 40;
        c.limits.max_header_bytes = 8192;
    });
    let raw = Raw::new(&gw.url);
    let ok = Raw::new(&gw.url.replace("/mcp", "/ok"));
    let fx = Fixture {
        ring: KeyRing::parse(&test_keys()).unwrap(),
        other_secret: KeyRing::parse("test1:AQECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap(),
        unknown_kid: KeyRing::parse("zz:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap(),
        tripwire_port: tripwire.port,
    };
    let mut table = Table::default();

    // Bit flips in every region of both kinds of token.
    let token = fx.session_token(&fx.ring, None);
    let state = fx.good_state();
    for (kind, text) in [("session token", &token), ("requestState", &state)] {
        let raw_len = URL_SAFE_NO_PAD.decode(text).unwrap().len();
        for (region, range) in regions(raw_len, "test1".len()) {
            let cases = bit_flips(text, range);
            for (i, case) in cases.iter().enumerate() {
                let name = format!("{kind} {region} flip {i}");
                match kind {
                    "session token" => assert_session_refused(&raw, case, &name),
                    _ => assert_uniform(&raw, case, &name),
                }
            }
            let expected = if kind == "session token" {
                "404 Session not found (POST, GET, DELETE)"
            } else {
                "400 -32602 uniform"
            };
            table.row(
                &format!("{kind}: bit flip in {region}"),
                cases.len(),
                expected,
            );
        }
    }
    still_serving(&ok, "bit flips");

    // Truncation and extension, then base64 garbage.
    let cases = truncations_and_extensions(&state);
    for case in &cases {
        assert_uniform(&raw, case, &format!("state cut/extended to {}", case.len()));
    }
    table.row(
        "requestState: truncated or extended",
        cases.len(),
        "400 -32602 uniform",
    );
    let cases = truncations_and_extensions(&token);
    for case in cases.iter().filter(|c| !c.is_empty()) {
        assert_session_refused(&raw, case, &format!("token cut/extended to {}", case.len()));
    }
    table.row(
        "session token: truncated or extended",
        cases.len() - 1,
        "404 Session not found",
    );
    for case in GARBAGE {
        assert_uniform(&raw, case, case);
    }
    let header_safe: Vec<&&str> = GARBAGE.iter().filter(|g| g.is_ascii()).collect();
    for case in &header_safe {
        assert_session_refused(&raw, case, case);
    }
    table.row(
        "base64 garbage",
        GARBAGE.len() + header_safe.len(),
        "-32602 uniform / 404",
    );
    still_serving(&ok, "truncation and garbage");

    // Wrong purpose and wrong key.
    let future = now_secs() + 600;
    assert_uniform(&raw, &token, "a session token as a state");
    assert_session_refused(&raw, &state, "a state as a session token");
    table.row(
        "wrong purpose (token as state, state as token)",
        2,
        "-32602 uniform / 404",
    );
    let foreign = [
        fx.state(&fx.other_secret, None, "ask_name", json!({}), future),
        fx.state(&fx.unknown_kid, None, "ask_name", json!({}), future),
    ];
    for case in &foreign {
        assert_uniform(&raw, case, "foreign key");
    }
    assert_session_refused(
        &raw,
        &fx.session_token(&fx.other_secret, None),
        "same kid, other secret",
    );
    assert_session_refused(
        &raw,
        &fx.session_token(&fx.unknown_kid, None),
        "unknown kid",
    );
    table.row(
        "wrong key id, or same id with another secret",
        4,
        "-32602 uniform / 404",
    );

    // Authentic states on the wrong request, for the wrong principal, or too late.
    let misbound = [
        (
            "expired",
            fx.state(&fx.ring, None, "ask_name", json!({}), now_secs() - 1),
        ),
        (
            "other principal",
            fx.state(
                &fx.ring,
                Some(b"Bearer mallory"),
                "ask_name",
                json!({}),
                future,
            ),
        ),
        (
            "other tool",
            fx.state(&fx.ring, None, "plan_trip", json!({}), future),
        ),
        (
            "other arguments",
            fx.state(&fx.ring, None, "ask_name", json!({"x": 1}), future),
        ),
    ];
    let anonymous = PrincipalSource::Authorization.digest(None);
    let ask_name = binding(&anonymous, "tools/call", Some("ask_name"), Some(&json!({})));
    for (case, state) in &misbound {
        assert_uniform(&raw, state, case);
    }
    assert_session_refused(
        &raw,
        &fx.session_token(&fx.ring, Some(b"Bearer mallory")),
        "other principal",
    );
    table.row(
        "expired, other principal, tool or arguments",
        misbound.len() + 1,
        "-32602 uniform / 404",
    );
    // An authentic state whose endpoint is not (or no longer) in the group: the call is
    // lost with its endpoint, which is never asked.
    let elsewhere = fx.flow_at(free_port(), future).seal(&fx.ring, &ask_name);
    let (status, body) = retry(&raw, &json!(elsewhere), answers());
    assert_eq!(
        (status, &body["error"]["code"]),
        (200, &json!(-32012)),
        "{body}"
    );
    table.row(
        "state naming an endpoint not in the group",
        1,
        "-32012 (call lost)",
    );
    still_serving(&ok, "misbound states");

    // Oversized fields, each with its own clear error; a state is counted as refused.
    let too_long = || {
        let name = "mrtr_gateway_request_state_rejections_total";
        metric_with(&gw.admin, name, "\"too_long\"").unwrap_or(0.0)
    };
    let too_long_before = too_long();
    let long_state = "A".repeat(5000);
    let (status, body) = retry(&raw, &json!(long_state), answers());
    assert_eq!(too_long(), too_long_before + 1.0, "counted as too_long");
    assert_eq!(
        (status, body["error"]["code"].as_i64()),
        (400, Some(-32602)),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("above the limit of 4096"),
        "{body}"
    );
    let big_answer =
        json!({"user_name": {"action": "accept", "content": {"name": "x".repeat(4000)}}});
    let (status, body) = retry(&raw, &json!(fx.good_state()), big_answer);
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("inputResponses is"),
        "{body}"
    );
    let many: serde_json::Map<String, Value> = (0..5)
        .map(|i| (format!("k{i}"), json!({"action": "decline"})))
        .collect();
    let (status, body) = retry(&raw, &json!(fx.good_state()), Value::Object(many));
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("5 entries"),
        "{body}"
    );
    let huge = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"pad": "x".repeat(70_000)}});
    let reply = raw.post(None, &huge);
    assert_eq!(reply.status, 413);
    let many_headers: Vec<(String, String)> = (0..50)
        .map(|i| (format!("x-pad-{i}"), "1".into()))
        .collect();
    let refs: Vec<(&str, &str)> = many_headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let reply = raw.request("POST", &refs, Some("{}"));
    assert_eq!(reply.status, 431);
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("headers"));
    // Past what the HTTP parser reads (256 lines): the same 431, not a parse error.
    let lines: String = (0..300).map(|i| format!("x-pad-{i}: 1\r\n")).collect();
    let request =
        format!("POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\n{lines}content-length: 2\r\n\r\n{{}}");
    let answer = raw_exchange(gw.port, request.as_bytes(), Duration::from_secs(5));
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(
        answer.contains("more lines than the gateway reads"),
        "{answer}"
    );
    let fat = "y".repeat(9000);
    let reply = raw.request("POST", &[("x-fat", fat.as_str())], Some("{}"));
    assert_eq!(reply.status, 431);
    assert_session_refused(&raw, &"A".repeat(2000), "oversized session token");
    table.row(
        "oversized: requestState, inputResponses (bytes, entries), body, headers (count, past the parser, bytes), session id",
        8,
        "-32602 naming the limit / 413 / 431 / 404",
    );

    // Malformed JSON-RPC and wrong types.
    let malformed: &[(&str, u16, i64)] = &[
        ("not json", 400, -32700),
        ("{\"jsonrpc\":\"2.0\",", 400, -32700),
        ("[]", 400, -32600),
        ("42", 400, -32600),
        (
            "{\"jsonrpc\":\"1.0\",\"id\":1,\"method\":\"tools/list\"}",
            400,
            -32600,
        ),
        (
            "{\"jsonrpc\":\"2.0\",\"id\":{},\"method\":\"tools/list\"}",
            400,
            -32600,
        ),
        ("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":7}", 400, -32600),
    ];
    for (body, status, code) in malformed {
        let reply = raw.request(
            "POST",
            &[
                ("content-type", "application/json"),
                ("accept", "application/json, text/event-stream"),
            ],
            Some(body),
        );
        assert_eq!(reply.status, *status, "{body}");
        assert_eq!(reply.json()["error"]["code"], *code, "{body}");
    }
    let wrong_types = [
        json!({"name": "ask_name", "arguments": {}, "requestState": 7}),
        json!({"name": "ask_name", "arguments": {}, "inputResponses": [1]}),
        json!({"name": 7}),
    ];
    for params in &wrong_types {
        let reply = raw.modern(4, "tools/call", params.clone(), json!({}));
        let status = reply.status;
        let body = reply.json();
        assert!(status == 400, "{params}: {status} {body}");
        assert!(
            matches!(body["error"]["code"].as_i64(), Some(-32602) | Some(-32020)),
            "{params}: {body}"
        );
    }
    table.row(
        "malformed JSON-RPC and wrong types",
        malformed.len() + wrong_types.len(),
        "400 -32700 / -32600 / -32602",
    );

    // Header mismatches on the 2026-07-28 surface.
    let meta = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}});
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "_meta": meta}});
    let mismatches: &[&[(&str, &str)]] = &[
        &[
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "u"),
        ],
        &[
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/list"),
            ("mcp-name", "t"),
        ],
        &[("mcp-protocol-version", "2026-07-28"), ("mcp-name", "t")],
        &[
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
        ],
    ];
    for headers in mismatches {
        let mut all = vec![
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
        ];
        all.extend_from_slice(headers);
        let reply = raw.request("POST", &all, Some(&call.to_string()));
        assert_eq!(reply.status, 400, "{headers:?}");
        assert_eq!(reply.json()["error"]["code"], -32020, "{headers:?}");
    }
    table.row(
        "header mismatches (Mcp-Method, Mcp-Name)",
        mismatches.len(),
        "400 -32020",
    );
    still_serving(&ok, "oversized, malformed and mismatched requests");

    // A replayed retry: the first use is acted on upstream (the call's stream resumed, the
    // answer posted), the replay reaches no upstream.
    assert_eq!(tripwire.count(), 0, "a refused input reached the upstream");
    assert_eq!(acting.count(), 0, "a refused input reached the upstream");
    let once = fx
        .flow_at(acting.port, now_secs() + 600)
        .seal(&fx.ring, &ask_name);
    let (status, done) = retry(&raw, &json!(once), answers());
    assert_eq!(status, 200, "the genuine state is acted on: {done}");
    assert_eq!(done["result"]["content"][0]["text"], "Hello, x!", "{done}");
    // The flow's session is deleted once the client has its result.
    wait_until("the flow's session deleted", Duration::from_secs(5), || {
        acting.requests().iter().any(|s| s.method == "DELETE")
    });
    let after_first = acting.count();
    let answers_posted = || acting.requests().iter().filter(|s| is_response(s)).count();
    assert_eq!(
        answers_posted(),
        1,
        "the genuine state's answer went up once"
    );
    assert_uniform(&raw, &once, "replayed state");
    assert_eq!(
        acting.count(),
        after_first,
        "the replay reached the upstream"
    );
    assert_eq!(tripwire.count(), 0, "the replay reached the upstream");
    table.row(
        "replayed requestState (same replica)",
        1,
        "400 -32602 uniform, nothing posted",
    );
    still_serving(&ok, "a replay");
    table.print("hostile-input corpus");
}

/// The transport's hostile peers (raw clients, scripted upstreams, the real Python
/// server): each class is a case of `transport.rs`, printed in the corpus's table form.
#[test]
fn the_transport_corpus_gets_documented_answers() {
    use crate::transport::*;
    let mut table = Table::default();
    table.row(
        "unparsable header (request line, header line, target over 64 KB)",
        unparsable_header_case(),
        "400 with a JSON-RPC error, closed, nothing forwarded",
    );
    table.row(
        "CL+TE request smuggling",
        cl_te_smuggling_case(),
        "answered, then the connection closes; the smuggled request never runs",
    );
    table.row(
        "request body with broken chunked framing, a request after it",
        broken_body_framing_case(),
        "400 with a JSON-RPC error, closed; the request after it never runs",
    );
    table.row(
        "transfer coding other than chunked; HTTP/1.1 without a Host or with a malformed one",
        unframed_or_unplaced_request_case(),
        "501 / 400 with a JSON-RPC error, closed, nothing forwarded",
    );
    table.row(
        "HTTP/1.0 framing",
        http10_framing_case(),
        "close-delimited body (never chunked); closed unless keep-alive",
    );
    table.row(
        "Expect: 100-continue and upstream 1xx",
        expect_continue_case() + interim_responses_case(),
        "100 from the gateway (none before a 413); 1xx skipped; 502 past 8",
    );
    table.row(
        "duplicate POST (upstream closed unanswered, timed out)",
        no_duplicate_post_case(),
        "502 / 504, sent once; an idempotent DELETE sent again",
    );
    table.row(
        "pooled connection past the upstream's Keep-Alive timeout",
        keep_alive_hint_case(),
        "reused within it, a fresh connection past it: the POST answered",
    );
    table.row(
        "upstream abort mid-body (bad chunk, reset, short body)",
        upstream_abort_case(),
        "no terminal chunk, connection closed; a short JSON body not yet relayed: 502",
    );
    table.row(
        "upstream codes a legacy client's JSON-RPC body against `identity`",
        coded_against_identity_case(),
        "502 with a JSON-RPC error naming it, sent once; no wrapped id relayed",
    );
    table.row(
        "upstream 101 Switching Protocols",
        upstream_switch_case(),
        "502 -32603 naming the group",
    );
    table.row(
        "forwarded headers (untrusted, trusted peer)",
        forwarded_headers_case(),
        "client's replaced / kept with the peer appended",
    );
    table.row(
        "connection cap",
        connection_cap_case(),
        "503 -32603, Connection: close; a freed slot is served",
    );
    table.row(
        "idle kept-alive connections (past the header timeout, at the cap)",
        client_idle_case() + crowded_listener_case(),
        "served until the idle timeout; a stalled header closed; idle ones closed near the cap",
    );
    table.row(
        "Origin null (and file://)",
        origin_null_case(),
        "403 -32600, nothing forwarded",
    );
    table.print("transport corpus");
}

/// Hostile and quirky upstreams against the bridge (scripted upstreams, and the real
/// Python server with the SDK's shared event store): each class is a case of
/// `hostile_upstream.rs` or `isolation.rs`, printed in the corpus's table form.
#[test]
fn the_bridge_corpus_gets_bounded_clear_answers() {
    use crate::hostile_upstream::*;
    use crate::isolation::*;
    let mut table = Table::default();
    table.row(
        "two principals' flows interleaved on a shared event store",
        interleaved_principals_case(),
        "each gets its own result (random upstream call ids)",
    );
    table.row(
        "parked flows on a shared, evicting event store",
        parked_flows_case(),
        "each sampled retry completes with its own answer",
    );
    table.row(
        "a flood of questions (count, bytes)",
        question_flood_case(),
        "the round ends at its limit / -32603 naming the byte limit",
    );
    table.row(
        "colliding server request ids (7 and \"7\")",
        colliding_ids_case(),
        "two questions, each answer to its own id",
    );
    table.row(
        "server request ids the gateway cannot carry",
        uncarried_ids_case(),
        "refused upstream (-32600); -32603 naming the request at once",
    );
    table.row(
        "an SSE event id too long to seal",
        long_event_id_case(),
        "-32603 naming the state limit; no state issued",
    );
    table.row(
        "a restartable tool's answers past the state limit",
        restartable_long_answer_case(),
        "-32603 naming the state limit; no state issued",
    );
    table.row(
        "numbers past f64 or with exponents, both ways",
        exact_numbers_case(),
        "exact value and form upstream and back",
    );
    table.print("bridge corpus");
}

#[test]
fn slow_senders_are_cut_off() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        c.limits.header_timeout_ms = 300;
        c.limits.body_timeout_ms = 300;
    });
    let addr = format!("127.0.0.1:{}", gw.port);
    // Slow body: the headers promise 200 bytes, then one byte at a time.
    let mut body_stream = TcpStream::connect(&addr).unwrap();
    body_stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let head = "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{";
    body_stream.write_all(head.as_bytes()).unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    // Trickle one byte per read-timeout tick until the gateway answers (bounded: 5 s).
    while started.elapsed() < Duration::from_secs(5) {
        match body_stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(_) if answer.is_empty() => {
                if body_stream.write_all(b" ").is_err() {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "slow body answer: {text}");
    assert!(text.contains("did not arrive within 300 ms"), "{text}");

    // Slow headers: half a request line, then silence; the connection is closed.
    let mut header_stream = TcpStream::connect(&addr).unwrap();
    header_stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    header_stream
        .write_all(b"POST /mcp HTTP/1.1\r\nhost: 127.")
        .unwrap();
    let started = Instant::now();
    let n = header_stream.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "slow headers got an answer instead of a close");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the connection was held"
    );
    assert_eq!(tripwire.count(), 0, "a slow request reached the upstream");
    println!("slow senders: body cut off with 408, headers with a close");
}
