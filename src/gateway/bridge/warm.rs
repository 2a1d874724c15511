//! Upstream sessions initialized ahead of demand, so a new interactive call does not
//! wait for `initialize` and `notifications/initialized` before its call goes out.
//!
//! A session is ready for one shape only: everything that decides what the upstream
//! session is (the group, the declared client capabilities, the client's identity, the
//! principal, the credentials its exchanges carry), the digest `KeptSessions::shape`
//! computes. Each is used for one call and deleted after it, like a session opened for
//! the call; no two flows ever share one. A shape is warmed once it comes back (its
//! second call within the idle time), and a call that takes one starts the opening of
//! its replacement once its client has the round's answer (before, the replacement's
//! `initialize` would queue at the upstream behind the call), so a shape that keeps
//! calling finds one ready; a shape seen once
//! costs nothing, and one that stops calling leaves at most `per_shape` sessions,
//! deleted once they idle past `idle`.
//!
//! Its GET stream is opened with it (the session's stream the flow would otherwise open
//! before its call), and held while it waits.
//!
//! A session that waits can be forgotten upstream (a restart, the server's own idle
//! timeout): the flow then runs its call on a session opened at once (`Flow` learns the
//! session was warm; a 404 or a refused connection means the call ran nowhere).
//!
//! Bounded: at most `per_shape` per shape, `per_principal` for one principal's shapes and
//! `max` in all, counting those still opening.

use super::one_shot::{KeptSessions, Shape};
use super::streams::{open_session_stream, SessionStream, SESSION_STREAM_PATIENCE};
use super::{caller, client_info};
use crate::gateway::Gateway;
use crate::mrtr::modern::ModernRequest;
use crate::protocol::revision::Revision;
use crate::upstream::exchange::{Connection, Response};
use crate::upstream::legacy_session::{Caller, LegacySession};
use crate::upstream::{Endpoint, Timeouts, UpstreamGroup};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often idle warm sessions are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The shape of a new interactive call's session.
pub(super) fn shape_of(
    group: &UpstreamGroup,
    request: &ModernRequest,
    principal: &[u8; 32],
) -> Shape {
    let caps = Value::Object(request.client_capabilities.clone());
    let credentials = request.headers.digest();
    KeptSessions::shape(
        &group.name,
        &caps,
        &client_info(request),
        principal,
        &credentials,
    )
}

/// A ready session for a new call of `shape`, acting for `request` (the caller starts its
/// replacement with `warm_up` once the call's client has its answer).
pub(super) fn take<'g>(
    gw: &'g Gateway,
    group: &'g UpstreamGroup,
    request: &ModernRequest,
    shape: &Shape,
) -> Option<(LegacySession<'g>, Option<Response>)> {
    let upstreams = &gw.upstreams;
    let warm = upstreams.warm.take(shape, Instant::now())?;
    let ready = upstreams.warm.ready() as i64;
    upstreams.client.metrics.warm_sessions.set(ready);
    // An endpoint that left the group since is not used (its session is reaped by the
    // upstream's own expiry).
    let endpoint = group.endpoint(warm.endpoint.addr)?;
    gw.runtime.metrics.upstream_session("warm");
    let mut session = LegacySession::resume(
        &upstreams.client,
        endpoint,
        &group.timeouts,
        warm.session_id,
        warm.version,
    );
    session.caller = caller(request);
    Some((session, warm.stream))
}

