//! The gateway's side of its upstream groups: the groups and the pooled client, what
//! each group's InitializeResult is, which era an `era: auto` group speaks, what was
//! learnt of each group's resumption, and the sessions one-shot methods are served on.

use super::bridge::one_shot::{self, Kept, KeptSessions, Shape};
use super::bridge::warm::WarmSessions;
use super::learnt::Learnt;
use super::reaper::Reaper;
use crate::config::{Config, ResumeMode, UpstreamEra};
use crate::metrics::Metrics;
use crate::mrtr::modern::ModernRequest;
use crate::upstream::exchange::{ExchangeFailure, UpstreamClient};
use crate::upstream::legacy_session::{
    answers_modern_discover, Caller, Discovery, LegacySession, SessionError, SessionFailure,
};
use crate::upstream::{UpstreamGroup, Upstreams};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// After a probe of an `era: auto` group got no verdict (the upstream was unreachable),
/// how long until the next one; until then the group is bridged. Also the least time a
/// verdict stands before what the upstream answers can call it into doubt.
const PROBE_RETRY: Duration = Duration::from_secs(10);

/// What is known of an `era: auto` group's era.
#[derive(Clone, Copy)]
enum Probed {
    /// Whether the upstream speaks only 2026-07-28, and since when that is known.
    Verdict {
        modern_only: bool,
        since: Instant,
    },
    RetryAfter(Instant),
}

/// What one probe of an `era: auto` group found.
enum Probe {
    Verdict(bool),
    /// The upstream could not be reached: no verdict, probe again later.
    Unreachable,
    /// The upstream denied the request the probe was made for: no verdict yet.
    Denied,
}

/// Who a request that needs an upstream session asks as: its declared capabilities,
/// client and credentials, and the one-shot shape they make.
pub struct Asker {
    pub capabilities: Value,
    pub client_info: Value,
    pub caller: Caller,
    pub shape: Shape,
    /// The principal whose share of the kept sessions its shape takes (`None`: anonymous).
    pub owner: Option<[u8; 32]>,
}

pub struct UpstreamSide {
    pub groups: Upstreams,
    /// The pooled client; it counts into the gateway's metrics. Shared with the work a
    /// request leaves behind (deleting its session, warming the next).
    pub client: Arc<UpstreamClient>,
    /// Each group's `serverInfo`, from the latest sessions opened there, by who they were
    /// opened for: it names the server in every modern result.
    server_infos: Mutex<ServerInfos>,
    /// For `era: auto` groups, what the probe found.
    modern_only: Mutex<HashMap<String, Probed>>,
    /// What this replica learnt about each group's upstream: refused resumptions (with
    /// `resume: auto` its flows are held from then on), priming, GET-stream replay.
    pub learnt: Learnt,
    /// The upstream sessions one-shot methods run on, one per shape.
    pub kept_sessions: KeptSessions,
    /// Sessions initialized ahead of demand for interactive calls.
    pub warm: Arc<WarmSessions>,
    /// Permits for finished flows' DELETEs sent in the background.
    pub background_deletes: Arc<Semaphore>,
    /// The upstream sessions of flows awaiting a retry, reaped when it does not come, and
    /// the DELETEs the upstream could not take yet, sent again.
    pub reaper: Arc<Reaper>,
}

/// Most finished flows' session DELETEs in flight in the background at once.
pub const MAX_BACKGROUND_DELETES: usize = 1024;

