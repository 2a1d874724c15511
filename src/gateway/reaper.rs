//! The reaper: upstream sessions of flows the client abandoned are deleted by the replica
//! that opened them, at the flow's deadline; in a data-layer session, which outlives its
//! calls, an abandoned call is cancelled by id instead (`notifications/cancelled`), by the
//! replica that posted it.
//!
//! What it guarantees: a flow's `requestState` never outlives its deadline (every round's
//! expiry is capped by it), so a session still watched at the deadline can serve no one
//! and is DELETEd, with the credentials of the round that watched it last (a server that
//! checks them on every request, as the SDKs' OAuth resource servers do, refuses a DELETE
//! without them and keeps the session). The table is per replica and bounded; a replica
//! that dies takes its table with it, and the upstream's own session expiry is then the
//! backstop. A flow that completes on another replica has its session deleted there, and
//! the reaper's later DELETE gets a harmless 404 (a call's later cancellation names an id
//! the server no longer runs, which receivers ignore). Such entries still take room in
//! the table: when it (or a principal's share) is full, `reclaim` asks the upstream, with
//! a `ping` in each of the oldest sessions, which ones it no longer has, and frees them.
//! An end the upstream could not take (down, restarting) is sent again a few times
//! (`RETRY_AFTER`), from a bounded list beside the table. Ends go only to endpoints a
//! group still has (a DNS group's pod that left may have given its address to another
//! server), and one endpoint that hangs takes only a few of a sweep's at once.

use super::admin::Drain;
use crate::mrtr::flow::{FailureKind, NOT_CONTINUED};
use crate::mrtr::state::now_secs;
use crate::protocol::headers::EndToEnd;
use crate::protocol::jsonrpc::Cancellation;
use crate::protocol::revision::Revision;
use crate::protocol::session_token::SessionToken;
use crate::upstream::exchange::UpstreamClient;
use crate::upstream::legacy_session::{within, LegacySession, SessionError};
use crate::upstream::DeleteLater;
use crate::upstream::{Endpoint, Timeouts};
use async_trait::async_trait;
use hashbrown::HashTable;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde_json::Value;
use slab::Slab;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often due sessions are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A DELETE or cancellation that failed without an answer saying why (the upstream down
/// or restarting, a cut, a server error) is sent again after each of these delays in
/// turn (seconds), then given up on with a warning: the SDK servers keep a session until
/// it is deleted.
const RETRY_AFTER: [u64; 4] = [5, 20, 60, 180];
/// The most that wait to be sent again; beyond, the oldest is given up on.
const MAX_RETRYING: usize = 4096;
/// Ends sent at once by a sweep, and the longest each may take: an upstream that hangs
/// holds neither the others nor the next sweep for its response timeouts.
const ENDS_AT_ONCE: usize = 16;
const END_WITHIN: Duration = Duration::from_secs(10);
/// The same in the grace period's last stretch (4 s by default): an upstream that hangs
/// must not keep the other last tries from going out before the process ends.
const LAST_ENDS_AT_ONCE: usize = 64;
const LAST_END_WITHIN: Duration = Duration::from_secs(1);
/// Ends one endpoint takes of a sweep's at once, outside the last stretch: one that hangs
/// leaves the rest to the others.
const ENDS_AT_ONCE_PER_ENDPOINT: usize = 4;
/// How long a sweep starts ends for; those left wait for the next sweep, with the ends
/// that came due meanwhile.
const STARTS_FOR: Duration = END_WITHIN;
/// Most sessions one `reclaim` asks about, the longest it takes, and how long after one
/// that freed nothing another may run for the same share of the table (a caller that
/// fills its share with flows it abandoned must not make every call it sends cost the
/// upstream a reclaim's pings).
const RECLAIM_CHECKS: usize = 256;
const RECLAIM_WITHIN: Duration = Duration::from_secs(2);
const RECLAIM_EVERY: Duration = Duration::from_secs(5);
/// How many sessions a reclaim asks at once, and the longest it waits for each.
const RECLAIM_AT_ONCE: usize = 16;
const RECLAIM_PING_WITHIN: Duration = Duration::from_millis(500);
/// Most shares whose last reclaim is remembered (then all are forgotten).
const RECLAIMS_REMEMBERED: usize = 1024;

/// Where a watched session lives: interned, since many sessions share one endpoint.
struct Target {
    endpoint: Endpoint,
    timeouts: Timeouts,
    /// Owners on it: the last one released drops it, so that endpoints gone from DNS
    /// (pods replaced) do not stay in the table for good.
    owners: u32,
}

/// What the reaper ends at a flow's deadline.
#[derive(Clone, Copy, Debug)]
pub enum Abandoned<'a> {
    /// A session the flow opened: deleted.
    Session(&'a str),
    /// A call waiting for answers in a data-layer session, which outlives it: cancelled
    /// by its upstream id.
    Call { session: &'a str, id: &'a Value },
}

impl<'a> From<&'a str> for Abandoned<'a> {
    fn from(session: &'a str) -> Abandoned<'a> {
        Abandoned::Session(session)
    }
}

/// Between a session id and a call's id in a call's key: a header value, which a session
/// id is, never holds a line feed.
const CALL_SEPARATOR: char = '\n';

impl Abandoned<'_> {
    /// The key it is watched under: the session id, or for a call the session id and the
    /// call's id (as JSON).
    fn key(&self) -> String {
        match self {
            Abandoned::Session(session) => (*session).to_owned(),
            Abandoned::Call { session, id } => format!("{session}{CALL_SEPARATOR}{id}"),
        }
    }
}

/// A watched session or call: whose it is, its key (`Abandoned::key`), and its deadline.
/// 24 bytes in the table, plus the key on the heap, since a replica may watch a million of
/// them (benches/RESULTS.md, "Parked flows at scale"); found by (endpoint, key).
struct Watched {
    key: Box<str>,
    owner: u32,
    /// Seconds since the epoch (fits until 2106).
    deadline: u32,
}

/// Whose watched sessions are: the endpoint they live on (an index into the targets), the
/// credentials their DELETE carries and the revision it names (the sessions'). Interned
/// and counted, since one user's many flows on one endpoint share one, and dropped with
/// the last.
struct Owner {
    target: u32,
    headers: EndToEnd,
    digest: [u8; 32],
    /// The principal its flows count against (`None`: anonymous, counted only in all).
    principal: Option<[u8; 32]>,
    version: Revision,
    watching: u32,
}

/// Who a watched session is for: the headers its DELETE carries, and the principal whose
/// share of the table it takes (`None`: only the whole table bounds it).
#[derive(Clone, Copy)]
pub struct Whose<'a> {
    pub headers: &'a EndToEnd,
    pub principal: Option<[u8; 32]>,
}

impl<'a> From<&'a EndToEnd> for Whose<'a> {
    fn from(headers: &'a EndToEnd) -> Whose<'a> {
        Whose {
            headers,
            principal: None,
        }
    }
}

