//! What operators rely on: every metric after a real flow, the dashboard built only on
//! exported metrics, SSE keep-alives on idle streams, and a SIGTERM drain that finishes
//! in-flight requests, refuses new connections, hands bridged rounds to another replica
//! and deletes the upstream sessions it opened ahead of demand.

use crate::common::*;
use crate::scripted::{
    holding_script, holding_server, legacy_basics, Answer, FirstRefused, Gate, OneQuestionCalls,
    ScriptedUpstream, Seen,
};
use mrtr_gateway::config::UpstreamEra;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

fn metrics_text(admin: &str) -> String {
    ureq::get(&format!("{admin}/metrics"))
        .call()
        .expect("/metrics")
        .into_string()
        .expect("metrics text")
}

fn value(admin: &str, name: &str, labels: &str) -> f64 {
    metric_with(admin, name, labels).unwrap_or_else(|| panic!("no {name}{{{labels}}}"))
}

#[test]
fn metrics_after_a_flow_and_a_refused_state_hold_every_named_metric() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let first = ask_name(&raw, 1, json!({}));
    let answers = answer(&first, json!({"name": "Ada"}));
    let state = answers["requestState"].as_str().unwrap().to_string();
    let mut tampered = answers.clone();
    let flipped = if &state[40..41] == "A" { "B" } else { "A" };
    tampered["requestState"] = json!(format!("{}{flipped}{}", &state[..40], &state[41..]));
    let refused = ask_name(&raw, 2, tampered);
    assert_eq!(refused["error"]["code"], -32602, "{refused}");
    let done = ask_name(&raw, 3, answers);
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Ada!",
        "{done}"
    );

    let a = gw.admin.as_str();
    let upstream = url.trim_start_matches("http://").trim_end_matches("/mcp");
    let requests = "mrtr_gateway_requests_total";
    for (outcome, n) in [
        ("input_required", 1.0),
        ("state_rejected", 1.0),
        ("ok", 1.0),
    ] {
        let labels = format!("era=\"modern\",method=\"tools/call\",outcome=\"{outcome}\"");
        // A request is counted once its response is written: the client may read first.
        wait_until(&labels, Duration::from_secs(5), || {
            metric_with(a, requests, &labels).is_some()
        });
        assert_eq!(value(a, requests, &labels), n, "{outcome}");
    }
    let input_required = "mrtr_gateway_input_required_total";
    assert_eq!(value(a, input_required, "method=\"tools/call\""), 1.0);
    assert_eq!(value(a, "mrtr_gateway_flow_rounds_count", ""), 1.0);
    assert_eq!(value(a, "mrtr_gateway_upstream_resumable", "default"), 1.0);
    assert_eq!(
        value(a, "mrtr_gateway_flow_rounds_sum", ""),
        2.0,
        "two rounds"
    );
    assert_eq!(
        value(a, "mrtr_gateway_flow_duration_seconds_count", ""),
        1.0
    );
    assert!(value(a, "mrtr_gateway_flow_duration_seconds_sum", "") > 0.0);
    let state_rejections = "mrtr_gateway_request_state_rejections_total";
    assert_eq!(value(a, state_rejections, "reason=\"tampered\""), 1.0);
    assert_eq!(value(a, state_rejections, "reason=\"expired\""), 0.0);
    let token_rejections = "mrtr_gateway_session_token_rejections_total";
    assert_eq!(value(a, token_rejections, "reason=\"principal\""), 0.0);
    let event_id_rejections = "mrtr_gateway_last_event_id_rejections_total";
    assert_eq!(value(a, event_id_rejections, "reason=\"tampered\""), 0.0);
    // Each counter lists the reasons it can count, as the README does: an event id is
    // bound to no request and names no endpoint.
    for (name, never) in [
        (event_id_rejections, "binding"),
        (event_id_rejections, "unknown_endpoint"),
        (token_rejections, "binding"),
        (state_rejections, "unknown_endpoint"),
    ] {
        assert_eq!(
            metric_with(a, name, &format!("reason=\"{never}\"")),
            None,
            "{name} {never}"
        );
    }
    assert_eq!(value(a, state_rejections, "reason=\"other_group\""), 0.0);
    let resumptions = "mrtr_gateway_upstream_resumptions_total";
    assert!(
        value(a, resumptions, "outcome=\"ok\"") >= 1.0,
        "the retry resumed"
    );
    assert_eq!(value(a, resumptions, "outcome=\"failed\""), 0.0);
    let sessions = "mrtr_gateway_upstream_sessions_total";
    // One call of its shape: nothing is opened ahead of demand for it.
    assert_eq!(value(a, "mrtr_gateway_warm_sessions", ""), 0.0);
    for (event, n) in [
        ("opened", 1.0),
        ("warm", 0.0),
        ("reused", 1.0),
        ("deleted", 1.0),
        ("reaped", 0.0),
    ] {
        assert_eq!(
            value(a, sessions, &format!("event=\"{event}\"")),
            n,
            "{event}"
        );
    }
    let latency = "mrtr_gateway_upstream_request_duration_seconds_count";
    let exchanges = value(a, latency, &format!("upstream=\"{upstream}\""));
    assert!(
        exchanges >= 6.0,
        "initialize, initialized, GET, call, answer, resume: {exchanges}"
    );
    wait_until(
        "upstream connections released",
        Duration::from_secs(5),
        || value(a, "mrtr_gateway_upstream_connections", "") == 0.0,
    );
    assert_eq!(value(a, "mrtr_gateway_active_client_streams", ""), 0.0);
    assert_eq!(value(a, "mrtr_gateway_pending_flows", ""), 0.0);
    assert_eq!(value(a, "mrtr_gateway_draining", ""), 0.0);
    assert_eq!(value(a, "mrtr_gateway_keys_loaded", ""), 1.0);
    assert_eq!(value(a, "mrtr_gateway_sse_keepalives_total", ""), 0.0);
    let version = format!("version=\"{}\"", env!("CARGO_PKG_VERSION"));
    assert_eq!(value(a, "mrtr_gateway_build_info", &version), 1.0);
    let text = metrics_text(a);
    assert!(!text.contains(&state), "no state in the metrics");

    // Bodyless legacy requests are labelled with their HTTP method, not as responses.
    let session = raw.initialize(json!({}));
    // Its own client: a stream left unread must not be reused for the DELETE.
    let stream = Raw::new(&gw.url).request(
        "GET",
        &[
            ("accept", "text/event-stream"),
            ("mcp-session-id", session.as_str()),
            ("mcp-protocol-version", "2025-11-25"),
        ],
        None,
    );
    assert_eq!(stream.status, 200);
    drop(stream);
    let deleted = raw.request(
        "DELETE",
        &[
            ("mcp-session-id", session.as_str()),
            ("mcp-protocol-version", "2025-11-25"),
        ],
        None,
    );
    assert_eq!(deleted.status, 200);
    let labelled = |method: &str| {
        let labels = format!("era=\"legacy\",method=\"{method}\"");
        metric_with(a, requests, &labels)
    };
    // A request is counted once its answer is out: the client may read it first.
    wait_until(
        "the GET stream's and the DELETE's requests counted",
        Duration::from_secs(5),
        || labelled("GET").is_some() && labelled("DELETE").is_some(),
    );
    assert_eq!(labelled("DELETE"), Some(1.0));
    assert_eq!(
        labelled("response"),
        None,
        "no bodyless request counted as a response"
    );
}

