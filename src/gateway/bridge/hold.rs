//! Hold mode: flows whose upstream cannot resume streams wait between rounds in a bounded
//! per-replica table that keeps their upstream streams open. The `requestState` names the
//! slot and the replica (`HeldAt`); a retry that lands on another replica is forwarded to
//! this one over the peer listener, and the retry takes the flow out of the table and
//! reads on where the round stopped.
//!
//! What a held flow costs: its two upstream connections (the call's stream and the
//! session's GET stream) and what the gateway keeps buffered for it, its round's
//! questions (to ask again any the client leaves unanswered) and any partial upstream
//! event; the latter is bounded by `bridge.max_held_bytes_per_flow`, the table by
//! `bridge.max_held_flows`, and both are exported. One principal holds at most
//! `bridge.max_held_flows_per_principal` of them, so that a client that abandons its flows
//! cannot take every slot from the others (requests without a principal share only the
//! table's bound). An entry lives until its state expires; the sweeper then closes its
//! streams and deletes its upstream session.

use super::streams::Streams;
use crate::gateway::Gateway;
use crate::mrtr::state::now_secs;
use crate::protocol::jsonrpc::Cancellation;
use crate::protocol::revision::Revision;
use crate::upstream::legacy_session::{Caller, LegacySession};
use crate::upstream::{Endpoint, Timeouts};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often expired entries are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One flow waiting for its client, with its upstream streams open.
pub(super) struct Held {
    pub flow_id: u64,
    pub expires_at: u64,
    pub endpoint: Endpoint,
    pub timeouts: Timeouts,
    /// The upstream session the flow runs in, if the server gave one.
    pub session: Option<HeldSession>,
    pub streams: Streams,
    /// The round's questions by key, to ask again those the retry leaves unanswered.
    pub questions: Map<String, Value>,
    /// What the gateway buffers for the flow, as accounted against the limit.
    bytes: usize,
    /// The principal whose flow it is (counted against its bound), unless anonymous.
    principal: Option<[u8; 32]>,
}

impl Held {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        flow_id: u64,
        expires_at: u64,
        endpoint: Endpoint,
        timeouts: Timeouts,
        session: Option<HeldSession>,
        streams: Streams,
        questions: Map<String, Value>,
    ) -> Box<Held> {
        let questions_bytes = serde_json::to_vec(&questions).map_or(0, |v| v.len());
        let bytes = questions_bytes + streams.buffered();
        Box::new(Held {
            flow_id,
            expires_at,
            endpoint,
            timeouts,
            session,
            streams,
            questions,
            bytes,
            principal: None,
        })
    }

    /// Ends the flow: closes its streams and ends its call upstream, deleting its session
    /// (one of its own) or cancelling the call (in a data-layer session), unless its
    /// endpoint left the group meanwhile (a DNS group's pod that left may have given its
    /// address to another server, which gets neither the session id nor credentials).
    pub async fn abandon(self, gw: &Gateway) {
        let client = &gw.upstreams.client;
        self.streams.close(client).await;
        if self.session.is_some() && !gw.upstreams.groups.holds(&self.endpoint) {
            tracing::info!(
                flow = format!("{:016x}", self.flow_id),
                "a held flow's endpoint left its group: its upstream call is not ended there"
            );
            gw.runtime.metrics.held_event("endpoint_left");
            return;
        }
        let Some(HeldSession {
            id,
            version,
            cancel,
            caller,
        }) = self.session
        else {
            return;
        };
        let reaper = &gw.upstreams.reaper;
        if cancel.is_none() {
            reaper.forget(&self.endpoint, id.as_str());
        }
        let mut upstream =
            LegacySession::resume(client, self.endpoint, &self.timeouts, id, version);
        upstream.caller = caller;
        // Now, and again later if the upstream cannot take it yet.
        match cancel {
            // A data-layer session's call: cancelled (the tool stops waiting).
            Some(cancel) => {
                let _first_try = reaper.cancel(&upstream, &cancel, "abandoned").await;
            }
            // Its own session: deleted (the SDK servers keep a session until then).
            None => reaper.reap(&upstream).await,
        }
    }
}

/// The upstream session a held flow runs in, and how its call ends if the flow does
/// without its client.
pub(super) struct HeldSession {
    pub id: String,
    /// The revision it negotiated.
    pub version: Revision,
    /// A data-layer session's call is cancelled so (the session outlives its flows); a
    /// session of the flow's own is deleted.
    pub cancel: Option<Cancellation>,
    /// The headers of the round that held it (its credentials): an upstream that
    /// authenticates every request refuses the cancellation or DELETE without them.
    pub caller: Caller,
}

/// Why a flow could not be held; its round ends with an error.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NotHeld {
    /// The table is at `bridge.max_held_flows`.
    Full,
    /// The principal holds `bridge.max_held_flows_per_principal` flows already.
    PrincipalFull,
    /// The flow buffers this many bytes, above `bridge.max_held_bytes_per_flow`.
    TooLarge(usize),
    /// The replica is shutting down: its held flows were ended, and no retry could
    /// reach one held now.
    Closed,
}