/// Why a session is not watched: the whole table is full, or the principal's share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotWatched {
    Full,
    PrincipalFull,
}

#[derive(Default)]
struct Owners {
    slots: Slab<Owner>,
    index: HashMap<OwnerKey, u32>,
}

/// What makes owners one: the target, the headers' digest, the revision and the
/// principal (two principals sending the same headers, where the principal comes from a
/// header not forwarded, still count apart).
type OwnerKey = (u32, [u8; 32], Revision, Option<[u8; 32]>);

impl Owners {
    /// The owner of `whose.principal`'s sessions on `target` of `version` deleted with
    /// `whose.headers`, counted once more.
    /// `true` with it: the owner is new.
    fn acquire(&mut self, target: u32, whose: Whose<'_>, version: Revision) -> (u32, bool) {
        let digest = whose.headers.digest();
        let key = (target, digest, version, whose.principal);
        if let Some(&index) = self.index.get(&key) {
            if let Some(owner) = self.slots.get_mut(index as usize) {
                owner.watching += 1;
                return (index, false);
            }
        }
        let index = self.slots.insert(Owner {
            target,
            headers: whose.headers.without_forwarding(),
            digest,
            principal: whose.principal,
            version,
            watching: 1,
        }) as u32;
        self.index.insert(key, index);
        (index, true)
    }

    /// Counts `index` once less; the last release drops its headers, and returns its
    /// target.
    fn release(&mut self, index: u32) -> Option<u32> {
        let owner = self.slots.get_mut(index as usize)?;
        owner.watching -= 1;
        if owner.watching > 0 {
            return None;
        }
        let owner = self.slots.remove(index as usize);
        let key = (owner.target, owner.digest, owner.version, owner.principal);
        self.index.remove(&key);
        Some(owner.target)
    }

    fn get(&self, index: u32) -> Option<&Owner> {
        self.slots.get(index as usize)
    }

    fn target_of(&self, index: u32) -> Option<u32> {
        self.get(index).map(|o| o.target)
    }
}

/// The watched sessions, whose they are, and the targets they live on.
#[derive(Default)]
struct Table {
    targets: Slab<Target>,
    owners: Owners,
    watched: HashTable<Watched>,
    /// How many watched entries each principal's owners have.
    by_principal: HashMap<[u8; 32], usize>,
    hasher: RandomState,
}

impl Table {
    fn find(&self, endpoint: &Endpoint) -> Option<u32> {
        let mut targets = self.targets.iter();
        let (index, _) = targets.find(|(_, t)| t.endpoint == *endpoint)?;
        Some(index as u32)
    }

    /// The owner of `whose` sessions on `endpoint`, counted once more (its target kept,
    /// or added, with `timeouts`).
    fn acquire(
        &mut self,
        endpoint: &Endpoint,
        timeouts: &Timeouts,
        whose: Whose<'_>,
        version: Revision,
    ) -> (u32, u32) {
        let target = match self.find(endpoint) {
            Some(i) => {
                self.targets[i as usize].timeouts = *timeouts;
                i
            }
            None => self.targets.insert(Target {
                endpoint: endpoint.clone(),
                timeouts: *timeouts,
                owners: 0,
            }) as u32,
        };
        let (owner, new) = self.owners.acquire(target, whose, version);
        if new {
            self.targets[target as usize].owners += 1;
        }
        (target, owner)
    }

    /// Removes the entry of `key` on `target`, if watched, and releases its owner.
    fn remove(&mut self, target: u32, key: &str) -> bool {
        let owners = &self.owners;
        let same = |w: &Watched| &*w.key == key && owners.target_of(w.owner) == Some(target);
        let hash = slot_hash(&self.hasher, Some(target), key);
        let Ok(found) = self.watched.find_entry(hash, same) else {
            return false;
        };
        let owner = found.remove().0.owner;
        self.release(owner);
        true
    }

    /// The end of the entry keyed `key` (`Abandoned::key`) for `owner`: where it lives
    /// and the headers it carries.
    fn due(&self, key: &str, owner: u32) -> Option<Due> {
        let owner = self.owners.get(owner)?;
        let target = &self.targets[owner.target as usize];
        let (session, end) = End::of_key(key)?;
        Some(Due {
            endpoint: target.endpoint.clone(),
            timeouts: target.timeouts,
            session: session.to_owned(),
            end,
            headers: owner.headers.clone(),
            version: owner.version,
        })
    }

    /// Counts a removed entry's owner, and its principal, once less.
    fn release(&mut self, owner: u32) {
        let principal = self.owners.get(owner).and_then(|o| o.principal);
        if let Some(principal) = principal {
            if let Some(count) = self.by_principal.get_mut(&principal) {
                *count -= 1;
                if *count == 0 {
                    self.by_principal.remove(&principal);
                }
            }
        }
        let Some(target) = self.owners.release(owner) else {
            return;
        };
        let Some(on_target) = self.targets.get_mut(target as usize) else {
            return;
        };
        on_target.owners -= 1;
        if on_target.owners == 0 {
            self.targets.remove(target as usize);
        }
    }

    /// How many entries `principal` has.
    fn count_of(&self, principal: Option<[u8; 32]>) -> usize {
        principal.map_or(0, |p| self.by_principal.get(&p).copied().unwrap_or(0))
    }

    /// Adds an entry known to be absent, for a session on `target`.
    fn insert(&mut self, target: u32, entry: Watched) {
        if let Some(principal) = self.owners.get(entry.owner).and_then(|o| o.principal) {
            *self.by_principal.entry(principal).or_default() += 1;
        }
        let Table {
            owners,
            watched,
            hasher,
            ..
        } = self;
        let hash = slot_hash(hasher, Some(target), &entry.key);
        let rehash = |w: &Watched| slot_hash(hasher, owners.target_of(w.owner), &w.key);
        watched.insert_unique(hash, entry, rehash);
    }
}

/// The hash a watched entry is found by: its endpoint and its key.
fn slot_hash(hasher: &RandomState, target: Option<u32>, key: &str) -> u64 {
    hasher.hash_one((target, key))
}

pub struct Reaper {
    table: Mutex<Table>,
    capacity: usize,
    per_principal: usize,
    /// Each share of the table (a principal's, or `None`: the whole) being reclaimed now,
    /// or whose last reclaim freed nothing.
    reclaims: Mutex<HashMap<Option<[u8; 32]>, Reclaim>>,
    /// Ends that failed and are tried again (`RETRY_AFTER`), in the order they failed.
    retrying: Mutex<Vec<Retrying>>,
    /// Ends given up on outside the sweeps (evicted from a full `retrying`), reported by
    /// the next sweep.
    given_up: AtomicUsize,
    /// An end was added to `retrying`: in the grace period's last stretch it is sent at
    /// once, not at the next tick.
    retry_kept: tokio::sync::Notify,
}

/// An end to send at `at` (seconds since the epoch), after `failed` attempts.
struct Retrying {
    due: Due,
    failed: usize,
    at: u64,
}

