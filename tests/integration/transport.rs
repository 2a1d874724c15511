//! The transport's guarantees against hostile peers: raw HTTP clients on one side and
//! scripted upstreams (or the real Python server) on the other. Each case is a function
//! returning how many cases it checked, run by its own test here and by the transport
//! corpus in `hostile.rs`, which prints them as table rows.

use crate::common::*;
use crate::scripted::*;
use serde_json::{json, Value};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn connect(port: u16) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the gateway");
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .expect("read timeout");
    stream
}

/// Reads until the peer closes the connection (an orderly close or a reset), within
/// `READ_LIMIT`; returns the bytes and whether it closed.
fn read_to_close(stream: &mut TcpStream) -> (String, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let deadline = Instant::now() + READ_LIMIT;
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), true),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), false)
}

/// Writes a POST to `/mcp` with `headers` (each line ending in CRLF, after the JSON
/// content type and accept lines) and the raw `body` on a new connection; returns what
/// came back until the close, and whether it closed.
fn post_raw_to_close(port: u16, headers: &str, body: &str) -> (String, bool) {
    let request = format!(
        "POST /mcp HTTP/1.1\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\n{headers}\r\n{body}"
    );
    let mut stream = connect(port);
    stream.write_all(request.as_bytes()).unwrap();
    read_to_close(&mut stream)
}

/// A raw request with a JSON body and the headers a legacy client sends.
fn post(version: &str, extra: &str, body: &Value) -> String {
    let body = body.to_string();
    format!(
        "POST /mcp {version}\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn list_body(id: u64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"})
}

/// An upstream speaking just enough of a legacy session; `tools/list` streams its
/// result as SSE (a body of unknown length).
fn sse_lister() -> ScriptedUpstream {
    ScriptedUpstream::start(|seen: &Seen| {
        if let Some(reply) = legacy_basics(seen, "s1") {
            return reply;
        }
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        Answer::sse(&[]).event(Some("1"), &result).end()
    })
}

/// Through a gateway in front of `upstream`: a legacy client's `tools/list` (id 2) in a
/// session it has just initialized, with one `extra` header.
fn list_in_a_session(upstream: &ScriptedUpstream, extra: (&str, &str)) -> (TestGateway, Reply) {
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", "2025-11-25"),
        ("mcp-session-id", session.as_str()),
        extra,
    ];
    let reply = raw.request("POST", &headers, Some(&list_body(2).to_string()));
    (gw, reply)
}

/// Only the ids the gateway wrapped for the client's own exchange come back unwrapped: a
/// string in a result that looks like a wrapped id under another tag (text another user
/// stored upstream, say) reaches the client as it is, while the response's id is the
/// client's again.
#[test]
fn a_string_that_looks_like_a_wrapped_id_of_another_session_is_content() {
    let lookalike = "mrtr.AAAAAAAAAAAAAAAA.n.5";
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if let Some(reply) = legacy_basics(seen, "s1") {
            return reply;
        }
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(),
            "result": {"tools": [], "_meta": {"note": lookalike}}});
        Answer::sse(&[]).event(Some("1"), &result).end()
    });
    let (_gw, mut reply) = list_in_a_session(&upstream, ("x-unused", "1"));
    let (_, message) = reply.next_message().expect("the list");
    assert_eq!(message["id"], 2, "{message}");
    assert_eq!(message["result"]["_meta"]["note"], lookalike, "{message}");
}

/// An SSE answer relayed through pass-through is marked unbuffered for proxies in front
/// (`X-Accel-Buffering: no`), whatever the case its media type is written in.
#[test]
fn a_relayed_stream_is_marked_unbuffered_whatever_its_media_types_case() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(reply) = legacy_basics(seen, "s1") {
            return reply;
        }
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        let head = "HTTP/1.1 200 OK\r\ncontent-type: Text/Event-Stream\r\ntransfer-encoding: chunked\r\n\r\n";
        Answer::raw(head).event(Some("1"), &result).end()
    });
    let (_gw, reply) = list_in_a_session(&upstream, ("x-unused", "1"));
    let buffering = reply
        .headers
        .iter()
        .find(|(name, _)| name == "x-accel-buffering")
        .map(|(_, value)| value.as_str());
    assert_eq!(buffering, Some("no"), "{:?}", reply.headers);
}

/// A legacy client's event ids come sealed, so the upstream's raw ids never reach it, and
/// a `Last-Event-ID` on anything but a GET (where it means nothing) is not forwarded.
#[test]
fn legacy_event_ids_come_sealed_and_a_posts_last_event_id_goes_nowhere() {
    let upstream = sse_lister();
    let (_gw, mut reply) = list_in_a_session(&upstream, ("last-event-id", "1"));
    assert_eq!(reply.status, 200);
    let (id, message) = reply.next_message().expect("the list");
    assert_eq!(message["id"], 2, "{message}");
    let id = id.expect("an event id");
    assert!(id != "1" && id.len() > 40, "not sealed: {id}");
    let posts: Vec<Seen> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("tools/list"))
        .collect();
    assert_eq!(posts.len(), 1);
    assert_eq!(posts[0].header("last-event-id"), None, "forwarded");
}

/// A server without sessions that keeps a store of its streams' events (the TypeScript
/// SDK's stateless transport given an `eventStore`): a legacy client's call, cut after an
/// event, resumed with a GET naming it. Its id went up under a tag of its own (there is
/// no session to name it after), and the resumed stream's answer carries that wrapped id:
/// the client gets its own id back, not the wrapped one it could not match.
#[test]
fn a_call_resumed_on_a_server_without_sessions_gets_its_own_id_back() {
    let wrapped = std::sync::Mutex::new(Value::Null);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": 1, "progress": 1}});
        match (seen.method.as_str(), seen.header("last-event-id")) {
            ("POST", _) => {
                *wrapped.lock().unwrap() = seen.json().unwrap_or_default()["id"].clone();
                Answer::sse(&[]).event(Some("e1"), &progress).end()
            }
            ("GET", Some("e1")) => {
                let id = wrapped.lock().unwrap().clone();
                let result = json!({"jsonrpc": "2.0", "id": id, "result": {"content": []}});
                Answer::sse(&[]).event(Some("e2"), &result).end()
            }
            _ => Answer::status(400, &[], b"unknown event id"),
        }
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "slow", "arguments": {}}});
    let mut reply = raw.post(None, &call);
    let (position, _) = reply.next_message().expect("the progress event");
    let position = position.expect("an event id");
    let headers = [
        ("accept", "text/event-stream"),
        ("last-event-id", position.as_str()),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    let mut resumed = raw.request("GET", &headers, None);
    assert_eq!(resumed.status, 200);
    let (_, answer) = resumed.next_message().expect("the call's answer");
    assert_eq!(answer["id"], 7, "{answer}");
    let gets: Vec<Seen> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.method == "GET")
        .collect();
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0].header("last-event-id"), Some("e1"));
}

/// A legacy client's request goes up asking for `identity` by name (a request without
/// `Accept-Encoding` accepts any coding), whatever codings the client accepts: its ids
/// come back in the body. An upstream that codes a JSON-RPC body anyway gets the client
/// a 502 saying so, not a body holding ids the client never sent.
pub(crate) fn coded_against_identity_case() -> usize {
    // A gzip member's first bytes: opaque to the gateway, as any coded body is.
    let coded = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xaa\x56\xca\x4c\x51".to_vec();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if let Some(reply) = legacy_basics(seen, "s1") {
            return reply;
        }
        let headers = [
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ];
        Answer::status(200, &headers, &coded)
    });
    let (_gw, reply) = list_in_a_session(&upstream, ("accept-encoding", "gzip, br"));
    assert_eq!(reply.status, 502);
    let body = reply.json();
    assert_eq!(body["id"], 2, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("content-coded"), "{body}");
    let lists: Vec<Seen> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("tools/list"))
        .collect();
    assert_eq!(lists.len(), 1, "sent again");
    assert_eq!(lists[0].header("accept-encoding"), Some("identity"));
    1
}

#[test]
fn a_legacy_response_coded_against_identity_gets_a_clear_502() {
    coded_against_identity_case();
}

