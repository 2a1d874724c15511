//! A scripted upstream: a hostile HTTP/1.1 server on raw sockets whose every answer a
//! test writes itself, byte for byte.
//!
//! `ScriptedUpstream::start(script)` binds 127.0.0.1:0 and serves each connection on its
//! own thread. It reads each request whole (request line, headers, a body framed by
//! `Content-Length` or chunked), records it in a log the test inspects (`requests`,
//! `wait_for`), and writes what `script(&seen)` returns: a [`Answer`]: raw bytes,
//! possibly in pieces with pauses or gates between them, then keep the connection open
//! (read its next request), close it, or reset it (SO_LINGER 0).
//!
//! ```ignore
//! let upstream = ScriptedUpstream::start(|seen: &Seen| {
//!     if let Some(reply) = legacy_basics(seen, "s1") {
//!         return reply; // initialize, notifications, answers, DELETE
//!     }
//!     match seen.jsonrpc_method().as_deref() {
//!         Some("tools/call") => Answer::sse(&[]).event(Some("1"), &progress).chunk(b"zz\r\n").then_close(),
//!         _ => Answer::json(200, &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {}})),
//!     }
//! });
//! let gw = TestGateway::start(&[&upstream.url()], &test_keys());
//! ...
//! let seen = upstream.wait_for(2, Duration::from_secs(5));
//! assert_eq!(seen[1].header("x-forwarded-for"), Some("127.0.0.1"));
//! ```
//!
//! Bounded: a request's header is at most 64 KiB and its body 16 MiB; every read waits
//! at most `IDLE_LIMIT` for the next byte, every gate at most `GATE_LIMIT`; dropping the
//! fixture stops the accept loop and every connection within one read tick.

#![allow(dead_code)]

use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Longest a connection waits for the next byte of a request before it is closed.
pub const IDLE_LIMIT: Duration = Duration::from_secs(30);
/// Longest a reply waits at a gate the test has not opened.
pub const GATE_LIMIT: Duration = Duration::from_secs(30);
const READ_TICK: Duration = Duration::from_millis(50);
const MAX_HEADER: usize = 64 << 10;
const MAX_BODY: usize = 16 << 20;

/// One request the upstream read.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The order of arrival, from 0, across all connections.
    pub index: usize,
    /// Which connection it came on (from 0, in the order they were accepted).
    pub connection: usize,
    /// Its place on that connection (0 for the first request).
    pub on_connection: usize,
    pub method: String,
    pub path: String,
    /// The headers as sent, names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Seen {
    /// The first value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of a header, in order.
    pub fn headers_named(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The body as JSON, if it is.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// The JSON-RPC method of the body, if it names one.
    pub fn jsonrpc_method(&self) -> Option<String> {
        self.json()?.get("method")?.as_str().map(str::to_string)
    }

    /// The JSON-RPC id of the body (`null` when it has none).
    pub fn jsonrpc_id(&self) -> Value {
        self.json()
            .and_then(|v| v.get("id").cloned())
            .unwrap_or(Value::Null)
    }

    /// The JSON-RPC id as the client sent it: the gateway sends a legacy client's ids
    /// wrapped per session (`protocol::request_ids`), and a script that answers by the
    /// client's request tells them apart by this.
    pub fn client_jsonrpc_id(&self) -> Value {
        use base64::Engine;
        let sent = self.jsonrpc_id();
        let wrapped = sent.as_str().and_then(|id| id.strip_prefix("mrtr."));
        let Some((_tag, id)) = wrapped.and_then(|w| w.split_once('.')) else {
            return sent;
        };
        match id.split_once('.') {
            Some(("n", n)) => serde_json::from_str(n).expect("a wrapped integer"),
            Some(("s", encoded)) => {
                let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
                let text = engine
                    .decode(encoded)
                    .expect("a wrapped string's base64url");
                Value::from(String::from_utf8(text).expect("a wrapped string's UTF-8"))
            }
            _ => sent,
        }
    }
}

