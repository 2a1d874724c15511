//! Pending flows: what a user thinking costs the gateway. N 2026-07-28 flows stop at an
//! `InputRequiredResult`, then all are completed and every used `requestState` replayed;
//! the same for M flows in hold mode (the gateway keeps each flow's upstream streams
//! open, as for an upstream without an event store); against M legacy flows whose call
//! stream the gateway's pass-through holds open.

use crate::client::{Conn, Events};
use crate::load::{drive, Budget, Stats};
use crate::mcp::{self, Interview, Step};
use crate::procs::{self, Footprint, GatewayOptions, Proc};
use crate::report::Report;
use crate::{Scale, DEFAULT_GATEWAY};
use serde_json::{json, Map, Value};
use std::cell::RefCell;
use std::path::Path;
use std::time::Duration;

/// Concurrent clients while opening and completing flows.
const WORKERS: usize = 64;
/// Full flows run first, so pools and allocator arenas are warm before measuring.
const WARM_UP: usize = 200;
/// No phase may take longer than this.
const PHASE_LIMIT: Duration = Duration::from_secs(600);
const ONE_QUESTION: Interview = Interview {
    rounds: 1,
    questions: 1,
};

pub struct Pending {
    pub flows: usize,
    pub opened: usize,
    pub before: Footprint,
    pub pending: Footprint,
    pub after: Footprint,
    pub completed: usize,
    /// Replayed retries the gateway ran again (must be 0).
    pub duplicated: usize,
    pub errors: Vec<String>,
}

impl Pending {
    pub fn bytes_per_flow(&self) -> f64 {
        (self.pending.rss_kib as f64 - self.before.rss_kib as f64) * 1024.0
            / self.opened.max(1) as f64
    }

    pub fn lost(&self) -> usize {
        self.flows - self.completed
    }
}

/// The gateway in hold mode.
const HOLDING: GatewayOptions = GatewayOptions {
    hold: true,
    ..DEFAULT_GATEWAY
};

pub async fn compare(scale: &Scale, dir: &Path, report: &mut Report) {
    let mrtr = mrtr_flows(scale.pending, dir, DEFAULT_GATEWAY).await;
    let mrtr_held = mrtr_flows(scale.held, dir, HOLDING).await;
    let held = held_streams(scale.held, dir).await;
    report.pending(&mrtr, &mrtr_held, &held);
}

fn phase(flows: usize) -> Budget {
    Budget::new(PHASE_LIMIT, flows)
}

async fn warm_up(target: &Proc, modern: bool) {
    let stats = crate::flows(WORKERS, phase(WARM_UP), target, ONE_QUESTION, modern).await;
    assert_eq!(stats.errors, 0, "warm-up: {:?}", stats.first_error);
}

fn first_errors(phases: &[&Stats]) -> Vec<String> {
    phases
        .iter()
        .filter_map(|s| s.first_error.clone())
        .collect()
}

async fn mrtr_flows(flows: usize, dir: &Path, options: GatewayOptions) -> Pending {
    let backend = procs::backend();
    let (gateway, _admin) = procs::gateway(dir, &backend, options);
    warm_up(&gateway, true).await;
    let before = procs::settled_footprint(gateway.pid()).await;
    let (opening, open) = open_flows(&gateway, 0, flows, |_| true).await;
    let pending = procs::settled_footprint(gateway.pid()).await;
    let opened = open.len();
    let (completing, used) = complete_flows(&gateway, open).await;
    let after = procs::settled_footprint(gateway.pid()).await;
    let duplicated = RefCell::new(0usize);
    let replaying = for_each(&gateway, used, |mut conn, (_, retry)| {
        let duplicated = &duplicated;
        async move {
            let outcome = match mcp::modern_call(&mut conn, 3, ONE_QUESTION, retry).await {
                Ok(m) if m["error"]["code"] == -32602 => Ok(()),
                Ok(m) if m.get("result").is_some() => {
                    *duplicated.borrow_mut() += 1;
                    Err(format!("a replay was accepted: {m}"))
                }
                Ok(m) => Err(format!("unexpected reply to a replay: {m}")),
                Err(e) => Err(e),
            };
            (conn, outcome)
        }
    })
    .await;
    let errors = first_errors(&[&opening, &completing, &replaying]);
    Pending {
        flows,
        opened,
        before,
        pending,
        after,
        completed: completing.ok,
        duplicated: duplicated.into_inner(),
        errors,
    }
}