impl Retrying {
    /// `due`'s first attempt, at `now`.
    fn first(due: Due, now: u64) -> Retrying {
        Retrying {
            due,
            failed: 0,
            at: now,
        }
    }
}

/// Where a share's reclaims stand.
enum Reclaim {
    /// One runs (one per share at a time).
    Running,
    /// The last one freed nothing, at this time.
    FreedNothing(std::time::Instant),
}

impl Reaper {
    /// A table of at most `capacity` entries, `per_principal` of them one principal's.
    pub fn new(capacity: usize, per_principal: usize) -> Reaper {
        Reaper {
            table: Mutex::new(Table::default()),
            capacity,
            per_principal,
            reclaims: Mutex::default(),
            retrying: Mutex::default(),
            given_up: AtomicUsize::new(0),
            retry_kept: tokio::sync::Notify::new(),
        }
    }

    /// Watches an upstream session that negotiated `version` (or a call in it) until
    /// `deadline` (seconds since the epoch), to be ended with the caller's headers (the
    /// latest round's: a refreshed token replaces an expired one). Refused when the table
    /// is full, or the principal's share of it: the caller should not leave the flow
    /// pending. Watching an entry again is not growth.
    pub fn watch<'w, 'c>(
        &self,
        endpoint: &Endpoint,
        timeouts: &Timeouts,
        what: impl Into<Abandoned<'w>>,
        whose: impl Into<Whose<'c>>,
        version: Revision,
        deadline: u64,
    ) -> Result<(), NotWatched> {
        let (key, whose) = (what.into().key().into_boxed_str(), whose.into());
        let mut table = self.table.lock().expect("reaper lock");
        let watched = table.find(endpoint);
        if !watched.is_some_and(|target| table.remove(target, &key)) {
            if table.watched.len() >= self.capacity {
                return Err(NotWatched::Full);
            }
            if table.count_of(whose.principal) >= self.per_principal {
                return Err(NotWatched::PrincipalFull);
            }
        }
        let (target, owner) = table.acquire(endpoint, timeouts, whose, version);
        let deadline = u32::try_from(deadline).unwrap_or(u32::MAX);
        table.insert(
            target,
            Watched {
                key,
                owner,
                deadline,
            },
        );
        Ok(())
    }