/// A gate a reply can wait at until the test opens it (bounded by `GATE_LIMIT`).
#[derive(Clone, Default)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub fn new() -> Gate {
        Gate::default()
    }

    pub fn open(&self) {
        let (lock, cv) = &*self.0;
        *lock.lock().expect("gate lock") = true;
        cv.notify_all();
    }

    /// Waits until opened; false when `GATE_LIMIT` passed first.
    fn wait(&self) -> bool {
        let (lock, cv) = &*self.0;
        let guard = lock.lock().expect("gate lock");
        let (open, _) = cv
            .wait_timeout_while(guard, GATE_LIMIT, |open| !*open)
            .expect("gate lock");
        *open
    }
}

/// One step of a reply.
#[derive(Clone)]
pub enum Piece {
    /// Bytes written (and flushed) as they are.
    Bytes(Vec<u8>),
    /// A pause before the next piece.
    Pause(Duration),
    /// Wait until the test opens the gate (or `GATE_LIMIT` passes: the connection closes).
    Wait(Gate),
}

/// What happens to the connection after a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum After {
    /// Read the next request on it (a silent reply then holds it open).
    KeepOpen,
    /// Close it (FIN).
    Close,
    /// Reset it (SO_LINGER 0, then close: RST).
    Reset,
}

/// A scripted answer to one request (`Answer`, not `common::Reply`, the raw client's response).
#[derive(Clone)]
pub struct Answer {
    pub pieces: Vec<Piece>,
    pub then: After,
}

impl Answer {
    /// Nothing at all; the connection stays open (an upstream that never answers).
    pub fn silent() -> Answer {
        Answer {
            pieces: Vec::new(),
            then: After::KeepOpen,
        }
    }

    /// Exactly these bytes.
    pub fn raw(bytes: impl AsRef<[u8]>) -> Answer {
        Answer::silent().bytes(bytes)
    }

    /// A whole response framed by `Content-Length`.
    pub fn status(status: u16, headers: &[(&str, &str)], body: &[u8]) -> Answer {
        let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
        Answer::raw(head).bytes(body)
    }

    /// A JSON response framed by `Content-Length`.
    pub fn json(status: u16, body: &Value) -> Answer {
        Answer::json_with(status, &[], body)
    }

    /// A JSON response with extra headers (e.g. `mcp-session-id`).
    pub fn json_with(status: u16, headers: &[(&str, &str)], body: &Value) -> Answer {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        Answer::status(status, &all, body.to_string().as_bytes())
    }

    /// The head of a chunked `text/event-stream` 200 response, no events yet: add them
    /// with `event`, end it with `end`.
    pub fn sse(headers: &[(&str, &str)]) -> Answer {
        let mut head = String::from(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n",
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        Answer::raw(head)
    }

    /// Appends one SSE event carrying `data` (a JSON value, or text), as one chunk.
    pub fn event(self, id: Option<&str>, data: &Value) -> Answer {
        let text = match data {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        self.chunk(sse_event(id, &text))
    }

    /// Appends `bytes` as one chunk of a chunked body (size line, bytes, CRLF).
    pub fn chunk(self, bytes: impl AsRef<[u8]>) -> Answer {
        self.bytes(chunk(bytes.as_ref()))
    }

    /// Appends the last chunk of a chunked body.
    pub fn end(self) -> Answer {
        self.bytes(b"0\r\n\r\n")
    }

    /// Appends raw bytes.
    pub fn bytes(mut self, bytes: impl AsRef<[u8]>) -> Answer {
        self.pieces.push(Piece::Bytes(bytes.as_ref().to_vec()));
        self
    }

    /// Appends a pause.
    pub fn pause(mut self, period: Duration) -> Answer {
        self.pieces.push(Piece::Pause(period));
        self
    }

    /// Appends a wait for `gate`.
    pub fn wait(mut self, gate: &Gate) -> Answer {
        self.pieces.push(Piece::Wait(gate.clone()));
        self
    }

    /// The answer's bytes, without its pauses and gates (to embed one answer in another).
    pub fn pieces_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in &self.pieces {
            if let Piece::Bytes(bytes) = piece {
                out.extend_from_slice(bytes);
            }
        }
        out
    }

    pub fn then_close(mut self) -> Answer {
        self.then = After::Close;
        self
    }

    pub fn then_reset(mut self) -> Answer {
        self.then = After::Reset;
        self
    }
}

/// One SSE event, LF-terminated.
pub fn sse_event(id: Option<&str>, data: &str) -> String {
    let mut out = String::new();
    if let Some(id) = id {
        out.push_str(&format!("id: {id}\n"));
    }
    for line in data.split('\n') {
        out.push_str(&format!("data: {line}\n"));
    }
    out.push('\n');
    out
}

/// `bytes` framed as one chunk.
pub fn chunk(bytes: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", bytes.len()).into_bytes();
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
    out
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        103 => "Early Hints",
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        404 => "Not Found",
        500 => "Internal Server Error",
        _ => "Status",
    }
}

