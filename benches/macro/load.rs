//! The load generator's driver: a fixed number of workers, each owning its state (its
//! connections), repeating one operation until a deadline or an operation budget runs
//! out; latencies are kept per operation.

use futures::future::join_all;
use std::cell::Cell;
use std::future::Future;
use std::time::{Duration, Instant};

/// When to stop: whichever of the deadline and the operation count comes first.
pub struct Budget {
    deadline: Instant,
    left: Cell<usize>,
}

impl Budget {
    pub fn new(duration: Duration, max_ops: usize) -> Budget {
        Budget {
            deadline: Instant::now() + duration,
            left: Cell::new(max_ops),
        }
    }

    fn take(&self) -> Option<usize> {
        let left = self.left.get();
        (left > 0 && Instant::now() < self.deadline).then(|| {
            self.left.set(left - 1);
            left
        })
    }
}

pub struct Stats {
    pub ok: usize,
    pub errors: usize,
    pub first_error: Option<String>,
    pub seconds: f64,
    latencies_us: Vec<u64>,
}

impl Stats {
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.seconds
    }

    pub fn percentile_ms(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let rank = ((self.latencies_us.len() - 1) as f64 * p).round() as usize;
        self.latencies_us[rank] as f64 / 1000.0
    }
}

/// Runs `workers` workers: each gets its state from `init`, then calls `op` (which hands
/// the state back with the outcome) until `budget` is spent.
pub async fn drive<S, I, IF, O, OF>(workers: usize, budget: Budget, init: I, op: O) -> Stats
where
    I: Fn(usize) -> IF,
    IF: Future<Output = S>,
    O: Fn(S, usize) -> OF,
    OF: Future<Output = (S, Result<(), String>)>,
{
    let started = Instant::now();
    let runs = (0..workers).map(|w| {
        let (budget, init, op) = (&budget, &init, &op);
        async move {
            let mut state = init(w).await;
            let mut latencies = Vec::new();
            let mut errors = Vec::new();
            while let Some(n) = budget.take() {
                let t = Instant::now();
                let (next, outcome) = op(state, n).await;
                state = next;
                match outcome {
                    Ok(()) => latencies.push(t.elapsed().as_micros() as u64),
                    Err(e) => errors.push(e),
                }
            }
            (latencies, errors)
        }
    });
    let results = join_all(runs).await;
    let seconds = started.elapsed().as_secs_f64();
    let mut latencies_us = Vec::new();
    let mut errors = Vec::new();
    for (l, e) in results {
        latencies_us.extend(l);
        errors.extend(e);
    }
    latencies_us.sort_unstable();
    Stats {
        ok: latencies_us.len(),
        errors: errors.len(),
        first_error: errors.into_iter().next(),
        seconds,
        latencies_us,
    }
}