/// Starts opening a session of `shape` in the background, if its pool has room: after a
/// call of the shape took one, or opened one itself for the second time within the idle
/// time (so an upstream that refuses the shape's sessions is not asked again for
/// nothing, and a shape that never recurs costs the server nothing).
/// `owner` is the principal whose share it takes (`None`: anonymous, counted only in all).
pub(super) fn warm_up(
    gw: &Gateway,
    group: &UpstreamGroup,
    request: &ModernRequest,
    shape: Shape,
    owner: Option<[u8; 32]>,
) {
    // A replica that drains serves no new call: nothing to open ahead of it.
    let drain = gw.runtime.drain.clone();
    if drain.is_draining() {
        return;
    }
    let pool = gw.upstreams.warm.clone();
    if !pool.reserve(&shape, owner) {
        return;
    }
    let Some(endpoint) = group.pick() else {
        pool.failed(&shape, owner);
        return;
    };
    let (client, reaper) = (gw.upstreams.client.clone(), gw.upstreams.reaper.clone());
    let timeouts = group.timeouts;
    let (caps, info) = (
        Value::Object(request.client_capabilities.clone()),
        client_info(request),
    );
    // Its own exchanges carry no trace of the request that caused them.
    let caller = Caller {
        headers: request.headers.clone(),
        ..Caller::default()
    };
    // Boxed: a task's future is copied several times as it is spawned and ended
    // (ARCHITECTURE.md, "A request's future stays small"); a box is moved once.
    tokio::spawn(Box::pin(async move {
        let opened = LegacySession::open(&client, endpoint, &timeouts, &caps, &info, &caller).await;
        match opened {
            Ok((session, _)) => match session.session_id.clone() {
                Some(session_id) => {
                    // A fresh session has no earlier GET stream to conflict with: one try;
                    // one still opening after the patience, or when the drain begins, is
                    // dropped (the call that takes the session opens its own; a draining
                    // replica deletes the session below).
                    let opened = open_session_stream(
                        &session,
                        &client,
                        None,
                        false,
                        Connection::Pooled,
                        SESSION_STREAM_PATIENCE,
                    );
                    let stream = tokio::select! {
                        opened = opened => match opened.0 {
                            SessionStream::Open(stream) => Some(stream),
                            _ => None,
                        },
                        _ = drain.wait() => None,
                    };
                    let warm = Warm {
                        endpoint: session.endpoint.clone(),
                        timeouts,
                        session_id,
                        version: session.version,
                        caller,
                        opened: Instant::now(),
                        stream,
                        owner,
                    };
                    if pool.opened(shape, warm).is_some() {
                        // The pool was drained for shutdown meanwhile: not kept upstream.
                        reaper.delete(&session).await;
                    }
                }
                // A server without sessions gains nothing from one opened ahead.
                None => pool.failed(&shape, owner),
            },
            Err(e) => {
                pool.failed(&shape, owner);
                tracing::debug!(error = %crate::outcome::Report(&e), "a session ahead of demand did not open");
            }
        }
        client.metrics.warm_sessions.set(pool.ready() as i64);
    }));
}

/// Deletes `warm` upstream; a DELETE the upstream may take later is handed to the
/// reaper to send again. Not at an endpoint that has left its group: a DNS group's pod
/// that left may have given its address to another server, which gets neither the
/// session id nor the credentials it was opened with.
async fn delete(gw: &Gateway, warm: Warm) {
    if !gw.upstreams.groups.holds(&warm.endpoint) {
        return;
    }
    let (client, reaper) = (&gw.upstreams.client, &gw.upstreams.reaper);
    let (endpoint, timeouts, id) = (warm.endpoint, &warm.timeouts, warm.session_id);
    let mut session = LegacySession::resume(client, endpoint, timeouts, id, warm.version);
    session.caller = warm.caller;
    reaper.delete(&session).await;
}

/// Deletes warm sessions that idled out, and every one at shutdown.
pub struct WarmSweeper {
    pub gw: Arc<Gateway>,
}

#[async_trait]
impl BackgroundService for WarmSweeper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let upstreams = &self.gw.upstreams;
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    self.delete_all(upstreams.warm.expired(Instant::now())).await;
                    upstreams.client.metrics.warm_sessions.set(upstreams.warm.ready() as i64);
                }
                _ = shutdown.changed() => break,
            }
        }
        self.delete_all(upstreams.warm.drain()).await;
    }
}

impl WarmSweeper {
    /// Deletes `sessions` upstream, all at once (each bounded by its group's timeouts).
    async fn delete_all(&self, sessions: Vec<Warm>) {
        let mut deleting = tokio::task::JoinSet::new();
        for warm in sessions {
            let gw = self.gw.clone();
            deleting.spawn(async move { delete(&gw, warm).await });
        }
        while deleting.join_next().await.is_some() {}
    }
}

/// A session initialized ahead of demand, ready for a call of its shape.
pub struct Warm {
    pub endpoint: Endpoint,
    pub timeouts: Timeouts,
    pub session_id: String,
    /// The revision the upstream negotiated for it.
    pub version: Revision,
    /// The headers it was opened with, for its DELETE when it idles out.
    pub caller: Caller,
    pub opened: Instant,
    /// Its GET stream, opened with it, so the call it serves goes up at once; `None`
    /// when the upstream offers none (the call's flow then tries itself).
    pub stream: Option<Response>,
    /// The principal whose share it takes (`None`: anonymous).
    pub owner: Option<[u8; 32]>,
}

