//! The macro benchmark harness: real processes on loopback, one load generator, every
//! comparison of the benchmarks issue in one run.
//!
//! `cargo bench --bench macro` runs it at full scale (a few minutes) and writes the report
//! to `target/macro-report.md`; `cargo test` runs it at smoke scale, which checks that
//! every comparison still works and loses nothing. Scale can be overridden with
//! `MRTR_BENCH_SECONDS`, `MRTR_BENCH_CONNECTIONS`, `MRTR_BENCH_FLOW_CONNECTIONS`,
//! `MRTR_BENCH_PENDING`, `MRTR_BENCH_HELD` and `MRTR_BENCH_PARKED`.
//!
//! 1. Pass-through: a legacy client's `tools/call`, JSON and streamed, direct to the demo
//!    backend, through the gateway and through nginx.
//! 2. The elicitation flow: a 2026-07-28 client through the gateway (MRTR) against the
//!    legacy stateful flow driven directly, for one and three rounds.
//! 3. Pending flows: N flows stopped at an `InputRequiredResult`, the gateway's footprint
//!    before and after, then all completed (none lost, none completed twice); against
//!    flows whose SSE stream the gateway's legacy pass-through holds.
//!    Parked at scale: a million flows (`MRTR_BENCH_PARKED`) parked on one replica, its RSS
//!    read along the way (the curve), then a sample spread over the run completed.
//! 4. `requestState` size on the wire for 1, 3 and 10 input requests.
//! 5. Stalls: sequential bridged flows against the Python SDK server with an event store,
//!    each timed (p50, p90, p99, max).
//! 6. Latency over a delayed link: the client behind a delay proxy (RTT 0, 10, 40 ms), the
//!    full legacy flow, a legacy client keeping its session, and a bridged flow.
//! 7. A retry on a replica that has served nothing yet, against one on the replica that
//!    ran the flow's first round and a flow before it.

mod client;
mod load;
mod mcp;
mod pending;
mod procs;
mod replica;
mod report;
mod stall;
mod wan;

use client::Conn;
use load::{drive, Budget, Stats};
use mcp::Interview;
use procs::{GatewayOptions, Proc};
use report::Report;
use serde_json::json;
use std::path::Path;
use std::time::Duration;

pub struct Scale {
    pub full: bool,
    pub seconds: f64,
    /// Load runs per target, interleaved across targets; the median run is reported.
    pub repeats: usize,
    pub workers: usize,
    pub flow_workers: usize,
    pub pending: usize,
    pub held: usize,
    /// Flows parked at once in the scale section.
    pub parked: usize,
    /// Sequential flows in the stall section.
    pub stall_flows: usize,
}

impl Scale {
    fn from_args() -> Scale {
        let full = std::env::args().any(|a| a == "--bench");
        let env = |name: &str, default: f64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let (seconds, pending, held) = if full {
            (3.0, 10_000.0, 5_000.0)
        } else {
            (0.5, 200.0, 100.0)
        };
        Scale {
            full,
            seconds: env("MRTR_BENCH_SECONDS", seconds),
            repeats: env("MRTR_BENCH_REPEATS", if full { 3.0 } else { 1.0 }) as usize,
            workers: env("MRTR_BENCH_CONNECTIONS", if full { 8.0 } else { 4.0 }) as usize,
            flow_workers: env("MRTR_BENCH_FLOW_CONNECTIONS", if full { 8.0 } else { 4.0 }) as usize,
            pending: env("MRTR_BENCH_PENDING", pending) as usize,
            held: env("MRTR_BENCH_HELD", held) as usize,
            parked: env(
                "MRTR_BENCH_PARKED",
                if full { 1_000_000.0 } else { 1_000.0 },
            ) as usize,
            stall_flows: env("MRTR_BENCH_STALL_FLOWS", if full { 100.0 } else { 10.0 }) as usize,
        }
    }

    fn budget(&self) -> Budget {
        Budget::new(Duration::from_secs_f64(self.seconds), 5_000_000)
    }
}

const DEFAULT_GATEWAY: GatewayOptions = GatewayOptions {
    threads: 1,
    quiet_window_ms: 1,
    hold: false,
    max_watched_sessions: 100_000,
    request_state_ttl_seconds: 600,
    warm_sessions_per_shape: 2,
};