/// An `initialize` answered content-coded is not relayed, so the client never learns the
/// session the upstream opened: the gateway ends it, with the client's credentials.
#[test]
fn an_unrelayed_answer_to_initialize_ends_the_session_it_opened() {
    let upstream = ScriptedUpstream::start(initialize_answered_coded);
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    initialize_refused_as_coded(&gw);
    let deletes: Vec<Seen> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.method == "DELETE")
        .collect();
    assert_eq!(deletes.len(), 1, "the opened session was left: {deletes:?}");
    assert_eq!(deletes[0].header("mcp-session-id"), Some("opened-1"));
    assert_eq!(
        deletes[0].header("authorization"),
        Some("Bearer user-token")
    );
}

/// That DELETE, when the upstream cannot take it (it is restarting: a 503), is sent again
/// later: nobody else knows of the session.
#[test]
fn an_unrelayed_sessions_delete_that_failed_is_sent_again() {
    let (upstream, deletes) = FirstRefused::deletes_in_front_of(initialize_answered_coded);
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    initialize_refused_as_coded(&gw);
    deletes.assert_deleted_at_second_attempt(&gw, &upstream);
}

/// A legacy server whose `initialize` opens session `opened-1` and answers gzip-coded.
fn initialize_answered_coded(seen: &Seen) -> Answer {
    if seen.jsonrpc_method().as_deref() == Some("initialize") {
        let headers = [
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
            ("mcp-session-id", "opened-1"),
        ];
        return Answer::status(200, &headers, b"\x1f\x8b\x08\x00");
    }
    legacy_basics(seen, "opened-1").unwrap_or_else(|| Answer::status(405, &[], b""))
}

/// A legacy client's `initialize` with a bearer token, accepting gzip, which `gw` refuses
/// (502) as its upstream answers it coded, handing out no session.
fn initialize_refused_as_coded(gw: &TestGateway) {
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("accept-encoding", "gzip"),
        ("authorization", "Bearer user-token"),
    ];
    let reply = Raw::new(&gw.url).request(
        "POST",
        &headers,
        Some(&legacy_initialize("raw").to_string()),
    );
    assert_eq!(reply.status, 502);
    assert_eq!(reply.session, None, "a session was handed out");
}

/// An `initialize` answered with a session id no token can carry (over 256 characters,
/// or holding a space) gets a 502 saying so rather than a session-less 200 whose client
/// could never use the session, and the session it opened upstream is ended.
#[test]
fn a_session_id_the_gateway_cannot_carry_is_refused_and_its_session_ended() {
    for sid in ["s".repeat(300), "has space".to_string()] {
        let opened = sid.clone();
        let upstream = ScriptedUpstream::start(move |seen: &Seen| {
            if seen.jsonrpc_method().as_deref() == Some("initialize") {
                let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                    "protocolVersion": "2025-11-25", "capabilities": {},
                    "serverInfo": {"name": "s", "version": "1"}}});
                return Answer::json_with(200, &[("mcp-session-id", &opened)], &result);
            }
            Answer::status(200, &[], b"")
        });
        let gw = TestGateway::start(&[&upstream.url()], &test_keys());
        let reply = Raw::new(&gw.url).post(None, &legacy_initialize("raw"));
        let (status, session) = (reply.status, reply.session.clone());
        let body = reply.json();
        assert_eq!((status, session), (502, None), "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("cannot carry"), "{body}");
        let deletes: Vec<Seen> = upstream.wait_for(2, Duration::from_secs(5));
        let deleted = deletes
            .iter()
            .any(|s| s.method == "DELETE" && s.header("mcp-session-id") == Some(sid.as_str()));
        assert!(deleted, "the opened session was left: {deletes:?}");
    }
}

/// Bug 2: a request with both `Content-Length` and `Transfer-Encoding: chunked` ends its
/// connection, so bytes after its chunked body never run as a second request.
pub(crate) fn cl_te_smuggling_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let body = legacy_initialize("raw").to_string();
    let smuggled = post("HTTP/1.1", "x-forwarded-user: admin\r\n", &list_body(2));
    let headers = "host: 127.0.0.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n";
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n{smuggled}", body.len());
    let (answer, closed) = post_raw_to_close(gw.port, headers, &chunked);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{answer}");
    assert!(closed, "the connection stayed open after CL+TE: {answer}");
    let seen = upstream.requests();
    assert_eq!(seen.len(), 1, "the smuggled request ran: {seen:?}");
    assert!(seen.iter().all(|s| s.header("x-forwarded-user").is_none()));
    1
}

#[test]
fn a_request_with_content_length_and_chunked_closes_its_connection() {
    cl_te_smuggling_case();
}

/// A chunked body whose framing is broken (a size with a sign, a prefix, or past 64
/// bits; a line end inside a quoted extension; bare LF lines; data not followed by CRLF)
/// cannot be read to its end: it is answered 400 with a JSON-RPC error and the
/// connection closes, so the well-formed request written after it never runs.
pub(crate) fn broken_body_framing_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let next = post("HTTP/1.1", "x-forwarded-user: admin\r\n", &list_body(2));
    let bodies = [
        "+5\r\nhello\r\n0\r\n\r\n",
        "0x5\r\nhello\r\n0\r\n\r\n",
        "ffffffffffffffffff1\r\nhello\r\n0\r\n\r\n",
        "5;a=\"b\r\nc\"\r\nhello\r\n0\r\n\r\n",
        "5\nhello\n0\n\n",
        "5\r\nhelloXX0\r\n\r\n",
    ];
    for body in bodies {
        let headers = "host: 127.0.0.1\r\ntransfer-encoding: chunked\r\n";
        let (answer, closed) = post_raw_to_close(gw.port, headers, &format!("{body}{next}"));
        assert!(answer.starts_with("HTTP/1.1 400"), "{body:?}: {answer}");
        assert!(answer.contains("could not be read"), "{body:?}: {answer}");
        assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{body:?}: {answer}");
        assert!(closed, "{body:?}: the connection stayed open: {answer}");
    }
    assert!(
        upstream.requests().is_empty(),
        "a request ran: {:?}",
        upstream.requests()
    );
    bodies.len()
}

#[test]
fn a_request_body_with_broken_framing_is_answered_and_closes_its_connection() {
    broken_body_framing_case();
}

/// A 2026-07-28 request carrying a header that mirrors its body twice, with different
/// values, is refused -32020: which one a reader takes is anyone's guess, and the first
/// matching the body must not carry a second, different one past the check.
#[test]
fn a_mirrored_header_sent_twice_with_different_values_is_refused() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let meta = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}});
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "t", "_meta": meta}})
    .to_string();
    let headers = format!(
        "host: 127.0.0.1\r\nconnection: close\r\nmcp-protocol-version: 2026-07-28\r\n\
         mcp-method: tools/call\r\nmcp-name: t\r\nmcp-name: u\r\ncontent-length: {}\r\n",
        body.len()
    );
    let (answer, _) = post_raw_to_close(gw.port, &headers, &body);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("-32020") && answer.contains("the Mcp-Name header appears more than once"),
        "{answer}"
    );
    // A relayed preflight too.
    let preflight = "OPTIONS /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\nmcp-session-id: s1\r\n\
                     mcp-session-id: s2\r\nconnection: close\r\n\r\n";
    let answer = raw_exchange(gw.port, preflight.as_bytes(), READ_LIMIT);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(
        tripwire.count(),
        0,
        "a refused request reached the upstream"
    );
}

/// A GET, DELETE or OPTIONS with a body is refused and its connection closed: only a
/// POST's body is read, and one left on the connection would be taken, byte by byte, for
/// the start of the next request (request smuggling on a kept-alive connection).
#[test]
fn a_request_other_than_post_with_a_body_is_refused() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    for method in ["GET", "DELETE", "OPTIONS"] {
        let request = format!(
            "{method} /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\naccept: text/event-stream\r\n\
             content-length: 5\r\n\r\nhello"
        );
        let answer = raw_exchange(gw.port, request.as_bytes(), READ_LIMIT);
        assert!(answer.starts_with("HTTP/1.1 400"), "{method}: {answer}");
        assert!(answer.contains("carries no body"), "{method}: {answer}");
    }
    assert_eq!(
        tripwire.count(),
        0,
        "a refused request reached the upstream"
    );
}

