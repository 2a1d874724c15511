//! The reaper: upstream sessions of flows the client abandoned are deleted by the replica
//! that opened them, at the flow's deadline.
//!
//! What it guarantees: a flow's `requestState` never outlives its deadline (every round's
//! expiry is capped by it), so a session still watched at the deadline can serve no one
//! and is DELETEd. The table is per replica and bounded; a replica that dies takes its
//! table with it, and the upstream's own session expiry is then the backstop. A flow that
//! completes on another replica has its session deleted there, and the reaper's later
//! DELETE gets a harmless 404.

use crate::mrtr::state::now_secs;
use crate::upstream::exchange::UpstreamClient;
use crate::upstream::legacy_session::LegacySession;
use crate::upstream::{Endpoint, Timeouts};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often due sessions are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Where a watched session lives: interned, since many sessions share one endpoint.
struct Target {
    endpoint: Endpoint,
    timeouts: Timeouts,
}

/// A watched session: where it lives, its id, and its deadline. Hashed and compared by
/// (target, session) only; 24 bytes in the table, plus the id on the heap, since a
/// replica may watch a million of them (benches/RESULTS.md, "Parked flows at scale").
struct Watched {
    session: Box<str>,
    target: u32,
    /// Seconds since the epoch (fits until 2106).
    deadline: u32,
}

impl Watched {
    fn new(target: u32, session: &str, deadline: u64) -> Watched {
        Watched {
            session: session.into(),
            target,
            deadline: u32::try_from(deadline).unwrap_or(u32::MAX),
        }
    }
}

impl PartialEq for Watched {
    fn eq(&self, other: &Self) -> bool {
        (self.target, &self.session) == (other.target, &other.session)
    }
}

impl Eq for Watched {}

impl Hash for Watched {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.target, &self.session).hash(state);
    }
}

/// The watched sessions, and the targets they live on.
#[derive(Default)]
struct Table {
    targets: Vec<Target>,
    watched: HashSet<Watched>,
}

impl Table {
    fn find(&self, endpoint: &Endpoint) -> Option<u32> {
        let same = |t: &Target| t.endpoint == *endpoint;
        self.targets.iter().position(same).map(|i| i as u32)
    }

    fn intern(&mut self, endpoint: &Endpoint, timeouts: &Timeouts) -> u32 {
        match self.find(endpoint) {
            Some(i) => {
                self.targets[i as usize].timeouts = *timeouts;
                i
            }
            None => {
                self.targets.push(Target {
                    endpoint: endpoint.clone(),
                    timeouts: *timeouts,
                });
                (self.targets.len() - 1) as u32
            }
        }
    }
}

pub struct Reaper {
    table: Mutex<Table>,
    capacity: usize,
}

impl Reaper {
    pub fn new(capacity: usize) -> Reaper {
        Reaper {
            table: Mutex::new(Table::default()),
            capacity,
        }
    }

    /// Watches an upstream session until `deadline` (seconds since the epoch). Returns
    /// false when the table is full: the caller should not leave the flow pending.
    pub fn watch(
        &self,
        endpoint: &Endpoint,
        timeouts: &Timeouts,
        session: &str,
        deadline: u64,
    ) -> bool {
        let mut table = self.table.lock().expect("reaper lock");
        let target = table.intern(endpoint, timeouts);
        let entry = Watched::new(target, session, deadline);
        if table.watched.len() >= self.capacity && !table.watched.contains(&entry) {
            return false;
        }
        table.watched.replace(entry);
        true
    }

    /// Stops watching a session this replica has deleted itself.
    pub fn forget(&self, endpoint: &Endpoint, session: &str) {
        let mut table = self.table.lock().expect("reaper lock");
        if let Some(target) = table.find(endpoint) {
            table.watched.remove(&Watched::new(target, session, 0));
        }
    }

    /// How many sessions are watched now.
    pub fn watched(&self) -> usize {
        self.table.lock().expect("reaper lock").watched.len()
    }

    /// Removes and returns the sessions due at `now`, with where they live.
    fn take_due(&self, now: u64) -> Vec<(Endpoint, Timeouts, String)> {
        let mut table = self.table.lock().expect("reaper lock");
        let due: Vec<Watched> = table
            .watched
            .extract_if(|w| u64::from(w.deadline) <= now)
            .collect();
        due.into_iter()
            .map(|w| {
                let target = &table.targets[w.target as usize];
                (target.endpoint.clone(), target.timeouts, w.session.into())
            })
            .collect()
    }

    /// Deletes every session due at `now`; returns how many.
    pub async fn sweep(&self, client: &UpstreamClient, now: u64) -> usize {
        let due = self.take_due(now);
        for (endpoint, timeouts, session) in &due {
            LegacySession::resume(client, endpoint.clone(), timeouts, session.clone())
                .reap()
                .await;
        }
        due.len()
    }
}

/// Runs the sweeps until shutdown.
pub struct ReaperService {
    pub reaper: Arc<Reaper>,
    /// The gateway's metrics, where reaped sessions are counted.
    pub metrics: Arc<crate::metrics::Metrics>,
}

#[async_trait]
impl BackgroundService for ReaperService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let client = UpstreamClient::new(self.metrics.clone());
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let reaped = self.reaper.sweep(&client, now_secs()).await;
                    if reaped > 0 {
                        tracing::info!(reaped, "deleted the upstream sessions of abandoned flows");
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(port: u16) -> Endpoint {
        Endpoint {
            addr: ([127, 0, 0, 1], port).into(),
            authority: format!("127.0.0.1:{port}"),
            path: "/mcp".into(),
            tls: None,
        }
    }

    fn timeouts() -> Timeouts {
        Timeouts {
            connect: Duration::from_millis(100),
            response: Duration::from_millis(100),
            stream_idle: None,
        }
    }

    #[test]
    fn only_due_sessions_are_taken_and_the_table_is_bounded() {
        let r = Reaper::new(2);
        assert!(r.watch(&endpoint(1), &timeouts(), "a", 100));
        assert!(r.watch(&endpoint(1), &timeouts(), "b", 200));
        assert!(!r.watch(&endpoint(2), &timeouts(), "c", 100), "full");
        assert!(
            r.watch(&endpoint(1), &timeouts(), "a", 150),
            "re-watching an entry is not growth"
        );
        r.forget(&endpoint(1), "b");
        assert_eq!(r.watched(), 1);
        assert!(r.take_due(149).is_empty());
        let due = r.take_due(150);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].2, "a");
        assert_eq!(due[0].0.addr, endpoint(1).addr);
        assert_eq!(r.watched(), 0);
    }
}
