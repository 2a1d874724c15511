//! What this replica learns about each upstream group while serving it, rather than
//! being told: whether the group's `Last-Event-ID` resumptions work, whether a resumed
//! stream is primed (an event with an id and no data once the replay is done and the
//! stream is live again), and whether the group's event store keeps sessions apart, so
//! that a session's GET stream can be replayed without another session's events, and
//! whether it lets go of a closed GET stream in time for a new one; and which of its
//! tools ask several questions at once (their rounds wait the quiet window). A store
//! probe runs one at a time per endpoint (`Learnt::probe_turn`).
//! `resume: auto`, the retry path and the round's end decide by it; each verdict is
//! logged once.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Most tools (and prompts, resources) remembered as asking several questions at once,
/// over all groups: beyond it, others are not remembered, and their rounds keep ending as
/// soon as the upstream has nothing more to send.
pub const MAX_ASKING_AT_ONCE: usize = 4096;

/// Whether a session's GET stream may be resumed with `Last-Event-ID`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SessionReplay {
    /// Not probed yet.
    #[default]
    Unknown,
    /// The store resolves only a session's own event ids: a replay holds only that
    /// session's events.
    Scoped,
    /// The store resolved another session's event id (it is shared and keyed by stream,
    /// as the SDKs' example stores are): a GET-stream replay could carry other sessions'
    /// requests, so the GET stream is reopened fresh instead.
    Shared,
    /// The upstream gives its streams no event ids: there is nothing to resume.
    Unavailable,
}

impl SessionReplay {
    /// Whether the store keeps sessions apart, where that is known (what a state carries
    /// to the replica taking its retry).
    pub fn kept_apart(self) -> Option<bool> {
        match self {
            SessionReplay::Scoped => Some(true),
            SessionReplay::Shared => Some(false),
            SessionReplay::Unknown | SessionReplay::Unavailable => None,
        }
    }

    /// The verdict `kept_apart` says (a state's word, taken as a probe's).
    pub fn of_kept_apart(kept_apart: bool) -> SessionReplay {
        match kept_apart {
            true => SessionReplay::Scoped,
            false => SessionReplay::Shared,
        }
    }
}

/// What is known of one group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupLearnt {
    /// The upstream refused a `Last-Event-ID` resumption, answered it with an empty
    /// stream, or sent one event id twice in a round (ids that name no one event):
    /// with `resume: auto` its flows are held from then on.
    pub replay_refused: bool,
    /// Whether its resumed streams end their replay with a priming event; `None` until a
    /// resumption showed it.
    pub resumption_primes: Option<bool>,
    /// The latest verdict on an endpoint's store (`StoreLearnt`), for what a new call,
    /// whose endpoint is not known yet, decides by it (whether its rounds ping the
    /// session before they end). A GET stream is resumed only by its endpoint's own.
    pub session_replay: SessionReplay,
    /// The upstream keeps a session's GET stream after the gateway closed it (a new GET
    /// got 409 for as long as the gateway tried): a GET stream is then reopened with one
    /// attempt, since waiting for the server to let go of the old one never paid.
    pub session_stream_kept: bool,
    /// Resumptions failing one after another without an answer saying why.
    pub failing_resumptions: Option<FailingResumptions>,
}

/// What is known of one endpoint's event store: whether it keeps sessions apart. Kept per
/// endpoint, not per group: a group's endpoints may run different servers, or one
/// server's versions during a rollout, and resuming a GET stream on a store shared by
/// sessions replays other sessions' events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreLearnt {
    pub session_replay: SessionReplay,
    /// How many probes of `session_replay` have ended (a failed one leaves it `Unknown`).
    pub probes: u32,
    /// After a failed probe, when the next may run: until then the verdict stays
    /// `Unknown` without asking the upstream again.
    pub retry_at: Option<tokio::time::Instant>,
}

/// Most endpoints whose stores are remembered; past it, all are forgotten (and probed
/// again): a DNS group's pods come and go.
const MAX_STORES: usize = 4096;