/// Two `Authorization` headers name two callers, two `Mcp-Session-Id` or `Last-Event-ID`
/// headers two sessions or positions: which one the request is bound to would be
/// anyone's guess (an upstream may read the other), so it gets 400 and goes nowhere.
#[test]
fn a_request_naming_two_callers_sessions_or_positions_is_refused() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let body = legacy_initialize("raw").to_string();
    for (name, twice) in [
        (
            "authorization",
            "authorization: Bearer alice\r\nauthorization: Bearer bob",
        ),
        ("mcp-session-id", "mcp-session-id: s1\r\nmcp-session-id: s2"),
        ("last-event-id", "last-event-id: 1\r\nlast-event-id: 2"),
    ] {
        let headers = format!(
            "host: 127.0.0.1\r\nconnection: close\r\n{twice}\r\ncontent-length: {}\r\n",
            body.len()
        );
        let (answer, _) = post_raw_to_close(gw.port, &headers, &body);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(
            answer.contains(&format!("the {name} header appears more than once")),
            "{answer}"
        );
    }
    assert_eq!(
        tripwire.count(),
        0,
        "a refused request reached the upstream"
    );
}

/// An upstream's denial with two challenges, one with UTF-8 in its error_description,
/// reaches both kinds of client with every challenge and that text kept (and the
/// metadata URL made public): a legacy client as the two fields, a 2026-07-28 client as
/// one list; neither is taken for a lost session.
#[test]
fn every_challenge_of_a_denial_reaches_the_client_whatever_its_bytes() {
    let upstream = ScriptedUpstream::start(|_: &Seen| {
        let head = "HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\
            www-authenticate: Basic realm=\"x\"\r\n\
            www-authenticate: Bearer error_description=\"Jeton expir\u{e9}\", \
            resource_metadata=\"http://10.9.9.9/.well-known/oauth-protected-resource/mcp\"\r\n\r\n";
        Answer::raw(head)
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let challenges = |answer: &str| -> Vec<String> {
        answer
            .lines()
            .filter_map(|l| l.strip_prefix("www-authenticate: "))
            .map(str::to_string)
            .collect()
    };
    let body = legacy_initialize("raw").to_string();
    let legacy = format!(
        "host: 127.0.0.1\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    let (answer, _) = post_raw_to_close(gw.port, &legacy, &body);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    let legacy = challenges(&answer);
    assert_eq!(legacy.len(), 2, "{answer}");
    assert!(legacy[1].contains("Jeton expir\u{e9}"), "{answer}");
    assert!(!legacy[1].contains("10.9.9.9"), "{answer}");

    let meta = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}});
    let body =
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta}})
            .to_string();
    let modern = format!(
        "host: 127.0.0.1\r\nconnection: close\r\nmcp-protocol-version: 2026-07-28\r\n\
         mcp-method: tools/list\r\ncontent-length: {}\r\n",
        body.len()
    );
    let (answer, _) = post_raw_to_close(gw.port, &modern, &body);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    let modern = challenges(&answer);
    assert_eq!(modern.len(), 1, "{answer}");
    assert!(
        modern[0].starts_with("Basic realm=\"x\", Bearer")
            && modern[0].contains("Jeton expir\u{e9}"),
        "{answer}"
    );
    assert!(!modern[0].contains("10.9.9.9"), "{answer}");
}

/// A request line the gateway cannot frame or place: a transfer coding other than one
/// `chunked` (RFC 9112 §6.1: 501), a content coding (RFC 9110 §15.5.16: 415), an HTTP/1.1 request without a Host, or with one no
/// host name has or whose port is not one (§3.2: 400). Each is answered with a JSON-RPC
/// error, its connection closed, and nothing reaches the upstream.
pub(crate) fn unframed_or_unplaced_request_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let body = list_body(2).to_string();
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let coded = |coding: &str| {
        format!(
            "host: 127.0.0.1\r\ncontent-encoding: {coding}\r\ncontent-length: {}\r\n",
            body.len()
        )
    };
    let (gzip, identity_br) = (coded("gzip"), coded("identity, br"));
    let cases = [
        (
            "host: 127.0.0.1\r\ntransfer-encoding: gzip, chunked\r\n",
            &chunked,
            "501",
        ),
        (
            "host: 127.0.0.1\r\ntransfer-encoding: chunked, chunked\r\n",
            &chunked,
            "501",
        ),
        (
            "host: 127.0.0.1\r\ntransfer-encoding: identity\r\ntransfer-encoding: chunked\r\n",
            &chunked,
            "501",
        ),
        // A coded body: checked as JSON, it would reach an upstream told to decode it.
        (&gzip[..], &body, "415"),
        (&identity_br[..], &body, "415"),
        ("content-length: 0\r\n", &String::new(), "400"),
        (
            "host: 127.0.0.1, evil.example\r\ncontent-length: 0\r\n",
            &String::new(),
            "400",
        ),
        (
            "host: 127.0.0.1 evil.example\r\ncontent-length: 0\r\n",
            &String::new(),
            "400",
        ),
        (
            "host: 127.0.0.1:99999\r\ncontent-length: 0\r\n",
            &String::new(),
            "400",
        ),
    ];
    for (headers, body, status) in cases {
        let (answer, closed) = post_raw_to_close(gw.port, headers, body);
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{headers:?}: {answer}"
        );
        assert!(
            answer.contains("\"jsonrpc\":\"2.0\""),
            "{headers:?}: {answer}"
        );
        assert!(closed, "{headers:?}: the connection stayed open");
        if status == "415" {
            // RFC 7694 §3: what would be taken.
            let head = answer.to_ascii_lowercase();
            assert!(head.contains("accept-encoding: identity"), "{answer}");
        }
    }
    assert!(upstream.requests().is_empty(), "{:?}", upstream.requests());
    cases.len()
}

#[test]
fn a_request_with_an_unsupported_coding_or_a_malformed_host_is_refused_and_closed() {
    unframed_or_unplaced_request_case();
}

/// HTTP/1.0 clients: a body of unknown length is close-delimited (never chunked), and
/// the connection closes after the response unless the client asked for keep-alive.
pub(crate) fn http10_framing_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());

    let mut stream = connect(gw.port);
    stream
        .write_all(post("HTTP/1.0", "", &list_body(2)).as_bytes())
        .unwrap();
    let (answer, closed) = read_to_close(&mut stream);
    let (head, body) = answer.split_once("\r\n\r\n").expect("a response");
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{answer}");
    assert!(
        !head.contains("transfer-encoding"),
        "chunked to HTTP/1.0: {head}"
    );
    assert!(!head.contains("content-length"), "{head}");
    // The event as the upstream framed it; its id sealed for the client.
    let (id, rest) = body.split_once('\n').expect("an event");
    assert!(
        id.starts_with("id: ") && rest.starts_with("data: {"),
        "not the upstream's event: {body:?}"
    );
    assert!(
        closed,
        "a close-delimited body must end with the connection"
    );

    let mut stream = connect(gw.port);
    stream
        .write_all(post("HTTP/1.0", "", &legacy_initialize("raw")).as_bytes())
        .unwrap();
    let (answer, closed) = read_to_close(&mut stream);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed, "HTTP/1.0 without keep-alive must close: {answer}");

    let mut stream = connect(gw.port);
    let keep = "connection: keep-alive\r\n";
    stream
        .write_all(post("HTTP/1.0", keep, &legacy_initialize("raw")).as_bytes())
        .unwrap();
    let (head, _) = read_response(&mut stream);
    assert!(
        header_value(&head, "connection") == Some("keep-alive"),
        "{head}"
    );
    stream
        .write_all(post("HTTP/1.0", keep, &legacy_initialize("raw")).as_bytes())
        .unwrap();
    let (head, body) = read_response(&mut stream);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(body.contains("protocolVersion"), "{body}");
    3
}

#[test]
fn http10_clients_get_close_delimited_bodies_and_closed_connections() {
    http10_framing_case();
}