#[test]
fn the_dashboard_uses_only_metrics_the_gateway_exports() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start(&[&url], &test_keys());
    // Series with labels per request appear with the first request.
    Raw::new(&gw.url).initialize(json!({}));
    let out = Command::new(python())
        .arg(root().join("deploy/dashboard_metrics.py"))
        .arg(root().join("deploy/grafana/mrtr-gateway.json"))
        .output()
        .expect("the dashboard metrics script runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let used = String::from_utf8(out.stdout).unwrap();
    let names: Vec<&str> = used.lines().filter(|l| !l.is_empty()).collect();
    assert!(names.len() >= 10, "the dashboard uses {names:?}");
    let exported = metrics_text(&gw.admin);
    for name in names {
        assert!(
            exported.contains(&format!("# TYPE {name} ")),
            "the dashboard uses {name}, which /metrics does not export"
        );
    }
}

#[test]
fn idle_client_streams_get_keep_alive_comments() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| c.sse_keepalive_ms = 100);
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    // Its own client: a stream left unread must not be reused for the DELETE.
    let mut stream = Raw::new(&gw.url).request(
        "GET",
        &[
            ("accept", "text/event-stream"),
            ("mcp-session-id", &session),
            ("mcp-protocol-version", "2025-11-25"),
        ],
        None,
    );
    assert_eq!(stream.status, 200);
    wait_until(
        "three keep-alives on the idle GET stream",
        Duration::from_secs(10),
        || metric(&gw.admin, "mrtr_gateway_sse_keepalives_total") >= 3.0,
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains(": keep-alive\n\n") {
        let n = stream.read_raw(&mut buf);
        assert!(
            n > 0 && seen.len() < 4096,
            "no keep-alive in {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
}

/// A content-coded SSE stream (gzip from a server's compression middleware, to a client
/// that accepts it: a 2026-07-28 client relayed to a server of that revision, whose
/// messages pass unchanged) is relayed byte for byte: its event boundaries cannot be
/// seen, so no keep-alive comment goes into it, however long the upstream is silent.
#[test]
fn a_content_coded_stream_gets_no_keep_alive_comments() {
    // A gzip stream's bytes, flushed in two pieces; the first ends in two newline bytes,
    // as compressed bytes may.
    let first = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xaa\x56\n\n".to_vec();
    let second = b"\xca\x4c\x51\xb2\x32\xd4\x01\x00\x00\x00\xff\xff".to_vec();
    let coded = [first.clone(), second.clone()].concat();
    let upstream = ScriptedUpstream::start(move |_: &Seen| {
        let silence = Duration::from_millis(350);
        Answer::sse(&[("content-encoding", "gzip")])
            .pause(silence)
            .chunk(&first)
            .pause(silence)
            .chunk(&second)
            .end()
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.sse_keepalive_ms = 100;
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Modern;
    });
    let raw = Raw::new(&gw.url);
    let call = json!({"name": "slow", "arguments": {}});
    let mut reply = raw.modern_with(
        2,
        "tools/call",
        call,
        json!({}),
        &[("accept-encoding", "gzip")],
    );
    assert_eq!(
        upstream.requests()[0].header("accept-encoding"),
        Some("gzip"),
        "the client's codings did not reach the upstream"
    );
    assert_eq!(reply.status, 200);
    let mut relayed = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        let n = reply.read_raw(&mut buf);
        if n == 0 {
            break;
        }
        relayed.extend_from_slice(&buf[..n]);
        assert!(relayed.len() <= 4096, "more than the upstream sent");
    }
    assert_eq!(relayed, coded, "the coded stream was changed");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_sse_keepalives_total"), 0.0);
}

/// An SSE answer framed by `Content-Length` (a 2026-07-28 upstream, relayed) that falls
/// silent gets keep-alive comments like any other stream, so it goes to the client under
/// no length: the comments and every byte of the upstream's events arrive whole, and
/// the result with them (the length used to frame the longer body, cutting the result).
#[test]
fn a_length_framed_stream_that_falls_silent_is_reframed_for_its_keep_alives() {
    let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
        "params": {"progressToken": "p", "progress": 1}});
    let result = json!({"jsonrpc": "2.0", "id": 2, "result": {"resultType": "complete",
        "content": [{"type": "text", "text": "slow and whole"}]}});
    let first = crate::scripted::sse_event(None, &progress.to_string());
    let second = crate::scripted::sse_event(None, &result.to_string());
    let silence = Gate::new();
    let upstream = ScriptedUpstream::start({
        let silence = silence.clone();
        move |_: &Seen| {
            let length = first.len() + second.len();
            Answer::raw(format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {length}\r\n\r\n"
            ))
            .bytes(&first)
            .wait(&silence)
            .bytes(&second)
        }
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.sse_keepalive_ms = 100;
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Modern;
    });
    let raw = Raw::new(&gw.url);
    let call = json!({"name": "slow", "arguments": {}, "_meta": {"progressToken": "p"}});
    let mut reply = raw.modern(2, "tools/call", call, json!({}));
    assert_eq!(reply.status, 200);
    assert!(
        !reply.headers.iter().any(|(n, _)| n == "content-length"),
        "{:?}",
        reply.headers
    );
    wait_until(
        "a keep-alive in the silence",
        Duration::from_secs(10),
        || metric(&gw.admin, "mrtr_gateway_sse_keepalives_total") >= 1.0,
    );
    silence.open();
    let mut messages = Vec::new();
    while let Some((_, m)) = reply.next_message() {
        messages.push(m);
    }
    assert_eq!(messages, [progress, result]);
}