/// A run of resumptions that failed without an answer saying why (`Learnt::ResumptionFailed`
/// of `mrtr::flow`: cut, a server error, no answer in time), none working in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailingResumptions {
    /// A round of the group reached its questions during the run: the upstream serves
    /// calls, and only the failures from then on count.
    pub served: bool,
    /// The failures since it was served, and when the first of them came.
    pub count: u32,
    pub first_at: Option<Instant>,
    /// The run's latest failure, served or not.
    pub last_at: Instant,
}

/// When a run of failed resumptions shows that a group's upstream cannot resume (a broken
/// event store), rather than that it restarted or is down: this many in a row while the
/// upstream served other calls' rounds, over at least this long. A restart cuts a few
/// seconds of resumptions before its rounds are served again, and one that works starts
/// the count anew; an upstream that is down serves no round.
pub const FAILED_RESUMPTIONS_IN_A_ROW: u32 = 5;
pub const FAILING_RESUMPTIONS_FOR: Duration = Duration::from_secs(60);
/// A failure this long after the run's last starts a run of its own: old ones are
/// forgotten.
pub const FAILING_RESUMPTIONS_GAP: Duration = Duration::from_secs(600);

impl GroupLearnt {
    /// Counts a resumption that failed at `now` without an answer saying why; true once
    /// the run shows the upstream cannot resume.
    pub fn note_resumption_failed(&mut self, now: Instant) -> bool {
        let fresh = FailingResumptions {
            served: false,
            count: 0,
            first_at: None,
            last_at: now,
        };
        let mut run = self
            .failing_resumptions
            .filter(|run| now.saturating_duration_since(run.last_at) <= FAILING_RESUMPTIONS_GAP)
            .unwrap_or(fresh);
        run.last_at = now;
        if run.served {
            run.count = run.count.saturating_add(1);
            run.first_at.get_or_insert(now);
        }
        self.failing_resumptions = Some(run);
        let lasted = run
            .first_at
            .is_some_and(|first| now.saturating_duration_since(first) >= FAILING_RESUMPTIONS_FOR);
        run.count >= FAILED_RESUMPTIONS_IN_A_ROW && lasted
    }

    /// A round of the group ended with its questions: the upstream serves calls.
    pub fn note_round_served(&mut self) {
        if let Some(run) = self.failing_resumptions.as_mut() {
            run.served = true;
        }
    }
}

/// The turn to probe one endpoint's store: held for the whole probe.
pub type ProbeTurn = Arc<tokio::sync::Mutex<()>>;

/// Every group's learnt facts, by group name.
#[derive(Default)]
pub struct Learnt {
    groups: Mutex<HashMap<String, GroupLearnt>>,
    /// The calls seen asking several questions at once, by a keyed hash of (group,
    /// method, target): 8 bytes each, and nothing allocated to look one up.
    asking_at_once: Mutex<HashSet<u64>>,
    call_hasher: RandomState,
    /// Per endpoint (group name and address), the turn to probe its store.
    probe_turns: Mutex<HashMap<(String, SocketAddr), ProbeTurn>>,
    /// Each endpoint's store, by group name then address: looked up by `&str`, so a
    /// round's lookup copies nothing.
    stores: Mutex<HashMap<String, HashMap<SocketAddr, StoreLearnt>>>,
}

impl Learnt {
    pub fn get(&self, group: &str) -> GroupLearnt {
        let groups = self.groups.lock().expect("learnt lock");
        groups.get(group).copied().unwrap_or_default()
    }

    /// Applies `learn` to the group's facts; returns them as they were before.
    pub fn update(&self, group: &str, learn: impl FnOnce(&mut GroupLearnt)) -> GroupLearnt {
        let mut groups = self.groups.lock().expect("learnt lock");
        // Looked up by name first: rounds update their group's facts, which are nearly
        // always there, and the name is copied only for a group's first.
        if !groups.contains_key(group) {
            groups.insert(group.to_string(), GroupLearnt::default());
        }
        let facts = groups.get_mut(group).expect("inserted");
        let before = *facts;
        learn(facts);
        before
    }

    /// What is known of the store at `endpoint` of `group`.
    pub fn store(&self, group: &str, endpoint: SocketAddr) -> StoreLearnt {
        let stores = self.stores.lock().expect("learnt lock");
        let known = stores.get(group).and_then(|group| group.get(&endpoint));
        known.copied().unwrap_or_default()
    }