/// Reads whatever arrives until `want` shows up or `limit` passes.
fn read_until(stream: &mut TcpStream, want: &str, limit: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    while !String::from_utf8_lossy(&got).contains(want) && Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Bug 3: `Expect: 100-continue` with a large body, to the real Python server (uvicorn
/// answers an `Expect` with an interim 100). The gateway answers 100 itself before
/// reading the body, never forwards `Expect`, and the final response is the server's
/// result; a declared body over the limit is refused at once, without a 100.
pub(crate) fn expect_continue_case() -> usize {
    let (_python, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.limits.max_body_bytes = 1 << 20;
    });
    let session = Raw::new(&gw.url).initialize(json!({}));
    let pad = "x".repeat(256 << 10);
    let big = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {"_meta": {"pad": pad}}});
    let request = post(
        "HTTP/1.1",
        &format!("mcp-session-id: {session}\r\nmcp-protocol-version: 2025-11-25\r\nexpect: 100-continue\r\n"),
        &big,
    );
    let (head, body) = request.split_at(request.find("\r\n\r\n").unwrap() + 4);
    let mut stream = connect(gw.port);
    stream.write_all(head.as_bytes()).unwrap();
    let interim = read_until(&mut stream, "\r\n\r\n", Duration::from_secs(2));
    assert!(
        interim.starts_with("HTTP/1.1 100 Continue\r\n"),
        "no 100 Continue before the body: {interim:?}"
    );
    stream.write_all(body.as_bytes()).unwrap();
    let answer = read_until(&mut stream, "\r\n0\r\n\r\n", READ_LIMIT);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("\"tools\""),
        "no tools/list result: {answer}"
    );
    // The interim 100 is no early answer: the connection stays for the next request.
    assert_eq!(
        header_value(&answer, "connection"),
        Some("keep-alive"),
        "{answer}"
    );
    let next = post(
        "HTTP/1.1",
        &format!("mcp-session-id: {session}\r\nmcp-protocol-version: 2025-11-25\r\n"),
        &list_body(3),
    );
    stream.write_all(next.as_bytes()).unwrap();
    let again = read_until(&mut stream, "\r\n0\r\n\r\n", READ_LIMIT);
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");

    let mut refused = connect(gw.port);
    let over = format!(
        "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         expect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        2 << 20
    );
    refused.write_all(over.as_bytes()).unwrap();
    let (answer, closed) = read_to_close(&mut refused);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        !answer.contains(" 100 "),
        "100 Continue before a refusal: {answer}"
    );
    assert!(closed, "a refused Expect request keeps no connection");
    2
}

#[test]
fn expect_100_continue_with_a_large_body_reaches_the_python_server() {
    expect_continue_case();
}

/// A 204 has no body (RFC 9112 §6.3): relayed without `Transfer-Encoding` (on which a
/// client such as Python's `http.client` waits for chunks that never come) or
/// `Content-Length`, and the connection serves the next request.
#[test]
fn a_bodiless_answer_is_relayed_without_framing() {
    let deletes = std::sync::atomic::AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if seen.method == "DELETE" {
            // The first without framing, the second with a (forbidden) zero length.
            let n = deletes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let length = if n == 0 { "" } else { "content-length: 0\r\n" };
            return Answer::raw(format!("HTTP/1.1 204 No Content\r\n{length}\r\n"));
        }
        if let Some(reply) = legacy_basics(seen, "s1") {
            return reply;
        }
        Answer::json(
            200,
            &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}}),
        )
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let session = Raw::new(&gw.url).initialize(json!({}));
    let mut stream = connect(gw.port);
    let delete = format!(
        "DELETE /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\nmcp-session-id: {session}\r\n\
         mcp-protocol-version: 2025-11-25\r\n\r\n"
    );
    for _ in 0..2 {
        stream.write_all(delete.as_bytes()).unwrap();
        let head = read_until(&mut stream, "\r\n\r\n", READ_LIMIT);
        assert!(head.starts_with("HTTP/1.1 204"), "{head}");
        assert_eq!(header_value(&head, "transfer-encoding"), None, "{head}");
        assert_eq!(header_value(&head, "content-length"), None, "{head}");
    }
    let (head, body) = ask(&mut stream, &list_body(2));
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(body.contains("\"tools\""), "{body}");
}

/// Bug 3: interim responses (100, 103) from an upstream are skipped, never relayed as
/// final; an upstream that sends nothing but interim responses is cut off with 502.
pub(crate) fn interim_responses_case() -> usize {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        match seen.client_jsonrpc_id().as_u64() {
            Some(1) => Answer::raw("HTTP/1.1 100 Continue\r\n\r\n")
                .bytes("HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n")
                .bytes(Answer::json(200, &result).pieces_bytes()),
            _ => Answer::raw("HTTP/1.1 103 Early Hints\r\n\r\n".repeat(50)).then_close(),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let mut stream = connect(gw.port);
    stream
        .write_all(post("HTTP/1.1", "", &list_body(1)).as_bytes())
        .unwrap();
    let (head, body) = read_response(&mut stream);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["result"],
        json!({"tools": []})
    );
    stream
        .write_all(post("HTTP/1.1", "", &list_body(2)).as_bytes())
        .unwrap();
    let (head, body) = read_response(&mut stream);
    assert!(head.starts_with("http/1.1 502"), "{head}");
    assert!(error_message(&body).contains("'default'"), "{body}");
    2
}

#[test]
fn upstream_interim_responses_are_skipped() {
    interim_responses_case();
}

/// An upstream `101 Switching Protocols` (the gateway never asks for an upgrade) is
/// refused with a 502 JSON-RPC error naming the group, never relayed.
pub(crate) fn upstream_switch_case() -> usize {
    let upstream = ScriptedUpstream::start(|_: &Seen| {
        Answer::raw(
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        )
        .bytes("raw bytes of another protocol")
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let (head, body) = post_once(gw.port, "", &list_body(1));
    assert!(head.starts_with("http/1.1 502"), "{head}\n{body}");
    let message = error_message(&body);
    assert!(
        message.contains("'default'") && message.contains("101"),
        "{message}"
    );
    1
}

#[test]
fn an_upstream_protocol_switch_is_refused() {
    upstream_switch_case();
}

/// Posts `body` on a fresh connection; returns the response's head and body (framed by
/// `Content-Length`).
fn post_once(port: u16, extra: &str, body: &Value) -> (String, String) {
    let mut stream = connect(port);
    stream
        .write_all(post("HTTP/1.1", extra, body).as_bytes())
        .unwrap();
    read_response(&mut stream)
}

/// Sends a legacy POST on `stream` and reads its response: head (lower-cased) and body.
fn ask(stream: &mut TcpStream, body: &Value) -> (String, String) {
    stream
        .write_all(post("HTTP/1.1", "", body).as_bytes())
        .unwrap();
    read_response(stream)
}

/// The JSON-RPC error message of a response body.
fn error_message(body: &str) -> String {
    let value: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    value["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error: {value}"))
        .to_string()
}

fn call_body(id: u64, tool: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": {}}})
}

/// Bug 4: a POST is never sent upstream twice. The upstream reads a `tools/call` on a
/// pooled connection and closes it unanswered, or never answers it: the client gets an
/// error and the call ran once. A DELETE (idempotent) whose pooled connection closed
/// without a response byte is sent again on a fresh one. (A GET goes out on a new
/// connection from the start.)
pub(crate) fn no_duplicate_post_case() -> usize {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if seen.method == "DELETE" && seen.on_connection > 0 {
            return Answer::silent().then_close();
        }
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        let tool = seen.json().map(|b| b["params"]["name"].clone());
        match (seen.method.as_str(), tool.as_ref().and_then(Value::as_str)) {
            ("POST", Some("vanish")) => Answer::silent().then_close(),
            ("POST", Some("stall")) => Answer::silent(),
            ("GET", _) => Answer::sse(&[])
                .event(
                    Some("1"),
                    &json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}),
                )
                .end(),
            _ => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}}),
            ),
        }
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].response_timeout_ms = 500;
    });
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    let in_session = format!("mcp-session-id: {session}\r\n");
    let calls_of = |tool: &str| {
        let named = |s: &Seen| s.json().is_some_and(|b| b["params"]["name"] == tool);
        upstream.requests().iter().filter(|s| named(s)).count()
    };

    let (head, body) = post_once(gw.port, &in_session, &call_body(2, "vanish"));
    assert!(head.starts_with("http/1.1 502"), "{head}");
    assert!(error_message(&body).contains("'default'"), "{body}");
    assert_eq!(calls_of("vanish"), 1, "a POST was sent twice");

    let list = raw.post(Some(&session), &list_body(3));
    assert_eq!(list.status, 200);
    let (head, _) = post_once(gw.port, &in_session, &call_body(4, "stall"));
    assert!(head.starts_with("http/1.1 504"), "{head}");
    assert_eq!(
        calls_of("stall"),
        1,
        "a POST was sent again after a timeout"
    );

    let list = raw.post(Some(&session), &list_body(5));
    assert_eq!(list.status, 200);
    let mut stream = raw.request(
        "GET",
        &[
            ("accept", "text/event-stream"),
            ("mcp-session-id", &session),
        ],
        None,
    );
    assert_eq!(stream.status, 200);
    let (_, event) = stream.next_message().expect("the GET stream's event");
    assert_eq!(event["method"], "notifications/tools/list_changed");

    let list = raw.post(Some(&session), &list_body(6));
    assert_eq!(list.status, 200);
    let delete = raw.request("DELETE", &[("mcp-session-id", &session)], None);
    assert_eq!(delete.status, 200, "the DELETE made again is answered");
    let deletes: Vec<usize> = (upstream.requests().iter())
        .filter(|s| s.method == "DELETE")
        .map(|s| s.on_connection)
        .collect();
    assert_eq!(deletes.len(), 2, "the idempotent DELETE was not sent again");
    assert!(deletes[0] > 0 && deletes[1] == 0, "{deletes:?}");
    4
}

