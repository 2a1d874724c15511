//! Latency over a wide-area link: the client behind a delay proxy on loopback (each byte
//! held `RTT / 2` in each direction), the gateway next to the server. Three one-question
//! flows, interleaved, timed whole from the client:
//!
//! - the full legacy flow: initialize, `notifications/initialized`, the call's stream,
//!   the answer POST, DELETE;
//! - a legacy client that keeps its session: per flow, the call's stream and the answer;
//! - a 2026-07-28 client through the gateway (default settings): two requests;
//! - the same through a gateway with `resume: hold`, which keeps the round's upstream
//!   streams for the retry instead of reopening them (what a retry reaching the replica
//!   that ran its round could save).
//!
//! Against the demo backend (`interview`, one question) and, when installed, the Python
//! SDK server (`ask_name`). Reported as medians and p90s with the bridged flow's ratio to
//! each legacy flow, and where the time goes: the kept session's flow and the bridged
//! flow each split where the client has the question.

use crate::client::Conn;
use crate::mcp::{self, Interview, LegacyCall};
use crate::procs::GatewayOptions;
use crate::procs::{self, Proc};
use crate::report::{Report, Times};
use crate::{stall, Scale, DEFAULT_GATEWAY};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A TCP proxy on loopback that delays every byte by `one_way` in each direction.
pub struct DelayProxy {
    pub addr: String,
    accept: JoinHandle<()>,
}

impl DelayProxy {
    pub async fn start(target: &str, one_way: Duration) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let addr = listener.local_addr().expect("bound").to_string();
        let target = target.to_string();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        delayed(client_read, server_write, one_way),
                        delayed(server_read, client_write, one_way)
                    );
                });
            }
        });
        DelayProxy { addr, accept }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read; the write side is
/// shut once `from` ends and everything read has gone out.
async fn delayed(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if chunks
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                return;
            }
        }
    };
    let writer = async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at.into()).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// The tool a backend's flows call, and how they are checked.
#[derive(Clone, Copy)]
enum Tool {
    /// The demo's `interview`, one question.
    Interview,
    /// The Python fixture's `ask_name`.
    AskName,
}

const ONE_QUESTION: Interview = Interview {
    rounds: 1,
    questions: 1,
};

impl Tool {
    fn legacy_call(self, expected: &str) -> LegacyCall<'_> {
        let (tool, arguments) = match self {
            Tool::Interview => ("interview", ONE_QUESTION.arguments()),
            Tool::AskName => ("ask_name", json!({})),
        };
        LegacyCall {
            tool,
            arguments,
            expected,
        }
    }

    fn expected(self, tag: &str) -> String {
        match self {
            Tool::Interview => ONE_QUESTION.expected(tag),
            Tool::AskName => format!("Hello, {tag}!"),
        }
    }

    fn answer(self, tag: &str, question: &Value) -> Value {
        match self {
            Tool::Interview => mcp::accept(tag, question),
            Tool::AskName => stall::accept_name(tag),
        }
    }

    /// One bridged flow; returns when the client had the question.
    async fn bridged(self, conn: &mut Conn, tag: &str) -> Result<Instant, String> {
        match self {
            Tool::Interview => mcp::modern_flow(conn, ONE_QUESTION, tag).await,
            Tool::AskName => stall::flow(conn, tag).await,
        }
    }
}

pub async fn measure(scale: &Scale, dir: &Path, report: &mut Report) {
    let flows = if scale.full { 40 } else { 3 };
    let rtts: &[u64] = if scale.full { &[0, 10, 40] } else { &[0, 10] };
    let backend = procs::backend();
    let name = "demo backend (`interview`, one question)";
    backend_run(name, dir, &backend, Tool::Interview, flows, rtts, report).await;
    drop(backend);
    match procs::python_backend() {
        Some(python) => {
            let name = "Python SDK server (`ask_name`)";
            backend_run(name, dir, &python, Tool::AskName, flows, rtts, report).await;
        }
        None => report.skipped(
            "WAN latency, Python SDK server",
            "the Python fixture is not installed (bash tests/setup.sh)",
        ),
    }
}