    /// Applies `learn` to what is known of the store at `endpoint` of `group`; returns it
    /// as it was before. A verdict is also the group's latest (`GroupLearnt`).
    pub fn update_store(
        &self,
        group: &str,
        endpoint: SocketAddr,
        learn: impl FnOnce(&mut StoreLearnt),
    ) -> StoreLearnt {
        let (before, after) = {
            let mut stores = self.stores.lock().expect("learnt lock");
            let known = stores.get(group).is_some_and(|g| g.contains_key(&endpoint));
            if !known && stores.values().map(HashMap::len).sum::<usize>() >= MAX_STORES {
                stores.clear();
            }
            if !stores.contains_key(group) {
                stores.insert(group.to_string(), HashMap::new());
            }
            let group_stores = stores.get_mut(group).expect("inserted");
            let facts = group_stores.entry(endpoint).or_default();
            let before = *facts;
            learn(facts);
            (before, *facts)
        };
        if after.session_replay != SessionReplay::Unknown {
            self.update(group, |facts| facts.session_replay = after.session_replay);
        }
        before
    }

    /// The lock a probe of the store at `endpoint` of `group` holds while it runs, so
    /// that requests arriving together wait for one probe's verdict rather than each
    /// probing the upstream; requests for other endpoints (whose verdicts are their own)
    /// do not wait for it. Past `MAX_STORES` endpoints, the turns nobody holds are
    /// forgotten.
    pub fn probe_turn(&self, group: &str, endpoint: SocketAddr) -> ProbeTurn {
        let mut turns = self.probe_turns.lock().expect("learnt lock");
        if turns.len() >= MAX_STORES {
            turns.retain(|_, turn| Arc::strong_count(turn) > 1);
        }
        let turn = turns.entry((group.to_string(), endpoint)).or_default();
        turn.clone()
    }

    /// Whether `target` of `group` (a tool's name, a prompt's, a resource's URI, by
    /// `method`) was seen asking several questions at once.
    pub fn asks_at_once(&self, group: &str, method: &str, target: &str) -> bool {
        let key = self.call_key(group, method, target);
        self.asking_at_once
            .lock()
            .expect("learnt lock")
            .contains(&key)
    }

    /// Remembers that `target` asks several questions at once; true if it is new (and
    /// there was room for it).
    pub fn note_asks_at_once(&self, group: &str, method: &str, target: &str) -> bool {
        let key = self.call_key(group, method, target);
        let mut asking = self.asking_at_once.lock().expect("learnt lock");
        asking.len() < MAX_ASKING_AT_ONCE && asking.insert(key)
    }