/// A gateway process started from the binary, so that it can get a real SIGTERM.
struct GatewayProcess {
    proc: Proc,
    pid: i32,
    port: u16,
    url: String,
    admin: String,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl GatewayProcess {
    fn start(upstream: &str) -> GatewayProcess {
        Self::start_logging(upstream, None)
    }

    /// Starts the binary; with `json_log`, its JSON log lines (`RUST_LOG=info`) go to
    /// that file.
    fn start_logging(upstream: &str, json_log: Option<&std::path::Path>) -> GatewayProcess {
        Self::start_logging_at(upstream, json_log, "info")
    }

    /// [`GatewayProcess::start_logging`] with `rust_log` as `RUST_LOG`.
    fn start_logging_at(
        upstream: &str,
        json_log: Option<&std::path::Path>,
        rust_log: &str,
    ) -> GatewayProcess {
        Self::start_full(upstream, json_log, rust_log, None, "")
    }

    /// Starts the binary with `extra` appended to its configuration (YAML).
    fn start_with(upstream: &str, extra: &str) -> GatewayProcess {
        Self::start_full(upstream, None, "info", None, extra)
    }

    /// Starts the binary with its keys in `keys_file` (watched), not the environment, and a
    /// grace period of a minute.
    fn start_with_keys_file(upstream: &str, keys_file: &std::path::Path) -> GatewayProcess {
        Self::start_full(upstream, None, "info", Some(keys_file), "")
    }

    fn start_full(
        upstream: &str,
        json_log: Option<&std::path::Path>,
        rust_log: &str,
        keys_file: Option<&std::path::Path>,
        extra: &str,
    ) -> GatewayProcess {
        let (port, admin_port) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("mrtr-drain-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        // A longer grace period where a test watches the drain rather than its end.
        let grace = if keys_file.is_some() { 60 } else { 5 };
        let mut config = format!(
            "listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}\n\
             server: {{threads: 1, grace_period_seconds: {grace}, graceful_shutdown_timeout_seconds: 1}}\n\
             upstreams:\n  - name: default\n    path: /mcp\n    era: legacy\n    \
             health_check_interval_ms: 0\n    endpoints: [\"{upstream}\"]\n"
        );
        if let Some(keys) = keys_file {
            config.push_str(&format!(
                "keys_file: {}\nkeys_poll_ms: 100\n",
                keys.display()
            ));
        }
        config.push_str(extra);
        let file = dir.join("gateway.yaml");
        std::fs::write(&file, config).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_mrtr-gateway"));
        command.args(["run", "--config"]).arg(&file);
        if keys_file.is_none() {
            command.env("MRTR_GATEWAY_KEYS", test_keys());
        }
        if let Some(log) = json_log {
            let file = std::fs::File::create(log).expect("log file");
            command
                .arg("--log-format=json")
                .env("RUST_LOG", rust_log)
                .stderr(file);
        } else if std::env::var_os("MRTR_TEST_GATEWAY_LOG").is_some() {
            command.stderr(Stdio::inherit());
        } else {
            command.stderr(Stdio::null());
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("the gateway binary starts");
        let pid = child.id() as i32;
        let proc = Proc::adopt(child, "gateway");
        wait_until("gateway listener", Duration::from_secs(10), || {
            port_open(port)
        });
        GatewayProcess {
            proc,
            pid,
            port,
            url: format!("http://127.0.0.1:{port}/mcp"),
            admin: format!("http://127.0.0.1:{admin_port}"),
            _dir: TempDir(dir),
        }
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) with a child's pid and a signal number has no memory effects.
        let rc = unsafe { libc::kill(self.pid, signal) };
        assert_eq!(rc, 0, "signal {signal} delivered");
    }

    fn sigterm(&self) {
        self.signal(libc::SIGTERM);
    }

    /// SIGTERM, then waits until the replica says it is draining.
    fn begin_drain(&self) {
        self.sigterm();
        self.wait_for_drain();
    }

    fn wait_for_drain(&self) {
        wait_until("draining", Duration::from_secs(5), || {
            metric(&self.admin, "mrtr_gateway_draining") == 1.0
        });
    }

    fn wait_for_exit(&mut self) {
        wait_until("the drained gateway exits", Duration::from_secs(15), || {
            self.proc.exited()
        });
    }
}

/// A flow held when SIGTERM comes stays held through the grace period (its retry may
/// still come), and is ended before the process exits: its upstream session is deleted
/// rather than left to the server's own idle timeout.
#[test]
fn flows_still_held_when_the_grace_period_ends_have_their_sessions_deleted() {
    let upstream = holding_server();
    let mut gw = GatewayProcess::start(&upstream.url());
    let asked = Raw::new(&gw.url)
        .modern(
            1,
            "tools/call",
            json!({"name": "ask"}),
            json!({"elicitation": {}}),
        )
        .json();
    assert_eq!(asked["result"]["resultType"], "input_required", "{asked}");
    gw.begin_drain();
    let deleted = |u: &ScriptedUpstream| u.requests().iter().any(|s| s.method == "DELETE");
    assert_eq!(
        metric(&gw.admin, "mrtr_gateway_held_flows"),
        1.0,
        "held through the grace"
    );
    assert!(
        !deleted(&upstream),
        "ended at the start of the grace period"
    );
    gw.wait_for_exit();
    assert!(
        deleted(&upstream),
        "the held flow's session was left open upstream"
    );
}

/// A held flow's DELETE at the end of the grace period that the upstream cannot take (it
/// is restarting: a 503) is sent again before the process exits, rather than left for a
/// turn the replica will not see.
#[test]
fn a_delete_that_failed_in_the_grace_periods_last_stretch_is_sent_again_before_exit() {
    let (upstream, _) = FirstRefused::deletes_in_front_of(holding_script);
    let mut gw = GatewayProcess::start(&upstream.url());
    let caps = json!({"elicitation": {}});
    let asked = Raw::new(&gw.url).modern(1, "tools/call", json!({"name": "ask"}), caps);
    assert_eq!(asked.json()["result"]["resultType"], "input_required");
    gw.begin_drain();
    gw.wait_for_exit();
    let methods: Vec<String> = upstream.requests().into_iter().map(|s| s.method).collect();
    let deletes = methods.iter().filter(|m| *m == "DELETE").count();
    assert_eq!(deletes, 2, "refused, then sent again: {methods:?}");
}

/// A replica that forwarded a retry to the replica holding its flow, and is shut down
/// while the owner continues it (the tool works on after its answer), tells its client so
/// near the end of its grace period, rather than close the connection without a word:
/// whether the owner's answer has not begun, or streams already (the owner's keep-alive
/// comments). The owner, its connection gone, ends the call upstream.
#[test]
fn a_forwarding_replica_shutting_down_tells_its_client_and_the_owner_ends_the_call() {
    for keepalive_ms in [15_000, 300] {
        forwarding_replica_shut_down(keepalive_ms);
    }
}

fn forwarding_replica_shut_down(keepalive_ms: u64) {
    let upstream = holding_server();
    let (owner_peer, forwarder_peer) = (free_port(), free_port());
    let peer = |port: u16| format!("127.0.0.1:{port}");
    let owner = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.sse_keepalive_ms = keepalive_ms;
        c.peers.listen = Some(peer(owner_peer));
        c.peers.members = vec![peer(owner_peer), peer(forwarder_peer)];
    });
    let members = format!("[\"{}\", \"{}\"]", peer(owner_peer), peer(forwarder_peer));
    let peers = format!(
        "peers: {{listen: \"{}\", members: {members}}}\n",
        peer(forwarder_peer)
    );
    let mut forwarder = GatewayProcess::start_with(&upstream.url(), &peers);
    let caps = json!({"elicitation": {}});
    let retry = held_ask_retry(&owner, &caps, &[]);
    let url = forwarder.url.clone();
    let retried = std::thread::spawn(move || {
        let mut reply = Raw::new(&url).modern(2, "tools/call", retry, caps);
        match reply.content_type.starts_with("text/event-stream") {
            true => reply.next_message().map(|(_, message)| message),
            false => Some(reply.json()),
        }
    });
    // The owner took the retry and posted its answer: the tool works on.
    wait_until("the answer went up", Duration::from_secs(10), || {
        let requests = upstream.requests();
        requests
            .iter()
            .any(|s| s.json().is_some_and(|m| m.get("result").is_some()))
    });
    forwarder.begin_drain();
    let reply = retried.join().expect("the client got an answer");
    let reply = reply.expect("a message before the stream ended");
    assert_eq!(reply["error"]["code"], -32603, "{reply}");
    assert_eq!(reply["id"], 2, "{reply}");
    let text = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("shutting down while the replica holding"),
        "{reply}"
    );
    assert!(text.contains("check whether it ran"), "{reply}");
    wait_until("the owner ended the call", Duration::from_secs(10), || {
        upstream.requests().iter().any(|s| s.method == "DELETE")
    });
    forwarder.wait_for_exit();
}