impl UpstreamSide {
    pub fn new(
        config: &Config,
        groups: Upstreams,
        metrics: Arc<Metrics>,
        reaper: Arc<Reaper>,
    ) -> UpstreamSide {
        for group in &config.upstreams {
            let unknown = metrics.upstream_resumable.with_label_values(&[&group.name]);
            unknown.set(-1);
            // At 0 from the start: "none yet" rather than "no data".
            metrics
                .resumptions_unprimed
                .with_label_values(&[&group.name]);
        }
        UpstreamSide {
            groups,
            client: Arc::new(
                UpstreamClient::new(metrics)
                    .with_max_message(config.limits.max_upstream_message_bytes)
                    .with_delete_later(reaper.clone()),
            ),
            server_infos: Mutex::default(),
            modern_only: Mutex::default(),
            learnt: Learnt::default(),
            kept_sessions: KeptSessions::new(
                config.bridge.max_one_shot_sessions,
                config.bridge.max_one_shot_sessions_per_principal,
                Duration::from_secs(config.bridge.one_shot_session_idle_seconds),
            ),
            background_deletes: Arc::new(Semaphore::new(MAX_BACKGROUND_DELETES)),
            warm: Arc::new(WarmSessions::new(
                config.bridge.warm_sessions_per_shape,
                config.bridge.max_warm_sessions,
                config.bridge.max_warm_sessions_per_principal,
                Duration::from_secs(config.bridge.warm_session_idle_seconds),
            )),
            reaper,
        }
    }

    /// Keeps the `serverInfo` of an InitializeResult of `group` for `caller` (taken out
    /// of the lock: only that part, and cloned before it is taken).
    pub fn remember_initialize(&self, group: &UpstreamGroup, caller: &Caller, result: &Value) {
        let info = result["serverInfo"].clone();
        let who = caller.headers.digest();
        let mut cache = self.server_infos.lock().expect("server info cache lock");
        cache.remember(&group.name, who, info);
    }