    fn call_key(&self, group: &str, method: &str, target: &str) -> u64 {
        self.call_hasher.hash_one((group, method, target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_start_unknown_and_update_returns_what_was_known() {
        let learnt = Learnt::default();
        assert_eq!(learnt.get("g"), GroupLearnt::default());
        let before = learnt.update("g", |f| f.resumption_primes = Some(true));
        assert_eq!(before.resumption_primes, None);
        assert_eq!(learnt.get("g").resumption_primes, Some(true));
        assert_eq!(learnt.get("other"), GroupLearnt::default());
    }

    /// One probe at a time per endpoint: a probe of one endpoint's store holds no
    /// request for another's; turns nobody holds are forgotten past `MAX_STORES`.
    #[test]
    fn probe_turns_are_per_endpoint_and_bounded() {
        let learnt = Learnt::default();
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let one = learnt.probe_turn("g", at(1));
        assert!(Arc::ptr_eq(&one, &learnt.probe_turn("g", at(1))));
        let held = one.try_lock().expect("free");
        let other = learnt.probe_turn("g", at(2));
        assert!(other.try_lock().is_ok(), "another endpoint's turn is free");
        for port in 3..=MAX_STORES as u16 + 1 {
            learnt.probe_turn("g", at(port));
        }
        let turns = learnt.probe_turns.lock().unwrap().len();
        assert!(turns < MAX_STORES, "{turns}");
        assert!(
            Arc::ptr_eq(&one, &learnt.probe_turn("g", at(1))),
            "a turn in use stays"
        );
        drop(held);
    }

    /// An endpoint's store verdict is its own, and the group's latest; past
    /// `MAX_STORES` endpoints all are forgotten, and one already known is never the one
    /// that makes room.
    #[test]
    fn store_facts_are_per_endpoint_and_bounded() {
        let learnt = Learnt::default();
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let before = learnt.update_store("g", at(1), |f| {
            f.session_replay = SessionReplay::Scoped;
        });
        assert_eq!(before, StoreLearnt::default());
        assert_eq!(
            learnt.store("g", at(1)).session_replay,
            SessionReplay::Scoped
        );
        assert_eq!(learnt.store("g", at(2)), StoreLearnt::default());
        assert_eq!(learnt.store("h", at(1)), StoreLearnt::default());
        assert_eq!(learnt.get("g").session_replay, SessionReplay::Scoped);
        for port in 2..=MAX_STORES as u16 {
            learnt.update_store("h", at(port), |f| f.probes = 1);
        }
        learnt.update_store("g", at(1), |f| f.probes = 1);
        assert_eq!(
            learnt.store("g", at(1)).probes,
            1,
            "a known endpoint makes no room"
        );
        learnt.update_store("g", at(2), |f| f.probes = 2);
        assert_eq!(learnt.store("g", at(2)).probes, 2);
        assert_eq!(
            learnt.store("g", at(1)),
            StoreLearnt::default(),
            "all forgotten"
        );
        assert_eq!(learnt.store("h", at(2)), StoreLearnt::default());
    }

    /// A run teaches only when its failures, counted once the upstream served other
    /// rounds, are many and last; a pause forgets it; one that worked ends it.
    #[test]
    fn resumptions_failing_often_and_long_while_others_are_served_show_a_broken_store() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let minute = FAILING_RESUMPTIONS_FOR.as_millis() as u64;
        let n = u64::from(FAILED_RESUMPTIONS_IN_A_ROW);
        let mut facts = GroupLearnt::default();
        // A burst, as an upstream restarting cuts, then nothing served for a minute (an
        // upstream down): nothing.
        for i in 0..2 * n {
            assert!(!facts.note_resumption_failed(at(i * 100)));
        }
        assert!(!facts.note_resumption_failed(at(minute)));
        // Served again: the burst does not count, and one more failure a minute and a
        // half in says nothing either.
        facts.note_round_served();
        assert!(!facts.note_resumption_failed(at(minute + minute / 2)));
        // Failures still coming while calls are served, for a minute: a broken store.
        for i in 1..n - 1 {
            assert!(!facts.note_resumption_failed(at(minute + minute / 2 + i * 1000)));
        }
        assert!(facts.note_resumption_failed(at(3 * minute)));

        // Many while served, but within seconds: not yet.
        let mut facts = GroupLearnt::default();
        assert!(!facts.note_resumption_failed(at(0)));
        facts.note_round_served();
        for i in 1..=2 * n {
            assert!(!facts.note_resumption_failed(at(i * 100)));
        }

        // A failure long after the run's last starts a run of its own.
        let gap = FAILING_RESUMPTIONS_GAP.as_millis() as u64;
        assert!(!facts.note_resumption_failed(at(gap + 10_000)));
        let run = facts.failing_resumptions.unwrap();
        assert_eq!((run.served, run.count), (false, 0));
    }

    #[test]
    fn tools_asking_at_once_are_remembered_per_group_and_bounded() {
        let learnt = Learnt::default();
        assert!(!learnt.asks_at_once("g", "tools/call", "ask_two"));
        assert!(learnt.note_asks_at_once("g", "tools/call", "ask_two"));
        assert!(
            !learnt.note_asks_at_once("g", "tools/call", "ask_two"),
            "known"
        );
        assert!(learnt.asks_at_once("g", "tools/call", "ask_two"));
        assert!(!learnt.asks_at_once("other", "tools/call", "ask_two"));
        assert!(!learnt.asks_at_once("g", "prompts/get", "ask_two"));
        for n in 1..MAX_ASKING_AT_ONCE {
            learnt.note_asks_at_once("g", "tools/call", &format!("t{n}"));
        }
        assert!(
            !learnt.note_asks_at_once("g", "tools/call", "one_more"),
            "full"
        );
        assert!(!learnt.asks_at_once("g", "tools/call", "one_more"));
    }
}
