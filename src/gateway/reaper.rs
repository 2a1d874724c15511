//! The reaper: upstream sessions of flows the client abandoned are deleted by the replica
//! that opened them, at the flow's deadline.
//!
//! What it guarantees: a flow's `requestState` never outlives its deadline (every round's
//! expiry is capped by it), so a session still watched at the deadline can serve no one
//! and is DELETEd, with the credentials of the round that watched it last (a server that
//! checks them on every request, as the SDKs' OAuth resource servers do, refuses a DELETE
//! without them and keeps the session). The table is per replica and bounded; a replica
//! that dies takes its table with it, and the upstream's own session expiry is then the
//! backstop. A flow that completes on another replica has its session deleted there, and
//! the reaper's later DELETE gets a harmless 404.

use crate::mrtr::state::now_secs;
use crate::protocol::headers::EndToEnd;
use crate::upstream::exchange::UpstreamClient;
use crate::upstream::legacy_session::LegacySession;
use crate::upstream::{Endpoint, Timeouts};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::{HashMap, HashSet};
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

/// A watched session: where it lives, whose credentials its DELETE carries, its id, and
/// its deadline. Hashed and compared by (target, session id) only; 24 bytes in the table,
/// plus the caller's index and the id on the heap (in the allocator's size class of the
/// id alone, for the 36-byte ids servers issue), since a replica may watch a million of
/// them (benches/RESULTS.md, "Parked flows at scale").
struct Watched {
    /// The caller's index (4 bytes, little-endian), then the session id.
    key: Box<[u8]>,
    target: u32,
    /// Seconds since the epoch (fits until 2106).
    deadline: u32,
}

impl Watched {
    fn new(target: u32, caller: u32, session: &str, deadline: u64) -> Watched {
        let mut key = Vec::with_capacity(4 + session.len());
        key.extend_from_slice(&caller.to_le_bytes());
        key.extend_from_slice(session.as_bytes());
        Watched {
            key: key.into_boxed_slice(),
            target,
            deadline: u32::try_from(deadline).unwrap_or(u32::MAX),
        }
    }

    fn caller(&self) -> u32 {
        let mut index = [0; 4];
        index.copy_from_slice(&self.key[..4]);
        u32::from_le_bytes(index)
    }

    fn session(&self) -> &[u8] {
        &self.key[4..]
    }
}

impl PartialEq for Watched {
    fn eq(&self, other: &Self) -> bool {
        (self.target, self.session()) == (other.target, other.session())
    }
}

impl Eq for Watched {}

impl Hash for Watched {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.target, self.session()).hash(state);
    }
}

/// The end-to-end headers (credentials) watched sessions' DELETEs carry, interned: one
/// user's many flows share one copy, dropped with the last of them.
#[derive(Default)]
struct Callers {
    slots: Vec<Option<Caller>>,
    by_digest: HashMap<[u8; 32], u32>,
    free: Vec<u32>,
}

struct Caller {
    headers: EndToEnd,
    digest: [u8; 32],
    watched_by: u32,
}

impl Callers {
    /// The index of `headers`, counted once more.
    fn acquire(&mut self, headers: &EndToEnd) -> u32 {
        let digest = headers.digest();
        if let Some(&index) = self.by_digest.get(&digest) {
            if let Some(caller) = &mut self.slots[index as usize] {
                caller.watched_by += 1;
                return index;
            }
        }
        let caller = Caller {
            headers: headers.without_forwarding(),
            digest,
            watched_by: 1,
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index as usize] = Some(caller);
                index
            }
            None => {
                self.slots.push(Some(caller));
                (self.slots.len() - 1) as u32
            }
        };
        self.by_digest.insert(digest, index);
        index
    }

    /// Counts `index` once less; the last release drops its headers.
    fn release(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        let Some(caller) = slot else { return };
        caller.watched_by -= 1;
        if caller.watched_by == 0 {
            self.by_digest.remove(&caller.digest);
            *slot = None;
            self.free.push(index);
        }
    }

    fn headers(&self, index: u32) -> EndToEnd {
        self.slots[index as usize]
            .as_ref()
            .map(|c| c.headers.clone())
            .unwrap_or_default()
    }
}

/// The watched sessions, and the targets they live on.
#[derive(Default)]
struct Table {
    targets: Vec<Target>,
    callers: Callers,
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

    /// Watches an upstream session until `deadline` (seconds since the epoch), to be
    /// deleted with `caller`'s headers (the latest round's: a refreshed token replaces
    /// an expired one). Returns false when the table is full: the caller should not
    /// leave the flow pending.
    pub fn watch(
        &self,
        endpoint: &Endpoint,
        timeouts: &Timeouts,
        session: &str,
        caller: &EndToEnd,
        deadline: u64,
    ) -> bool {
        let mut table = self.table.lock().expect("reaper lock");
        let target = table.intern(endpoint, timeouts);
        let caller = table.callers.acquire(caller);
        let entry = Watched::new(target, caller, session, deadline);
        if table.watched.len() >= self.capacity && !table.watched.contains(&entry) {
            table.callers.release(caller);
            return false;
        }
        if let Some(replaced) = table.watched.replace(entry) {
            table.callers.release(replaced.caller());
        }
        true
    }

