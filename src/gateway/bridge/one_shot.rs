//! One-shot methods (lists, completion) served from a kept upstream session per shape.
//!
//! A legacy upstream needs a session (`initialize`, `notifications/initialized`) before
//! it answers anything, and some servers take long to open one (one TypeScript framework
//! waits a second for the client's capabilities on every `initialize`). A 2026-07-28
//! client has no session, so opening one per request made every `tools/list` pay that
//! cost. One-shot methods change nothing on the server, so one session serves all of a
//! shape's one-shot requests: a shape is everything that decides what a session answers
//! (the group, the declared client capabilities, the client's identity, the principal,
//! the credentials its requests carry upstream).
//! Interactive calls never use these sessions, so no call's server-side state is seen by
//! another. A kept session the upstream has forgotten (HTTP 404, or a 401 without a
//! challenge) is replaced, and the request sent again on the new one: either means the
//! request was not processed; so is one whose endpoint takes no connection. A kept
//! session counts the requests running on it, and is deleted only when none is: past
//! the bound, when it idles out (`KeptSweeper`), and at shutdown.

use crate::gateway::upstream_side::UpstreamSide;
use crate::protocol::jsonrpc;
use crate::protocol::revision::Revision;
use crate::upstream::exchange::UpstreamClient;
use crate::upstream::legacy_session::{Caller, LegacySession};
use crate::upstream::{Timeouts, UpstreamGroup};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A shape's digest: group, capabilities, client identity and principal.
pub type Shape = [u8; 32];

/// Which upstream session serves a shape's one-shot requests.
#[derive(Clone, Debug)]
pub struct Kept {
    /// The group it belongs to, by name.
    pub group: Arc<str>,
    pub endpoint: SocketAddr,
    pub session_id: String,
    /// The revision the upstream negotiated for it.
    pub version: Revision,
    /// The headers it was opened with (the shape's credentials), for its DELETE: an
    /// upstream that authenticates every request refuses one without them, and keeps
    /// the session.
    caller: Arc<Caller>,
    last_used: Instant,
    /// One count for the table's entry, and one for each request running on it (a copy
    /// taken by `take_live` lives as long as its request).
    users: Arc<()>,
    /// The principal whose share it takes (`None`: anonymous, counted only in all).
    owner: Option<[u8; 32]>,
}

impl Kept {
    /// `session` kept as of `now`; `None` if the upstream gave it no session id (it keeps
    /// no sessions).
    pub fn of(group: &str, session: &LegacySession<'_>, now: Instant) -> Option<Kept> {
        let session_id = session.session_id.clone()?;
        Some(Kept {
            group: group.into(),
            endpoint: session.endpoint.addr,
            session_id,
            version: session.version,
            caller: Arc::new(session.caller.clone()),
            last_used: now,
            users: Arc::new(()),
            owner: None,
        })
    }

    /// Whether a request is running on it: deleting it would cut that request.
    fn in_use(&self) -> bool {
        Arc::strong_count(&self.users) > 1
    }
}

/// The kept sessions, by shape; bounded in all and per principal, the least recently
/// used going first.
pub struct KeptSessions {
    sessions: Mutex<HashMap<Shape, Kept>>,
    /// Set, under `sessions`' lock, once every session was taken at shutdown: a session
    /// offered after that would never be swept, and is handed back for deletion.
    closed: AtomicBool,
    max: usize,
    max_per_principal: usize,
    idle: Duration,
}

impl KeptSessions {
    pub fn new(max: usize, max_per_principal: usize, idle: Duration) -> KeptSessions {
        KeptSessions {
            sessions: Mutex::default(),
            closed: Default::default(),
            max,
            max_per_principal,
            idle,
        }
    }