    /// Stops watching a session this replica has deleted itself, or a call that ended.
    pub fn forget<'w>(&self, endpoint: &Endpoint, what: impl Into<Abandoned<'w>>) {
        let key = what.into().key();
        let mut table = self.table.lock().expect("reaper lock");
        if let Some(target) = table.find(endpoint) {
            table.remove(target, &key);
        }
    }

    /// How many sessions are watched now.
    pub fn watched(&self) -> usize {
        self.table.lock().expect("reaper lock").watched.len()
    }

    /// Frees the entries of sessions the upstream no longer has (their flows ended on
    /// another replica, which deleted them): at most `RECLAIM_CHECKS` of `principal`'s
    /// (or of anyone's, for `None`), those due first, each asked with a `ping`, within
    /// `RECLAIM_WITHIN`. Run when the table, or a principal's share, is full: the
    /// replica that opened a flow cannot otherwise know that another ended it. At most
    /// `RECLAIM_EVERY` after one that freed nothing, another runs for the same share;
    /// returns how many entries it freed.
    pub async fn reclaim(
        &self,
        client: &Arc<UpstreamClient>,
        principal: Option<[u8; 32]>,
    ) -> usize {
        let Some(turn) = self.reclaim_turn(principal) else {
            return 0;
        };
        // Asked at once, a few at a time, each within its own bound: a session whose
        // server does not answer holds up no other.
        let asking = Arc::new(tokio::sync::Semaphore::new(RECLAIM_AT_ONCE));
        let mut checks = tokio::task::JoinSet::new();
        for candidate in self.candidates(principal) {
            let (client, asking) = (client.clone(), asking.clone());
            checks.spawn(async move {
                let _slot = asking.acquire_owned().await.ok()?;
                let Due {
                    endpoint,
                    timeouts,
                    session,
                    headers,
                    version,
                    ..
                } = candidate;
                let mut upstream = LegacySession::resume(
                    &client,
                    endpoint.clone(),
                    &timeouts,
                    session.clone(),
                    version,
                );
                upstream.caller.headers = headers;
                let gone = tokio::time::timeout(RECLAIM_PING_WITHIN, upstream.is_gone()).await;
                gone.unwrap_or(false).then_some((endpoint, session))
            });
        }
        let mut freed = 0;
        let deadline = tokio::time::Instant::now() + RECLAIM_WITHIN;
        while let Ok(Some(checked)) = tokio::time::timeout_at(deadline, checks.join_next()).await {
            if let Ok(Some((endpoint, session))) = checked {
                self.forget(&endpoint, session.as_str());
                freed += 1;
            }
        }
        if freed == 0 {
            turn.freed_nothing();
        } else {
            tracing::info!(
                freed,
                "freed the watched sessions of flows that ended on other replicas"
            );
        }
        freed
    }

    /// The turn to reclaim `principal`'s share, unless one runs now or one freed nothing
    /// within `RECLAIM_EVERY`.
    fn reclaim_turn(&self, principal: Option<[u8; 32]>) -> Option<ReclaimTurn<'_>> {
        let mut reclaims = self.reclaims.lock().expect("reclaims lock");
        match reclaims.get(&principal) {
            Some(Reclaim::Running) => return None,
            Some(Reclaim::FreedNothing(at)) if at.elapsed() < RECLAIM_EVERY => return None,
            _ => {}
        }
        if reclaims.len() >= RECLAIMS_REMEMBERED {
            reclaims.retain(|_, r| matches!(r, Reclaim::Running));
        }
        reclaims.insert(principal, Reclaim::Running);
        let reaper = self;
        Some(ReclaimTurn { reaper, principal })
    }

    /// The sessions (not calls) `reclaim` asks about, those due first (then by id): the
    /// `RECLAIM_CHECKS` first kept as the table is read, only they copied out.
    fn candidates(&self, principal: Option<[u8; 32]>) -> Vec<Due> {
        let table = self.table.lock().expect("reaper lock");
        let mut first = std::collections::BinaryHeap::with_capacity(RECLAIM_CHECKS + 1);
        let sessions = table
            .watched
            .iter()
            .filter(|w| !w.key.contains(CALL_SEPARATOR));
        for w in sessions {
            let Some(owner) = table.owners.get(w.owner) else {
                continue;
            };
            if principal.is_some() && owner.principal != principal {
                continue;
            }
            first.push((w.deadline, &*w.key, w.owner));
            if first.len() > RECLAIM_CHECKS {
                first.pop();
            }
        }
        let due = |(_, key, owner): (u32, &str, u32)| table.due(key, owner);
        first
            .into_sorted_vec()
            .into_iter()
            .filter_map(due)
            .collect()
    }

    /// Removes and returns the sessions due at `now`, with where they live and the
    /// headers their DELETE carries.
    fn take_due(&self, now: u64) -> Vec<Due> {
        let mut table = self.table.lock().expect("reaper lock");
        let due: Vec<Watched> = table
            .watched
            .extract_if(|w| u64::from(w.deadline) <= now)
            .collect();
        let mut out = Vec::with_capacity(due.len());
        for w in due {
            out.extend(table.due(&w.key, w.owner));
            table.release(w.owner);
        }
        out
    }

    /// Ends every session and call due at `now`, and those due to be tried again (when
    /// `stopping`, in the grace period's last stretch: all of them, a last time), on
    /// endpoints that are still members of a group (`member`): an address that left its
    /// group may be another server's now, and gets neither a session id nor credentials.
    /// Returns how many it tried. Outside the last stretch, one endpoint takes at most
    /// `ENDS_AT_ONCE_PER_ENDPOINT` of the ends at once, and ends not started within
    /// `STARTS_FOR` wait for the next sweep, as do those not started when `near_end`
    /// comes (the ends running then are left to finish on their own): an endpoint that
    /// hangs holds up neither the others nor the last stretch.
    pub async fn sweep(
        &self,
        client: &Arc<UpstreamClient>,
        now: u64,
        stopping: bool,
        member: impl Fn(&Endpoint) -> bool,
        near_end: impl std::future::Future<Output = ()>,
    ) -> usize {
        let first = self.take_due(now).into_iter();
        let mut due: Vec<Retrying> = first.map(|due| Retrying::first(due, now)).collect();
        due.extend(match stopping {
            false => self.take_retries(now),
            true => self.take_all_retries(),
        });
        let before = due.len();
        due.retain(|r| member(&r.due.endpoint));
        if due.len() < before {
            let dropped = before - due.len();
            tracing::info!(dropped, "ends of upstream sessions or calls on endpoints that left their group were dropped: the address may serve another server now");
        }
        let (at_once, per_endpoint, limit) = match stopping {
            false => (ENDS_AT_ONCE, ENDS_AT_ONCE_PER_ENDPOINT, END_WITHIN),
            true => (LAST_ENDS_AT_ONCE, LAST_ENDS_AT_ONCE, LAST_END_WITHIN),
        };
        let tried = due.len();
        let mut waiting = std::collections::VecDeque::from(due);
        let mut running: HashMap<SocketAddr, usize> = HashMap::new();
        let mut ends = tokio::task::JoinSet::new();
        let mut given_up = self.given_up.swap(0, Ordering::Relaxed);
        let starts_until = tokio::time::Instant::now() + STARTS_FOR;
        let mut near_end = std::pin::pin!(near_end);
        loop {
            let starting = stopping || tokio::time::Instant::now() < starts_until;
            while starting && ends.len() < at_once {
                let Some(Retrying { due, failed, .. }) =
                    next_free(&mut waiting, &running, per_endpoint)
                else {
                    break;
                };
                *running.entry(due.endpoint.addr).or_default() += 1;
                let client = client.clone();
                ends.spawn(async move {
                    let ended = within(limit, Some(due.endpoint.addr), end(&client, &due)).await;
                    (due, failed, ended.err())
                });
            }
            if !starting {
                self.put_back(waiting.drain(..));
            }
            let joined = tokio::select! {
                joined = ends.join_next() => joined,
                () = &mut near_end, if !stopping => {
                    self.put_back(waiting.drain(..));
                    ends.detach_all();
                    break;
                }
            };
            let Some(joined) = joined else {
                break;
            };
            if let Ok((due, failed, ended)) = joined {
                if let Some(n) = running.get_mut(&due.endpoint.addr) {
                    *n -= 1;
                }
                if let Some(e) = ended {
                    // In the last stretch, a first attempt still gets its last try.
                    given_up += self.retry_later(due, failed, &e, stopping && failed > 0);
                }
            }
        }
        if given_up > 0 {
            tracing::warn!(given_up, "ends of flows' upstream sessions or calls were given up on, out of tries or to keep the list of ends to try again bounded; the upstream's own session expiry is left to end them");
        }
        tried
    }

    /// Keeps ends a sweep did not start for the next one, as they were (their tries
    /// not counted); beyond `MAX_RETRYING`, since they come from the bounded table.
    fn put_back(&self, ends: impl Iterator<Item = Retrying>) {
        let mut retrying = self.retrying.lock().expect("reaper retries lock");
        let now = now_secs();
        retrying.extend(ends.map(|r| Retrying { at: now, ..r }));
    }

    /// Deletes `upstream`'s session; a DELETE the upstream may take later is kept for
    /// the sweeps to send again.
    pub async fn delete(&self, upstream: &LegacySession<'_>) {
        if let Err(e) = upstream.end().await {
            self.delete_later(upstream, &e);
        }
    }

    /// Deletes the session of a flow its client abandoned (counted `reaped`); a DELETE
    /// the upstream may take later is kept for the sweeps to send again.
    pub async fn reap(&self, upstream: &LegacySession<'_>) {
        if let Err(e) = upstream.reap().await {
            self.delete_later(upstream, &e);
        }
    }

    /// Cancels a call in `upstream`'s data-layer session with `cancel`, counted under
    /// `why` (`abandoned`, `gave_up`); one the upstream may take later is kept for the
    /// sweeps to send again, the same. Returns how the first attempt went.
    pub async fn cancel(
        &self,
        upstream: &LegacySession<'_>,
        cancel: &Cancellation,
        why: &'static str,
    ) -> Result<(), SessionError> {
        let posted = upstream.cancel(cancel, why).await;
        if let Err(e) = &posted {
            // A session already gone has nothing to cancel: no news.
            let kind = FailureKind::from(e.failure());
            if !kind.may_pass_later() && kind != FailureKind::Gone {
                let error = crate::outcome::Report(e);
                tracing::info!(%error, why, "the upstream refused a call's cancellation");
            }
            self.keep_for_later(Due::cancel(upstream, cancel, why), e);
        }
        posted
    }

    /// Keeps `due`, which failed with `e` at its first attempt, for the sweeps.
    fn keep_for_later(&self, due: Option<Due>, e: &SessionError) {
        if let Some(due) = due {
            let evicted = self.retry_later(due, 0, e, false);
            self.given_up.fetch_add(evicted, Ordering::Relaxed);
        }
    }

    /// Removes and returns the ends due to be tried again at `now`.
    fn take_retries(&self, now: u64) -> Vec<Retrying> {
        let mut retrying = self.retrying.lock().expect("reaper retries lock");
        retrying.extract_if(.., |r| r.at <= now).collect()
    }

    /// Every end waiting to be sent again, whatever its turn: the replica is stopping, and
    /// will not be there for it.
    fn take_all_retries(&self) -> Vec<Retrying> {
        let mut retrying = self.retrying.lock().expect("reaper retries lock");
        retrying.drain(..).collect()
    }

    /// Keeps an end that failed (`failed` times before) to be tried again, when the
    /// upstream may take it later and it has tries left (none after its `last`); returns
    /// how many ends were given up on (this one, or the oldest waiting when the list is
    /// full).
    fn retry_later(&self, due: Due, failed: usize, e: &SessionError, last: bool) -> usize {
        let report = crate::outcome::Report(e);
        if !FailureKind::from(e.failure()).may_pass_later() {
            // Refused as such (a 404 for a session the flow's end on another replica
            // deleted already): sending it again would change nothing.
            tracing::debug!(error = %report, "the upstream refused to end a session or call");
            return 0;
        }
        let Some(after) = RETRY_AFTER.get(failed).filter(|_| !last) else {
            tracing::info!(error = %report, tries = failed + 1, "an upstream session or call could not be ended");
            return 1;
        };
        tracing::info!(error = %report, after_seconds = after, "an upstream session or call could not be ended yet; trying again");
        let mut retrying = self.retrying.lock().expect("reaper retries lock");
        let evicted = usize::from(retrying.len() >= MAX_RETRYING);
        if evicted > 0 {
            retrying.remove(0);
        }
        retrying.push(Retrying {
            due,
            failed: failed + 1,
            at: now_secs() + after,
        });
        self.retry_kept.notify_one();
        evicted
    }
}

