//! The processes under test: the demo backend, the gateway and nginx, each on a free
//! loopback port, killed on drop; and what /proc says about a process's footprint.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

pub const GATEWAY: &str = env!("CARGO_BIN_EXE_mrtr-gateway");

/// Another build's gateway to measure, `MRTR_BENCH_GATEWAY`, for a before-and-after run of
/// the same harness (the demo backend stays this build's).
pub fn gateway_override() -> Option<PathBuf> {
    std::env::var_os("MRTR_BENCH_GATEWAY").map(PathBuf::from)
}

/// The gateway binary measured: the override, or this build's.
fn gateway_binary() -> PathBuf {
    gateway_override().unwrap_or_else(|| PathBuf::from(GATEWAY))
}

pub struct Proc {
    pub name: &'static str,
    pub addr: String,
    child: Child,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    /// nginx is asked to stop (SIGTERM), so that its master stops its worker too; the
    /// others are single processes and are killed.
    fn drop(&mut self) {
        if self.name == "nginx" {
            let pid = self.child.id().to_string();
            let stopped = Command::new("kill").args(["-TERM", &pid]).status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while stopped.is_ok() && Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where each side runs. With two or more CPUs the proxy under test gets CPU 1 to
/// itself, and the backend and the load generator share CPU 0, so every proxy is measured
/// on exactly one core and the runs do not fight over the scheduler.
#[derive(Clone, Copy)]
pub enum Side {
    Proxy,
    Backend,
}

fn pinned() -> bool {
    std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
}

fn cpu(side: Side) -> &'static str {
    match side {
        Side::Proxy => "1",
        Side::Backend => "0",
    }
}

/// A command for `program`, pinned to its side's CPU when pinning applies.
fn command(side: Side, program: impl AsRef<std::ffi::OsStr>) -> Command {
    if !pinned() {
        return Command::new(program);
    }
    let mut command = Command::new("taskset");
    command.args(["-c", cpu(side)]).arg(program);
    command
}

/// Pins the calling thread (the load generator) to the backend's CPU.
pub fn pin_load_generator() {
    if !pinned() {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity
    // only read and write that set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// A loopback address nothing listens on, never handed out twice in this process. Ports
/// come from a counter below the kernel's ephemeral range (32768 and up): `bind(":0")`
/// then release could hand the same port out twice (a gateway's listener and its admin
/// listener), or to an outgoing connection before the server binds it.
fn free_addr() -> String {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    const FIRST: u16 = 10_000;
    const SPAN: u16 = 10_000;
    // Processes started one after another begin at different places.
    let offset = (std::process::id() % 50) as u16 * 200;
    for _ in 0..SPAN {
        let port = FIRST + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return format!("127.0.0.1:{port}");
        }
    }
    panic!("no free loopback port in {FIRST}..{}", FIRST + SPAN)
}

fn start(name: &'static str, addr: String, command: &mut Command) -> Proc {
    start_with(name, addr, command, Stdio::inherit())
}

/// `start`, with the process's standard error going to `stderr`.
fn start_with(name: &'static str, addr: String, command: &mut Command, stderr: Stdio) -> Proc {
    let child = command
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("start {name}: {e}"));
    let proc = Proc { name, addr, child };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&proc.addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "{name} did not listen on {}",
            proc.addr
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    proc
}

/// The embedded legacy demo server, alone, on one thread.
/// Sessions the demo backend holds at once: room for every parked flow of the scale
/// section (its sessions are a hash map, so the bound costs nothing until used).
const BACKEND_SESSIONS: usize = 4_000_000;
/// How long the demo backend's tools wait for an answer, in seconds: longer than the
/// scale section parks its first flow (about eleven minutes for a million).
const BACKEND_ANSWER_TIMEOUT_SECONDS: u64 = 7200;

pub fn backend() -> Proc {
    let addr = free_addr();
    start(
        "backend",
        addr.clone(),
        command(Side::Backend, GATEWAY)
            .args(["demo-server", "--threads", "1", "--listen", &addr])
            .args(["--max-sessions", &BACKEND_SESSIONS.to_string()])
            .args([
                "--answer-timeout-seconds",
                &BACKEND_ANSWER_TIMEOUT_SECONDS.to_string(),
            ])
            .env("RUST_LOG", "warn"),
    )
}

/// The Python SDK legacy fixture (`mcp` 2.3.0, with the SDK-style shared event store),
/// or `None` when `tests/setup.sh` has not installed its venv.
pub fn python_backend() -> Option<Proc> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("tests/.venv/bin/python");
    if !python.exists() {
        return None;
    }
    let addr = free_addr();
    let port = addr.rsplit(':').next().expect("host:port").to_string();
    // The SDK logs every session it opens; the report is what matters here.
    Some(start_with(
        "Python",
        addr,
        command(Side::Backend, python)
            .arg(root.join("tests/fixtures/py_legacy_server.py"))
            .arg(port),
        Stdio::null(),
    ))
}

/// Gateway options the harness varies.
#[derive(Clone, Copy)]
pub struct GatewayOptions {
    pub threads: usize,
    pub quiet_window_ms: u64,
    /// `resume: hold`: flows wait with their upstream streams held, not resumable.
    pub hold: bool,
    /// `bridge.max_watched_sessions`: how many flows may be parked at once.
    pub max_watched_sessions: usize,
    /// `bridge.request_state_ttl_seconds`: how long a parked flow may wait.
    pub request_state_ttl_seconds: u64,
    /// `bridge.warm_sessions_per_shape`: upstream sessions opened ahead of demand (0: none).
    pub warm_sessions_per_shape: usize,
}

/// The gateway in front of `backend`, its config written to `dir`, with a key of its own.
pub fn gateway(dir: &Path, backend: &Proc, options: GatewayOptions) -> (Proc, String) {
    let keys = mrtr_gateway::keys::generate_entry("bench").expect("a valid key id");
    replica(dir, backend, options, &keys)
}

/// A gateway in front of `backend` sealing with `keys` (`MRTR_GATEWAY_KEYS`): replicas
/// given the same keys take each other's retries.
pub fn replica(dir: &Path, backend: &Proc, options: GatewayOptions, keys: &str) -> (Proc, String) {
    let (addr, admin) = (free_addr(), free_addr());
    let config = format!(
        "listen: {addr}\nadmin_listen: {admin}\nserver:\n  threads: {}\nbridge:\n  quiet_window_ms: {}\n  max_used_states: 1000000\n  max_watched_sessions: {}\n  request_state_ttl_seconds: {}\n  warm_sessions_per_shape: {}\nupstreams:\n  - name: demo\n    path: /mcp\n    endpoints: [http://{}/mcp]\n    health_check_interval_ms: 0\n    resume: {}\n",
        options.threads,
        options.quiet_window_ms,
        options.max_watched_sessions,
        options.request_state_ttl_seconds,
        options.warm_sessions_per_shape,
        backend.addr,
        if options.hold { "hold" } else { "auto" }
    );
    let path = dir.join(format!("gateway-{}.yaml", addr.replace([':', '.'], "-")));
    std::fs::write(&path, config).expect("write the gateway config");
    let proc = start(
        "gateway",
        addr,
        command(Side::Proxy, gateway_binary())
            .args(["run", "--config"])
            .arg(&path)
            .env("MRTR_GATEWAY_KEYS", keys)
            .env("RUST_LOG", "warn"),
    );
    (proc, admin)
}

pub fn nginx_binary() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// nginx as a reverse proxy for `backend`: one worker, upstream keepalive, no buffering
/// (so SSE streams through), no access log.
pub fn nginx(dir: &Path, backend: &Proc) -> Proc {
    let binary = nginx_binary().expect("nginx is installed (tests/setup.sh installs nginx-light)");
    let addr = free_addr();
    let prefix = dir.join(format!("nginx-{}", addr.replace([':', '.'], "-")));
    std::fs::create_dir_all(prefix.join("logs")).expect("nginx prefix");
    let config = format!(
        "worker_processes 1;\ndaemon off;\npid {p}/nginx.pid;\nerror_log {p}/logs/error.log warn;\nevents {{ worker_connections 16384; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n  upstream backend {{ server {backend}; keepalive 64; }}\n  server {{\n    listen {addr};\n    location / {{\n      proxy_pass http://backend;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n      proxy_read_timeout 600s;\n    }}\n  }}\n}}\n",
        p = prefix.display(),
        backend = backend.addr,
    );
    let path = prefix.join("nginx.conf");
    std::fs::write(&path, config).expect("write the nginx config");
    start(
        "nginx",
        addr,
        command(Side::Proxy, binary)
            .arg("-p")
            .arg(&prefix)
            .arg("-c")
            .arg(&path),
    )
}

/// A process's resident memory, open descriptors and sockets, from /proc.
#[derive(Clone, Copy, Debug)]
pub struct Footprint {
    pub rss_kib: u64,
    pub fds: usize,
    pub sockets: usize,
}

/// How long RSS must stay within `SETTLED_KIB` to count as settled, how often it is read,
/// and the longest wait.
const SETTLE_FOR: Duration = Duration::from_millis(1500);
const SETTLE_POLL: Duration = Duration::from_millis(250);
const SETTLE_LIMIT: Duration = Duration::from_secs(15);
const SETTLED_KIB: u64 = 64;

/// The footprint once RSS has settled: pages that finished requests freed go back to the
/// system a moment later (the gateway's jemalloc purges within about a second), and RSS
/// read at once would count them as held. Waits until RSS stays within 64 KiB for 1.5 s,
/// at most 15 s.
pub async fn settled_footprint(pid: u32) -> Footprint {
    let deadline = Instant::now() + SETTLE_LIMIT;
    let mut last = footprint(pid);
    let mut steady_since = Instant::now();
    while Instant::now() < deadline && steady_since.elapsed() < SETTLE_FOR {
        tokio::time::sleep(SETTLE_POLL).await;
        let now = footprint(pid);
        if now.rss_kib.abs_diff(last.rss_kib) > SETTLED_KIB {
            steady_since = Instant::now();
        }
        last = now;
    }
    last
}

/// CPU time (user and system, all threads) `pid` has used so far, in seconds: fields 14
/// and 15 of `/proc/PID/stat`, in the kernel's fixed user-space tick of 1/100 s.
pub fn cpu_seconds(pid: u32) -> f64 {
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces; the fields after it are plain numbers.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: f64 = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|t| t.parse::<f64>().ok())
        .sum();
    ticks / TICKS_PER_SECOND
}

pub fn footprint(pid: u32) -> Footprint {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let links: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .collect()
        })
        .unwrap_or_default();
    let sockets = links
        .iter()
        .filter(|l| l.to_string_lossy().starts_with("socket:"))
        .count();
    Footprint {
        rss_kib,
        fds: links.len(),
        sockets,
    }
}
