//! A retry on a replica that has served nothing yet: two replicas sharing keys in front of
//! one backend, as a new pod or a serverless instance joins a running one. Per trial, the
//! first replica serves one flow whole (it learns what a group's first retry teaches:
//! whether its resumed streams are primed, whether its store keeps sessions apart); then a
//! flow's first round runs on it and its retry on the fresh replica, and another flow runs
//! both rounds on the first. Each retry is timed from sending it to its result, each on a
//! new client connection (so both include the client's connect).

use crate::client::Conn;
use crate::mcp::{check, modern_round, Interview, Step};
use crate::procs::{self, Proc};
use crate::report::Report;
use crate::{stall, Scale, DEFAULT_GATEWAY};
use serde_json::{Map, Value};
use std::path::Path;
use std::time::{Duration, Instant};

const INTERVIEW: Interview = Interview {
    rounds: 1,
    questions: 1,
};

/// The tool a backend's flows call.
#[derive(Clone, Copy)]
enum Tool {
    /// The demo backend's `interview`, one question.
    Interview,
    /// The Python fixture's `ask_name`.
    AskName,
}

impl Tool {
    async fn first_round(self, conn: &mut Conn, tag: &str) -> Result<Map<String, Value>, String> {
        match self {
            Tool::Interview => match modern_round(conn, 1, INTERVIEW, Map::new(), tag).await? {
                Step::Input { retry } => Ok(retry),
                Step::Done(text) => Err(format!("no question: {text}")),
            },
            Tool::AskName => stall::first_round(conn, tag).await,
        }
    }

    async fn answer_round(
        self,
        conn: &mut Conn,
        retry: Map<String, Value>,
        tag: &str,
    ) -> Result<(), String> {
        match self {
            Tool::Interview => match modern_round(conn, 2, INTERVIEW, retry, tag).await? {
                Step::Done(text) => check(&text, &INTERVIEW.expected(tag)),
                Step::Input { .. } => Err("asked again".into()),
            },
            Tool::AskName => stall::answer_round(conn, retry, tag).await,
        }
    }
}

/// Retry times on a fresh replica and on one that has served a flow, one of each per trial.
pub struct Retries {
    pub fresh: Vec<Duration>,
    pub served: Vec<Duration>,
}

pub async fn measure(scale: &Scale, dir: &Path, report: &mut Report) {
    let trials = if scale.full { 10 } else { 2 };
    let demo = procs::backend();
    let mut rows = Vec::new();
    match trial_runs(&demo, Tool::Interview, trials, dir).await {
        Ok(retries) => rows.push(("demo backend (`interview`)", retries)),
        Err(e) => return report.failed("a retry on a fresh replica, demo backend", &e),
    }
    match procs::python_backend() {
        Some(python) => match trial_runs(&python, Tool::AskName, trials, dir).await {
            Ok(retries) => rows.push(("Python SDK server (`ask_name`)", retries)),
            Err(e) => return report.failed("a retry on a fresh replica, Python server", &e),
        },
        None => report.skipped(
            "A retry on a fresh replica: Python SDK server",
            "the Python fixture is not installed (bash tests/setup.sh)",
        ),
    }
    report.replicas(&rows);
}

async fn trial_runs(
    backend: &Proc,
    tool: Tool,
    trials: usize,
    dir: &Path,
) -> Result<Retries, String> {
    let mut retries = Retries {
        fresh: Vec::with_capacity(trials),
        served: Vec::with_capacity(trials),
    };
    for trial in 0..trials {
        let keys = mrtr_gateway::keys::generate_entry("bench").expect("a valid key id");
        let (first, _) = procs::replica(dir, backend, DEFAULT_GATEWAY, &keys);
        let (fresh, _) = procs::replica(dir, backend, DEFAULT_GATEWAY, &keys);
        let (mut on_first, mut on_fresh) = (Conn::new(&first.addr), Conn::new(&fresh.addr));
        let tag = format!("t{trial}");
        let retry = tool.first_round(&mut on_first, &tag).await?;
        tool.answer_round(&mut on_first, retry, &tag).await?;
        let retry = tool.first_round(&mut on_first, &tag).await?;
        let started = Instant::now();
        tool.answer_round(&mut on_fresh, retry, &tag).await?;
        retries.fresh.push(started.elapsed());
        let retry = tool.first_round(&mut on_first, &tag).await?;
        let mut again = Conn::new(&first.addr);
        let started = Instant::now();
        tool.answer_round(&mut again, retry, &tag).await?;
        retries.served.push(started.elapsed());
    }
    Ok(retries)
}