impl DeleteLater for Reaper {
    /// A session whose DELETE failed: kept for the sweeps to send again when the upstream
    /// may take it later.
    fn delete_later(&self, session: &LegacySession<'_>, failed: &SessionError) {
        self.keep_for_later(Due::delete(session), failed);
    }
}

/// The first of `waiting` whose endpoint runs fewer than `per_endpoint` of the ends
/// (`running`), taken out.
fn next_free(
    waiting: &mut std::collections::VecDeque<Retrying>,
    running: &HashMap<SocketAddr, usize>,
    per_endpoint: usize,
) -> Option<Retrying> {
    let free = |r: &Retrying| {
        running
            .get(&r.due.endpoint.addr)
            .is_none_or(|n| *n < per_endpoint)
    };
    let next = waiting.iter().position(free)?;
    waiting.remove(next)
}

/// Sends the end of a flow: its session's DELETE, or its call's cancellation.
async fn end(client: &UpstreamClient, due: &Due) -> Result<(), SessionError> {
    let (endpoint, session) = (due.endpoint.clone(), due.session.clone());
    let mut upstream = LegacySession::resume(client, endpoint, &due.timeouts, session, due.version);
    upstream.caller.headers = due.headers.clone();
    match &due.end {
        End::Session => upstream.reap().await,
        End::Call { cancel, why } => upstream.cancel(cancel, why).await,
    }
}

/// A running reclaim of one share of the table; its end lets the next one run.
struct ReclaimTurn<'r> {
    reaper: &'r Reaper,
    principal: Option<[u8; 32]>,
}

impl ReclaimTurn<'_> {
    /// The reclaim freed nothing: none for this share for `RECLAIM_EVERY`.
    fn freed_nothing(self) {
        let mut reclaims = self.reaper.reclaims.lock().expect("reclaims lock");
        let now = std::time::Instant::now();
        reclaims.insert(self.principal, Reclaim::FreedNothing(now));
    }
}

impl Drop for ReclaimTurn<'_> {
    fn drop(&mut self) {
        let mut reclaims = self.reaper.reclaims.lock().expect("reclaims lock");
        if let Some(Reclaim::Running) = reclaims.get(&self.principal) {
            reclaims.remove(&self.principal);
        }
    }
}

/// A session due for its DELETE, or a call in it for its cancellation.
struct Due {
    endpoint: Endpoint,
    timeouts: Timeouts,
    session: String,
    end: End,
    headers: EndToEnd,
    version: Revision,
}

/// What a `Due` ends.
enum End {
    /// The session: deleted.
    Session,
    /// A call in it: cancelled with `cancel`, counted under `why`.
    Call {
        cancel: Cancellation,
        why: &'static str,
    },
}

impl End {
    /// The end of the entry keyed `key` (`Abandoned::key`): a call's is the reaper's own,
    /// for a call whose client did not continue it by its deadline. Returns the session
    /// too; none for a key `Abandoned::key` did not write.
    fn of_key(key: &str) -> Option<(&str, End)> {
        let Some((session, id)) = key.split_once(CALL_SEPARATOR) else {
            return Some((key, End::Session));
        };
        let request_id = serde_json::from_str(id).ok()?;
        let cancel = Cancellation {
            request_id,
            reason: NOT_CONTINUED,
        };
        let why = "abandoned";
        Some((session, End::Call { cancel, why }))
    }
}

impl Due {
    /// The DELETE of `upstream`'s session, as `upstream` sends it; none without one, for
    /// a data-layer session (which outlives its flows), or for an id no token can carry
    /// (one an upstream may make as long as its header limit: not kept for retries).
    fn delete(upstream: &LegacySession<'_>) -> Option<Due> {
        let session = upstream.own_session()?;
        SessionToken::validate_upstream_session(session).ok()?;
        Some(Due::of(upstream, session.to_owned(), End::Session))
    }

    /// The cancellation `cancel` of a call in `upstream`'s session, counted under `why`,
    /// as `upstream` sends it; none without a session.
    fn cancel(
        upstream: &LegacySession<'_>,
        cancel: &Cancellation,
        why: &'static str,
    ) -> Option<Due> {
        let session = upstream.session_id.clone()?;
        let cancel = cancel.clone();
        Some(Due::of(upstream, session, End::Call { cancel, why }))
    }

    /// The `end` of `session` at `upstream`'s endpoint, with its headers.
    fn of(upstream: &LegacySession<'_>, session: String, end: End) -> Due {
        Due {
            endpoint: upstream.endpoint.clone(),
            timeouts: *upstream.timeouts,
            session,
            end,
            headers: upstream.caller.headers.clone(),
            version: upstream.version,
        }
    }
}

/// Runs the sweeps until the process ends: through the grace period, since the drain
/// still ends sessions and calls (warm and kept sessions, held flows), whose ends that
/// fail are kept here. When the grace period's last stretch begins, and whenever an end
/// is kept in it, every end waiting to be sent again is sent at once, a last time (each
/// within `LAST_END_WITHIN`), and counted as given up if the upstream still cannot take
/// it: the replica will not be there for its turn.
pub struct ReaperService {
    pub reaper: Arc<Reaper>,
    /// The gateway's metrics, where reaped sessions are counted.
    pub metrics: Arc<crate::metrics::Metrics>,
    pub drain: Arc<Drain>,
    /// The groups, whose members alone get ends.
    pub gw: Arc<super::Gateway>,
}