    /// Opens an upstream session on a healthy endpoint of `group` with the client's
    /// declared capabilities, and remembers the group's InitializeResult.
    pub async fn open_upstream<'g>(
        &'g self,
        group: &'g UpstreamGroup,
        capabilities: &Value,
        client_info: &Value,
        caller: &Caller,
    ) -> Result<(LegacySession<'g>, Value), SessionError> {
        let mut endpoint = group
            .pick()
            .ok_or_else(|| SessionError::no_endpoint(&group.name))?;
        let mut tried = Vec::new();
        let opened = loop {
            tried.push(endpoint.addr);
            let opened = LegacySession::open(
                &self.client,
                endpoint,
                &group.timeouts,
                capabilities,
                client_info,
                caller,
            )
            .await;
            // An endpoint that refused the connection ran nothing: another healthy one
            // opens the session (before a health check has marked the first down).
            let refused = SessionFailure::Exchange(ExchangeFailure::Connect);
            match &opened {
                Err(e) if *e.failure() == refused => match group.pick_other(&tried) {
                    Some(next) => endpoint = next,
                    None => break opened,
                },
                _ => break opened,
            }
        };
        match &opened {
            Ok((_, result)) => self.remember_initialize(group, caller, result),
            Err(e) if e.failure().doubts_legacy_era() => self.doubt_era(group, false),
            Err(_) => {}
        }
        opened
    }

    /// Whether a round that ended with questions waits resumable (its state resumes the
    /// call's stream with `Last-Event-ID`) rather than held: by the group's `resume`
    /// setting, or for `auto` by what the upstream showed (event ids on the call's stream,
    /// and no refused resumption so far).
    pub fn resumes(&self, group: &UpstreamGroup, stream_has_ids: bool) -> bool {
        match group.resume {
            ResumeMode::Resumable => true,
            ResumeMode::Hold => false,
            ResumeMode::Auto => stream_has_ids && !self.replay_refused(group),
        }
    }

    fn replay_refused(&self, group: &UpstreamGroup) -> bool {
        self.learnt.get(&group.name).replay_refused
    }

    /// Records that a group's upstream refused a `Last-Event-ID` resumption, answered it
    /// with an empty stream, or sent one event id twice in a round (`how`): with
    /// `resume: auto`, its later flows are held.
    pub fn note_replay_refused(&self, group: &UpstreamGroup, how: &str) {
        if group.resume != ResumeMode::Auto {
            return;
        }
        let before = self
            .learnt
            .update(&group.name, |facts| facts.replay_refused = true);
        if !before.replay_refused {
            tracing::warn!(group = %group.name, how, "upstream cannot resume a Last-Event-ID stream; its flows are held from now on");
            self.note_resumable(group, false);
        }
    }

    /// Records a resumption that failed without an answer saying why (cut, a server
    /// error, no answer in time): once they have failed often and long enough, with none
    /// working in between, the upstream cannot resume (`note_replay_refused`).
    pub fn note_resumption_failed(&self, group: &UpstreamGroup) {
        let now = tokio::time::Instant::now();
        let mut for_good = false;
        self.learnt.update(&group.name, |facts| {
            for_good = facts.note_resumption_failed(now);
        });
        if for_good {
            self.note_replay_refused(group, "resumptions failing without an answer for a minute");
        }
    }

    /// Records that the group's upstream keeps a session's GET stream after the gateway
    /// closed it: its GET streams are reopened with one attempt from now on.
    pub fn note_session_stream_kept(&self, group: &UpstreamGroup) {
        let before = self
            .learnt
            .update(&group.name, |facts| facts.session_stream_kept = true);
        if !before.session_stream_kept {
            tracing::info!(group = %group.name, "upstream keeps a closed GET stream for a while (409 to a new one); GET streams are reopened without waiting from now on");
        }
    }

    /// Records that `request`'s call asks several questions at once: its rounds wait the
    /// quiet window from now on. Logged once per call.
    pub fn note_asks_at_once(&self, group: &UpstreamGroup, request: &ModernRequest) {
        let target = request.target.as_deref().unwrap_or_default();
        if self
            .learnt
            .note_asks_at_once(&group.name, &request.method, target)
        {
            tracing::info!(group = %group.name, method = %request.method, target, "this call asks several questions at once (one missed its round); its rounds wait bridge.quiet_window_ms for the rest from now on");
        }
    }

    /// Records how a group's bridged rounds wait (resumed, or held), for the
    /// `upstream_resumable` gauge. Logged when first known and whenever it changes (a
    /// rolling upgrade of the upstream).
    pub fn note_resumable(&self, group: &UpstreamGroup, resumable: bool) {
        let gauge = self
            .client
            .metrics
            .upstream_resumable
            .with_label_values(&[&group.name]);
        let value = i64::from(resumable);
        if gauge.get() != value {
            gauge.set(value);
            let mode = if resumable { "resumable" } else { "hold" };
            tracing::info!(group = %group.name, mode, "bridged rounds of this group wait {mode}");
        }
    }

    /// The group's InitializeResult as the upstream gives it to `asker` now: a session
    /// opened as `asker` (so a caller the upstream denies is denied, and an upstream
    /// restarted as another server says so). That session has run nothing: it is kept
    /// for the asker's one-shot requests (a server slow to open sessions then pays once,
    /// not twice), or deleted if none are kept.
    pub async fn initialize_result(
        &self,
        group: &UpstreamGroup,
        asker: &Asker,
    ) -> Result<Value, SessionError> {
        let (session, result) = self
            .open_upstream(
                group,
                &asker.capabilities,
                &asker.client_info,
                &asker.caller,
            )
            .await?;
        let kept = Kept::of(&group.name, &session, Instant::now());
        match kept.filter(|_| self.kept_sessions.enabled()) {
            Some(kept) => {
                let older = self.kept_sessions.keep(asker.shape, asker.owner, kept);
                one_shot::retire(self, older.into_iter().collect()).await;
            }
            None => self.reaper.delete(&session).await,
        }
        Ok(result)
    }

    /// Whether 2026-07-28 requests to `group` are relayed unchanged rather than bridged
    /// (an `era: auto` group is probed on behalf of the request asking, made by `asker`).
    pub async fn relays(&self, group: &UpstreamGroup, asker: impl FnOnce() -> Asker) -> bool {
        match group.era {
            UpstreamEra::Legacy => false,
            UpstreamEra::Modern => true,
            UpstreamEra::Auto => {
                if let Some(known) = self.relays_as_known(group) {
                    return known;
                }
                let probed = match self.probe_modern_only(group, &asker()).await {
                    Probe::Verdict(modern_only) => Probed::Verdict {
                        modern_only,
                        since: Instant::now(),
                    },
                    Probe::Unreachable => Probed::RetryAfter(Instant::now() + PROBE_RETRY),
                    // The caller was denied: bridged, it gets the upstream's challenge,
                    // and its authenticated retry probes again.
                    Probe::Denied => return false,
                };
                self.modern_only
                    .lock()
                    .expect("era cache lock")
                    .insert(group.name.clone(), probed);
                matches!(
                    probed,
                    Probed::Verdict {
                        modern_only: true,
                        ..
                    }
                )
            }
        }
    }

    /// Whether 2026-07-28 requests to `group` are relayed, as known now without a probe;
    /// `None` for an `era: auto` group whose upstream has not been probed (or is to be
    /// probed again).
    pub fn relays_as_known(&self, group: &UpstreamGroup) -> Option<bool> {
        match group.era {
            UpstreamEra::Legacy => Some(false),
            UpstreamEra::Modern => Some(true),
            UpstreamEra::Auto => {
                let known = self.modern_only.lock().expect("era cache lock");
                match known.get(&group.name).copied() {
                    Some(Probed::Verdict { modern_only, .. }) => Some(modern_only),
                    Some(Probed::RetryAfter(at)) if Instant::now() < at => Some(false),
                    _ => None,
                }
            }
        }
    }

    /// What an `era: auto` group's upstream just answered does not fit its era's verdict
    /// (a bridged `initialize` refused, a relayed request refused as one without a
    /// session): an upstream redeployed as a server of the other era. A verdict older than
    /// `PROBE_RETRY` is dropped, and the next request probes again; a younger one stands,
    /// so that refusals a client can provoke probe the upstream at most that often.
    pub fn doubt_era(&self, group: &UpstreamGroup, modern_only: bool) {
        if group.era != UpstreamEra::Auto {
            return;
        }
        let mut known = self.modern_only.lock().expect("era cache lock");
        let stale = |since: Instant| since.elapsed() >= PROBE_RETRY;
        match known.get(&group.name) {
            Some(&Probed::Verdict {
                modern_only: was,
                since,
            }) if was == modern_only && stale(since) => {
                known.remove(&group.name);
                let era = if modern_only {
                    "2026-07-28 only"
                } else {
                    "the 2025 transport"
                };
                tracing::info!(group = %group.name, era, "the upstream no longer answers as its era was found to be; probing it again");
            }
            _ => {}
        }
    }

    /// An upstream that refuses `initialize` but answers `server/discover` speaks only
    /// 2026-07-28.
    async fn probe_modern_only(&self, group: &UpstreamGroup, asker: &Asker) -> Probe {
        let denied = match self.initialize_result(group, asker).await {
            Ok(_) => return Probe::Verdict(false),
            Err(e) => match e.failure() {
                SessionFailure::Protocol(_) | SessionFailure::Refused(_) => false,
                SessionFailure::Denied { .. } => true,
                _ => return Probe::Unreachable,
            },
        };
        let Some(endpoint) = group.pick() else {
            return Probe::Unreachable;
        };
        let discovered =
            answers_modern_discover(&self.client, &endpoint, &group.timeouts, &asker.caller).await;
        match discovered {
            Discovery::Modern => Probe::Verdict(true),
            Discovery::NotModern if !denied => Probe::Verdict(false),
            // Only an answer decides: a discover not answered is tried again shortly,
            // and one denied or throttled for this caller, by the next caller.
            Discovery::Unanswered => Probe::Unreachable,
            Discovery::NotModern | Discovery::Denied => Probe::Denied,
        }
    }

    /// The upstream's serverInfo for a modern result to `request`, once known
    /// (`ServerInfos::get`); else one naming the group.
    pub fn server_info(&self, group: &UpstreamGroup, request: &ModernRequest) -> Value {
        let who = request.headers.digest();
        let cache = self.server_infos.lock().expect("server info cache lock");
        match cache.get(&group.name, &who) {
            Some(info) if !info.is_null() => info.clone(),
            _ => json!({"name": group.name, "version": "unknown"}),
        }
    }
}