#[test]
fn a_post_is_never_sent_upstream_twice() {
    no_duplicate_post_case();
}

/// A pooled connection idles for less than its upstream keeps it open: a request written
/// as the upstream's idle timer fires meets its close, and a POST that met it is not made
/// again. The upstream says `Keep-Alive: timeout=2` and closes, unanswered, a request that
/// comes on a connection it has left idle for 1.5 s (its timer firing as the request
/// arrives). A request right after the last is still carried on the same connection; a
/// call 1.6 s later goes on a fresh one and is answered.
pub(crate) fn keep_alive_hint_case() -> usize {
    let last_answered = std::sync::Mutex::new(std::collections::HashMap::new());
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let mut last_answered = last_answered.lock().unwrap();
        let idle = last_answered.get(&seen.connection).map(Instant::elapsed);
        if idle.is_some_and(|idle| idle >= Duration::from_millis(1500)) {
            return Answer::silent().then_close();
        }
        last_answered.insert(seen.connection, Instant::now());
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        Answer::json_with(200, &[("keep-alive", "timeout=2")], &result)
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let (head, _) = post_once(gw.port, "", &list_body(1));
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let (head, _) = post_once(gw.port, "", &list_body(2));
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let second = &upstream.requests()[1];
    assert_eq!(
        (second.connection, second.on_connection),
        (0, 1),
        "a connection within its hinted life was not reused"
    );

    // Let the connection idle past what the upstream said it keeps it.
    std::thread::sleep(Duration::from_millis(1600));
    let (head, body) = post_once(gw.port, "", &call_body(3, "work"));
    assert!(head.starts_with("http/1.1 200"), "{head}\n{body}");
    let call = &upstream.requests()[2];
    assert_eq!(
        call.on_connection, 0,
        "the call went on a connection idle past the upstream's keep-alive"
    );
    2
}

#[test]
fn a_pooled_connection_idles_less_than_its_upstream_keeps_it() {
    keep_alive_hint_case();
}

/// A response that says its length both ways (`Content-Length` and chunked
/// `Transfer-Encoding`) is read by the chunks and relayed with one framing, and its
/// connection is closed: the next request, which may be another caller's, goes on a new
/// one (RFC 9112, 6.3: a sign of response splitting).
#[test]
fn a_response_framed_both_ways_does_not_keep_its_connection() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        let body = result.to_string();
        let mut wire = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        wire.extend(chunk(body.as_bytes()));
        wire.extend(b"0\r\n\r\n");
        Answer::raw(wire)
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    for id in [1, 2] {
        let reply = raw.post(None, &list_body(id));
        assert_eq!(reply.status, 200);
        let framings = ["content-length", "transfer-encoding"]
            .map(|name| reply.headers.iter().any(|(n, _)| n == name));
        assert_ne!(
            framings,
            [true, true],
            "relayed with both: {:?}",
            reply.headers
        );
        let relayed = reply.json();
        assert_eq!(relayed["id"], id, "{relayed}");
    }
    let second = &upstream.requests()[1];
    assert_eq!(
        second.on_connection, 0,
        "the connection of a response framed both ways was reused"
    );
}

/// A response whose second `Connection` field says `close` does not keep its connection:
/// the upstream is closing it, and a request written into that close would fail.
#[test]
fn a_close_in_any_connection_field_does_not_keep_the_connection() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        let headers = [("connection", "keep-alive"), ("connection", "close")];
        Answer::json_with(200, &headers, &result)
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    for id in [1, 2] {
        assert_eq!(raw.post(None, &list_body(id)).status, 200);
    }
    let second = &upstream.requests()[1];
    assert_eq!(
        second.on_connection, 0,
        "a connection its upstream said it closes was reused"
    );
}

/// A legacy client's query string (a per-user key in its URL) reaches the upstream after
/// the endpoint's own query, whose parameters it cannot override.
pub(crate) fn client_query_case() -> usize {
    let upstream = sse_lister();
    let endpoint = format!("{}?tenant=a", upstream.url());
    let gw = TestGateway::start(&[&endpoint], &test_keys());
    let raw = Raw::new(&format!("{}?apiKey=k1&tenant=b", gw.url));
    let session = raw.initialize(json!({}));
    assert_eq!(raw.post(Some(&session), &list_body(2)).status, 200);
    let plain = Raw::new(&gw.url);
    assert_eq!(plain.post(Some(&session), &list_body(3)).status, 200);
    let paths: Vec<String> = upstream.requests().iter().map(|s| s.path.clone()).collect();
    assert_eq!(
        paths,
        [
            "/mcp?tenant=a&apiKey=k1",
            "/mcp?tenant=a&apiKey=k1",
            "/mcp?tenant=a&apiKey=k1",
            "/mcp?tenant=a",
        ],
        "initialize, initialized, a list with the key; a list without"
    );
    2
}

#[test]
fn a_legacy_clients_query_reaches_the_upstream() {
    client_query_case();
}

/// A request whose header cannot be parsed (a malformed request line or header line, a
/// target longer than the 65,534 bytes a URI may have) is answered 400 with a JSON-RPC
/// error saying so, and its connection closed; nothing reaches the upstream.
pub(crate) fn unparsable_header_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let long_target = format!(
        "POST /mcp?k={} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 2\r\n\r\n{{}}",
        "a".repeat(70_000)
    );
    let cases = [
        long_target,
        "GARBAGE\r\n\r\n".to_string(),
        "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\nno colon here\r\n\r\n".to_string(),
    ];
    for request in &cases {
        let mut stream = connect(gw.port);
        stream.write_all(request.as_bytes()).unwrap();
        let (answer, closed) = read_to_close(&mut stream);
        let (head, body) = answer
            .split_once("\r\n\r\n")
            .expect("an answer, not a reset");
        assert!(head.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(
            error_message(body).contains("could not be parsed"),
            "{body}"
        );
        assert!(closed, "the connection outlived an unparsable header");
    }
    assert_eq!(
        upstream.count(),
        0,
        "an unparsable request reached the upstream"
    );
    cases.len()
}

#[test]
fn a_request_whose_header_cannot_be_parsed_gets_400() {
    unparsable_header_case();
}