    /// The digest of a shape.
    pub fn shape(
        group: &str,
        capabilities: &serde_json::Value,
        client_info: &serde_json::Value,
        principal: &[u8; 32],
        credentials: &[u8; 32],
    ) -> Shape {
        let mut h = Sha256::new();
        h.update(b"mrtr-gateway one-shot shape v1\0");
        for part in [
            group.to_string(),
            jsonrpc::text_of(capabilities),
            jsonrpc::text_of(client_info),
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        h.update(principal);
        h.update(credentials);
        h.finalize().into()
    }

    /// The session kept for `shape` at `now`, unless it idled past the limit with no
    /// request running on it: that one is handed back as `Err` for its owner to delete.
    pub fn take_live(&self, shape: &Shape, now: Instant) -> Result<Option<Kept>, Box<Kept>> {
        let mut sessions = self.sessions.lock().expect("kept sessions lock");
        let Some(kept) = sessions.get_mut(shape) else {
            return Ok(None);
        };
        if now.saturating_duration_since(kept.last_used) > self.idle && !kept.in_use() {
            return Err(Box::new(sessions.remove(shape).expect("present")));
        }
        kept.last_used = now;
        Ok(Some(kept.clone()))
    }

    /// Keeps a session for `shape`, of `owner`'s share (`None`: anonymous); returns what
    /// no longer fits for its owner to delete: this session, if the shape has one kept
    /// already (requests may be running on that one, which deleting it would cut; this
    /// one has served only the request that opened it); past the owner's share, the least
    /// recently used of its sessions no request runs on; past the bound, the least
    /// recently used of all no request runs on (none while every one is in use: the table
    /// is over its bound until one is free). After shutdown took them all, this one.
    pub fn keep(&self, shape: Shape, owner: Option<[u8; 32]>, mut kept: Kept) -> Option<Kept> {
        let mut sessions = self.sessions.lock().expect("kept sessions lock");
        if sessions.contains_key(&shape) || self.closed.load(Ordering::Relaxed) {
            return Some(kept);
        }
        kept.owner = owner;
        let group = kept.group.clone();
        sessions.insert(shape, kept);
        // A principal's share is per group: one that reaches many groups keeps its share
        // in each.
        let owned = |k: &Kept| owner.is_some() && k.owner == owner && k.group == group;
        let least_recent = |only_owned: bool| {
            sessions
                .iter()
                .filter(|(_, k)| !k.in_use() && (!only_owned || owned(k)))
                .min_by_key(|(_, k)| k.last_used)
                .map(|(shape, _)| *shape)
        };
        let over_share = sessions.values().filter(|k| owned(k)).count() > self.max_per_principal;
        let over_bound = sessions.len() > self.max;
        let going = (over_share.then(|| least_recent(true)).flatten())
            .or_else(|| over_bound.then(|| least_recent(false)).flatten())?;
        sessions.remove(&going)
    }

    /// Takes the sessions idle past the limit that no request runs on, for deletion.
    pub fn take_idle(&self, now: Instant) -> Vec<Kept> {
        let mut sessions = self.sessions.lock().expect("kept sessions lock");
        let idle = |k: &Kept| now.saturating_duration_since(k.last_used) > self.idle && !k.in_use();
        let shapes: Vec<Shape> = sessions
            .iter()
            .filter(|(_, k)| idle(k))
            .map(|(shape, _)| *shape)
            .collect();
        shapes.iter().filter_map(|s| sessions.remove(s)).collect()
    }

    /// Takes every session (at shutdown), for deletion; none is kept from then on.
    pub fn take_all(&self) -> Vec<Kept> {
        let mut sessions = self.sessions.lock().expect("kept sessions lock");
        self.closed.store(true, Ordering::Relaxed);
        sessions.drain().map(|(_, kept)| kept).collect()
    }

    /// Forgets the session of `shape` if it is still `session_id` (the upstream lost it).
    pub fn forget(&self, shape: &Shape, session_id: &str) {
        let mut sessions = self.sessions.lock().expect("kept sessions lock");
        if sessions
            .get(shape)
            .is_some_and(|k| k.session_id == session_id)
        {
            sessions.remove(shape);
        }
    }

    /// Whether sessions are kept at all (`bridge.one_shot_session_idle_seconds` above 0).
    pub fn enabled(&self) -> bool {
        !self.idle.is_zero()
    }

    /// How many sessions are kept now.
    pub fn len(&self) -> usize {
        self.sessions.lock().expect("kept sessions lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Resumes a kept session on `group` (whose endpoint must still be a member).
pub fn resume<'g>(
    client: &'g UpstreamClient,
    group: &'g UpstreamGroup,
    timeouts: &'g Timeouts,
    kept: &Kept,
) -> Option<LegacySession<'g>> {
    let endpoint = group.endpoint(kept.endpoint)?;
    let id = kept.session_id.clone();
    Some(LegacySession::resume(
        client,
        endpoint,
        timeouts,
        id,
        kept.version,
    ))
}

/// DELETEs `retire` sends at once: an upstream slow to answer one does not hold the
/// others (at shutdown, those not sent before the process exits stay open upstream).
const RETIRE_AT_ONCE: usize = 64;

/// Deletes kept sessions that were let go (idle, replaced, or over a bound), each in its
/// own group, which may not be the group of the request that let it go; a DELETE the
/// upstream may take later is handed to the reaper to send again.
pub async fn retire(upstreams: &UpstreamSide, retired: Vec<Kept>) {
    use futures_util::StreamExt;
    let client = &upstreams.client;
    let delete = |kept: Kept| async move {
        let Some(group) = upstreams.groups.by_name(&kept.group) else {
            return;
        };
        if let Some(mut upstream) = resume(client, group, &group.timeouts, &kept) {
            upstream.caller = Caller::clone(&kept.caller);
            upstreams.reaper.delete(&upstream).await;
        }
    };
    futures_util::stream::iter(retired)
        .for_each_concurrent(RETIRE_AT_ONCE, delete)
        .await;
}

/// How often idle kept sessions are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Deletes kept sessions that idled out (a shape that sends nothing more would otherwise
/// keep its upstream session until the table overflows), and every one near the end of
/// the grace period at shutdown.
pub struct KeptSweeper {
    pub gw: Arc<crate::gateway::Gateway>,
}

#[async_trait::async_trait]
impl pingora::services::background::BackgroundService for KeptSweeper {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        let kept = &self.gw.upstreams.kept_sessions;
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => self.retire_all(kept.take_idle(Instant::now())).await,
                _ = shutdown.changed() => break,
            }
        }
        // The shutdown signal starts the grace period, in which requests still run on
        // these sessions: they go at its last stretch, as held flows do.
        self.gw.runtime.drain.wait_near_end().await;
        self.retire_all(kept.take_all()).await;
    }
}