#[async_trait]
impl BackgroundService for ReaperService {
    async fn start(&self, _shutdown: ShutdownWatch) {
        let client = Arc::new(UpstreamClient::new(self.metrics.clone()));
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        loop {
            let stopping = self.drain.is_near_end();
            tokio::select! {
                _ = tick.tick() => {}
                () = self.drain.wait_near_end(), if !stopping => {}
                () = self.reaper.retry_kept.notified(), if stopping => {}
            }
            let stopping = self.drain.is_near_end();
            let member = |endpoint: &Endpoint| self.gw.upstreams.groups.holds(endpoint);
            let near_end = self.drain.wait_near_end();
            let tried = self
                .reaper
                .sweep(&client, now_secs(), stopping, &member, near_end);
            let tried = tried.await;
            if tried > 0 {
                tracing::info!(tried, stopping, "ending the upstream sessions and calls of abandoned flows, and ends that failed before");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::exchange::ExchangeFailure;
    use crate::upstream::legacy_session::SessionFailure;

    fn endpoint(port: u16) -> Endpoint {
        Endpoint {
            addr: ([127, 0, 0, 1], port).into(),
            authority: format!("127.0.0.1:{port}"),
            path: "/mcp".into(),
            tls: None,
            peer: false,
        }
    }

    /// The DELETE of session `session` at `endpoint(1)`, anonymous.
    fn due(session: &str) -> Due {
        Due {
            endpoint: endpoint(1),
            timeouts: timeouts(),
            session: session.into(),
            end: End::Session,
            headers: nobody(),
            version: v(),
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

    fn v() -> Revision {
        Revision::REQUESTED
    }

    fn bearer(token: &'static str) -> EndToEnd {
        let mut headers = EndToEnd::default();
        headers.push(
            http::header::AUTHORIZATION,
            http::HeaderValue::from_static(token),
        );
        headers
    }

    /// An end the upstream may take later (it could not be reached, a 5xx, a throttle) is
    /// kept to be sent again, once per delay of `RETRY_AFTER`, and not before its time;
    /// then it is given up on. One refused as such (a 404) is not kept.
    #[test]
    fn an_end_that_may_pass_later_is_tried_again_a_bounded_number_of_times() {
        let reaper = Reaper::new(10, 10);
        let failing = |failure| SessionError::at(None, failure);
        let down = || failing(SessionFailure::Exchange(ExchangeFailure::Connect));
        for refused in [SessionFailure::Gone, SessionFailure::Refused(404)] {
            assert_eq!(
                reaper.retry_later(due("s1"), 0, &failing(refused), false),
                0
            );
        }
        assert!(
            reaper.take_retries(u64::MAX).is_empty(),
            "a refusal is final"
        );
        let mut failed = 0;
        loop {
            let given_up = reaper.retry_later(due("s1"), failed, &down(), false);
            assert!(reaper.take_retries(0).is_empty(), "not before its time");
            let kept = reaper.take_retries(u64::MAX);
            if given_up == 1 {
                assert!(kept.is_empty());
                break;
            }
            assert_eq!(kept.len(), 1);
            failed = kept[0].failed;
        }
        assert_eq!(failed, RETRY_AFTER.len(), "each delay once");
        for status in [429, 503] {
            let refused = failing(SessionFailure::Refused(status));
            assert_eq!(reaper.retry_later(due("s1"), 0, &refused, false), 0);
        }
        assert_eq!(reaper.take_retries(u64::MAX).len(), 2);
    }

    /// A replica that stops sends every end waiting for its turn at once, for the last
    /// time: one that fails again is given up on, not kept for a turn it will not see.
    #[test]
    fn a_stopping_replica_tries_every_waiting_end_a_last_time() {
        let reaper = Reaper::new(10, 10);
        let down = SessionError::at(None, SessionFailure::Exchange(ExchangeFailure::Connect));
        for key in ["s1", "s2"] {
            assert_eq!(reaper.retry_later(due(key), 0, &down, false), 0);
        }
        let last = reaper.take_all_retries();
        assert_eq!(last.len(), 2, "whatever their turn");
        assert!(reaper.take_retries(u64::MAX).is_empty());
        for Retrying { due, failed, .. } in last {
            assert_eq!(failed, 1, "the tries made");
            let given_up = reaper.retry_later(due, failed, &down, true);
            assert_eq!(given_up, 1, "given up on");
        }
        assert!(reaper.take_retries(u64::MAX).is_empty(), "none kept");
    }

    /// A loopback endpoint that accepts connections: `Answers` each DELETE with 200, or
    /// holds it unanswered; counts the requests (or connections) it got.
    struct TestEndpoint {
        port: u16,
        got: Arc<AtomicUsize>,
    }

    impl TestEndpoint {
        async fn start(answers: bool) -> TestEndpoint {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let got = Arc::new(AtomicUsize::new(0));
            let counted = got.clone();
            tokio::spawn(async move {
                while let Ok((mut tcp, _)) = listener.accept().await {
                    let counted = counted.clone();
                    tokio::spawn(async move {
                        let mut buf = [0u8; 4096];
                        while let Ok(n @ 1..) = tcp.read(&mut buf).await {
                            if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                                counted.fetch_add(1, Ordering::SeqCst);
                                if answers {
                                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                                    let _ = tcp.write_all(ok).await;
                                }
                            }
                        }
                    });
                }
            });
            TestEndpoint { port, got }
        }

        fn got(&self) -> usize {
            self.got.load(Ordering::SeqCst)
        }

        /// `n` DELETEs of sessions here, kept in `reaper` for its next sweep.
        fn ends(&self, reaper: &Reaper, n: usize, response: Duration) {
            let down = SessionError::at(None, SessionFailure::Exchange(ExchangeFailure::Connect));
            for i in 0..n {
                let due = Due {
                    endpoint: endpoint(self.port),
                    timeouts: Timeouts {
                        response,
                        ..timeouts()
                    },
                    ..due(&format!("s{i}"))
                };
                reaper.retry_later(due, 0, &down, false);
            }
        }
    }

    async fn until(what: &str, condition: impl Fn() -> bool) {
        let waited = tokio::time::timeout(Duration::from_secs(5), async {
            while !condition() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        waited
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
    }

    /// An address that left its group may be another server's now: its ends are dropped,
    /// neither its session id nor its credentials sent there.
    #[tokio::test]
    async fn a_sweep_sends_nothing_to_an_endpoint_no_group_holds() {
        let reaper = Reaper::new(10, 10);
        let left = TestEndpoint::start(true).await;
        left.ends(&reaper, 2, Duration::from_secs(1));
        let client = Arc::new(UpstreamClient::new(
            Arc::new(crate::metrics::Metrics::new()),
        ));
        let never = std::future::pending::<()>();
        let tried = reaper
            .sweep(&client, u64::MAX, false, |_| false, never)
            .await;
        assert_eq!((tried, left.got()), (0, 0));
        assert!(reaper.take_all_retries().is_empty(), "not kept either");
        left.ends(&reaper, 2, Duration::from_secs(1));
        let never = std::future::pending::<()>();
        let tried = reaper
            .sweep(&client, u64::MAX, false, |_| true, never)
            .await;
        assert_eq!((tried, left.got()), (2, 2), "a member gets its ends");
    }

    /// An endpoint that takes DELETEs and never answers holds a few of a sweep's ends at
    /// once, not all: another endpoint's go out meanwhile. When the grace period's last
    /// stretch comes, the sweep ends at once, and the ends it did not start wait for the
    /// last sweep.
    #[tokio::test]
    async fn an_endpoint_that_hangs_holds_neither_the_others_nor_the_last_stretch() {
        let reaper = Arc::new(Reaper::new(10, 10));
        let (hangs, answers) = (
            TestEndpoint::start(false).await,
            TestEndpoint::start(true).await,
        );
        hangs.ends(&reaper, 20, Duration::from_secs(30));
        answers.ends(&reaper, 2, Duration::from_secs(30));
        let client = Arc::new(UpstreamClient::new(
            Arc::new(crate::metrics::Metrics::new()),
        ));
        let (last_stretch, near_end) = tokio::sync::oneshot::channel::<()>();
        let sweeping = reaper.clone();
        let sweep = tokio::spawn(async move {
            let near_end = async {
                let _ = near_end.await;
            };
            sweeping
                .sweep(&client, u64::MAX, false, |_| true, near_end)
                .await
        });
        until("the other endpoint's ends", || answers.got() == 2).await;
        until("the hanging endpoint's share", || {
            hangs.got() == ENDS_AT_ONCE_PER_ENDPOINT
        })
        .await;
        let _ = last_stretch.send(());
        let swept = tokio::time::timeout(Duration::from_secs(5), sweep).await;
        assert_eq!(swept.expect("the sweep ended").unwrap(), 22);
        let waiting = reaper.take_all_retries();
        assert_eq!(
            waiting.len(),
            20 - ENDS_AT_ONCE_PER_ENDPOINT,
            "kept for the last sweep"
        );
        assert!(
            waiting.iter().all(|r| r.failed == 1),
            "their tries not counted"
        );
    }

    /// One reclaim per share at a time, and none for a while after one freed nothing (the
    /// share is full of flows still waiting): a caller that fills its share cannot make
    /// each of its calls cost the upstream a round of pings.
    #[test]
    fn a_share_is_reclaimed_once_at_a_time_and_not_again_soon_after_freeing_nothing() {
        let r = Reaper::new(8, 4);
        let (alice, bob) = (Some([1; 32]), Some([2; 32]));
        let turn = r.reclaim_turn(alice).expect("the first turn");
        assert!(r.reclaim_turn(alice).is_none(), "one at a time");
        assert!(r.reclaim_turn(bob).is_some(), "another share's own turn");
        drop(turn);
        let turn = r.reclaim_turn(alice).expect("a turn once the first ended");
        turn.freed_nothing();
        assert!(r.reclaim_turn(alice).is_none(), "freed nothing just now");
        assert!(r.reclaim_turn(None).is_some());
    }

    /// Principals that send the same headers (their principal read from a header that is
    /// not forwarded, or no credentials forwarded at all) still take their own shares:
    /// one's abandoned flows never count against the other.
    #[test]
    fn principals_sending_the_same_headers_count_apart() {
        let r = Reaper::new(100, 2);
        let nobody = nobody();
        let whose = |principal| Whose {
            headers: &nobody,
            principal: Some(principal),
        };
        let (alice, bob) = ([1; 32], [2; 32]);
        for key in ["b1", "b2"] {
            r.watch(&endpoint(1), &timeouts(), key, whose(bob), v(), 100)
                .expect("within bob's share");
        }
        let third = r.watch(&endpoint(1), &timeouts(), "b3", whose(bob), v(), 100);
        assert_eq!(third, Err(NotWatched::PrincipalFull), "bob's share is full");
        r.watch(&endpoint(1), &timeouts(), "a1", whose(alice), v(), 100)
            .expect("alice's share is her own");
        r.forget(&endpoint(1), "b1");
        r.watch(&endpoint(1), &timeouts(), "b3", whose(bob), v(), 100)
            .expect("bob's share freed by his own entry");
    }

    /// A reclaim asks about the share's sessions due first, at most `RECLAIM_CHECKS` of
    /// them, never a call in a data-layer session (a ping in its session says nothing of
    /// the call).
    #[test]
    fn a_reclaim_asks_about_the_shares_first_due_sessions_only() {
        let r = Reaper::new(1_000, 1_000);
        let nobody = nobody();
        let (alice, bob) = ([1; 32], [2; 32]);
        let whose = |principal| Whose {
            headers: &nobody,
            principal: Some(principal),
        };
        let id = serde_json::json!(7);
        let call = Abandoned::Call {
            session: "c",
            id: &id,
        };
        r.watch(&endpoint(1), &timeouts(), call, whose(alice), v(), 1)
            .expect("watched");
        r.watch(&endpoint(1), &timeouts(), "bob", whose(bob), v(), 2)
            .expect("watched");
        let n = RECLAIM_CHECKS + 10;
        for i in 0..n {
            // Deadlines in no order: 1000 + (i * 37 mod n).
            let deadline = 1_000 + (i * 37 % n) as u64;
            let key = format!("s{deadline}");
            r.watch(
                &endpoint(1),
                &timeouts(),
                key.as_str(),
                whose(alice),
                v(),
                deadline,
            )
            .expect("watched");
        }
        let keys: Vec<String> = r
            .candidates(Some(alice))
            .into_iter()
            .map(|d| d.session)
            .collect();
        let first: Vec<String> = (0..RECLAIM_CHECKS)
            .map(|i| format!("s{}", 1_000 + i))
            .collect();
        assert_eq!(keys, first, "the share's first due sessions, in order");
        let anyone = r.candidates(None);
        assert_eq!(anyone.len(), RECLAIM_CHECKS);
        assert_eq!(anyone[0].session, "bob", "the whole table's first due");
    }

    /// Endpoints come and go (pods replaced under `discovery: dns`): one whose last
    /// session is forgotten, or taken when due, leaves the table.
    #[test]
    fn an_endpoint_without_sessions_leaves_the_table() {
        let r = Reaper::new(1_000, 1_000);
        for port in 1..=200 {
            r.watch(&endpoint(port), &timeouts(), "s", &nobody(), v(), 100)
                .expect("room");
            r.watch(&endpoint(port), &timeouts(), "t", &nobody(), v(), 300)
                .expect("room");
        }
        for port in 1..=200 {
            r.forget(&endpoint(port), "s");
        }
        let targets = || r.table.lock().unwrap().targets.len();
        assert_eq!(targets(), 200, "each still has a session watched");
        assert_eq!(r.take_due(400).len(), 200);
        assert_eq!(targets(), 0);
        r.watch(&endpoint(7), &timeouts(), "u", &nobody(), v(), 500)
            .expect("room");
        let due = r.take_due(600);
        assert_eq!(
            due[0].endpoint,
            endpoint(7),
            "a target made again is its own"
        );
    }

    #[test]
    fn only_due_sessions_are_taken_and_the_table_is_bounded() {
        let r = Reaper::new(2, 10);
        assert!(r
            .watch(&endpoint(1), &timeouts(), "a", &nobody(), v(), 100)
            .is_ok());
        assert!(r
            .watch(&endpoint(1), &timeouts(), "b", &nobody(), v(), 200)
            .is_ok());
        assert_eq!(
            r.watch(&endpoint(2), &timeouts(), "c", &nobody(), v(), 100),
            Err(NotWatched::Full),
            "full"
        );
        assert!(
            r.watch(&endpoint(1), &timeouts(), "a", &nobody(), v(), 150)
                .is_ok(),
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

    /// A data-layer session's call is watched apart from the session (which a flow of its
    /// own may watch) and from the session's other calls, and forgotten by its id.
    #[test]
    fn a_call_is_watched_apart_from_its_session_and_forgotten_by_its_id() {
        let r = Reaper::new(10, 10);
        let (id, other) = (serde_json::json!(4294967296u64), serde_json::json!(7));
        let call = Abandoned::Call {
            session: "s",
            id: &id,
        };
        let other = Abandoned::Call {
            session: "s",
            id: &other,
        };
        assert!(r
            .watch(&endpoint(1), &timeouts(), "s", &nobody(), v(), 100)
            .is_ok());
        assert!(r
            .watch(&endpoint(1), &timeouts(), call, &nobody(), v(), 100)
            .is_ok());
        assert!(r
            .watch(&endpoint(1), &timeouts(), other, &nobody(), v(), 200)
            .is_ok());
        assert_eq!(r.watched(), 3);
        r.forget(&endpoint(1), other);
        assert_eq!(r.watched(), 2);
        let mut ends: Vec<String> = (r.take_due(100).iter())
            .map(|d| match &d.end {
                End::Session => format!("DELETE {}", d.session),
                End::Call { cancel, why } => {
                    let id = &cancel.request_id;
                    format!("cancel {id} in {} ({why}: {})", d.session, cancel.reason)
                }
            })
            .collect();
        ends.sort();
        let cancelled = format!("cancel 4294967296 in s (abandoned: {NOT_CONTINUED})");
        assert_eq!(ends, ["DELETE s".to_string(), cancelled]);
    }

    #[test]
    fn a_due_session_carries_the_credentials_of_its_latest_round_and_no_forwarding() {
        let r = Reaper::new(10, 10);
        let mut first = bearer("Bearer old");
        first.push(
            http::HeaderName::from_static("x-forwarded-for"),
            http::HeaderValue::from_static("10.0.0.9"),
        );
        assert!(r
            .watch(&endpoint(1), &timeouts(), "a", &first, v(), 100)
            .is_ok());
        assert!(r
            .watch(
                &endpoint(1),
                &timeouts(),
                "b",
                &bearer("Bearer other"),
                v(),
                100
            )
            .is_ok());
        // The next round of "a" came with a refreshed token.
        assert!(r
            .watch(
                &endpoint(1),
                &timeouts(),
                "a",
                &bearer("Bearer new"),
                v(),
                100
            )
            .is_ok());
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
    fn a_due_session_is_deleted_naming_the_revision_it_negotiated() {
        let r = Reaper::new(10, 10);
        let older = Revision::parse("2025-06-18").unwrap();
        assert!(r
            .watch(&endpoint(1), &timeouts(), "a", &nobody(), older, 100)
            .is_ok());
        assert!(r
            .watch(&endpoint(1), &timeouts(), "b", &nobody(), v(), 100)
            .is_ok());
        let mut due = r.take_due(100);
        due.sort_by(|x, y| x.session.cmp(&y.session));
        assert_eq!(due[0].version, older);
        assert_eq!(due[1].version, Revision::REQUESTED);
    }

    #[test]
    fn one_id_on_two_endpoints_is_two_sessions() {
        let r = Reaper::new(10, 10);
        assert!(r
            .watch(&endpoint(1), &timeouts(), "1", &nobody(), v(), 100)
            .is_ok());
        assert!(r
            .watch(&endpoint(2), &timeouts(), "1", &nobody(), v(), 100)
            .is_ok());
        assert_eq!(r.watched(), 2);
        r.forget(&endpoint(1), "1");
        let due = r.take_due(100);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].endpoint.addr, endpoint(2).addr);
    }

    #[test]
    fn one_principal_takes_only_its_share_and_anonymous_flows_only_the_whole() {
        let r = Reaper::new(4, 2);
        let (alice, bob, nobody) = (bearer("Bearer alice"), bearer("Bearer bob"), nobody());
        let whose = |headers, principal: u8| Whose {
            headers,
            principal: Some([principal; 32]),
        };
        let watch =
            |key: &str, who: Whose<'_>| r.watch(&endpoint(1), &timeouts(), key, who, v(), 100);
        assert!(watch("a", whose(&alice, 1)).is_ok());
        assert!(watch("b", whose(&alice, 1)).is_ok());
        assert_eq!(watch("c", whose(&alice, 1)), Err(NotWatched::PrincipalFull));
        assert!(
            watch("a", whose(&alice, 1)).is_ok(),
            "watching an entry again is not growth"
        );
        assert!(
            watch("d", whose(&bob, 2)).is_ok(),
            "another principal has its own share"
        );
        r.forget(&endpoint(1), "b");
        assert!(
            watch("c", whose(&alice, 1)).is_ok(),
            "a forgotten entry frees its slot"
        );
        assert!(watch("e", (&nobody).into()).is_ok());
        assert_eq!(watch("f", (&nobody).into()), Err(NotWatched::Full));
        assert_eq!(r.take_due(100).len(), 4);
        assert!(
            r.table.lock().unwrap().by_principal.is_empty(),
            "counts drop with entries"
        );
        for key in ["e", "f", "g"] {
            assert!(
                watch(key, (&nobody).into()).is_ok(),
                "anonymous: only the whole table bounds"
            );
        }
    }

    #[test]
    fn a_watched_session_stays_24_bytes_in_the_table() {
        assert_eq!(std::mem::size_of::<Watched>(), 24);
    }

    #[test]
    fn owners_are_shared_and_dropped_with_their_last_session() {
        let r = Reaper::new(10, 10);
        for session in ["a", "b", "c"] {
            assert!(r
                .watch(
                    &endpoint(1),
                    &timeouts(),
                    session,
                    &bearer("Bearer u"),
                    v(),
                    100
                )
                .is_ok());
        }
        let live = |r: &Reaper| {
            let table = r.table.lock().unwrap();
            table.owners.slots.len()
        };
        assert_eq!(live(&r), 1, "one user's flows share one copy");
        r.forget(&endpoint(1), "a");
        r.forget(&endpoint(1), "b");
        assert_eq!(live(&r), 1);
        r.forget(&endpoint(1), "c");
        assert_eq!(live(&r), 0, "the last session released its caller");
        assert!(r
            .watch(
                &endpoint(1),
                &timeouts(),
                "d",
                &bearer("Bearer v"),
                v(),
                100
            )
            .is_ok());
        let indexes: Vec<u32> = r
            .table
            .lock()
            .unwrap()
            .owners
            .index
            .values()
            .copied()
            .collect();
        assert_eq!(indexes, [0], "slot reused");
    }
}