/// A flow stopped at its `InputRequiredResult`: its tag and the retry that completes it.
type Open = (String, Map<String, Value>);

/// Opens `count` flows numbered from `first`, each stopped at its `InputRequiredResult`;
/// returns the retries of those `keep` selects by number.
async fn open_flows(
    gateway: &Proc,
    first: usize,
    count: usize,
    keep: impl Fn(usize) -> bool,
) -> (Stats, Vec<Open>) {
    let open: RefCell<Vec<Open>> = RefCell::new(Vec::new());
    let opening = drive(
        WORKERS,
        phase(count),
        |_| async { Conn::new(&gateway.addr) },
        |mut conn, n| {
            let (open, number) = (&open, first + n);
            let keep = keep(number);
            async move {
                let tag = format!("p{number}");
                let outcome =
                    match mcp::modern_round(&mut conn, 1, ONE_QUESTION, Map::new(), &tag).await {
                        Ok(Step::Input { retry }) => {
                            if keep {
                                open.borrow_mut().push((tag, retry));
                            }
                            Ok(())
                        }
                        Ok(Step::Done(text)) => Err(format!("completed without asking: {text}")),
                        Err(e) => Err(e),
                    };
                (conn, outcome)
            }
        },
    )
    .await;
    (opening, open.into_inner())
}

/// Completes `open` flows, each result checked against its own answer; returns the
/// retries used.
async fn complete_flows(gateway: &Proc, open: Vec<Open>) -> (Stats, Vec<Open>) {
    let used = RefCell::new(Vec::new());
    let completing = for_each(gateway, open, |mut conn, (tag, retry)| {
        let used = &used;
        async move {
            let outcome =
                match mcp::modern_round(&mut conn, 2, ONE_QUESTION, retry.clone(), &tag).await {
                    Ok(Step::Done(text)) => mcp::check(&text, &ONE_QUESTION.expected(&tag)),
                    Ok(Step::Input { .. }) => Err("asked again".into()),
                    Err(e) => Err(e),
                };
            used.borrow_mut().push((tag, retry));
            (conn, outcome)
        }
    })
    .await;
    (completing, used.into_inner())
}

/// Runs `op` on each of `items`, `WORKERS` at a time, each worker on its own connection.
async fn for_each<T, F, Fut>(gateway: &Proc, items: Vec<T>, op: F) -> Stats
where
    F: Fn(Conn, T) -> Fut,
    Fut: std::future::Future<Output = (Conn, Result<(), String>)>,
{
    let count = items.len();
    let (items, op) = (RefCell::new(items), &op);
    drive(
        WORKERS,
        phase(count),
        |_| async { Conn::new(&gateway.addr) },
        |conn, _| {
            let item = items.borrow_mut().pop();
            async move {
                match item {
                    Some(item) => op(conn, item).await,
                    None => (conn, Err("nothing left to do".into())),
                }
            }
        },
    )
    .await
}

/// Parked flows at scale: what the gateway's RSS does as flows wait for their users.
pub struct Parked {
    pub flows: usize,
    pub before: Footprint,
    /// (flows parked, footprint) after each step.
    pub curve: Vec<(usize, Footprint)>,
    /// Parked flows completed at the end, spread over the run.
    pub sample: usize,
    pub completed: usize,
    pub errors: Vec<String>,
}

impl Parked {
    pub fn bytes_per_flow(&self, (flows, footprint): &(usize, Footprint)) -> f64 {
        (footprint.rss_kib as f64 - self.before.rss_kib as f64) * 1024.0 / (*flows).max(1) as f64
    }
}

/// Where the curve is read, as fractions of the flows parked.
const CURVE: [f64; 6] = [0.01, 0.1, 0.25, 0.5, 0.75, 1.0];
/// Parked flows completed at the end (one every `flows / SAMPLE`).
const SAMPLE: usize = 1000;