/// SIGQUIT drains as SIGTERM does. Pingora's default takes it for a socket handover to a
/// new process (ten seconds of retries on a fixed path in /tmp, ready and accepting
/// meanwhile, and the listening socket sent to whatever listens there), which this
/// binary does not use.
#[test]
fn sigquit_drains_at_once_like_sigterm() {
    let upstream = holding_server();
    let mut gw = GatewayProcess::start(&upstream.url());
    gw.signal(libc::SIGQUIT);
    gw.wait_for_drain();
    wait_until("new connections refused", Duration::from_secs(5), || {
        !port_open(gw.port)
    });
    gw.wait_for_exit();
}

/// Held flows and forwarded retries are served through the grace period, so key changes
/// still apply while it lasts: a key being retired stops opening states when its file says
/// so, not when the process exits.
#[test]
fn the_keys_file_is_still_reloaded_while_draining() {
    let upstream = holding_server();
    let dir = std::env::temp_dir().join(format!("mrtr-keys-drain-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, format!("{}\n", test_keys())).unwrap();
    let gw = GatewayProcess::start_with_keys_file(&upstream.url(), &keys);
    let reloads = |gw: &GatewayProcess| {
        let labels = "file=\"keys\",outcome=\"ok\"";
        metric_with(&gw.admin, "mrtr_gateway_reloads_total", labels).unwrap_or(0.0)
    };
    gw.begin_drain();
    let before = reloads(&gw);
    let second = "k2:AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA";
    std::fs::write(&keys, format!("{second}\n{}\n", test_keys())).unwrap();
    wait_until("the new keys file applied", Duration::from_secs(10), || {
        reloads(&gw) > before
    });
    assert_eq!(metric(&gw.admin, "mrtr_gateway_keys_loaded"), 2.0);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A one-shot request in flight when the drain begins keeps its kept session: the
/// session is deleted near the end of the grace period, not under the request.
#[test]
fn a_kept_session_is_deleted_at_the_end_of_the_grace_period_not_under_a_request() {
    let held = Gate::default();
    let gate = held.clone();
    let lists = AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if seen.jsonrpc_method().as_deref() == Some("tools/list") {
            let tools = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
            let answer = Answer::json(200, &tools);
            return match lists.fetch_add(1, Ordering::SeqCst) {
                0 => answer,
                _ => Answer::silent().wait(&gate).bytes(answer.pieces_bytes()),
            };
        }
        legacy_basics(seen, "s1").unwrap_or_else(|| Answer::status(405, &[], b""))
    });
    let mut gw = GatewayProcess::start(&upstream.url());
    let list = |url: String, id: u64| {
        move || {
            Raw::new(&url)
                .modern(id, "tools/list", json!({}), json!({}))
                .json()
        }
    };
    let first = list(gw.url.clone(), 1)();
    assert!(first["result"]["tools"].is_array(), "{first}");
    let in_flight = std::thread::spawn(list(gw.url.clone(), 2));
    let listed = |u: &ScriptedUpstream| {
        let seen = u.requests();
        seen.iter()
            .filter(|s| s.jsonrpc_method().as_deref() == Some("tools/list"))
            .count()
    };
    wait_until("the second list went up", Duration::from_secs(10), || {
        listed(&upstream) == 2
    });
    gw.begin_drain();
    let deleted = |u: &ScriptedUpstream| u.requests().iter().any(|s| s.method == "DELETE");
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(1) {
        assert!(
            !deleted(&upstream),
            "the kept session was deleted under the request"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    held.open();
    let second = in_flight.join().expect("the second list");
    assert!(second["result"]["tools"].is_array(), "{second}");
    gw.wait_for_exit();
    assert!(
        deleted(&upstream),
        "the kept session was left open upstream"
    );
}

/// A response whose header goes out after the drain began says the connection closes
/// after it: the client sends its next request on a new connection, which another replica
/// takes, not on this one, where it would fail unread.
#[test]
fn a_response_written_while_draining_closes_its_connection() {
    let answered = Gate::default();
    let held = answered.clone();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let answer = legacy_basics(seen, "s1").unwrap_or_else(|| Answer::status(405, &[], b""));
        Answer::silent().wait(&held).bytes(answer.pieces_bytes())
    });
    let mut gw = GatewayProcess::start(&upstream.url());
    let raw = Raw::new(&gw.url);
    let init = legacy_initialize("t");
    let in_flight = std::thread::spawn(move || raw.post(None, &init));
    wait_until("the request went up", Duration::from_secs(10), || {
        !upstream.requests().is_empty()
    });
    gw.begin_drain();
    answered.open();
    let reply = in_flight.join().expect("the in-flight request");
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header_values("connection"),
        ["close"],
        "{:?}",
        reply.headers
    );
    gw.wait_for_exit();
}