/// Risk: an upstream that aborts its body (a bad chunk size, a reset mid-body, a
/// `Content-Length` body cut short) must not reach the client as a complete body: the
/// client's response ends without its terminal chunk and the connection closes; a JSON
/// body of known length, read whole before it is relayed (its ids unwrapped), is
/// answered 502 with an error instead.
pub(crate) fn upstream_abort_case() -> usize {
    let event =
        json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}});
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let stream = Answer::sse(&[]).event(Some("1"), &event);
        match seen.client_jsonrpc_id().as_u64() {
            Some(1) => stream.bytes("zz\r\nnot a chunk\r\n").then_close(),
            Some(2) => stream.then_reset(),
            _ => Answer::raw("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"jsonrpc\":")
                .then_close(),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    for id in [1, 2] {
        let mut stream = connect(gw.port);
        stream
            .write_all(post("HTTP/1.1", "", &list_body(id)).as_bytes())
            .unwrap();
        let (answer, closed) = read_to_close(&mut stream);
        assert!(
            answer.contains("transfer-encoding: chunked")
                || answer.contains("Transfer-Encoding: chunked"),
            "{answer}"
        );
        assert!(answer.contains("notifications/progress"), "{answer}");
        assert!(
            !answer.ends_with("0\r\n\r\n"),
            "an aborted body ended cleanly: {answer:?}"
        );
        assert!(closed, "the connection outlived an aborted body");
    }
    let mut stream = connect(gw.port);
    stream
        .write_all(post("HTTP/1.1", "", &list_body(3)).as_bytes())
        .unwrap();
    // A JSON body short of its length, none of it relayed yet: the client is told.
    let (head, body) = read_response(&mut stream);
    assert!(head.starts_with("http/1.1 502"), "{head}");
    assert!(error_message(&body).contains("broke off"), "{body}");
    3
}

#[test]
fn an_upstream_abort_reaches_the_client_as_a_truncated_body() {
    upstream_abort_case();
}

/// A client that closes its sending side while its answer streams (a half-close: it may
/// still read) is cut, not sent the terminal chunk: what it got would read as a whole
/// stream, its answer missing.
#[test]
fn a_client_that_half_closes_mid_stream_sees_the_truncation() {
    let gate = Gate::new();
    let held = gate.clone();
    let event =
        json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}});
    let upstream = ScriptedUpstream::start(move |_: &Seen| {
        Answer::sse(&[]).event(Some("1"), &event).wait(&held).end()
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let mut stream = connect(gw.port);
    stream
        .write_all(post("HTTP/1.1", "", &list_body(1)).as_bytes())
        .unwrap();
    let got = read_until(&mut stream, "notifications/progress", READ_LIMIT);
    assert!(got.contains("notifications/progress"), "{got}");
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let (rest, closed) = read_to_close(&mut stream);
    gate.open();
    assert!(closed, "the connection outlived its client's close");
    assert!(
        !rest.ends_with("0\r\n\r\n"),
        "a stream cut short ended cleanly: {rest:?}"
    );
}

/// Risk: `Origin: null` (sandboxed frames, `file://` pages, redirects) is refused on a
/// loopback listener like any other foreign origin, and nothing is forwarded.
pub(crate) fn origin_null_case() -> usize {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start(&[&tripwire.url()], &test_keys());
    let cases = ["null", "file://", "NULL"];
    for origin in cases {
        let (head, body) = post_once(gw.port, &format!("origin: {origin}\r\n"), &list_body(1));
        assert!(head.starts_with("http/1.1 403"), "Origin {origin}: {head}");
        assert!(error_message(&body).contains("Origin"), "{body}");
    }
    assert_eq!(
        tripwire.count(),
        0,
        "a request with a foreign Origin was forwarded"
    );
    cases.len()
}

#[test]
fn origin_null_is_refused_on_a_loopback_listener() {
    origin_null_case();
}

/// Risk: forwarding headers. From an untrusted peer (the default) a client's own
/// `X-Forwarded-For`, `Forwarded`, `X-Forwarded-Proto` and `X-Forwarded-Host` are
/// replaced by the gateway's, and other proxies' claims (`X-Real-IP`, `X-Original-URL`,
/// `X-Forwarded-Ssl`) dropped; from a trusted one (`forwarded.trusted_peers`) they are kept and the peer
/// appended.
pub(crate) fn forwarded_headers_case() -> usize {
    let upstream = sse_lister();
    let spoofed = "x-forwarded-for: 6.6.6.6\r\nforwarded: for=6.6.6.6;proto=https\r\n\
                   x-forwarded-proto: https\r\nx-forwarded-host: evil.example\r\n\
                   x-real-ip: 6.6.6.6\r\nx-original-url: /admin\r\nx-forwarded-ssl: on\r\n";
    let cases: [(bool, [&str; 4]); 2] = [
        (
            false,
            [
                "127.0.0.1",
                "for=127.0.0.1;host=\"127.0.0.1\";proto=http",
                "http",
                "127.0.0.1",
            ],
        ),
        (
            true,
            [
                "6.6.6.6, 127.0.0.1",
                "for=6.6.6.6;proto=https, for=127.0.0.1;host=\"127.0.0.1\";proto=http",
                "https",
                "evil.example",
            ],
        ),
    ];
    for (trusted, expected) in cases {
        let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
            if trusted {
                c.forwarded.trusted_peers = vec!["127.0.0.0/8".into()];
            }
        });
        let before = upstream.count();
        let (head, _) = post_once(gw.port, spoofed, &legacy_initialize("raw"));
        assert!(head.starts_with("http/1.1 200"), "{head}");
        let seen = &upstream.wait_for(before + 1, READ_LIMIT)[before];
        let names = [
            "x-forwarded-for",
            "forwarded",
            "x-forwarded-proto",
            "x-forwarded-host",
        ];
        for (name, value) in names.iter().zip(expected) {
            assert_eq!(
                seen.headers_named(name),
                [value],
                "{name}, trusted: {trusted}"
            );
        }
        let claims = ["x-real-ip", "x-original-url", "x-forwarded-ssl"];
        let claimed = claims.map(|n| seen.headers_named(n).len());
        let expected = if trusted { [1, 1, 1] } else { [0, 0, 0] };
        assert_eq!(claimed, expected, "claims passed on, trusted: {trusted}");
    }
    cases.len()
}

#[test]
fn forwarding_headers_name_the_client_and_trust_only_configured_peers() {
    forwarded_headers_case();
}

/// Risk: idle client connections without a cap. Above `limits.max_client_connections`
/// a connection is answered 503 with a JSON-RPC error and `Connection: close` (not a
/// reset), counted, and a freed slot is served again.
pub(crate) fn connection_cap_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.limits.max_client_connections = 2;
    });
    let gauge = || metric(&gw.admin, "mrtr_gateway_client_connections");
    let idle = [connect(gw.port), connect(gw.port)];
    wait_until("two client connections served", READ_LIMIT, || {
        gauge() == 2.0
    });
    let mut over = connect(gw.port);
    over.write_all(post("HTTP/1.1", "", &legacy_initialize("raw")).as_bytes())
        .unwrap();
    let (answer, closed) = read_to_close(&mut over);
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .expect("an answer, not a reset");
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 503"), "{answer}");
    assert_eq!(header_value(&head, "connection"), Some("close"), "{head}");
    assert!(error_message(body).contains("connections"), "{body}");
    assert!(closed, "the refused connection stayed open");
    let refused = "mrtr_gateway_client_connections_refused_total";
    assert_eq!(metric(&gw.admin, refused), 1.0);
    assert_eq!(
        upstream.count(),
        0,
        "a refused connection's request was forwarded"
    );
    drop(idle);
    wait_until("the idle connections released", READ_LIMIT, || {
        gauge() == 0.0
    });
    let (head, _) = post_once(gw.port, "", &legacy_initialize("raw"));
    assert!(
        head.starts_with("http/1.1 200"),
        "a freed slot is served: {head}"
    );
    2
}

#[test]
fn client_connections_above_the_cap_get_503_and_close() {
    connection_cap_case();
}