fn main() {
    let scale = Scale::from_args();
    let dir = std::env::temp_dir().join(format!("mrtr-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let mut report = Report::new(&scale);
    procs::pin_load_generator();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    // MRTR_BENCH_ONLY=pending (or pass, flow, parked, state, stall, wan, replica) runs one
    // section.
    let only = std::env::var("MRTR_BENCH_ONLY").unwrap_or_default();
    let run = |section: &str| only.is_empty() || only == section;
    runtime.block_on(async {
        if run("pass") {
            pass_through(&scale, &dir, &mut report).await;
        }
        if run("flow") {
            elicitation(&scale, &dir, &mut report).await;
        }
        if run("pending") {
            pending::compare(&scale, &dir, &mut report).await;
        }
        if run("parked") {
            pending::parked(&scale, &dir, &mut report).await;
        }
        if run("state") {
            state_sizes(&dir, &mut report).await;
        }
        if run("stall") {
            stall::measure(scale.stall_flows, &dir, &mut report).await;
        }
        if run("wan") {
            wan::measure(&scale, &dir, &mut report).await;
        }
        if run("replica") {
            replica::measure(&scale, &dir, &mut report).await;
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    report.finish();
}

/// One legacy session per target, shared by every worker (as one busy client would).
async fn legacy_load(scale: &Scale, target: &Proc, streamed: bool) -> Stats {
    let session = mcp::initialize(&mut Conn::new(&target.addr))
        .await
        .unwrap_or_else(|e| panic!("initialize through {}: {e}", target.name));
    let (tool, args, expect) = if streamed {
        ("count", json!({"steps": 3}), "counted to 3")
    } else {
        ("echo", json!({"text": "hello"}), "hello")
    };
    let session = &session;
    let args = &args;
    drive(
        scale.workers,
        scale.budget(),
        |_| async { Conn::new(&target.addr) },
        |mut conn, n| async move {
            let outcome = mcp::call(&mut conn, session, n as u64, tool, args.clone(), expect).await;
            (conn, outcome)
        },
    )
    .await
}

async fn pass_through(scale: &Scale, dir: &Path, report: &mut Report) {
    let backend = procs::backend();
    let (gateway, _admin) = procs::gateway(dir, &backend, DEFAULT_GATEWAY);
    let two_threads = GatewayOptions {
        threads: 2,
        ..DEFAULT_GATEWAY
    };
    let (gateway2, _admin2) = procs::gateway(dir, &backend, two_threads);
    let nginx = procs::nginx(dir, &backend);
    let targets = [
        ("direct to the backend", &backend),
        ("nginx (1 worker)", &nginx),
        ("mrtr-gateway (1 thread)", &gateway),
        ("mrtr-gateway (2 threads)", &gateway2),
    ];
    for streamed in [false, true] {
        let mut runs: Vec<Vec<Stats>> = targets.iter().map(|_| Vec::new()).collect();
        for _ in 0..scale.repeats {
            for ((_, target), runs) in targets.iter().zip(&mut runs) {
                runs.push(legacy_load(scale, target, streamed).await);
            }
        }
        let rows: Vec<_> = targets
            .iter()
            .zip(runs)
            .map(|((label, _), runs)| (*label, median(runs)))
            .collect();
        report.pass_through(streamed, &rows);
    }
}

/// The run with the median rate.
fn median(mut runs: Vec<Stats>) -> Stats {
    runs.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    runs.swap_remove(runs.len() / 2)
}

async fn flow_load(scale: &Scale, target: &Proc, interview: Interview, modern: bool) -> Stats {
    flows(
        scale.flow_workers,
        scale.budget(),
        target,
        interview,
        modern,
    )
    .await
}

/// Whole interview flows against `target`: MRTR (`modern`) or the legacy stateful flow.
pub async fn flows(
    workers: usize,
    budget: Budget,
    target: &Proc,
    interview: Interview,
    modern: bool,
) -> Stats {
    drive(
        workers,
        budget,
        |_| async { (Conn::new(&target.addr), Conn::new(&target.addr)) },
        |(mut a, mut b), n| async move {
            let tag = format!("f{n}");
            let outcome = if modern {
                mcp::modern_flow(&mut a, interview, &tag).await.map(drop)
            } else {
                mcp::legacy_flow(&mut a, &mut b, interview, &tag).await
            };
            ((a, b), outcome)
        },
    )
    .await
}

async fn elicitation(scale: &Scale, dir: &Path, report: &mut Report) {
    let backend = procs::backend();
    let (gateway, _admin) = procs::gateway(dir, &backend, DEFAULT_GATEWAY);
    let short = GatewayOptions {
        quiet_window_ms: 0,
        ..DEFAULT_GATEWAY
    };
    let (gateway_short, _admin2) = procs::gateway(dir, &backend, short);
    let held = GatewayOptions {
        hold: true,
        ..DEFAULT_GATEWAY
    };
    let (gateway_held, _admin3) = procs::gateway(dir, &backend, held);
    for rounds in [1, 3] {
        let interview = Interview {
            rounds,
            questions: 1,
        };
        // The last: legacy flows through the same gateway's pass-through, whose CPU per
        // flow the bridged flows' is compared with.
        let clients = [
            (&backend, false),
            (&gateway, true),
            (&gateway_short, true),
            (&gateway_held, true),
            (&gateway, false),
        ];
        let mut runs: [Vec<Stats>; 5] = Default::default();
        let mut cpu = [(0.0, 0); 5];
        for _ in 0..scale.repeats {
            for (((target, modern), runs), cpu) in clients.iter().zip(&mut runs).zip(&mut cpu) {
                let before = procs::cpu_seconds(target.pid());
                let stats = flow_load(scale, target, interview, *modern).await;
                *cpu = (
                    cpu.0 + procs::cpu_seconds(target.pid()) - before,
                    cpu.1 + stats.ok,
                );
                runs.push(stats);
            }
        }
        let cpu_us = |i: usize| cpu[i].0 * 1e6 / cpu[i].1.max(1) as f64;
        let gateway_cpu = report::FlowCpu {
            bridged_us: cpu_us(1),
            pass_through_us: cpu_us(4),
        };
        let [direct, through, short, held, passed] = runs.map(median);
        report.elicitation(
            rounds,
            &direct,
            [&through, &short, &held, &passed],
            gateway_cpu,
        );
    }
}

async fn state_sizes(dir: &Path, report: &mut Report) {
    let backend = procs::backend();
    let (gateway, _admin) = procs::gateway(dir, &backend, DEFAULT_GATEWAY);
    let mut conn = Conn::new(&gateway.addr);
    let mut sizes = Vec::new();
    for questions in [1, 3, 10] {
        let interview = Interview {
            rounds: 1,
            questions,
        };
        let step = mcp::modern_round(&mut conn, 1, interview, Default::default(), "s")
            .await
            .unwrap_or_else(|e| panic!("first round with {questions} questions: {e}"));
        let mcp::Step::Input { retry } = step else {
            panic!("the interview did not ask");
        };
        sizes.push((questions, mcp::state_len(&retry)));
    }
    report.state_sizes(&sizes);
}