/// The flows this replica holds, by slot, with the bytes they buffer in all.
pub struct HeldFlows {
    table: Mutex<Table>,
    capacity: usize,
    per_principal: usize,
    max_bytes: usize,
}

#[derive(Default)]
struct Table {
    flows: HashMap<u64, Box<Held>>,
    bytes: usize,
    /// How many flows each principal holds (those holding any).
    by_principal: HashMap<[u8; 32], usize>,
    /// Shutting down: every flow was taken, and none is held any more.
    closed: bool,
}

impl Table {
    fn remove(&mut self, slot: &u64) -> Option<Box<Held>> {
        let held = self.flows.remove(slot)?;
        self.bytes -= held.bytes;
        if let Some(principal) = &held.principal {
            if let Some(count) = self.by_principal.get_mut(principal) {
                *count -= 1;
                if *count == 0 {
                    self.by_principal.remove(principal);
                }
            }
        }
        Some(held)
    }
}

impl HeldFlows {
    /// A table of at most `capacity` flows, `per_principal` of one principal, each
    /// buffering at most `max_bytes`.
    pub fn new(capacity: usize, per_principal: usize, max_bytes: usize) -> HeldFlows {
        HeldFlows {
            table: Mutex::new(Table::default()),
            capacity,
            per_principal,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("held-flows lock")
    }

    /// Holds a flow of `principal` (`None`: anonymous); returns its slot. On refusal the
    /// entry comes back, to be abandoned.
    pub(super) fn hold(
        &self,
        mut held: Box<Held>,
        principal: Option<[u8; 32]>,
    ) -> Result<u64, (NotHeld, Box<Held>)> {
        if held.bytes > self.max_bytes {
            return Err((NotHeld::TooLarge(held.bytes), held));
        }
        let mut table = self.lock();
        if table.closed {
            return Err((NotHeld::Closed, held));
        }
        if table.flows.len() >= self.capacity {
            return Err((NotHeld::Full, held));
        }
        if let Some(principal) = principal {
            let count = table.by_principal.entry(principal).or_default();
            if *count >= self.per_principal {
                return Err((NotHeld::PrincipalFull, held));
            }
            *count += 1;
        }
        held.principal = principal;
        let mut slot: u64 = rand::random();
        while table.flows.contains_key(&slot) {
            slot = rand::random();
        }
        table.bytes += held.bytes;
        table.flows.insert(slot, held);
        Ok(slot)
    }

    /// Takes the flow out of its slot, if this replica still holds it.
    pub(super) fn take(&self, slot: u64, flow_id: u64) -> Option<Box<Held>> {
        let mut table = self.lock();
        match table.flows.get(&slot) {
            Some(held) if held.flow_id == flow_id => table.remove(&slot),
            _ => None,
        }
    }

    /// Takes every flow whose state has expired by `now`.
    fn take_expired(&self, now: u64) -> Vec<Held> {
        let mut table = self.lock();
        let due: Vec<u64> = table
            .flows
            .iter()
            .filter(|(_, h)| h.expires_at <= now)
            .map(|(slot, _)| *slot)
            .collect();
        due.iter()
            .filter_map(|slot| table.remove(slot))
            .map(|held| *held)
            .collect()
    }

    /// Takes every flow, and holds none from now on (at shutdown: nobody can continue
    /// them after this process).
    fn take_all(&self) -> Vec<Held> {
        let mut table = self.lock();
        table.closed = true;
        let slots: Vec<u64> = table.flows.keys().copied().collect();
        slots
            .iter()
            .filter_map(|slot| table.remove(slot))
            .map(|held| *held)
            .collect()
    }

    /// How many flows are held, and the bytes they buffer.
    pub fn usage(&self) -> (usize, usize) {
        let table = self.lock();
        (table.flows.len(), table.bytes)
    }
}

/// Ends held flows whose state expired, and at shutdown (near the end of the grace
/// period, in which they could still be continued) every one left: nobody can continue
/// them any more, and their upstream sessions would otherwise wait for the server's own
/// idle timeout. Then it tells the rounds still running that the grace period is ending
/// (`Drain::near_end`), and the table holds no flow from then on.
pub struct HeldSweeper {
    pub gw: Arc<Gateway>,
}

#[async_trait]
impl BackgroundService for HeldSweeper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        // The shutdown signal comes at SIGTERM, when the grace period begins: held flows
        // can still be continued through it, so the last of them end near its end (four
        // fifths in, leaving the rest for their DELETEs before the runtime stops).
        let mut last_call: Option<tokio::time::Instant> = None;
        // Expired flows end each on its own task: an upstream slow to take their DELETEs
        // (each within the group's response timeout) must not hold the sweep, the flows
        // expiring meanwhile, or the shutdown's last call.
        let mut expiring = tokio::task::JoinSet::new();
        loop {
            let ending = async {
                match last_call {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed(), if last_call.is_none() => {
                    let grace = Duration::from_secs(self.gw.config.server.grace_period_seconds);
                    last_call = Some(tokio::time::Instant::now() + grace - grace / 5);
                }
                _ = ending => break,
            }
            while expiring.try_join_next().is_some() {}
            for held in self.gw.flows.held.take_expired(now_secs()) {
                tracing::info!(flow = format!("{:016x}", held.flow_id), "held flow expired");
                self.gw.runtime.metrics.held_event("expired");
                let gw = self.gw.clone();
                expiring.spawn(async move { held.abandon(&gw).await });
            }
        }
        // Rounds that could not be handed over end now too, with their upstream calls.
        self.gw.runtime.drain.near_end();
        let left = self.gw.flows.held.take_all();
        if !left.is_empty() {
            tracing::info!(flows = left.len(), "held flows ended at shutdown");
        }
        for held in left {
            self.gw.runtime.metrics.held_event("shutdown");
            let gw = self.gw.clone();
            expiring.spawn(async move { held.abandon(&gw).await });
        }
        while expiring.join_next().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(flow_id: u64, expires_at: u64, question_bytes: usize) -> Box<Held> {
        let mut questions = Map::new();
        questions.insert("k".into(), Value::String("x".repeat(question_bytes)));
        Held::new(
            flow_id,
            expires_at,
            Endpoint {
                addr: "127.0.0.1:1".parse().unwrap(),
                authority: "127.0.0.1:1".into(),
                path: "/mcp".into(),
                tls: None,
                peer: false,
            },
            Timeouts {
                connect: Duration::from_secs(1),
                response: Duration::from_secs(1),
                stream_idle: None,
            },
            None,
            Streams::new(None, None),
            questions,
        )
    }

    #[test]
    fn a_slot_gives_its_flow_once_and_only_to_that_flow() {
        let flows = HeldFlows::new(8, 8, 1 << 20);
        let slot = flows.hold(held(7, 100, 10), None).ok().unwrap();
        assert!(flows.take(slot, 8).is_none(), "another flow's state");
        assert_eq!(flows.usage().0, 1);
        assert_eq!(flows.take(slot, 7).unwrap().flow_id, 7);
        assert!(flows.take(slot, 7).is_none(), "taken already");
        assert_eq!(flows.usage(), (0, 0));
    }

    #[test]
    fn the_table_and_each_flow_are_bounded() {
        let flows = HeldFlows::new(2, 2, 2048);
        let (refused, _) = flows.hold(held(1, 100, 4096), None).err().unwrap();
        assert!(matches!(refused, NotHeld::TooLarge(n) if n > 4096));
        flows.hold(held(1, 100, 10), None).ok().unwrap();
        flows.hold(held(2, 100, 10), None).ok().unwrap();
        let (refused, back) = flows.hold(held(3, 100, 10), None).err().unwrap();
        assert_eq!((refused, back.flow_id), (NotHeld::Full, 3));
        assert!(flows.usage().1 > 20);
    }

    /// At shutdown the sweep takes every flow and ends it; a round that ends after that
    /// cannot be held either (nobody could continue it), so its call ends, not leaks.
    #[test]
    fn once_every_flow_was_taken_at_shutdown_none_is_held() {
        let flows = HeldFlows::new(8, 8, 1 << 20);
        flows.hold(held(1, 100, 1), None).ok().unwrap();
        assert_eq!(flows.take_all().len(), 1);
        let (refused, back) = flows.hold(held(2, 100, 1), None).err().unwrap();
        assert_eq!((refused, back.flow_id), (NotHeld::Closed, 2));
        assert_eq!(flows.usage(), (0, 0));
    }

    #[test]
    fn expired_flows_are_taken_by_the_sweep() {
        let flows = HeldFlows::new(8, 8, 1 << 20);
        flows.hold(held(1, 100, 1), None).ok().unwrap();
        let live = flows.hold(held(2, 200, 1), None).ok().unwrap();
        let expired = flows.take_expired(150);
        assert_eq!(expired.iter().map(|h| h.flow_id).collect::<Vec<_>>(), [1]);
        assert!(flows.take(live, 2).is_some());
    }

    #[test]
    fn one_principal_holds_its_share_and_gets_slots_back_as_its_flows_end() {
        let flows = HeldFlows::new(8, 2, 1 << 20);
        let (alice, bob) = (Some([1; 32]), Some([2; 32]));
        let first = flows.hold(held(1, 100, 1), alice).ok().unwrap();
        flows.hold(held(2, 200, 1), alice).ok().unwrap();
        let (refused, back) = flows.hold(held(3, 100, 1), alice).err().unwrap();
        assert_eq!((refused, back.flow_id), (NotHeld::PrincipalFull, 3));
        // Others, and requests without a principal, are not held back by Alice's share.
        flows.hold(held(4, 100, 1), bob).ok().unwrap();
        for flow in 5..8 {
            flows.hold(held(flow, 100, 1), None).ok().unwrap();
        }
        // A flow taken, or expired, gives its principal's slot back.
        flows.take(first, 1).unwrap();
        let third = flows.hold(held(3, 300, 1), alice).ok().unwrap();
        assert_eq!(flows.take_expired(250).len(), 5);
        flows.hold(held(8, 300, 1), alice).ok().unwrap();
        assert!(flows.hold(held(9, 300, 1), alice).is_err());
        assert!(flows.take(third, 3).is_some());
    }
}