/// A kept-alive connection waits for its next request for `limits.client_idle_timeout_ms`
/// (longer than the 60 s a load balancer keeps an idle connection to a backend, so that
/// it closes first), and the header timeout counts from the request's first byte: a
/// request sent after an idle longer than the header timeout is served on the same
/// connection, one whose header stalls is closed after the header timeout, and an idle
/// connection is closed after the idle timeout.
pub(crate) fn client_idle_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.limits.header_timeout_ms = 300;
    });
    let mut stream = connect(gw.port);
    let (head, _) = ask(&mut stream, &legacy_initialize("raw"));
    assert!(head.starts_with("http/1.1 200"), "{head}");
    // Idle for longer than a request's header may take.
    std::thread::sleep(Duration::from_millis(700));
    let (head, _) = ask(&mut stream, &legacy_initialize("raw"));
    assert!(
        head.starts_with("http/1.1 200"),
        "the kept-alive connection closed before the idle timeout: {head}"
    );
    stream.write_all(b"POST /mcp HTTP/1.1\r\nhost: 1").unwrap();
    let (answer, closed) = read_to_close(&mut stream);
    assert!(
        closed,
        "a stalled header outlived the header timeout: {answer}"
    );

    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.limits.client_idle_timeout_ms = 300;
    });
    let mut stream = connect(gw.port);
    let (head, _) = ask(&mut stream, &legacy_initialize("raw"));
    assert_eq!(
        header_value(&head, "connection"),
        Some("keep-alive"),
        "{head}"
    );
    let (answer, closed) = read_to_close(&mut stream);
    assert!(
        closed,
        "an idle connection outlived the idle timeout: {answer}"
    );
    3
}

#[test]
fn a_kept_alive_connection_waits_for_its_next_request_for_the_idle_timeout() {
    client_idle_case();
}

/// A listener near its connection cap (nine tenths) closes kept-alive connections that
/// wait for a next request, so that new clients get their slots (nginx's manner), and
/// answers `Connection: close` while it is crowded.
pub(crate) fn crowded_listener_case() -> usize {
    let upstream = sse_lister();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.limits.max_client_connections = 3;
    });
    let gauge = || metric(&gw.admin, "mrtr_gateway_client_connections");
    let mut kept = connect(gw.port);
    let (head, _) = ask(&mut kept, &legacy_initialize("raw"));
    assert_eq!(
        header_value(&head, "connection"),
        Some("keep-alive"),
        "{head}"
    );
    // The third connection reaches the cap's nine tenths.
    let fresh = [connect(gw.port), connect(gw.port)];
    let (answer, closed) = read_to_close(&mut kept);
    assert!(
        closed,
        "an idle connection kept its slot at the cap: {answer}"
    );
    wait_until("the idle connection's slot given up", READ_LIMIT, || {
        gauge() == 2.0
    });
    let mut newcomer = connect(gw.port);
    let (head, _) = ask(&mut newcomer, &legacy_initialize("raw"));
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(
        header_value(&head, "connection"),
        Some("close"),
        "a crowded listener keeps connections: {head}"
    );
    drop(fresh);
    2
}

#[test]
fn a_crowded_listener_gives_idle_connections_slots_to_new_clients() {
    crowded_listener_case();
}

/// A gateway in front of `big_result_upstream(bytes)`, whose client writes wait at most
/// `write_timeout_ms`.
fn big_result_gateway(bytes: usize, write_timeout_ms: u64) -> (ScriptedUpstream, TestGateway) {
    let upstream = big_result_upstream(bytes);
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
        c.limits.client_write_timeout_ms = write_timeout_ms;
    });
    (upstream, gw)
}

/// A method the upstream does not serve (it answers -32601, as a server without prompts
/// answers `prompts/list`) reaches the 2026-07-28 client as an unknown method does: HTTP
/// 404 with -32601 and the server's message, not a 200.
#[test]
fn a_method_the_upstream_does_not_serve_is_a_404() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        let error = json!({"code": -32601, "message": "Method not found: prompts/list"});
        Answer::json(
            200,
            &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "error": error}),
        )
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
    });
    let reply = Raw::new(&gw.url).modern(1, "prompts/list", json!({}), json!({}));
    let status = reply.status;
    let body = reply.json();
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], -32601, "{body}");
    assert_eq!(body["error"]["message"], "Method not found: prompts/list");
}

/// A legacy server whose every call answers with what `stream` makes of the call's
/// progress token and id; its GET stream is open and empty.
fn streaming_upstream(
    stream: impl Fn(&Value, &Value) -> Answer + Send + Sync + 'static,
) -> ScriptedUpstream {
    ScriptedUpstream::start(move |seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        if seen.method == "GET" {
            return Answer::sse(&[]);
        }
        let body = seen.json().unwrap_or_default();
        stream(&body["params"]["_meta"]["progressToken"], &body["id"])
    })
}

/// A gateway in front of a legacy server whose every call sends one progress
/// notification, then waits at `gate` before its result.
fn gated_progress_gateway(gate: &Gate) -> (ScriptedUpstream, TestGateway) {
    let gate = gate.clone();
    let upstream = streaming_upstream(move |token, id| {
        let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": token, "progress": 1}});
        let done = json!({"jsonrpc": "2.0", "id": id, "result": {"content": []}});
        Answer::sse(&[])
            .event(None, &progress)
            .wait(&gate)
            .event(None, &done)
            .end()
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
    });
    (upstream, gw)
}

/// A 2026-07-28 client that stops reading while its call streams progress loses the call
/// at the write timeout, as it would by closing its response: the round ends and its
/// upstream session is deleted. Its connection is reset and its slot under
/// `max_client_connections` freed, though the client keeps its socket open.
#[test]
fn a_client_that_stops_reading_its_progress_loses_the_call_and_its_connection() {
    let progress = "p".repeat(64 << 10);
    let upstream = streaming_upstream(move |token, _| {
        // About 13 MB of progress, more than loopback's socket buffers take; then the
        // stream stays open.
        (0..200).fold(Answer::sse(&[]), |answer, i| {
            let params = json!({"progressToken": token, "progress": i, "message": progress});
            answer.event(
                None,
                &json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": params}),
            )
        })
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
        c.limits.client_write_timeout_ms = 500;
    });
    let params = json!({"name": "slow", "_meta": {"progressToken": "t"}});
    let request = raw_modern_request(1, "tools/call", params, json!({}), "");
    let mut client = connect(gw.port);
    client.write_all(request.as_bytes()).unwrap();
    // The client reads nothing, and keeps its socket.
    wait_until(
        "the call's session deleted",
        Duration::from_secs(10),
        || upstream.requests().iter().any(|s| s.method == "DELETE"),
    );
    wait_until(
        "the connection's slot freed",
        Duration::from_secs(10),
        || {
            metric(&gw.admin, "mrtr_gateway_client_connections") == 0.0
                && metric(&gw.admin, "mrtr_gateway_active_rounds") == 0.0
        },
    );
    let (_, closed) = read_to_close(&mut client);
    assert!(closed, "the connection stayed open");
}

/// A bridged response that streams (its progress relayed over SSE) counts in
/// `active_client_streams` while it streams, as a relayed one does, and not after.
#[test]
fn a_streaming_bridged_response_counts_as_a_client_stream() {
    let go_on = Gate::new();
    let (_upstream, gw) = gated_progress_gateway(&go_on);
    let streams = || metric(&gw.admin, "mrtr_gateway_active_client_streams");
    let params = json!({"name": "slow", "_meta": {"progressToken": "t"}});
    let request = raw_modern_request(1, "tools/call", params, json!({}), "connection: close\r\n");
    let mut client = connect(gw.port);
    client.write_all(request.as_bytes()).unwrap();
    wait_until("the response streams", Duration::from_secs(10), || {
        streams() == 1.0
    });
    go_on.open();
    let (got, closed) = read_to_close(&mut client);
    assert!(closed && got.contains("notifications/progress"), "{got}");
    wait_until("the stream counted off", Duration::from_secs(10), || {
        streams() == 0.0
    });
}

