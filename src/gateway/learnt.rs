//! What this replica learns about each upstream group while serving it, rather than
//! being told: whether the group's `Last-Event-ID` resumptions work, whether a resumed
//! stream is primed (an event with an id and no data once the replay is done and the
//! stream is live again), and whether the group's event store keeps sessions apart, so
//! that a session's GET stream can be replayed without another session's events, and
//! whether it lets go of a closed GET stream in time for a new one; and which of its
//! tools ask several questions at once (their rounds wait the quiet window). A probe
//! runs one at a time per group (`Learnt::probe_turn`).
//! `resume: auto`, the retry path and the round's end decide by it; each verdict is
//! logged once.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
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
    pub session_replay: SessionReplay,
    /// How many probes of `session_replay` have ended (a failed one leaves it `Unknown`).
    pub session_replay_probes: u32,
    /// After a failed probe, when the next may run: until then the verdict stays
    /// `Unknown` without asking the upstream again.
    pub session_replay_retry_at: Option<tokio::time::Instant>,
    /// The upstream keeps a session's GET stream after the gateway closed it (a new GET
    /// got 409 for as long as the gateway tried): a GET stream is then reopened with one
    /// attempt, since waiting for the server to let go of the old one never paid.
    pub session_stream_kept: bool,
    /// Resumptions that failed without an answer saying why (`Learnt::ResumptionFailed`
    /// of `mrtr::flow`) since the last one that worked: how many, and since when.
    pub failing_resumptions: Option<(u32, Instant)>,
}

/// How many resumptions in a row, failing for how long, show that a group's upstream
/// cannot resume (a broken event store), rather than that it restarted: a restart cuts
/// the resumptions of a few seconds, and any that works in between starts the count anew.
pub const FAILED_RESUMPTIONS_IN_A_ROW: u32 = 5;
pub const FAILING_RESUMPTIONS_FOR: Duration = Duration::from_secs(60);

impl GroupLearnt {
    /// Counts a resumption that failed at `now` without an answer saying why; true once
    /// they have failed often enough, for long enough.
    pub fn note_resumption_failed(&mut self, now: Instant) -> bool {
        let (count, since) = self.failing_resumptions.get_or_insert((0, now));
        *count = count.saturating_add(1);
        *count >= FAILED_RESUMPTIONS_IN_A_ROW
            && now.duration_since(*since) >= FAILING_RESUMPTIONS_FOR
    }
}

/// Every group's learnt facts, by group name.
#[derive(Default)]
pub struct Learnt {
    groups: Mutex<HashMap<String, GroupLearnt>>,
    /// The calls seen asking several questions at once, by a keyed hash of (group,
    /// method, target): 8 bytes each, and nothing allocated to look one up.
    asking_at_once: Mutex<HashSet<u64>>,
    call_hasher: RandomState,
    /// Per group, the turn to probe it: held for the whole probe.
    probe_turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Learnt {
    pub fn get(&self, group: &str) -> GroupLearnt {
        let groups = self.groups.lock().expect("learnt lock");
        groups.get(group).copied().unwrap_or_default()
    }

    /// Applies `learn` to the group's facts; returns them as they were before.
    pub fn update(&self, group: &str, learn: impl FnOnce(&mut GroupLearnt)) -> GroupLearnt {
        let mut groups = self.groups.lock().expect("learnt lock");
        let facts = groups.entry(group.to_string()).or_default();
        let before = *facts;
        learn(facts);
        before
    }

    /// The lock a probe of `group` holds while it runs, so that requests arriving
    /// together wait for one probe's verdict rather than each probing the upstream.
    pub fn probe_turn(&self, group: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut turns = self.probe_turns.lock().expect("learnt lock");
        turns.entry(group.to_string()).or_default().clone()
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

    #[test]
    fn resumptions_failing_often_and_long_show_an_upstream_that_cannot_resume() {
        let start = Instant::now();
        let mut facts = GroupLearnt::default();
        // A burst, as an upstream restarting cuts: many, but within seconds.
        for n in 0..2 * FAILED_RESUMPTIONS_IN_A_ROW {
            let at = start + Duration::from_millis(u64::from(n) * 100);
            assert!(!facts.note_resumption_failed(at));
        }
        // A minute on, still failing: the store is broken.
        assert!(facts.note_resumption_failed(start + FAILING_RESUMPTIONS_FOR));
        // Long, but few: four over minutes say nothing yet; the fifth does.
        let mut facts = GroupLearnt::default();
        for n in 1..FAILED_RESUMPTIONS_IN_A_ROW {
            assert!(!facts.note_resumption_failed(start + FAILING_RESUMPTIONS_FOR * n));
        }
        assert!(facts.note_resumption_failed(start + FAILING_RESUMPTIONS_FOR * 9));
        // One that worked starts the count anew.
        facts.failing_resumptions = None;
        assert!(!facts.note_resumption_failed(start + FAILING_RESUMPTIONS_FOR * 10));
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