/// Parks `scale.parked` flows on one replica (the bounds raised for them), reading RSS at
/// each point of the curve, then completes a sample spread over the whole run.
pub async fn parked(scale: &Scale, dir: &Path, report: &mut Report) {
    let flows = scale.parked;
    let backend = procs::backend();
    // Parking a million flows takes longer than a state's default lifetime (600 s): the
    // first ones must still be valid when the sample is completed.
    let options = GatewayOptions {
        max_watched_sessions: flows + WARM_UP,
        request_state_ttl_seconds: 1800,
        ..DEFAULT_GATEWAY
    };
    let (gateway, _admin) = procs::gateway(dir, &backend, options);
    warm_up(&gateway, true).await;
    let before = procs::settled_footprint(gateway.pid()).await;
    let stride = (flows / SAMPLE).max(1);
    let (mut curve, mut sample, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    let mut parked = 0;
    for fraction in CURVE {
        let until = (flows as f64 * fraction) as usize;
        if until <= parked {
            continue;
        }
        let (opening, kept) =
            open_flows(&gateway, parked, until - parked, |n| n % stride == 0).await;
        parked += opening.ok;
        sample.extend(kept);
        errors.extend(opening.first_error);
        curve.push((parked, procs::settled_footprint(gateway.pid()).await));
    }
    let count = sample.len();
    let (completing, _) = complete_flows(&gateway, sample).await;
    errors.extend(completing.first_error);
    report.parked(&Parked {
        flows,
        before,
        curve,
        sample: count,
        completed: completing.ok,
        errors,
    });
}

/// A legacy flow waiting for its answer: its session, and its call stream held open.
struct Held {
    tag: String,
    session: String,
    question: Value,
    _conn: Conn,
    events: Events,
}

async fn hold(conn: &mut Conn, tag: String) -> Result<Held, String> {
    let session = mcp::initialize(conn).await?;
    let mut stream = Conn::new(conn.addr());
    let params = json!({"name": "interview", "arguments": {"rounds": 1, "questions": 1}});
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params});
    let mut events = mcp::legacy_post(&mut stream, Some(&session), body)
        .await?
        .events();
    let question = events
        .next()
        .await?
        .ok_or("the stream ended before asking")?;
    Ok(Held {
        tag,
        session,
        question,
        _conn: stream,
        events,
    })
}

async fn answer(conn: &mut Conn, held: Held) -> Result<(), String> {
    let Held {
        tag,
        session,
        question,
        mut events,
        ..
    } = held;
    let answer = json!({"jsonrpc": "2.0", "id": question["id"], "result": mcp::accept(&tag, &question["params"])});
    let reply = mcp::legacy_post(conn, Some(&session), answer).await?;
    mcp::expect_status(reply, 202, "answer").await?;
    while let Some(message) = events.next().await? {
        if message["id"] == 1 {
            mcp::check(mcp::result_text(&message)?, &ONE_QUESTION.expected(&tag))?;
            return mcp::delete(conn, &session).await;
        }
    }
    Err("the stream ended without a result".into())
}

async fn held_streams(flows: usize, dir: &Path) -> Pending {
    let backend = procs::backend();
    let (gateway, _admin) = procs::gateway(dir, &backend, DEFAULT_GATEWAY);
    warm_up(&gateway, false).await;
    let before = procs::settled_footprint(gateway.pid()).await;
    let held: RefCell<Vec<Held>> = RefCell::new(Vec::new());
    let opening = drive(
        WORKERS,
        phase(flows),
        |_| async { Conn::new(&gateway.addr) },
        |mut conn, n| {
            let held = &held;
            async move {
                let outcome = hold(&mut conn, format!("h{n}"))
                    .await
                    .map(|h| held.borrow_mut().push(h));
                (conn, outcome)
            }
        },
    )
    .await;
    let pending = procs::settled_footprint(gateway.pid()).await;
    let opened = held.borrow().len();
    let completing = drive(
        WORKERS,
        phase(opened),
        |_| async { Conn::new(&gateway.addr) },
        |mut conn, _| {
            let held = &held;
            async move {
                let Some(h) = held.borrow_mut().pop() else {
                    return (conn, Err("nothing left to answer".into()));
                };
                let outcome = answer(&mut conn, h).await;
                (conn, outcome)
            }
        },
    )
    .await;
    let after = procs::settled_footprint(gateway.pid()).await;
    let errors = first_errors(&[&opening, &completing]);
    Pending {
        flows,
        opened,
        before,
        pending,
        after,
        completed: completing.ok,
        duplicated: 0,
        errors,
    }
}