impl KeptSweeper {
    async fn retire_all(&self, sessions: Vec<Kept>) {
        retire(&self.gw.upstreams, sessions).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn addr() -> SocketAddr {
        "127.0.0.1:1".parse().unwrap()
    }

    #[test]
    fn a_shape_is_every_part_that_decides_what_a_session_answers() {
        let (caps, info) = (json!({"roots": {}}), json!({"name": "c"}));
        let base = KeptSessions::shape("g", &caps, &info, &[1; 32], &[0; 32]);
        for other in [
            KeptSessions::shape("h", &caps, &info, &[1; 32], &[0; 32]),
            KeptSessions::shape("g", &json!({}), &info, &[1; 32], &[0; 32]),
            KeptSessions::shape("g", &caps, &json!({"name": "d"}), &[1; 32], &[0; 32]),
            KeptSessions::shape("g", &caps, &info, &[2; 32], &[0; 32]),
            KeptSessions::shape("g", &caps, &info, &[1; 32], &[9; 32]),
        ] {
            assert_ne!(base, other);
        }
    }

    /// Keeps session `sid` for shape `[shape; 32]` of group "g" at `at`, anonymous.
    fn keep_at(kept: &KeptSessions, shape: u8, sid: &str, at: Instant) -> Option<Kept> {
        keep_as(kept, None, shape, sid, at)
    }

    /// `keep_at`, of `owner`'s share.
    fn keep_as(
        kept: &KeptSessions,
        owner: Option<u8>,
        shape: u8,
        sid: &str,
        at: Instant,
    ) -> Option<Kept> {
        keep_in(kept, "g", owner, shape, sid, at)
    }

    /// `keep_as`, in `group`.
    fn keep_in(
        kept: &KeptSessions,
        group: &str,
        owner: Option<u8>,
        shape: u8,
        sid: &str,
        at: Instant,
    ) -> Option<Kept> {
        let session = Kept {
            group: group.into(),
            endpoint: addr(),
            session_id: sid.into(),
            version: Revision::REQUESTED,
            caller: Arc::default(),
            last_used: at,
            users: Arc::new(()),
            owner: None,
        };
        kept.keep([shape; 32], owner.map(|o| [o; 32]), session)
    }

    /// A session offered once shutdown took them all is handed back for deletion: no sweep
    /// would find it again.
    #[test]
    fn a_session_offered_after_shutdown_took_them_all_is_handed_back() {
        let kept = KeptSessions::new(8, 8, Duration::from_secs(30));
        let now = Instant::now();
        assert!(keep_at(&kept, 1, "s1", now).is_none());
        assert_eq!(kept.take_all().len(), 1);
        let late = keep_at(&kept, 2, "s2", now).expect("handed back");
        assert_eq!(late.session_id, "s2");
        assert_eq!(kept.len(), 0);
    }

    /// A principal sending ever new shapes (capabilities, client names) pushes out only
    /// its own sessions of that group; anonymous ones count only against the whole table.
    #[test]
    fn one_principal_keeps_only_its_share() {
        let t0 = Instant::now();
        let kept = KeptSessions::new(5, 2, Duration::from_secs(60));
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(keep_as(&kept, Some(1), 1, "other", at(0)).is_none());
        assert!(keep_as(&kept, Some(9), 2, "m1", at(1)).is_none());
        assert!(keep_as(&kept, Some(9), 3, "m2", at(2)).is_none());
        let pushed = keep_as(&kept, Some(9), 4, "m3", at(3)).unwrap();
        assert_eq!(
            pushed.session_id, "m1",
            "its own least recent, not the older other's"
        );
        let pushed = keep_as(&kept, Some(9), 5, "m4", at(4)).unwrap();
        assert_eq!(pushed.session_id, "m2");
        assert!(kept.take_live(&[1; 32], at(5)).unwrap().is_some(), "kept");
        // Its share in another group is its own.
        assert!(keep_in(&kept, "h", Some(9), 8, "h1", at(5)).is_none());
        // Anonymous sessions share no principal: only the whole bounds them.
        assert!(keep_as(&kept, None, 6, "a1", at(6)).is_none());
        let pushed = keep_as(&kept, None, 7, "a2", at(7)).unwrap();
        assert_eq!(pushed.session_id, "m3", "the least recent of all");
    }

    #[test]
    fn kept_sessions_are_bounded_idle_ones_handed_back_and_forgotten_ones_dropped() {
        let t0 = Instant::now();
        let kept = KeptSessions::new(2, 2, Duration::from_secs(60));
        let keep = |shape: u8, sid: &str, at: Instant| keep_at(&kept, shape, sid, at);
        assert!(keep(1, "a", t0).is_none());
        assert!(keep(2, "b", t0).is_none());
        let later = t0 + Duration::from_secs(1);
        assert_eq!(
            kept.take_live(&[1; 32], later).unwrap().unwrap().session_id,
            "a"
        );
        let evicted = keep(3, "c", later).unwrap();
        assert_eq!(evicted.session_id, "b", "the least recently used goes");
        // Requests may be running on the kept one: the newcomer goes instead.
        let newcomer = keep(1, "a2", later).unwrap();
        assert_eq!(newcomer.session_id, "a2");
        kept.forget(&[1; 32], "a2");
        assert_eq!(kept.len(), 2, "only the session named is forgotten");
        kept.forget(&[1; 32], "a");
        assert!(kept.take_live(&[1; 32], later).unwrap().is_none());

        let idle = t0 + Duration::from_secs(62);
        assert_eq!(kept.take_live(&[3; 32], idle).unwrap_err().session_id, "c");
        assert!(kept.is_empty());
    }

    /// A session a request runs on is neither evicted nor retired idle under it.
    #[test]
    fn a_kept_session_in_use_is_never_let_go() {
        let t0 = Instant::now();
        let kept = KeptSessions::new(2, 2, Duration::from_secs(60));
        let keep = |shape: u8, sid: &str, at: Instant| keep_at(&kept, shape, sid, at);
        assert!(keep(1, "a", t0).is_none());
        let running = kept.take_live(&[1; 32], t0).unwrap().unwrap();
        let later = t0 + Duration::from_secs(1);
        assert!(keep(2, "b", later).is_none());
        let evicted = keep(3, "c", later + Duration::from_secs(1)).unwrap();
        assert_eq!(evicted.session_id, "b", "not the one in use, however old");
        let idle = t0 + Duration::from_secs(90);
        let still = kept.take_live(&[1; 32], idle).unwrap().unwrap();
        assert_eq!(still.session_id, "a", "in use: not retired idle");
        drop((running, still));
        let idle_again = idle + Duration::from_secs(61);
        let swept: Vec<String> = kept
            .take_idle(idle_again)
            .into_iter()
            .map(|k| k.session_id)
            .collect();
        assert!(
            swept.contains(&"a".to_string()),
            "idle, and free: {swept:?}"
        );
    }
}