#[derive(Default)]
struct Pools {
    ready: HashMap<Shape, Vec<Warm>>,
    opening: HashMap<Shape, usize>,
    /// Ready and opening, over every shape.
    total: usize,
    /// Ready and opening, per principal.
    by_owner: HashMap<[u8; 32], usize>,
    /// When each shape last opened a session for a call of its own (bounded, idle ones
    /// forgotten): a shape is warmed only once it has come back.
    seen: HashMap<Shape, Instant>,
    /// Drained for shutdown: nothing is opened or kept any more.
    closed: bool,
}

impl Pools {
    fn count(&self, shape: &Shape) -> usize {
        self.ready.get(shape).map_or(0, Vec::len) + self.opening.get(shape).copied().unwrap_or(0)
    }

    fn done_opening(&mut self, shape: &Shape) {
        if let Some(n) = self.opening.get_mut(shape) {
            *n -= 1;
            if *n == 0 {
                self.opening.remove(shape);
            }
            self.total -= 1;
        }
    }

    /// Counts `owner` once more (`None`: anonymous, not counted).
    fn owned(&mut self, owner: Option<[u8; 32]>) {
        if let Some(owner) = owner {
            *self.by_owner.entry(owner).or_default() += 1;
        }
    }

    /// Counts `owner` once less.
    fn released(&mut self, owner: Option<[u8; 32]>) {
        let Some(owner) = owner else {
            return;
        };
        if let Some(n) = self.by_owner.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.by_owner.remove(&owner);
            }
        }
    }
}

/// The warm sessions of this replica, by shape.
pub struct WarmSessions {
    pools: Mutex<Pools>,
    per_shape: usize,
    max: usize,
    per_principal: usize,
    idle: Duration,
}

impl WarmSessions {
    /// `per_shape` 0 turns warm sessions off.
    pub fn new(per_shape: usize, max: usize, per_principal: usize, idle: Duration) -> WarmSessions {
        WarmSessions {
            pools: Mutex::default(),
            per_shape,
            max,
            per_principal,
            idle,
        }
    }