/// A round that cannot be handed over (its upstream's stream has no event ids) runs on
/// through the grace period; if it is still running near its end, it ends then, with an
/// error saying why and its upstream session deleted, rather than be cut with the process.
#[test]
fn a_round_still_running_near_the_end_of_the_grace_period_ends_with_its_call() {
    // The call works on, silent, on a stream without event ids.
    ends_with_the_grace_period(Answer::sse(&[]));
}

/// So does a call whose answer has not come (a server that answers in JSON once its tool
/// is done sends nothing before).
#[test]
fn a_call_still_unanswered_near_the_end_of_the_grace_period_ends_with_its_session() {
    ends_with_the_grace_period(Answer::silent());
}

/// Drains a gateway while a call the upstream answers with `call` runs, and checks that
/// the client hears the replica is shutting down and the call's session is deleted.
fn ends_with_the_grace_period(call: Answer) {
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        match seen.method.as_str() {
            "GET" => Answer::sse(&[]),
            _ => call.clone(),
        }
    });
    let mut gw = GatewayProcess::start(&upstream.url());
    let url = gw.url.clone();
    let caller = std::thread::spawn(move || {
        let params = json!({"name": "work", "arguments": {}});
        Raw::new(&url)
            .modern(1, "tools/call", params, json!({}))
            .json()
    });
    let called = |u: &ScriptedUpstream| {
        let seen = u.requests();
        seen.iter()
            .any(|s| s.jsonrpc_method().as_deref() == Some("tools/call"))
    };
    wait_until("the call went up", Duration::from_secs(10), || {
        called(&upstream)
    });
    gw.begin_drain();
    let reply = caller.join().expect("the caller");
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("shutting down"), "{reply}");
    // The client is answered first, then the session deleted.
    wait_until("the call's session deleted", Duration::from_secs(5), || {
        upstream.requests().iter().any(|s| s.method == "DELETE")
    });
    gw.wait_for_exit();
}

/// The `requestState` of a round handed over at a drain: an `InputRequiredResult` that
/// asks nothing.
fn handed_over_state(reply: &Value) -> String {
    let result = &reply["result"];
    assert_eq!(result["resultType"], "input_required", "{reply}");
    assert!(
        result.get("inputRequests").is_none(),
        "nothing was asked: {reply}"
    );
    let state = result["requestState"].as_str();
    state.expect("a requestState").to_string()
}

/// Waits until the gateway has `n` upstream exchanges in progress.
fn wait_for_upstream_exchanges(gw: &GatewayProcess, n: f64) {
    wait_until(
        "the call in flight upstream",
        Duration::from_secs(10),
        || metric(&gw.admin, "mrtr_gateway_upstream_connections") >= n,
    );
}

/// The response to request `id`: the JSON body, or the SSE event that carries it.
fn final_message(mut reply: Reply, id: u64) -> Value {
    if reply.content_type.starts_with("application/json") {
        return reply.json();
    }
    let seen = Raw::messages_until(&mut reply, |m| m["id"] == id);
    seen.last().unwrap().1.clone()
}

#[test]
fn sigterm_finishes_the_request_in_flight_and_refuses_new_connections() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let mut gw = GatewayProcess::start(&url);
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    // The initialization's exchanges may still be finishing: the call is in flight only
    // once the count rises from nothing.
    wait_until("the initialization done", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_upstream_connections") == 0.0
    });
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "slow_echo", "arguments": {"text": "still here", "ms": 2500}}});
    let in_flight = std::thread::spawn(move || final_message(raw.post(Some(&session), &call), 7));
    wait_for_upstream_exchanges(&gw, 1.0);
    gw.sigterm();
    wait_until("new connections refused", Duration::from_secs(5), || {
        !port_open(gw.port)
    });
    // The admin listener stays up through the grace period.
    let status = |path: &str| match ureq::get(&format!("{}{path}", gw.admin)).call() {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(e) => panic!("{path}: {e}"),
    };
    wait_until("/readyz answers 503", Duration::from_secs(5), || {
        status("/readyz") == 503
    });
    assert_eq!(status("/healthz"), 200, "alive while draining");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_draining"), 1.0);
    let answer = in_flight.join().expect("the in-flight request");
    assert_eq!(
        answer["result"]["content"][0]["text"], "echo: still here",
        "{answer}"
    );
    gw.wait_for_exit();
}

#[test]
fn a_round_cut_by_sigterm_is_handed_to_another_replica() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let mut a = GatewayProcess::start(&url);
    let b = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let params = json!({"name": "slow_echo", "arguments": {"text": "moved", "ms": 3000}});
    let (raw_a, call) = (Raw::new(&a.url), params.clone());
    let first = std::thread::spawn(move || {
        let reply = raw_a.modern(1, "tools/call", call, json!({}));
        final_message(reply, 1)
    });
    // The session's GET stream and the call's stream.
    wait_for_upstream_exchanges(&a, 2.0);
    a.sigterm();
    let state = handed_over_state(&first.join().expect("the first round"));
    a.wait_for_exit();
    let mut retry = params;
    retry["requestState"] = json!(state);
    let done = final_message(
        Raw::new(&b.url).modern(2, "tools/call", retry, json!({})),
        2,
    );
    assert_eq!(done["result"]["resultType"], "complete", "{done}");
    assert_eq!(done["result"]["content"][0]["text"], "echo: moved");
}

