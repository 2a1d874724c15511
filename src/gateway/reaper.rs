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
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often due sessions are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

struct Watched {
    endpoint: Endpoint,
    timeouts: Timeouts,
    deadline: u64,
}

pub struct Reaper {
    watched: Mutex<HashMap<String, Watched>>,
    capacity: usize,
}

impl Reaper {
    pub fn new(capacity: usize) -> Reaper {
        Reaper {
            watched: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    fn key(endpoint: &Endpoint, session: &str) -> String {
        format!("{} {session}", endpoint.addr)
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
        let mut watched = self.watched.lock().expect("reaper lock");
        let key = Self::key(endpoint, session);
        if watched.len() >= self.capacity && !watched.contains_key(&key) {
            return false;
        }
        let entry = Watched {
            endpoint: endpoint.clone(),
            timeouts: *timeouts,
            deadline,
        };
        watched.insert(key, entry);
        true
    }

    /// Stops watching a session this replica has deleted itself.
    pub fn forget(&self, endpoint: &Endpoint, session: &str) {
        self.watched
            .lock()
            .expect("reaper lock")
            .remove(&Self::key(endpoint, session));
    }

    /// How many sessions are watched now.
    pub fn watched(&self) -> usize {
        self.watched.lock().expect("reaper lock").len()
    }

    /// Removes and returns the sessions due at `now`.
    fn take_due(&self, now: u64) -> Vec<(Watched, String)> {
        let mut watched = self.watched.lock().expect("reaper lock");
        let due: Vec<String> = watched
            .iter()
            .filter(|(_, w)| w.deadline <= now)
            .map(|(k, _)| k.clone())
            .collect();
        due.into_iter()
            .filter_map(|k| {
                let w = watched.remove(&k)?;
                let session = k.split_once(' ').map(|(_, s)| s.to_string())?;
                Some((w, session))
            })
            .collect()
    }

    /// Deletes every session due at `now`; returns how many.
    pub async fn sweep(&self, client: &UpstreamClient, now: u64) -> usize {
        let due = self.take_due(now);
        for (w, session) in &due {
            LegacySession::resume(client, &w.endpoint, &w.timeouts, session.clone())
                .delete()
                .await;
        }
        due.len()
    }
}

/// Runs the sweeps until shutdown.
pub struct ReaperService {
    pub reaper: Arc<Reaper>,
}

#[async_trait]
impl BackgroundService for ReaperService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let client = UpstreamClient::default();
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
        assert_eq!(due[0].1, "a");
        assert_eq!(r.watched(), 0);
    }
}
