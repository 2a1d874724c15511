//! The harness's report: markdown tables with each goal next to its measured figure,
//! printed and written to `target/macro-report.md`. Any lost, duplicated or failed
//! operation is a failure: the report says so and the run exits non-zero.

use crate::load::Stats;
use crate::pending::{Parked, Pending};
use crate::Scale;
use std::fmt::Write;

pub struct Report {
    text: String,
    goals: Vec<String>,
    failures: Vec<String>,
}

fn command_output(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {model}")
}

/// Flow times (ms) of each variant of the delayed-link section at one RTT; for the kept
/// session's flow and the bridged flow, also until the client had the question.
#[derive(Default)]
pub struct Times {
    pub rtt_ms: u64,
    pub full: Vec<f64>,
    pub kept: Vec<f64>,
    pub kept_asked: Vec<f64>,
    pub bridged: Vec<f64>,
    pub bridged_asked: Vec<f64>,
    /// The bridged flow through a gateway with `resume: hold`.
    pub held: Vec<f64>,
    pub held_asked: Vec<f64>,
}

/// The median and p90 of `times` (ms), nearest rank.
fn quantiles(times: &[f64]) -> [f64; 2] {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    [50.0, 90.0].map(|p| {
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        sorted
            .get(rank.clamp(1, sorted.len().max(1)) - 1)
            .copied()
            .unwrap_or(0.0)
    })
}

/// The `p`th percentile (0 to 100) of sorted durations, nearest rank.
fn percentile(sorted: &[std::time::Duration], p: f64) -> std::time::Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The `ps` percentiles of `times`, in milliseconds.
fn percentiles_ms<const N: usize>(times: &[std::time::Duration], ps: [f64; N]) -> [f64; N] {
    let mut sorted = times.to_vec();
    sorted.sort();
    ps.map(|p| percentile(&sorted, p).as_secs_f64() * 1000.0)
}

fn ms(stats: &Stats, p: f64) -> String {
    format!("{:.2}", stats.percentile_ms(p))
}