/// A drain that begins while the call's answer is still awaited is acted on once the
/// round reads: the call's header comes after the drain began, and the round is handed
/// over as soon as its stream shows an event id, not run to its end.
#[test]
fn a_drain_while_the_calls_answer_is_awaited_hands_the_round_over() {
    let drained = Gate::new();
    let header_after_drain = drained.clone();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if seen.method == "GET" {
            return Answer::sse(&[]);
        }
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        // The header only once the test saw the drain begin; a priming event; then
        // nothing until the round's retry would resume it.
        let stream = Answer::sse(&[]).event(Some("c1"), &json!(""));
        Answer::silent()
            .wait(&header_after_drain)
            .bytes(stream.pieces_bytes())
    });
    let mut a = GatewayProcess::start(&upstream.url());
    let params = json!({"name": "slow", "arguments": {}});
    let raw = Raw::new(&a.url);
    let first = std::thread::spawn(move || {
        final_message(raw.modern(1, "tools/call", params, json!({})), 1)
    });
    let is_call = |s: &Seen| s.jsonrpc_method().as_deref() == Some("tools/call");
    wait_until("the call posted", Duration::from_secs(10), || {
        upstream.requests().iter().any(is_call)
    });
    a.begin_drain();
    drained.open();
    handed_over_state(&first.join().expect("the first round"));
    a.wait_for_exit();
}

/// A scripted server whose calls ask one question on their stream, resumptions scoped to
/// their session: one after the question primes (`-c3`), and sends the result once the
/// answer is in; the second call's primes only once `primes` opens. One after `-c3`
/// replays the result.
fn drain_script(primes: Gate) -> ScriptedUpstream {
    let calls = OneQuestionCalls::default();
    let resumptions = AtomicUsize::new(0);
    ScriptedUpstream::start(move |seen: &Seen| {
        let sid = seen.header("mcp-session-id").unwrap_or_default();
        if seen.method != "GET" {
            return calls.post(seen);
        }
        let result = calls.result(sid, "done");
        match seen.header("last-event-id") {
            None => Answer::sse(&[]),
            Some(after) if !after.starts_with(&format!("{sid}-")) => {
                Answer::status(400, &[], b"unknown event id")
            }
            Some(after) if after.ends_with("-c3") => Answer::sse(&[]).event(None, &result).end(),
            Some(_) => {
                let stream = match resumptions.fetch_add(1, Ordering::SeqCst) {
                    0 => Answer::sse(&[]),
                    _ => Answer::sse(&[]).wait(&primes),
                };
                stream
                    .event(Some(&format!("{sid}-c3")), &json!(""))
                    .wait(&calls.answered(sid))
                    .event(None, &result)
                    .end()
            }
        }
    })
}

/// A drain that begins while a retry's resumed stream settles: the retry's answer goes up
/// once the stream is live, and the round is then handed over (the client gets a state
/// to take to another replica, which finishes the call), not run to its end here. The
/// answer goes upstream once.
#[test]
fn a_drain_while_a_retry_settles_posts_its_answers_then_hands_the_round_over() {
    let primes = Gate::new();
    let upstream = drain_script(primes.clone());
    let mut a = GatewayProcess::start(&upstream.url());
    let b = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let call = |raw: &Raw, id: u64, extra: Value| {
        let params = tool_params("ask", extra);
        final_message(
            raw.modern(id, "tools/call", params, json!({"elicitation": {}})),
            id,
        )
    };
    let raw = Raw::new(&a.url);
    // One flow to its end first: the replica learns that the server primes a resumed
    // stream, so the next retry waits for that priming event.
    let first = call(&raw, 1, json!({}));
    let done = call(&raw, 2, answer(&first, json!({"name": "x"})));
    assert_eq!(done["result"]["content"][0]["text"], "done", "{done}");
    let first = call(&raw, 3, json!({}));
    let retry = answer(&first, json!({"name": "y"}));
    let settling = std::thread::spawn({
        let retry = retry.clone();
        move || call(&raw, 4, retry)
    });
    let resumptions = |u: &ScriptedUpstream| {
        u.requests()
            .iter()
            .filter(|s| {
                s.header("last-event-id")
                    .is_some_and(|e| e.ends_with("-c2"))
            })
            .count()
    };
    wait_until(
        "the retry resumed the call's stream",
        Duration::from_secs(10),
        || resumptions(&upstream) == 2,
    );
    a.begin_drain();
    primes.open();
    let state = handed_over_state(&settling.join().expect("the settling round"));
    a.wait_for_exit();
    let moved = json!({"name": "ask", "arguments": {}, "requestState": state});
    let done = final_message(
        Raw::new(&b.url).modern(5, "tools/call", moved, json!({"elicitation": {}})),
        5,
    );
    assert_eq!(done["result"]["resultType"], "complete", "{done}");
    assert_eq!(done["result"]["content"][0]["text"], "done", "{done}");
    let answers = upstream
        .requests()
        .iter()
        .filter(|s| {
            s.json()
                .is_some_and(|m| m.get("method").is_none() && m.get("result").is_some())
        })
        .count();
    assert_eq!(answers, 2, "each flow's answer went upstream once");
}

#[test]
fn json_access_lines_carry_one_flow_id_across_replicas_and_no_secrets() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let dir = TempDir(std::env::temp_dir().join(format!("mrtr-logs-{}", free_port())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let (log_a, log_b) = (dir.0.join("a.log"), dir.0.join("b.log"));
    let a = GatewayProcess::start_logging(&url, Some(&log_a));
    let b = GatewayProcess::start_logging(&url, Some(&log_b));
    let bearer = "Bearer s3cr3t-token-value";
    let ask = |gw: &GatewayProcess, id: u64, extra: Value| {
        let params = tool_params("ask_name", extra);
        let caps = json!({"elicitation": {}});
        let reply = Raw::new(&gw.url).modern_with(
            id,
            "tools/call",
            params,
            caps,
            &[("authorization", bearer)],
        );
        final_message(reply, id)
    };
    let first = ask(&a, 1, json!({}));
    let answers = answer(&first, json!({"name": "Io"}));
    let state = answers["requestState"].as_str().unwrap().to_string();
    let done = ask(&b, 2, answers);
    assert_eq!(done["result"]["content"][0]["text"], "Hello, Io!", "{done}");

    let access_flow = |log: &std::path::Path, outcome: &str| -> String {
        let mut found = None;
        wait_until("the access line", Duration::from_secs(5), || {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            found = text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|l| {
                    l["target"] == "mrtr_gateway::access" && l["fields"]["outcome"] == outcome
                });
            found.is_some()
        });
        let line = found.unwrap();
        assert_eq!(line["fields"]["method"], "tools/call", "{line}");
        line["span"]["flow"]
            .as_str()
            .unwrap_or_else(|| panic!("no flow id: {line}"))
            .to_string()
    };
    let flow_a = access_flow(&log_a, "input_required");
    let flow_b = access_flow(&log_b, "ok");
    assert_eq!(flow_a.len(), 16);
    assert_eq!(flow_a, flow_b, "one flow id on both replicas");
    let logs = std::fs::read_to_string(&log_a).unwrap() + &std::fs::read_to_string(&log_b).unwrap();
    for secret in [&state[..], "s3cr3t-token-value", &test_keys()[6..]] {
        assert!(!logs.contains(secret), "a secret reached the logs");
    }
}