/// A 2026-07-28 client that closes its sending side while its call streams progress (a
/// half-close: it may still read) is cut, not sent the terminal chunk: its stream must
/// not end like a whole one, its result missing. The call is given up as for a client
/// gone.
#[test]
fn a_bridged_client_that_half_closes_mid_stream_sees_the_truncation() {
    let held = Gate::new();
    let (_upstream, gw) = gated_progress_gateway(&held);
    let params = json!({"name": "slow", "_meta": {"progressToken": "t"}});
    let request = raw_modern_request(1, "tools/call", params, json!({}), "");
    let mut client = connect(gw.port);
    client.write_all(request.as_bytes()).unwrap();
    let got = read_until(&mut client, "notifications/progress", READ_LIMIT);
    assert!(got.contains("notifications/progress"), "{got}");
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let (rest, closed) = read_to_close(&mut client);
    held.open();
    assert!(closed, "the connection outlived its client's close");
    assert!(
        !rest.ends_with("0\r\n\r\n"),
        "a stream cut short ended cleanly: {rest:?}"
    );
}

/// A raw connection that has sent a 2026-07-28 `tools/call` (closing after its answer).
fn modern_call(port: u16) -> TcpStream {
    let params = json!({"name": "big"});
    let request = raw_modern_request(1, "tools/call", params, json!({}), "connection: close\r\n");
    let mut client = connect(port);
    client.write_all(request.as_bytes()).unwrap();
    client
}

/// A client that stops reading its response (its window full) loses it after
/// `limits.client_write_timeout_ms`: the round ends and what it held is freed, rather than
/// a bridged result of many megabytes pinned, and its round counted, for as long as the
/// client keeps the connection.
#[test]
fn a_client_that_stops_reading_its_response_loses_it_after_the_write_timeout() {
    let (upstream, gw) = big_result_gateway(12 << 20, 500);
    let client = modern_call(gw.port);
    wait_until("the call went up", Duration::from_secs(10), || {
        upstream
            .requests()
            .iter()
            .any(|s| s.jsonrpc_method().as_deref() == Some("tools/call"))
    });
    // The client reads nothing, and keeps its connection.
    wait_until("the round freed", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_active_rounds") == 0.0
    });
    // Counted as a client gone, not as an answer delivered.
    let gone = "era=\"modern\",method=\"tools/call\",outcome=\"client_gone\"";
    wait_until("counted as a client gone", Duration::from_secs(10), || {
        metric_with(&gw.admin, "mrtr_gateway_requests_total", gone).unwrap_or(0.0) >= 1.0
    });
    let ok = "era=\"modern\",method=\"tools/call\",outcome=\"ok\"";
    let ok = metric_with(&gw.admin, "mrtr_gateway_requests_total", ok).unwrap_or(0.0);
    assert_eq!(ok, 0.0, "no request counted as answered");
    drop(client);
}

/// A client reading slowly but steadily gets its whole response, however large: the
/// write timeout bounds each write the gateway makes, and a large body goes in pieces,
/// not as one write that a slow reader could not take within the timeout.
#[test]
fn a_client_reading_slowly_but_steadily_gets_a_large_response_whole() {
    let (_upstream, gw) = big_result_gateway(12 << 20, 1500);
    let mut client = modern_call(gw.port);
    // About 3 MB/s: the whole answer takes about four seconds, and the gateway's socket,
    // once full, has room again (half its buffer drained) well within the timeout.
    let (mut got, mut buf) = (Vec::new(), vec![0u8; 64 << 10]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        match client.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("read: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = String::from_utf8_lossy(&got);
    let (_, answer) = text.split_once("\r\n\r\n").expect("a response");
    let answer: Value = serde_json::from_str(answer).expect("the whole JSON answer");
    let content = answer["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(content.len(), 12 << 20);
}

/// A relayed response the client stopped reading is cut at the write timeout, and the
/// connection closed then: the client sees the truncation as soon as it reads again,
/// rather than a silent open connection.
#[test]
fn a_relayed_response_cut_at_the_write_timeout_closes_its_connection() {
    let result = "x".repeat(12 << 20);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let id = seen.json().map(|m| m["id"].clone()).unwrap_or_default();
        let body = json!({"jsonrpc": "2.0", "id": id, "result": {"text": result}});
        Answer::json(200, &body)
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
        c.limits.client_write_timeout_ms = 300;
    });
    let mut client = connect(gw.port);
    let request = post("HTTP/1.1", "", &list_body(1));
    client.write_all(request.as_bytes()).unwrap();
    wait_until("the request went up", Duration::from_secs(10), || {
        !upstream.requests().is_empty()
    });
    // Not reading: the gateway's writes stall and time out.
    wait_until("the write timed out", Duration::from_secs(10), || {
        let gone = "outcome=\"client_gone\"";
        metric_with(&gw.admin, "mrtr_gateway_requests_total", gone).unwrap_or(0.0) >= 1.0
    });
    // The connection is let go while the client still reads nothing: its slot is free.
    wait_until(
        "the connection's slot freed",
        Duration::from_secs(10),
        || metric(&gw.admin, "mrtr_gateway_client_connections") == 0.0,
    );
    let (got, closed) = read_to_close(&mut client);
    assert!(closed, "the connection stayed open after the cut");
    assert!(got.len() < 12 << 20, "the body came whole");
}

/// A client that pipelines requests answered by a header alone (a notification's 202)
/// and reads nothing, its receive buffer small: the answers fill the connection, and the
/// next header's write, which pingora flushes without a bound of its own, waits. It is
/// cut at the write timeout, and the connection's slot freed, while the client still
/// holds its socket open.
#[test]
fn a_client_that_reads_no_answers_to_pipelined_requests_loses_its_connection() {
    let tripwire = Tripwire::start();
    let gw = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
        c.limits.client_write_timeout_ms = 300;
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let client = runtime
        .block_on(async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.set_recv_buffer_size(4096)?;
            socket.connect(([127, 0, 0, 1], gw.port).into()).await
        })
        .and_then(|stream| stream.into_std())
        .expect("connect to the gateway");
    client.set_nonblocking(false).expect("blocking");
    client
        .set_write_timeout(Some(Duration::from_secs(1)))
        .expect("write timeout");
    let notification = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let one = post(
        "HTTP/1.1",
        "mcp-protocol-version: 2026-07-28\r\n",
        &notification,
    );
    let batch = one.repeat(1000);
    let mut client = client;
    // Bounded: at most 200 batches, until the writes stall (the gateway stopped reading).
    for _ in 0..200 {
        if client.write_all(batch.as_bytes()).is_err() {
            break;
        }
    }
    let answered = "outcome=\"ok\"";
    assert!(
        metric_with(&gw.admin, "mrtr_gateway_requests_total", answered).unwrap_or(0.0) > 0.0,
        "the requests were answered"
    );
    wait_until(
        "the connection's slot freed",
        Duration::from_secs(15),
        || metric(&gw.admin, "mrtr_gateway_client_connections") == 0.0,
    );
    assert_eq!(tripwire.count(), 0, "nothing reached an upstream");
    drop(client);
}

/// A legacy client that closes a call's SSE stream once it has read the call's result
/// (the server keeping the stream open a while after it, as the Python SDK's servers
/// do) was answered: the request counts as `ok`, not as a client gone before its answer.
#[test]
fn a_client_leaving_a_stream_after_its_answer_counts_as_answered() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        let body = seen.json().unwrap_or_default();
        match body["method"].as_str() {
            Some("tools/call") => {
                let result = json!({"jsonrpc": "2.0", "id": body["id"],
                    "result": {"content": [{"type": "text", "text": "done"}]}});
                Answer::sse(&[]).event(Some("e1"), &result)
            }
            _ => Answer::status(405, &[], b""),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "x", "arguments": {}}});
    let mut reply = raw.post(Some(&session), &call);
    let (_, result) = reply.next_message().expect("the call's result");
    assert_eq!(result["id"], 7, "{result}");
    drop(reply);
    let counted = |outcome: &str| {
        let labels = format!("era=\"legacy\",method=\"tools/call\",outcome=\"{outcome}\"");
        metric_with(&gw.admin, "mrtr_gateway_requests_total", &labels)
    };
    wait_until("the call counted", Duration::from_secs(10), || {
        counted("ok").is_some() || counted("client_gone").is_some()
    });
    assert_eq!(counted("ok"), Some(1.0));
    assert_eq!(counted("client_gone"), None);
}