    fn pools(&self) -> std::sync::MutexGuard<'_, Pools> {
        self.pools.lock().expect("warm sessions lock")
    }

    /// A ready session of `shape` that has not idled past the limit at `now`, the most
    /// recently opened first.
    pub fn take(&self, shape: &Shape, now: Instant) -> Option<Warm> {
        let mut pools = self.pools();
        let ready = pools.ready.get_mut(shape)?;
        let fresh = ready
            .iter()
            .rposition(|w| now.saturating_duration_since(w.opened) < self.idle)?;
        let warm = ready.remove(fresh);
        if ready.is_empty() {
            pools.ready.remove(shape);
        }
        pools.total -= 1;
        pools.released(warm.owner);
        Some(warm)
    }

    /// Notes that a call of `shape` opened a session of its own at `now`; whether the
    /// shape had done so within the idle time before (it recurs, so warming it pays: a
    /// shape made unique by a per-request header never is).
    pub fn recurs(&self, shape: &Shape, now: Instant) -> bool {
        let mut pools = self.pools();
        let idle = self.idle;
        if pools.seen.len() >= self.max.max(1) * 4 {
            pools
                .seen
                .retain(|_, at| now.saturating_duration_since(*at) < idle);
            if pools.seen.len() >= self.max.max(1) * 4 {
                pools.seen.clear();
            }
        }
        let before = pools.seen.insert(*shape, now);
        before.is_some_and(|at| now.saturating_duration_since(at) < idle)
    }

    /// Whether a session of `shape`, of `owner`'s share, may start opening now (room in
    /// its pool, in the share and in all); a `true` must be followed by `opened` or
    /// `failed`.
    pub fn reserve(&self, shape: &Shape, owner: Option<[u8; 32]>) -> bool {
        let mut pools = self.pools();
        let owned = owner.map_or(0, |o| pools.by_owner.get(&o).copied().unwrap_or(0));
        let full = pools.count(shape) >= self.per_shape
            || owned >= self.per_principal
            || pools.total >= self.max;
        if pools.closed || full {
            return false;
        }
        *pools.opening.entry(*shape).or_default() += 1;
        pools.total += 1;
        pools.owned(owner);
        true
    }

    /// A reserved session is open and ready; given back (for deletion) when the pool was
    /// drained meanwhile.
    #[must_use]
    pub fn opened(&self, shape: Shape, warm: Warm) -> Option<Warm> {
        let mut pools = self.pools();
        pools.done_opening(&shape);
        if pools.closed {
            pools.released(warm.owner);
            return Some(warm);
        }
        pools.ready.entry(shape).or_default().push(warm);
        pools.total += 1;
        None
    }

    /// A reserved session, of `owner`'s share, did not open.
    pub fn failed(&self, shape: &Shape, owner: Option<[u8; 32]>) {
        let mut pools = self.pools();
        pools.done_opening(shape);
        pools.released(owner);
    }

    /// Removes and returns the sessions that idled past the limit at `now`, for deletion.
    pub fn expired(&self, now: Instant) -> Vec<Warm> {
        let mut pools = self.pools();
        let idle = self.idle;
        let mut gone = Vec::new();
        pools.ready.retain(|_, ready| {
            let (old, young) = std::mem::take(ready)
                .into_iter()
                .partition(|w| now.saturating_duration_since(w.opened) >= idle);
            *ready = young;
            gone.extend::<Vec<Warm>>(old);
            !ready.is_empty()
        });
        pools.total -= gone.len();
        for warm in &gone {
            pools.released(warm.owner);
        }
        gone
    }

    /// Removes and returns every ready session (at shutdown), for deletion.
    pub fn drain(&self) -> Vec<Warm> {
        let mut pools = self.pools();
        pools.closed = true;
        let all: Vec<Warm> = pools.ready.drain().flat_map(|(_, w)| w).collect();
        pools.total -= all.len();
        for warm in &all {
            pools.released(warm.owner);
        }
        all
    }

    /// How many sessions are ready now.
    pub fn ready(&self) -> usize {
        self.pools().ready.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warm(id: &str, opened: Instant) -> Warm {
        Warm {
            endpoint: Endpoint {
                addr: ([127, 0, 0, 1], 3001).into(),
                authority: "127.0.0.1:3001".into(),
                path: "/mcp".into(),
                tls: None,
                peer: false,
            },
            timeouts: Timeouts {
                connect: Duration::from_secs(1),
                response: Duration::from_secs(1),
                stream_idle: None,
            },
            session_id: id.into(),
            version: Revision::REQUESTED,
            caller: Caller::default(),
            opened,
            stream: None,
            owner: None,
        }
    }

    /// Once drained for shutdown, the pool reserves nothing more, and a session that
    /// opens afterwards is given back for deletion, never kept (it would stay upstream).
    #[test]
    fn a_drained_pool_keeps_nothing_that_opens_after() {
        let w = WarmSessions::new(2, 10, 10, Duration::from_secs(60));
        let now = Instant::now();
        assert!(w.reserve(&[1; 32], None));
        assert!(w.drain().is_empty());
        assert!(w.opened([1; 32], warm("late", now)).is_some(), "given back");
        assert!(!w.reserve(&[1; 32], None), "nothing reserved once drained");
        assert_eq!(w.ready(), 0);
    }

    #[test]
    fn a_ready_session_serves_one_call_of_its_shape_only() {
        let w = WarmSessions::new(2, 10, 10, Duration::from_secs(30));
        let now = Instant::now();
        assert!(w.reserve(&[1; 32], None));
        assert!(w.opened([1; 32], warm("a", now)).is_none());
        assert!(w.take(&[2; 32], now).is_none(), "another shape");
        assert_eq!(
            w.take(&[1; 32], now).map(|w| w.session_id),
            Some("a".into())
        );
        assert!(w.take(&[1; 32], now).is_none(), "used once");
        assert_eq!(w.ready(), 0);
    }

    #[test]
    fn pools_are_bounded_per_shape_and_in_all_counting_those_opening() {
        let w = WarmSessions::new(2, 3, 10, Duration::from_secs(30));
        let now = Instant::now();
        assert!(w.reserve(&[1; 32], None));
        assert!(w.reserve(&[1; 32], None));
        assert!(
            !w.reserve(&[1; 32], None),
            "two per shape, opening or ready"
        );
        assert!(w.opened([1; 32], warm("a", now)).is_none());
        assert!(!w.reserve(&[1; 32], None));
        assert!(w.reserve(&[2; 32], None));
        assert!(!w.reserve(&[3; 32], None), "three in all");
        w.failed(&[2; 32], None);
        assert!(
            w.reserve(&[3; 32], None),
            "a failed opening frees its place"
        );
        assert!(w.take(&[1; 32], now).is_some());
        assert!(w.reserve(&[1; 32], None), "a taken session frees its place");
    }

    /// One principal's shapes take at most its share, opening or ready, however many
    /// shapes it sends (new capabilities on each call); anonymous ones only the whole.
    /// A place comes back when its session is taken, fails, idles out or is drained.
    #[test]
    fn one_principal_takes_only_its_share() {
        let w = WarmSessions::new(2, 10, 2, Duration::from_secs(30));
        let (alice, bob) = (Some([7; 32]), Some([8; 32]));
        let now = Instant::now();
        assert!(w.reserve(&[1; 32], alice) && w.reserve(&[2; 32], alice));
        assert!(!w.reserve(&[3; 32], alice), "alice's share is full");
        assert!(w.reserve(&[4; 32], bob), "bob's is his own");
        assert!(w.reserve(&[5; 32], None) && w.reserve(&[6; 32], None));
        assert!(
            w.reserve(&[6; 32], None),
            "anonymous: only the whole bounds it"
        );
        w.failed(&[2; 32], alice);
        let ready = Warm {
            owner: alice,
            ..warm("a", now)
        };
        assert!(w.opened([1; 32], ready).is_none());
        assert!(w.reserve(&[3; 32], alice), "a failed opening freed a place");
        assert!(!w.reserve(&[9; 32], alice));
        assert!(w.take(&[1; 32], now).is_some());
        assert!(w.reserve(&[9; 32], alice), "a taken session freed one");
    }

    #[test]
    fn idle_sessions_are_never_handed_out_and_are_returned_for_deletion() {
        let w = WarmSessions::new(3, 10, 10, Duration::from_secs(30));
        let start = Instant::now();
        for (id, at) in [("old", start), ("new", start + Duration::from_secs(20))] {
            assert!(w.reserve(&[1; 32], None));
            assert!(w.opened([1; 32], warm(id, at)).is_none());
        }
        let later = start + Duration::from_secs(31);
        assert_eq!(
            w.take(&[1; 32], later).map(|w| w.session_id),
            Some("new".into())
        );
        assert!(
            w.take(&[1; 32], later).is_none(),
            "the idle one is not handed out"
        );
        let expired = w.expired(later);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].session_id, "old");
        assert_eq!(w.ready(), 0);
        assert!(
            w.reserve(&[1; 32], None) && w.reserve(&[1; 32], None) && w.reserve(&[1; 32], None)
        );
    }

    #[test]
    fn drain_returns_every_ready_session() {
        let w = WarmSessions::new(2, 10, 10, Duration::from_secs(30));
        let now = Instant::now();
        for shape in [[1; 32], [2; 32]] {
            assert!(w.reserve(&shape, None));
            assert!(w.opened(shape, warm("s", now)).is_none());
        }
        assert_eq!(w.drain().len(), 2);
        assert_eq!(w.ready(), 0);
    }

    #[test]
    fn a_shape_recurs_when_it_came_back_within_the_idle_time() {
        let w = WarmSessions::new(2, 1, 1, Duration::from_secs(30));
        let t0 = Instant::now();
        assert!(!w.recurs(&[1; 32], t0), "seen once");
        assert!(w.recurs(&[1; 32], t0 + Duration::from_secs(29)));
        assert!(
            !w.recurs(&[1; 32], t0 + Duration::from_secs(60)),
            "idle since"
        );
        // Bounded: four shapes per warm session allowed; idle ones go first.
        for n in 2..10u8 {
            w.recurs(&[n; 32], t0 + Duration::from_secs(60));
        }
        assert!(w.pools().seen.len() <= 4);
    }

    #[test]
    fn turned_off_nothing_is_reserved() {
        let w = WarmSessions::new(0, 10, 10, Duration::from_secs(30));
        assert!(!w.reserve(&[1; 32], None));
    }
}