impl Report {
    pub fn new(scale: &Scale) -> Report {
        let mut text = String::from("# Macro benchmarks\n\n");
        let _ = writeln!(text, "- Machine: {}", machine());
        let _ = writeln!(
            text,
            "- Date: {}. Commit: `{}`{}",
            command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            command_output("git", &["rev-parse", "--short", "HEAD"]),
            if command_output("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty()
            {
                ""
            } else {
                " (with uncommitted changes)"
            }
        );
        if let Some(gateway) = crate::procs::gateway_override() {
            let _ = writeln!(
                text,
                "- Gateway measured: `{}` (`MRTR_BENCH_GATEWAY`), not this commit's build.",
                gateway.display()
            );
        }
        let _ = writeln!(
            text,
            "- Scale: {} s per load run (the median of {} runs, interleaved), {} connections for calls, {} for flows; {} pending MRTR flows, {} held streams.\n- Loopback only. One single-threaded load generator and the demo backend (one thread) share CPU 0; the proxy under test runs alone on CPU 1 (with two or more CPUs).\n",
            scale.seconds, scale.repeats, scale.workers, scale.flow_workers, scale.pending, scale.held
        );
        Report {
            text,
            goals: Vec::new(),
            failures: Vec::new(),
        }
    }

    fn check(&mut self, what: &str, stats: &Stats) {
        if stats.errors > 0 || stats.ok == 0 {
            self.failures.push(format!(
                "{what}: {} ok, {} failed; first error: {}",
                stats.ok,
                stats.errors,
                stats.first_error.as_deref().unwrap_or("none")
            ));
        }
    }

    fn goal(&mut self, goal: &str, figure: String, met: bool) {
        let verdict = if met { "met" } else { "**missed**" };
        self.goals
            .push(format!("| {goal} | {figure} | {verdict} |"));
    }

    pub fn pass_through(&mut self, streamed: bool, rows: &[(&str, Stats)]) {
        let kind = if streamed {
            "streamed (`count`, 3 progress events and the result over SSE)"
        } else {
            "JSON (`echo`)"
        };
        let _ = writeln!(
            self.text,
            "## Pass-through: a legacy `tools/call`, {kind}\n"
        );
        let _ = writeln!(
            self.text,
            "| target | req/s | p50 ms | p99 ms | errors |\n| --- | ---: | ---: | ---: | ---: |"
        );
        for (label, stats) in rows {
            let _ = writeln!(
                self.text,
                "| {label} | {:.0} | {} | {} | {} |",
                stats.rate(),
                ms(stats, 0.5),
                ms(stats, 0.99),
                stats.errors
            );
            self.check(&format!("pass-through {kind}, {label}"), stats);
        }
        let rate = |prefix: &str| {
            rows.iter()
                .find(|(l, _)| l.starts_with(prefix))
                .map_or(f64::NAN, |(_, s)| s.rate())
        };
        let (direct, nginx) = (rate("direct"), rate("nginx"));
        let (one, two) = (rate("mrtr-gateway (1"), rate("mrtr-gateway (2"));
        let _ = writeln!(
            self.text,
            "\nRatios: gateway (1 thread) / nginx (1 worker) = {:.2}; gateway (2 threads) / nginx = {:.2}; gateway (1 thread) / direct = {:.2}.\n",
            one / nginx,
            two / nginx,
            one / direct
        );
        let figure = format!("{:.2}× nginx ({kind}, 1 thread vs 1 worker)", one / nginx);
        self.goal("pass-through req/s ≥ nginx's", figure, one >= nginx);
    }

    /// The flow through the gateway: resumable with the default (1 ms) and a zero quiet
    /// window, and in hold mode with the default.
    pub fn elicitation(&mut self, rounds: u64, direct: &Stats, gateway: [&Stats; 4], cpu: FlowCpu) {
        let [through, short, held, passed] = gateway;
        let _ = writeln!(
            self.text,
            "## The elicitation flow, {rounds} round(s) of one question\n"
        );
        let _ = writeln!(
            self.text,
            "| client | flows/s | p50 ms | p99 ms | errors |\n| --- | ---: | ---: | ---: | ---: |"
        );
        let rows = [
            (
                "legacy stateful, direct (initialize, held stream, answers POSTed, DELETE)",
                direct,
            ),
            (
                "2026-07-28 MRTR through the gateway (quiet window 1 ms, the default)",
                through,
            ),
            (
                "2026-07-28 MRTR through the gateway (quiet window 0)",
                short,
            ),
            (
                "2026-07-28 MRTR through the gateway, hold mode (quiet window 1 ms)",
                held,
            ),
            ("legacy stateful through the gateway's pass-through", passed),
        ];
        for (label, stats) in rows {
            let _ = writeln!(
                self.text,
                "| {label} | {:.1} | {} | {} | {} |",
                stats.rate(),
                ms(stats, 0.5),
                ms(stats, 0.99),
                stats.errors
            );
            self.check(&format!("elicitation, {rounds} rounds, {label}"), stats);
        }
        let ratio = |s: &Stats| s.percentile_ms(0.5) / direct.percentile_ms(0.5);
        let _ = writeln!(
            self.text,
            "\nRatio of p50 flow time, gateway / direct: {:.2} (default), {:.2} (quiet window 0), {:.2} (hold mode).\n",
            ratio(through),
            ratio(short),
            ratio(held)
        );
        let goal = format!("MRTR flow ≤ 1.2× direct stateful, {rounds} round(s)");
        let figure = format!(
            "{:.2}× (default); {:.2}× (quiet window 0)",
            ratio(through),
            ratio(short)
        );
        self.goal(&goal, figure, ratio(through) <= 1.2);
        let cpu_ratio = cpu.bridged_us / cpu.pass_through_us;
        let _ = writeln!(
            self.text,
            "Gateway CPU (user + system, all threads) per flow: {:.0} µs bridged (default), {:.0} µs for the legacy flow through pass-through ({cpu_ratio:.2}×).\n",
            cpu.bridged_us, cpu.pass_through_us
        );
        self.goal(
            &format!("gateway CPU per bridged flow ≤ 1.0× a legacy flow through pass-through, {rounds} round(s)"),
            format!(
                "{cpu_ratio:.2}× ({:.0} µs vs {:.0} µs)",
                cpu.bridged_us, cpu.pass_through_us
            ),
            cpu_ratio <= 1.0,
        );
    }

    pub fn parked(&mut self, p: &Parked) {
        let _ = writeln!(
            self.text,
            "## Parked flows at scale: {} flows waiting for their users on one replica\n",
            p.flows
        );
        let _ = writeln!(
            self.text,
            "Default settings except `bridge.max_watched_sessions` ({}) and `request_state_ttl_seconds` (1800, as parking them all takes longer than the default 600 s); RSS before: {:.1} MiB.\n",
            p.flows + 200,
            p.before.rss_kib as f64 / 1024.0
        );
        let _ = writeln!(
            self.text,
            "| flows parked | RSS (MiB) | bytes per parked flow | fds |\n| ---: | ---: | ---: | ---: |"
        );
        for point in &p.curve {
            let _ = writeln!(
                self.text,
                "| {} | {:.1} | {:.0} | {} |",
                point.0,
                point.1.rss_kib as f64 / 1024.0,
                p.bytes_per_flow(point),
                point.1.fds
            );
        }
        let _ = writeln!(
            self.text,
            "\nThen {} of them, spread over the run, completed: {} with their own answer.\n",
            p.sample, p.completed
        );
        if p.completed < p.sample || !p.errors.is_empty() {
            self.failures.push(format!(
                "parked: {} of {} completed; errors: {:?}",
                p.completed, p.sample, p.errors
            ));
        }
        let Some(last) = p.curve.last() else {
            return;
        };
        let rss = last.1.rss_kib as f64 * 1024.0;
        self.goal(
            "1,000,000 parked flows on one replica within 128 MB RSS",
            format!(
                "{} parked: {:.1} MB RSS ({:.0} B per flow)",
                last.0,
                rss / 1e6,
                p.bytes_per_flow(last)
            ),
            last.0 >= 1_000_000 && rss <= 128e6,
        );
    }

    pub fn pending(&mut self, mrtr: &Pending, mrtr_held: &Pending, held: &Pending) {
        let _ = writeln!(
            self.text,
            "## Pending flows: the gateway's footprint while users think\n"
        );
        let _ = writeln!(self.text, "| flows | count | RSS before → pending → after (MiB) | bytes per pending flow | fds before → pending → after | sockets pending | completed | lost | duplicated |\n| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |");
        let mib = |k: u64| k as f64 / 1024.0;
        for (label, p) in [
            ("MRTR, stopped at InputRequiredResult", mrtr),
            (
                "MRTR in hold mode, upstream streams held by the gateway",
                mrtr_held,
            ),
            (
                "legacy, SSE stream held by the gateway's pass-through",
                held,
            ),
        ] {
            let _ = writeln!(
                self.text,
                "| {label} | {} | {:.1} → {:.1} → {:.1} | {:.0} | {} → {} → {} | {} | {} | {} | {} |",
                p.opened,
                mib(p.before.rss_kib),
                mib(p.pending.rss_kib),
                mib(p.after.rss_kib),
                p.bytes_per_flow(),
                p.before.fds,
                p.pending.fds,
                p.after.fds,
                p.pending.sockets,
                p.completed,
                p.lost(),
                p.duplicated
            );
            if p.lost() > 0 || p.duplicated > 0 || !p.errors.is_empty() {
                self.failures.push(format!(
                    "pending, {label}: {} lost, {} duplicated; errors: {:?}",
                    p.lost(),
                    p.duplicated,
                    p.errors
                ));
            }
        }
        let _ = writeln!(
            self.text,
            "\nEvery completed flow's result listed exactly its own answer; every used `requestState` was replayed once and refused (duplicated counts replays that ran).\n"
        );
        let figure = format!(
            "{:.0} B per MRTR flow ({:.1} MB for {}); {:.0} B per flow in hold mode; {:.0} B per held legacy stream",
            mrtr.bytes_per_flow(),
            mrtr.bytes_per_flow() * mrtr.opened as f64 / 1e6,
            mrtr.opened,
            mrtr_held.bytes_per_flow(),
            held.bytes_per_flow()
        );
        self.goal(
            "a pending flow < 500 B at the gateway",
            figure,
            mrtr.bytes_per_flow() < 500.0,
        );
    }

    pub fn state_sizes(&mut self, sizes: &[(u64, usize)]) {
        let _ = writeln!(
            self.text,
            "## `requestState` on the wire (demo `interview`, one round)\n"
        );
        let _ = writeln!(
            self.text,
            "| input requests | requestState characters |\n| ---: | ---: |"
        );
        for (questions, len) in sizes {
            let _ = writeln!(self.text, "| {questions} | {len} |");
        }
        let _ = writeln!(self.text);
    }

    /// A section that could not run here, and why.
    pub fn skipped(&mut self, section: &str, why: &str) {
        let _ = writeln!(self.text, "## {section}\n\nNot run: {why}.\n");
    }

    /// A section that failed: the run exits non-zero.
    pub fn failed(&mut self, what: &str, error: &str) {
        self.failures.push(format!("{what}: {error}"));
    }

    /// Bridged flows against the same flows driven directly, interleaved in one run.
    pub fn stalls(
        &mut self,
        bridged: &[std::time::Duration],
        bridged_cold: &[std::time::Duration],
        direct: &[std::time::Duration],
        backend: &crate::procs::Proc,
    ) {
        let figures =
            |times: &[std::time::Duration]| percentiles_ms(times, [50.0, 90.0, 99.0, 100.0]);
        let _ = writeln!(
            self.text,
            "## Stalls: {} sequential flows against the {} SDK server with an event store\n",
            bridged.len(),
            backend.name
        );
        let _ = writeln!(
            self.text,
            "`ask_name` (one question, then the result), one client retrying as soon as it has the question, default settings (quiet window 1 ms, resume poll 2 s); each bridged flow followed by the same flow through a gateway that opens no session ahead of demand (`warm_sessions_per_shape: 0`), then driven directly by a legacy client (its stream held open), whose tail is the server's own.\n\n| flow | p50 | p90 | p99 | max | max / p50 |\n| --- | ---: | ---: | ---: | ---: | ---: |"
        );
        for (label, times) in [
            ("2026-07-28 through the gateway", bridged),
            ("the same, no sessions opened ahead of demand", bridged_cold),
            ("legacy, direct", direct),
        ] {
            let [p50, p90, p99, max] = figures(times);
            let _ = writeln!(
                self.text,
                "| {label} | {p50:.2} ms | {p90:.2} ms | {p99:.2} ms | {max:.2} ms | {:.2} |",
                max / p50
            );
        }
        let _ = writeln!(self.text);
        let [p50, _, _, max] = figures(bridged);
        self.goal(
            "stalls: no bridged flow of the run over 2 × p50",
            format!("max {max:.2} ms, p50 {p50:.2} ms ({:.2}×)", max / p50),
            max < 2.0 * p50,
        );
    }

    /// Retry times on a replica that has served nothing against the replica that served
    /// the flow's first round, per backend.
    pub fn replicas(&mut self, rows: &[(&str, crate::replica::Retries)]) {
        let _ = writeln!(
            self.text,
            "## A retry on a replica that has served nothing yet

Two replicas sharing keys, default settings; per trial, the first serves a flow whole, then a flow's first round runs on it and its retry on the fresh replica, and another flow's retry on the first. Retries timed from sending to the result, each on a new client connection; medians and maxima over {} trials.

| backend | retry on the fresh replica: p50, max | on the replica that served: p50, max | fresh / served (p50) |
| --- | ---: | ---: | ---: |",
            rows.first().map_or(0, |(_, r)| r.fresh.len())
        );
        for (backend, retries) in rows {
            let [fresh, fresh_max] = percentiles_ms(&retries.fresh, [50.0, 100.0]);
            let [served, served_max] = percentiles_ms(&retries.served, [50.0, 100.0]);
            let _ = writeln!(
                self.text,
                "| {backend} | {fresh:.2} ms, {fresh_max:.2} ms | {served:.2} ms, {served_max:.2} ms | {:.2}× |",
                fresh / served
            );
        }
        let _ = writeln!(self.text);
    }

    /// Flow times over a delayed link, for one backend: each RTT's three variants.
    pub fn wan(&mut self, backend: &str, runs: &[Times]) {
        let _ = writeln!(
            self.text,
            "## Latency over a delayed link: {backend}\n\nThe client behind a delay proxy on loopback (RTT / 2 each way), the gateway next to the server, default settings; one-question flows interleaved, {} of each per RTT, timed whole by the client.\n\n| RTT | full legacy flow p50 / p90 | legacy, session kept p50 / p90 | 2026-07-28 through the gateway p50 / p90 | bridged / kept | bridged / full |\n| ---: | ---: | ---: | ---: | ---: | ---: |",
            runs.first().map_or(0, |r| r.bridged.len())
        );
        for run in runs {
            let [full, kept, bridged] = [&run.full, &run.kept, &run.bridged].map(|t| quantiles(t));
            let _ = writeln!(
                self.text,
                "| {} ms | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {:.2}× | {:.2}× |",
                run.rtt_ms,
                full[0], full[1], kept[0], kept[1], bridged[0], bridged[1],
                bridged[0] / kept[0],
                bridged[0] / full[0]
            );
            let [kept, full, bridged] = [kept[0], full[0], bridged[0]];
            if run.rtt_ms == 10 {
                self.goal(
                    &format!("{backend}, RTT 10 ms: bridged flow ≤ 1.05× the legacy client keeping its session"),
                    format!("{:.2}× ({bridged:.1} ms vs {kept:.1} ms)", bridged / kept),
                    bridged <= 1.05 * kept,
                );
                self.goal(
                    &format!("{backend}, RTT 10 ms: bridged flow ≤ 0.5× the full legacy flow"),
                    format!("{:.2}× ({bridged:.1} ms vs {full:.1} ms)", bridged / full),
                    bridged <= 0.5 * full,
                );
            }
            if run.rtt_ms == 0 && backend.starts_with("demo") {
                self.goal(
                    "demo backend, loopback: bridged flow ≤ 1.5× the legacy client keeping its session",
                    format!("{:.2}× ({bridged:.2} ms vs {kept:.2} ms)", bridged / kept),
                    bridged <= 1.5 * kept,
                );
            }
        }
        self.wan_split(runs);
    }

    /// The kept session's flow and the bridged flow, split where the client has the
    /// question: p50s of the time until then and of the time after.
    fn wan_split(&mut self, runs: &[Times]) {
        let _ = writeln!(
            self.text,
            "\nWhere the time goes (p50 until the client has the question / after it):\n\n| RTT | legacy, session kept | 2026-07-28 through the gateway | the same, `resume: hold` |\n| ---: | ---: | ---: | ---: |"
        );
        let after = |whole: &[f64], asked: &[f64]| -> Vec<f64> {
            whole.iter().zip(asked).map(|(w, a)| w - a).collect()
        };
        for run in runs {
            let kept_after = after(&run.kept, &run.kept_asked);
            let bridged_after = after(&run.bridged, &run.bridged_asked);
            let held_after = after(&run.held, &run.held_asked);
            let p50 = |t: &[f64]| quantiles(t)[0];
            let _ = writeln!(
                self.text,
                "| {} ms | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {:.1} / {:.1} ms |",
                run.rtt_ms,
                p50(&run.kept_asked),
                p50(&kept_after),
                p50(&run.bridged_asked),
                p50(&bridged_after),
                p50(&run.held_asked),
                p50(&held_after)
            );
        }
        let _ = writeln!(self.text);
    }

    pub fn finish(mut self) {
        let _ = writeln!(
            self.text,
            "## Goals\n\n| goal | measured | verdict |\n| --- | --- | --- |"
        );
        for goal in &self.goals {
            let _ = writeln!(self.text, "{goal}");
        }
        let _ = writeln!(self.text, "| seal + open < 5 µs | `cargo bench --bench core` (micro benchmarks) | see benches/RESULTS.md |");
        println!("{}", self.text);
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/target/macro-report.md");
        if let Err(e) = std::fs::write(path, &self.text) {
            eprintln!("could not write {path}: {e}");
        }
        if !self.failures.is_empty() {
            for failure in &self.failures {
                eprintln!("FAILED: {failure}");
            }
            std::process::exit(1);
        }
    }
}

/// The gateway's CPU time per flow, over all runs of a comparison.
#[derive(Clone, Copy)]
pub struct FlowCpu {
    pub bridged_us: f64,
    pub pass_through_us: f64,
}