/// Most `serverInfo`s kept, over all groups; past it, all are forgotten.
const MAX_SERVER_INFOS: usize = 4096;

/// The `serverInfo`s upstream sessions were opened with, per group, by the digest of
/// the headers that decide who the upstream serves (`EndToEnd::digest`): a server may
/// name its caller there (a tenant, a user), which no other caller is shown.
#[derive(Default)]
pub struct ServerInfos {
    groups: HashMap<String, GroupServerInfos>,
    count: usize,
}

#[derive(Default)]
struct GroupServerInfos {
    by_caller: HashMap<[u8; 32], Value>,
    /// Every caller was given the same one so far.
    uniform: bool,
}

impl ServerInfos {
    fn remember(&mut self, group: &str, who: [u8; 32], info: Value) {
        let known = self
            .groups
            .get(group)
            .is_some_and(|g| g.by_caller.contains_key(&who));
        if !known && self.count >= MAX_SERVER_INFOS {
            *self = ServerInfos::default();
        }
        if !self.groups.contains_key(group) {
            self.groups
                .insert(group.to_string(), GroupServerInfos::default());
        }
        let infos = self.groups.get_mut(group).expect("inserted");
        let others = infos.by_caller.iter().find(|(w, _)| **w != who);
        infos.uniform = match others {
            None => true,
            Some((_, other)) => infos.uniform && *other == info,
        };
        if infos.by_caller.insert(who, info).is_none() {
            self.count += 1;
        }
    }