/// The gateways a backend's bridged flows go through: default settings, and hold mode.
struct Gateways {
    default: Proc,
    hold: Proc,
}

async fn backend_run(
    name: &str,
    dir: &Path,
    backend: &Proc,
    tool: Tool,
    flows: usize,
    rtts: &[u64],
    report: &mut Report,
) {
    let hold = GatewayOptions {
        hold: true,
        ..DEFAULT_GATEWAY
    };
    let gateways = Gateways {
        default: procs::gateway(dir, backend, DEFAULT_GATEWAY).0,
        hold: procs::gateway(dir, backend, hold).0,
    };
    let mut all = Vec::new();
    for &rtt_ms in rtts {
        match at_rtt(backend, &gateways, tool, flows, rtt_ms).await {
            Ok(times) => all.push(times),
            Err(e) => return report.failed(&format!("WAN latency, {name}, RTT {rtt_ms} ms"), &e),
        }
    }
    report.wan(name, &all);
}

async fn at_rtt(
    backend: &Proc,
    gateways: &Gateways,
    tool: Tool,
    flows: usize,
    rtt_ms: u64,
) -> Result<Times, String> {
    let one_way = Duration::from_millis(rtt_ms) / 2;
    // RTT 0: no proxy at all.
    let via = |addr: &str| {
        let addr = addr.to_string();
        async move {
            if rtt_ms == 0 {
                return (addr, None);
            }
            let proxy = DelayProxy::start(&addr, one_way).await;
            (proxy.addr.clone(), Some(proxy))
        }
    };
    let (to_backend, p1) = via(&backend.addr).await;
    let (to_gateway, p2) = via(&gateways.default.addr).await;
    let (to_hold, p3) = via(&gateways.hold.addr).await;
    let _proxies = (p1, p2, p3);
    let (mut stream, mut side) = (Conn::new(&to_backend), Conn::new(&to_backend));
    let mut modern = Conn::new(&to_gateway);
    let mut modern_hold = Conn::new(&to_hold);
    let session = mcp::initialize(&mut side).await?;
    let mut times = Times {
        rtt_ms,
        ..Times::default()
    };
    // One untimed flow of each first: connections open, the gateway learns its upstream
    // (era, resumption) and opens a session ahead of demand, as after any first call.
    for n in 0..=flows {
        let tag = format!("w{rtt_ms}-{n}");
        let expected = tool.expected(&tag);
        let answer = |q: &Value| tool.answer(&tag, q);
        let started = Instant::now();
        mcp::legacy_call_flow(&mut stream, &mut side, tool.legacy_call(&expected), answer).await?;
        let full = started.elapsed();
        let asked = std::cell::Cell::new(None);
        let started = Instant::now();
        mcp::legacy_call_in(
            &mut stream,
            &mut side,
            &session,
            tool.legacy_call(&expected),
            |q: &Value| {
                asked.set(Some(Instant::now()));
                answer(q)
            },
        )
        .await?;
        let kept = started.elapsed();
        let kept_asked = asked.get().ok_or("the kept session's call asked nothing")? - started;
        let started = Instant::now();
        let bridged_asked = tool.bridged(&mut modern, &tag).await? - started;
        let bridged = started.elapsed();
        let started = Instant::now();
        let held_asked = tool.bridged(&mut modern_hold, &tag).await? - started;
        let held = started.elapsed();
        if n > 0 {
            let ms = |d: Duration| d.as_secs_f64() * 1000.0;
            times.full.push(ms(full));
            times.kept.push(ms(kept));
            times.kept_asked.push(ms(kept_asked));
            times.bridged.push(ms(bridged));
            times.bridged_asked.push(ms(bridged_asked));
            times.held.push(ms(held));
            times.held_asked.push(ms(held_asked));
        }
    }
    mcp::delete(&mut side, &session).await?;
    Ok(times)
}