    /// Stops watching a session this replica has deleted itself.
    pub fn forget(&self, endpoint: &Endpoint, session: &str) {
        let mut table = self.table.lock().expect("reaper lock");
        let Some(target) = table.find(endpoint) else {
            return;
        };
        if let Some(watched) = table.watched.take(&Watched::new(target, 0, session, 0)) {
            table.callers.release(watched.caller());
        }
    }

    /// How many sessions are watched now.
    pub fn watched(&self) -> usize {
        self.table.lock().expect("reaper lock").watched.len()
    }

    /// Removes and returns the sessions due at `now`, with where they live and the
    /// headers their DELETE carries.
    fn take_due(&self, now: u64) -> Vec<Due> {
        let mut table = self.table.lock().expect("reaper lock");
        let due: Vec<Watched> = table
            .watched
            .extract_if(|w| u64::from(w.deadline) <= now)
            .collect();
        due.into_iter()
            .map(|w| {
                let target = &table.targets[w.target as usize];
                let (endpoint, timeouts) = (target.endpoint.clone(), target.timeouts);
                let headers = table.callers.headers(w.caller());
                table.callers.release(w.caller());
                Due {
                    endpoint,
                    timeouts,
                    session: String::from_utf8_lossy(w.session()).into_owned(),
                    headers,
                }
            })
            .collect()
    }

    /// Deletes every session due at `now`; returns how many.
    pub async fn sweep(&self, client: &UpstreamClient, now: u64) -> usize {
        let due = self.take_due(now);
        let reaped = due.len();
        for Due {
            endpoint,
            timeouts,
            session,
            headers,
        } in due
        {
            let mut upstream = LegacySession::resume(client, endpoint, &timeouts, session);
            upstream.caller.headers = headers;
            upstream.reap().await;
        }
        reaped
    }
}

/// A session due for its DELETE.
struct Due {
    endpoint: Endpoint,
    timeouts: Timeouts,
    session: String,
    headers: EndToEnd,
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

    fn nobody() -> EndToEnd {
        EndToEnd::default()
    }

    fn bearer(token: &'static str) -> EndToEnd {
        let mut headers = EndToEnd::default();
        headers.push(
            http::header::AUTHORIZATION,
            http::HeaderValue::from_static(token),
        );
        headers
    }

    #[test]
    fn only_due_sessions_are_taken_and_the_table_is_bounded() {
        let r = Reaper::new(2);
        assert!(r.watch(&endpoint(1), &timeouts(), "a", &nobody(), 100));
        assert!(r.watch(&endpoint(1), &timeouts(), "b", &nobody(), 200));
        assert!(
            !r.watch(&endpoint(2), &timeouts(), "c", &nobody(), 100),
            "full"
        );
        assert!(
            r.watch(&endpoint(1), &timeouts(), "a", &nobody(), 150),
            "re-watching an entry is not growth"
        );
        r.forget(&endpoint(1), "b");
        assert_eq!(r.watched(), 1);
        assert!(r.take_due(149).is_empty());
        let due = r.take_due(150);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].session, "a");
        assert_eq!(due[0].endpoint.addr, endpoint(1).addr);
        assert_eq!(r.watched(), 0);
    }

    #[test]
    fn a_due_session_carries_the_credentials_of_its_latest_round_and_no_forwarding() {
        let r = Reaper::new(10);
        let mut first = bearer("Bearer old");
        first.push(
            http::HeaderName::from_static("x-forwarded-for"),
            http::HeaderValue::from_static("10.0.0.9"),
        );
        assert!(r.watch(&endpoint(1), &timeouts(), "a", &first, 100));
        assert!(r.watch(&endpoint(1), &timeouts(), "b", &bearer("Bearer other"), 100));
        // The next round of "a" came with a refreshed token.
        assert!(r.watch(&endpoint(1), &timeouts(), "a", &bearer("Bearer new"), 100));
        let mut due = r.take_due(100);
        due.sort_by(|x, y| x.session.cmp(&y.session));
        let credential = |d: &Due| {
            let names: Vec<_> = d.headers.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["authorization"], "only the credentials");
            d.headers.iter().next().map(|(_, v)| v.clone()).unwrap()
        };
        assert_eq!(credential(&due[0]), "Bearer new");
        assert_eq!(credential(&due[1]), "Bearer other");
    }

    #[test]
    fn a_watched_session_stays_24_bytes_in_the_table() {
        assert_eq!(std::mem::size_of::<Watched>(), 24);
    }

    #[test]
    fn callers_are_shared_and_dropped_with_their_last_session() {
        let r = Reaper::new(10);
        for session in ["a", "b", "c"] {
            assert!(r.watch(&endpoint(1), &timeouts(), session, &bearer("Bearer u"), 100));
        }
        let live = |r: &Reaper| {
            let table = r.table.lock().unwrap();
            table.callers.slots.iter().flatten().count()
        };
        assert_eq!(live(&r), 1, "one user's flows share one copy");
        r.forget(&endpoint(1), "a");
        r.forget(&endpoint(1), "b");
        assert_eq!(live(&r), 1);
        r.forget(&endpoint(1), "c");
        assert_eq!(live(&r), 0, "the last session released its caller");
        assert!(r.watch(&endpoint(1), &timeouts(), "d", &bearer("Bearer v"), 100));
        assert_eq!(
            r.table.lock().unwrap().callers.slots.len(),
            1,
            "slot reused"
        );
    }
}