    /// The caller's own, or, where at least two callers were given the same and none
    /// another, that one: the server names nobody there.
    fn get(&self, group: &str, who: &[u8; 32]) -> Option<&Value> {
        let infos = self.groups.get(group)?;
        match infos.by_caller.get(who) {
            Some(own) => Some(own),
            None if infos.uniform && infos.by_caller.len() >= 2 => infos.by_caller.values().next(),
            None => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller is shown its own `serverInfo`; one the replica has not opened a session
    /// for is shown the group's only where two or more callers were all given the same,
    /// never one that names another caller.
    #[test]
    fn a_caller_is_shown_its_own_server_info_or_one_every_caller_was_given() {
        let mut infos = ServerInfos::default();
        let (ada, bob, cy) = ([1; 32], [2; 32], [3; 32]);
        let named = |who: &str| json!({"name": "s", "title": who});
        infos.remember("g", ada, named("Ada"));
        assert_eq!(infos.get("g", &ada), Some(&named("Ada")));
        assert_eq!(infos.get("g", &bob), None, "one caller's may name it");
        infos.remember("g", bob, named("Bob"));
        assert_eq!(infos.get("g", &bob), Some(&named("Bob")));
        assert_eq!(infos.get("g", &cy), None, "they differ");
        assert_eq!(infos.get("other", &ada), None);

        let mut alike = ServerInfos::default();
        let plain = json!({"name": "s", "version": "1"});
        alike.remember("g", ada, plain.clone());
        alike.remember("g", ada, plain.clone());
        assert_eq!(alike.get("g", &cy), None, "one caller twice is one caller");
        alike.remember("g", bob, plain.clone());
        assert_eq!(alike.get("g", &cy), Some(&plain));
        alike.remember("g", cy, named("Cy"));
        assert_eq!(alike.get("g", &[4; 32]), None, "no longer alike");

        let mut many = ServerInfos::default();
        for i in 0..=MAX_SERVER_INFOS {
            let who: [u8; 32] = std::array::from_fn(|b| (i >> (8 * (b % 4))) as u8);
            many.remember("g", who, plain.clone());
        }
        assert!(many.count <= MAX_SERVER_INFOS);
    }
}