/// The legacy-session basics most scripts need, or `None` for the rest: `initialize`
/// answered with an InitializeResult and `Mcp-Session-Id: session`, notifications and
/// JSON-RPC responses (answers to server requests) with 202, DELETE with 200.
pub fn legacy_basics(seen: &Seen, session: &str) -> Option<Answer> {
    if seen.method == "DELETE" {
        return Some(Answer::status(200, &[], b""));
    }
    if seen.method != "POST" {
        return None;
    }
    let body = seen.json()?;
    match body.get("method").and_then(Value::as_str) {
        Some("initialize") => {
            let result = serde_json::json!({"jsonrpc": "2.0", "id": body["id"], "result": {
                "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                "serverInfo": {"name": "scripted", "version": "1"}}});
            Some(Answer::json_with(
                200,
                &[("mcp-session-id", session)],
                &result,
            ))
        }
        Some(_) if body.get("id").is_none() => Some(Answer::status(202, &[], b"")),
        None if body.get("result").is_some() || body.get("error").is_some() => {
            Some(Answer::status(202, &[], b""))
        }
        _ => None,
    }
}

/// A legacy server in session `s1` whose `tools/call` asks one question without an event
/// id (so the call cannot be resumed and the gateway holds it), then works on after the
/// answer (202), sending nothing more; its GET stream is empty, other posts get 405.
pub fn holding_server() -> ScriptedUpstream {
    ScriptedUpstream::start(holding_script)
}

/// `holding_server`'s answer to each request.
pub fn holding_script(seen: &Seen) -> Answer {
    if let Some(answer) = legacy_basics(seen, "s1") {
        return answer;
    }
    if seen.method == "GET" {
        return Answer::sse(&[]);
    }
    if seen.json().is_some_and(|m| m.get("result").is_some()) {
        return Answer::status(202, &[], b"");
    }
    if seen.jsonrpc_method().as_deref() != Some("tools/call") {
        return Answer::status(405, &[], b"");
    }
    let question = json!({"jsonrpc": "2.0", "id": 0, "method": "elicitation/create",
        "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}});
    Answer::sse(&[]).event(None, &question)
}

/// Counts a script's requests of one kind (DELETEs, or `notifications/cancelled`) and
/// refuses the first with 503, as an upstream restarting does; the rest go on to the
/// script.
pub struct FirstRefused {
    of_kind: fn(&Seen) -> bool,
    seen: AtomicUsize,
}

impl FirstRefused {
    /// An upstream serving `script` behind a first DELETE refused, and the counter to
    /// assert on.
    pub fn deletes_in_front_of(
        script: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
    ) -> (ScriptedUpstream, Arc<FirstRefused>) {
        Self::in_front_of(|seen| seen.method == "DELETE", script)
    }

    /// An upstream serving `script` behind a first call cancellation refused.
    pub fn cancellations_in_front_of(
        script: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
    ) -> (ScriptedUpstream, Arc<FirstRefused>) {
        Self::in_front_of(is_cancellation, script)
    }

    fn in_front_of(
        of_kind: fn(&Seen) -> bool,
        script: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
    ) -> (ScriptedUpstream, Arc<FirstRefused>) {
        let refused = Arc::new(FirstRefused {
            of_kind,
            seen: AtomicUsize::new(0),
        });
        let counting = refused.clone();
        let upstream = ScriptedUpstream::start(move |seen: &Seen| {
            counting.answer(seen).unwrap_or_else(|| script(seen))
        });
        (upstream, refused)
    }

    /// The 503 for the first request of the kind, `None` for anything else.
    fn answer(&self, seen: &Seen) -> Option<Answer> {
        let first = (self.of_kind)(seen) && self.seen.fetch_add(1, Ordering::SeqCst) == 0;
        first.then(|| Answer::status(503, &[], b"restarting"))
    }

    /// How many requests of the kind came, the refused one included.
    pub fn seen(&self) -> usize {
        self.seen.load(Ordering::SeqCst)
    }

    /// The reaper sent the refused DELETE again, and the upstream took it: the session
    /// was deleted at the second attempt, and no DELETE came after.
    pub fn assert_deleted_at_second_attempt(
        &self,
        gw: &crate::common::TestGateway,
        upstream: &ScriptedUpstream,
    ) {
        crate::common::wait_until(
            "the session deleted at the second attempt",
            Duration::from_secs(30),
            || {
                let name = "mrtr_gateway_upstream_sessions_total";
                crate::common::metric_with(&gw.admin, name, "reaped") == Some(1.0)
            },
        );
        let deletes = self.seen.load(Ordering::SeqCst);
        assert_eq!(deletes, 2, "{:?}", upstream.requests());
    }

    /// Every session the upstream opened got a DELETE, and the refused one a second: the
    /// reaper sent it again (counted `reaped`).
    pub fn assert_every_session_deleted_the_refused_one_again(
        &self,
        gw: &crate::common::TestGateway,
        upstream: &ScriptedUpstream,
    ) {
        crate::common::wait_until(
            "the refused DELETE sent again",
            Duration::from_secs(30),
            || {
                let opened = upstream
                    .requests()
                    .iter()
                    .filter(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
                    .count();
                let name = "mrtr_gateway_upstream_sessions_total";
                let reaped = crate::common::metric_with(&gw.admin, name, "reaped");
                reaped == Some(1.0) && self.seen() == opened + 1
            },
        );
    }

    /// The refused cancellation was sent again, the same, in the same session.
    pub fn assert_cancelled_again_the_same(&self, upstream: &ScriptedUpstream) {
        crate::common::wait_until(
            "the cancellation sent again",
            Duration::from_secs(30),
            || self.seen.load(Ordering::SeqCst) == 2,
        );
        let requests = upstream.requests();
        let sent: Vec<&Seen> = requests.iter().filter(|s| is_cancellation(s)).collect();
        assert_eq!(
            sent[1].json(),
            sent[0].json(),
            "the same cancellation again"
        );
        let session = |s: &Seen| s.header("mcp-session-id").map(str::to_owned);
        assert_eq!(session(sent[1]), session(sent[0]), "in the same session");
    }
}

/// Whether `seen` is a call's cancellation (`notifications/cancelled`).
pub fn is_cancellation(seen: &Seen) -> bool {
    seen.jsonrpc_method().as_deref() == Some("notifications/cancelled")
}

/// A legacy server whose every call answers at once with a `bytes`-long text result.
pub fn big_result_upstream(bytes: usize) -> ScriptedUpstream {
    let result = "x".repeat(bytes);
    ScriptedUpstream::start(move |seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        match seen.method.as_str() {
            "GET" => Answer::status(405, &[], b""),
            _ => {
                let id = seen.json().map(|m| m["id"].clone()).unwrap_or_default();
                let body = json!({"jsonrpc": "2.0", "id": id,
                    "result": {"content": [{"type": "text", "text": result}]}});
                Answer::json(200, &body)
            }
        }
    })
}

/// The POST side of a scripted server whose calls ask one question each: `initialize`
/// opens sessions `s0`, `s1`, …; a `tools/call` is remembered and streams `{session}-c1`
/// (a priming event) and `{session}-c2` (an `elicitation/create`), and stays open; an
/// answer opens its session's `answered` gate (202); the rest as `legacy_basics`, else
/// 405. The script answers GETs (resumptions) itself, with `result` once `answered`.
#[derive(Default)]
pub struct OneQuestionCalls {
    sessions: AtomicUsize,
    answered: Mutex<HashMap<String, Gate>>,
    call_ids: Mutex<HashMap<String, Value>>,
}

impl OneQuestionCalls {
    pub fn post(&self, seen: &Seen) -> Answer {
        let sid = seen.header("mcp-session-id").unwrap_or_default();
        let body = seen.json().unwrap_or_default();
        if body.get("method").is_none() && body.get("result").is_some() {
            self.answered(sid).open();
            return Answer::status(202, &[], b"");
        }
        match body["method"].as_str() {
            Some("initialize") => {
                let n = self.sessions.fetch_add(1, Ordering::SeqCst);
                legacy_basics(seen, &format!("s{n}")).expect("initialize")
            }
            Some("tools/call") => {
                let mut ids = self.call_ids.lock().expect("call ids");
                ids.insert(sid.to_string(), body["id"].clone());
                let question = json!({"jsonrpc": "2.0", "id": 0, "method": "elicitation/create",
                    "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}});
                Answer::sse(&[])
                    .event(Some(&format!("{sid}-c1")), &json!(""))
                    .event(Some(&format!("{sid}-c2")), &question)
            }
            _ => legacy_basics(seen, "unused").unwrap_or_else(|| Answer::status(405, &[], b"")),
        }
    }

    /// Opens once session `sid`'s answer came.
    pub fn answered(&self, sid: &str) -> Gate {
        let mut gates = self.answered.lock().expect("gates");
        gates.entry(sid.to_string()).or_default().clone()
    }

    /// Session `sid`'s call stream resumed: primed (`{sid}-c3`), then, once the answer
    /// came, the result (`text`), and its end.
    pub fn resumed(&self, sid: &str, text: &str) -> Answer {
        Answer::sse(&[])
            .event(Some(&format!("{sid}-c3")), &json!(""))
            .wait(&self.answered(sid))
            .event(None, &self.result(sid, text))
            .end()
    }

    /// Session `sid`'s call result, its content `text`.
    pub fn result(&self, sid: &str, text: &str) -> Value {
        let id = self.call_ids.lock().expect("call ids").get(sid).cloned();
        json!({"jsonrpc": "2.0", "id": id.unwrap_or_default(), "result": {
            "content": [{"type": "text", "text": text}]}})
    }
}

type Script = dyn Fn(&Seen) -> Answer + Send + Sync;

struct Shared {
    script: Box<Script>,
    log: Mutex<Vec<Seen>>,
    connections: AtomicUsize,
    stop: AtomicBool,
}

/// The scripted upstream; stops when dropped.
pub struct ScriptedUpstream {
    pub port: u16,
    shared: Arc<Shared>,
}

impl ScriptedUpstream {
    /// Starts serving on a free loopback port; `script` answers every request.
    pub fn start(script: impl Fn(&Seen) -> Answer + Send + Sync + 'static) -> ScriptedUpstream {
        Self::start_on("127.0.0.1:0", script)
    }

    /// The same at `addr` (a pod's address, as DNS names it).
    pub fn start_on(
        addr: &str,
        script: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
    ) -> ScriptedUpstream {
        let listener = TcpListener::bind(addr).expect("bind the scripted upstream");
        let port = listener.local_addr().expect("local address").port();
        let shared = Arc::new(Shared {
            script: Box::new(script),
            log: Mutex::new(Vec::new()),
            connections: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let accepting = shared.clone();
        std::thread::spawn(move || accept_loop(listener, accepting));
        ScriptedUpstream { port, shared }
    }

    /// The MCP URL to configure as an upstream endpoint.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// Every request read so far, in order of arrival.
    pub fn requests(&self) -> Vec<Seen> {
        self.shared.log.lock().expect("log lock").clone()
    }

    /// How many requests were read so far.
    pub fn count(&self) -> usize {
        self.shared.log.lock().expect("log lock").len()
    }

    /// How many connections were accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Waits (bounded by `limit`) until at least `n` requests were read; returns them all.
    pub fn wait_for(&self, n: usize, limit: Duration) -> Vec<Seen> {
        crate::common::wait_until(&format!("{n} upstream requests"), limit, || {
            self.count() >= n
        });
        self.requests()
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let connection = shared.connections.fetch_add(1, Ordering::SeqCst);
        let serving = shared.clone();
        std::thread::spawn(move || serve(stream, connection, serving));
    }
}

/// Serves one connection: request after request, each answered by the script.
fn serve(mut stream: TcpStream, connection: usize, shared: Arc<Shared>) {
    let _ = stream.set_read_timeout(Some(READ_TICK));
    let _ = stream.set_nodelay(true);
    let mut reader = Reader {
        buf: Vec::new(),
        stop: &shared.stop,
    };
    for on_connection in 0.. {
        let Some(request) = reader.request(&mut stream) else {
            return;
        };
        let seen = {
            let mut log = shared.log.lock().expect("log lock");
            let seen = Seen {
                index: log.len(),
                connection,
                on_connection,
                method: request.method,
                path: request.path,
                headers: request.headers,
                body: request.body,
            };
            log.push(seen.clone());
            seen
        };
        let reply = (shared.script)(&seen);
        if !write_reply(&mut stream, &reply) {
            return;
        }
        match reply.then {
            After::KeepOpen => continue,
            After::Close => return,
            After::Reset => return reset(stream),
        }
    }
}

/// Writes a reply's pieces; false if the connection must end (write failed, gate timed
/// out). Bytes with no pause or gate between them go out in one write, as a server sends
/// what it had queued at once: a loaded machine cannot then split them across the
/// gateway's reads (only a pause or a gate does).
fn write_reply(stream: &mut TcpStream, reply: &Answer) -> bool {
    let mut queued = Vec::new();
    for piece in &reply.pieces {
        let ok = match piece {
            Piece::Bytes(bytes) => {
                queued.extend_from_slice(bytes);
                true
            }
            Piece::Pause(period) => {
                let sent = send(stream, &mut queued);
                if sent {
                    std::thread::sleep(*period);
                }
                sent
            }
            Piece::Wait(gate) => send(stream, &mut queued) && gate.wait(),
        };
        if !ok {
            return false;
        }
    }
    send(stream, &mut queued)
}

/// Writes and clears `queued`, if it holds anything.
fn send(stream: &mut TcpStream, queued: &mut Vec<u8>) -> bool {
    let sent = queued.is_empty()
        || stream
            .write_all(queued)
            .and_then(|_| stream.flush())
            .is_ok();
    queued.clear();
    sent
}

/// Closes with SO_LINGER 0, so the peer gets a reset rather than an orderly close.
fn reset(stream: TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket descriptor and a correctly sized option value.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(stream);
}

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// Reads requests off one connection, keeping bytes read past the end of one for the next.
struct Reader<'a> {
    buf: Vec<u8>,
    stop: &'a AtomicBool,
}

impl Reader<'_> {
    /// The next whole request; `None` when the connection ended, broke, idled past
    /// `IDLE_LIMIT`, sent something that is not HTTP/1.1, or the fixture stopped.
    fn request(&mut self, stream: &mut TcpStream) -> Option<Request> {
        let head_end = loop {
            if let Some(at) = find(&self.buf, b"\r\n\r\n") {
                break at;
            }
            if self.buf.len() > MAX_HEADER {
                return None;
            }
            self.fill(stream)?;
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        self.buf.drain(..head_end + 4);
        let mut lines = head.split("\r\n");
        let mut start = lines.next()?.split(' ');
        let (method, path) = (start.next()?.to_string(), start.next()?.to_string());
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let value = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v);
        let chunked = value("transfer-encoding").is_some_and(|v| v.contains("chunked"));
        let body = if chunked {
            self.chunked_body(stream)?
        } else {
            let length = value("content-length").map_or(Some(0), |v| v.parse().ok())?;
            self.exactly(stream, length)?
        };
        Some(Request {
            method,
            path,
            headers,
            body,
        })
    }

    fn chunked_body(&mut self, stream: &mut TcpStream) -> Option<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let line = self.line(stream)?;
            let size_text = line.split(';').next()?.trim();
            let size = usize::from_str_radix(size_text, 16).ok()?;
            if size == 0 {
                // Trailers, up to the empty line.
                while !self.line(stream)?.is_empty() {}
                return Some(body);
            }
            if body.len() + size > MAX_BODY {
                return None;
            }
            body.extend(self.exactly(stream, size)?);
            if !self.line(stream)?.is_empty() {
                return None;
            }
        }
    }

    fn line(&mut self, stream: &mut TcpStream) -> Option<String> {
        loop {
            if let Some(at) = find(&self.buf, b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..at]).into_owned();
                self.buf.drain(..at + 2);
                return Some(line);
            }
            if self.buf.len() > MAX_HEADER {
                return None;
            }
            self.fill(stream)?;
        }
    }

    fn exactly(&mut self, stream: &mut TcpStream, n: usize) -> Option<Vec<u8>> {
        if n > MAX_BODY {
            return None;
        }
        while self.buf.len() < n {
            self.fill(stream)?;
        }
        Some(self.buf.drain(..n).collect())
    }

    /// Reads more bytes, waiting at most `IDLE_LIMIT` in ticks that watch the stop flag.
    fn fill(&mut self, stream: &mut TcpStream) -> Option<()> {
        let deadline = Instant::now() + IDLE_LIMIT;
        let mut chunk = [0u8; 16 << 10];
        while Instant::now() < deadline && !self.stop.load(Ordering::SeqCst) {
            match stream.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Some(());
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return None,
            }
        }
        None
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Waits until `upstream` (legacy session `s1`) got a `notifications/cancelled`, and
/// checks it names the call's upstream id, in its session, which is not deleted (a
/// data-layer session outlives its calls); and that `admin` counted it under `why`.
pub fn assert_call_cancelled_in_its_session(upstream: &ScriptedUpstream, admin: &str, why: &str) {
    use crate::common::{metric_with, wait_until};
    wait_until("the call cancelled", Duration::from_secs(15), || {
        upstream.requests().iter().any(is_cancellation)
    });
    let requests = upstream.requests();
    let call = requests
        .iter()
        .find(|s| s.jsonrpc_method().as_deref() == Some("tools/call"))
        .expect("the call went up");
    let cancel = requests.iter().find(|s| is_cancellation(s)).unwrap();
    assert_eq!(
        cancel.json().unwrap()["params"]["requestId"],
        call.jsonrpc_id()
    );
    assert_eq!(cancel.header("mcp-session-id"), Some("s1"));
    assert!(
        !requests.iter().any(|s| s.method == "DELETE"),
        "the session outlives the call"
    );
    let cancelled = "mrtr_gateway_upstream_calls_cancelled_total";
    wait_until("the cancellation counted", Duration::from_secs(5), || {
        metric_with(admin, cancelled, &format!("why=\"{why}\"")) == Some(1.0)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_some(stream: &mut TcpStream, want: &str) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(5);
        while !String::from_utf8_lossy(&got).contains(want) && Instant::now() < deadline {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    #[test]
    fn the_scripted_upstream_records_requests_and_follows_its_script() {
        let upstream = ScriptedUpstream::start(|seen: &Seen| match seen.on_connection {
            0 => Answer::json(200, &serde_json::json!({"n": seen.index})),
            _ => Answer::sse(&[("x-extra", "1")])
                .event(Some("e1"), &Value::String("hi".into()))
                .end()
                .then_reset(),
        });
        let mut stream = TcpStream::connect(("127.0.0.1", upstream.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let first = "POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}";
        let second = "POST /mcp HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        stream.write_all(first.as_bytes()).unwrap();
        assert!(read_some(&mut stream, "{\"n\":0}").ends_with("{\"n\":0}"));
        stream.write_all(second.as_bytes()).unwrap();
        let sse = read_some(&mut stream, "0\r\n\r\n");
        assert!(sse.contains("x-extra: 1\r\n"), "{sse}");
        assert!(sse.contains("id: e1\ndata: hi\n\n"), "{sse}");
        let seen = upstream.wait_for(2, Duration::from_secs(5));
        assert_eq!(
            (seen[0].method.as_str(), seen[0].body.as_slice()),
            ("POST", &b"{}"[..])
        );
        assert_eq!(seen[1].body, b"abc");
        assert_eq!(seen[1].header("HOST"), Some("x"));
        assert_eq!((seen[1].connection, seen[1].on_connection), (0, 1));
        let mut buf = [0u8; 16];
        let after = stream.read(&mut buf);
        assert!(
            matches!(&after, Err(e) if e.kind() == ErrorKind::ConnectionReset),
            "reset expected, got {after:?}"
        );
    }
}