/// `RUST_LOG=trace` logs the gateway's own lines up to DEBUG and other crates' up to INFO:
/// below that, pingora dumps request headers (the client's and a metrics scraper's
/// `Authorization`), every body chunk (states, answers, upstream event ids) and, at DEBUG,
/// the whole buffer of a malformed chunked body with the request pipelined after it. A
/// chunked request, a bearer token, a scrape with credentials and a malformed chunked
/// body leave no such line and no secret, in any escaping.
#[test]
fn the_most_verbose_logs_carry_no_secrets() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let dir = TempDir(std::env::temp_dir().join(format!("mrtr-trace-{}", free_port())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let log = dir.0.join("trace.log");
    let gw = GatewayProcess::start_logging_at(&url, Some(&log), "trace");
    let body = legacy_initialize("trace-test").to_string();
    let chunked = format!(
        "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\nauthorization: Bearer tr4ce-t0ken\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let answer = raw_exchange(gw.port, chunked.as_bytes(), Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let session = answer
        .lines()
        .find_map(|l| l.strip_prefix("mcp-session-id: "))
        .unwrap_or_else(|| panic!("no session: {answer}"))
        .trim()
        .to_string();
    let scrape = ureq::get(&format!("{}/metrics", gw.admin))
        .set("authorization", "Bearer scr4pe-t0ken")
        .call();
    assert!(scrape.is_ok(), "the scrape failed");
    // A body that is not chunked as it says, with a request pipelined after it.
    let malformed = "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n\
         {\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"ping\",\"params\":{\"a\":\"ch0nked-s3cret\"}}\
         POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer p1pelined-t0ken\r\n\
         content-length: 2\r\n\r\n{}";
    let (refused, _stream) = raw_status(gw.port, malformed.as_bytes(), Duration::from_secs(10));
    assert_eq!(
        refused, "HTTP/1.1 400",
        "a malformed chunked body is refused"
    );
    let mut text = String::new();
    wait_until("the requests' access lines", Duration::from_secs(5), || {
        text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("mrtr_gateway::access") && text.contains("initialize")
    });
    let lines: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect();
    assert!(!lines.is_empty(), "JSON lines are logged");
    for line in &lines {
        let (level, target) = (line["level"].as_str(), line["target"].as_str());
        let own = target.is_some_and(|t| t.starts_with("mrtr_gateway"));
        match level {
            Some("TRACE") => panic!("a trace line: {target:?}"),
            Some("DEBUG") => assert!(own, "another crate's debug line: {target:?}"),
            _ => {}
        }
    }
    // Secrets compared on letters and digits only: a line may escape them character by
    // character.
    let squeezed = |s: &str| -> String { s.chars().filter(char::is_ascii_alphanumeric).collect() };
    let logged = squeezed(&text);
    for secret in [
        "tr4ce-t0ken",
        "scr4pe-t0ken",
        "ch0nked-s3cret",
        "p1pelined-t0ken",
        &session[..],
        &test_keys()[6..],
    ] {
        assert!(
            !logged.contains(&squeezed(secret)),
            "a secret reached the logs"
        );
    }
}

#[test]
fn trace_context_reaches_the_upstream_in_headers_and_meta() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let trace = [("traceparent", parent), ("tracestate", "vendor=abc")];
    let seen = |reply: Reply, id: u64| -> Value {
        let message = final_message(reply, id);
        let text = message["result"]["content"][0]["text"].as_str();
        serde_json::from_str(text.unwrap_or_else(|| panic!("{message}"))).unwrap()
    };
    let call = json!({"name": "trace_seen", "arguments": {}});
    let raw = Raw::new(&gw.url);
    let bridged = seen(
        raw.modern_with(1, "tools/call", call.clone(), json!({}), &trace),
        1,
    );
    assert_eq!(bridged["traceparent"], parent, "bridged: header {bridged}");
    assert_eq!(bridged["tracestate"], "vendor=abc", "{bridged}");
    assert_eq!(
        bridged["meta_traceparent"], parent,
        "bridged: _meta {bridged}"
    );
    assert_eq!(bridged["meta_tracestate"], "vendor=abc", "{bridged}");

    let malformed = [("traceparent", "00-not-a-trace-01"), ("tracestate", "x=y")];
    let dropped = seen(
        raw.modern_with(2, "tools/call", call.clone(), json!({}), &malformed),
        2,
    );
    assert_eq!(dropped["traceparent"], Value::Null, "malformed: {dropped}");
    assert_eq!(dropped["meta_traceparent"], Value::Null, "{dropped}");

    let session = raw.initialize(json!({}));
    let body = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call});
    let mut headers = vec![
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-session-id", session.as_str()),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    headers.extend_from_slice(&trace);
    let relayed = seen(raw.request("POST", &headers, Some(&body.to_string())), 3);
    assert_eq!(relayed["traceparent"], parent, "pass-through: {relayed}");
    assert_eq!(relayed["tracestate"], "vendor=abc", "{relayed}");
}

#[test]
fn sessions_opened_ahead_of_demand_are_deleted_at_shutdown() {
    let opened = std::sync::atomic::AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if seen.method == "GET" {
            return Answer::sse(&[]);
        }
        match seen.jsonrpc_method().as_deref() {
            Some("initialize") => {
                let n = opened.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                legacy_basics(seen, &format!("s{n}")).expect("an initialize")
            }
            Some("tools/call") => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                    "content": [{"type": "text", "text": "done"}]}}),
            ),
            _ => legacy_basics(seen, "-").unwrap_or_else(|| Answer::status(405, &[], b"")),
        }
    });
    let mut gw = GatewayProcess::start(&upstream.url());
    let raw = Raw::new(&gw.url);
    // Two calls of one shape: s3 is opened ahead of its next call.
    for id in 1..=2 {
        let params = json!({"name": "work", "arguments": {}});
        let reply = raw.modern(id, "tools/call", params, json!({}));
        assert_eq!(reply.status, 200);
    }
    wait_until("a warm session ready", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_warm_sessions") == 1.0
    });
    gw.sigterm();
    wait_until("the gateway exits", Duration::from_secs(15), || {
        gw.proc.exited()
    });
    let deleted = upstream
        .requests()
        .iter()
        .any(|s| s.method == "DELETE" && s.header("mcp-session-id") == Some("s3"));
    assert!(deleted, "the warm session is deleted at shutdown");
}

/// A session opened ahead of demand whose GET stream the upstream is slow to open (8 s,
/// past a 5 s grace period) when SIGTERM comes is deleted before the process exits, as
/// every session the replica opened is.
#[test]
fn a_warm_session_still_opening_at_sigterm_is_deleted() {
    let sessions = AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        if seen.jsonrpc_method().as_deref() == Some("initialize") {
            let n = sessions.fetch_add(1, Ordering::SeqCst);
            return legacy_basics(seen, &format!("s{n}")).expect("initialize");
        }
        if let Some(answer) = legacy_basics(seen, "unused") {
            return answer;
        }
        if seen.method == "GET" {
            let head = Answer::sse(&[]).pieces_bytes();
            return Answer::silent().pause(Duration::from_secs(8)).bytes(head);
        }
        let id = seen.json().map(|m| m["id"].clone()).unwrap_or_default();
        Answer::json(
            200,
            &json!({"jsonrpc": "2.0", "id": id, "result": {"content": []}}),
        )
    });
    let mut gw = GatewayProcess::start(&upstream.url());
    let raw = Raw::new(&gw.url);
    // The shape recurs: its second call starts a session ahead of the next.
    for id in 1..=2 {
        let done = call_tool(&raw, id, "quick", json!({}));
        assert!(done["result"].is_object(), "{done}");
    }
    let count = |method: &str| {
        let seen = upstream.requests();
        let of = |s: &&Seen| s.method == method || s.jsonrpc_method().as_deref() == Some(method);
        seen.iter().filter(of).count()
    };
    wait_until("the warm-up's initialize", Duration::from_secs(10), || {
        count("initialize") == 3
    });
    gw.begin_drain();
    gw.wait_for_exit();
    assert_eq!(count("DELETE"), 3, "every session opened was deleted");
}

/// A response header the gateway cannot parse is logged as such, without its bytes:
/// pingora's error quotes the raw header it read, with the upstream's `Set-Cookie` and
/// the session id the gateway otherwise seals. Relayed and bridged requests alike.
#[test]
fn an_unparsable_upstream_header_is_logged_without_its_bytes() {
    let upstream = ScriptedUpstream::start(|_: &Seen| {
        Answer::raw(
            "HTTP/1.1 200 OK\r\nset-cookie: upstr3am-c00kie\r\nmcp-session-id: s3ssion-0f-upstr3am\r\n\
             not a header line\r\n\r\n",
        )
        .then_close()
    });
    let dir = TempDir(std::env::temp_dir().join(format!("mrtr-badheader-{}", free_port())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let log = dir.0.join("gateway.log");
    let gw = GatewayProcess::start_logging(&upstream.url(), Some(&log));
    let raw = Raw::new(&gw.url);
    let initialize = legacy_initialize("c");
    assert_eq!(raw.post(None, &initialize).status, 502, "relayed");
    let call = json!({"name": "echo", "arguments": {}});
    let bridged = raw.modern(2, "tools/call", call, json!({}));
    assert!(bridged.status >= 200, "bridged");
    let mut text = String::new();
    wait_until(
        "both requests' access lines",
        Duration::from_secs(5),
        || {
            text = std::fs::read_to_string(&log).unwrap_or_default();
            text.matches("mrtr_gateway::access").count() >= 2
        },
    );
    assert!(upstream.count() >= 2, "both reached the upstream");
    assert!(
        text.contains("broke the exchange"),
        "the failure is logged: {text}"
    );
    let squeezed = |s: &str| -> String { s.chars().filter(char::is_ascii_alphanumeric).collect() };
    for secret in ["upstr3am-c00kie", "s3ssion-0f-upstr3am"] {
        assert!(
            !squeezed(&text).contains(&squeezed(secret)),
            "an upstream header reached the logs: {text}"
        );
    }
}

/// The kept sessions still open at the end of the grace period are deleted together, not
/// one after another: an upstream slow to answer a DELETE does not leave the rest of them
/// open when the process exits.
#[test]
fn kept_sessions_are_deleted_together_at_the_end_of_the_grace_period() {
    let deletes = Gate::default();
    let gate = deletes.clone();
    let sessions = AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        match (seen.method.as_str(), seen.jsonrpc_method().as_deref()) {
            ("DELETE", _) => Answer::silent()
                .wait(&gate)
                .bytes(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            (_, Some("initialize")) => {
                let id = format!("s{}", sessions.fetch_add(1, Ordering::SeqCst));
                legacy_basics(seen, &id).expect("an initialize answer")
            }
            (_, Some("tools/list")) => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}}),
            ),
            _ => legacy_basics(seen, "s").unwrap_or_else(|| Answer::status(405, &[], b"")),
        }
    });
    let mut gw = GatewayProcess::start(&upstream.url());
    // Three callers, three kept sessions.
    for who in ["a", "b", "c"] {
        let credential = format!("Bearer {who}");
        let listed = Raw::new(&gw.url)
            .modern_with(
                1,
                "tools/list",
                json!({}),
                json!({}),
                &[("authorization", &credential)],
            )
            .json();
        assert!(listed["result"]["tools"].is_array(), "{listed}");
    }
    gw.begin_drain();
    gw.wait_for_exit();
    let deleted: Vec<String> = upstream
        .requests()
        .iter()
        .filter(|s| s.method == "DELETE")
        .filter_map(|s| s.header("mcp-session-id").map(str::to_string))
        .collect();
    deletes.open();
    assert_eq!(deleted.len(), 3, "{deleted:?}");
}
