//! Idle upstream connections, kept for the next exchange with the same peer. Unlike
//! pingora's pool, no task watches an idle connection: a connection is checked when it is
//! taken (a read that must find nothing: a close or stray bytes discard it) and for its
//! idle time, and each peer keeps a bounded number, the most recently used taken first.
//! Releasing and taking one is a lock and a vector operation, not a task spawned per
//! release and a task handoff per reuse. One sweeper task per pool closes, every
//! `SWEEP_EVERY`, what the upstream closed or what idled past its time, so that the
//! connections to a peer never used again (a pod gone from DNS) do not stay open.
//!
//! A connection idles only for as long as its upstream keeps it open with time to spare
//! (`idle_life`): a request written as the upstream's idle timer fires meets its close, and
//! a POST that met a close cannot be made again (it may have run). The upstream's own
//! `Keep-Alive: timeout` hint, less a margin, or else less than the 5 s of common servers
//! (Node, uvicorn, Apache): the choice of Node's undici client, for the same reason.

use pingora::protocols::Stream;
use prometheus::IntGauge;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::Instant;

/// Most idle connections kept per peer; past it the oldest is closed.
pub const MAX_IDLE_PER_PEER: usize = 128;
/// How long a connection idles when its upstream gave no `Keep-Alive: timeout`.
pub const IDLE_UNHINTED: Duration = Duration::from_secs(4);
/// What is taken off an upstream's `Keep-Alive: timeout`: a request's time in flight and
/// the upstream's timer granularity.
const HINT_MARGIN: Duration = Duration::from_secs(1);
/// Longest a connection idles, whatever its upstream says.
pub const IDLE_MOST: Duration = Duration::from_secs(60);
/// How often the sweeper closes idle connections that are closed, stray or too old.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Each peer's idle connections, oldest first, with when each must no longer be used.
type ByPeer = Mutex<HashMap<u64, Vec<(Stream, Instant)>>>;

/// How long a connection may idle after a response whose `Keep-Alive` header values are
/// `keep_alive`: the smallest `timeout` hint (seconds) less `HINT_MARGIN`, at most
/// `IDLE_MOST`; `IDLE_UNHINTED` without a readable hint. Zero: do not keep it.
pub fn idle_life<'a>(keep_alive: impl IntoIterator<Item = &'a [u8]>) -> Duration {
    let hint = keep_alive
        .into_iter()
        .filter_map(|value| std::str::from_utf8(value).ok())
        .flat_map(|value| value.split(','))
        .filter_map(|param| {
            let (name, seconds) = param.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("timeout") {
                return None;
            }
            seconds.trim().trim_matches('"').parse::<u64>().ok()
        })
        .min();
    match hint {
        Some(seconds) => Duration::from_secs(seconds)
            .saturating_sub(HINT_MARGIN)
            .min(IDLE_MOST),
        None => IDLE_UNHINTED,
    }
}

/// Idle connections by peer (pingora's `reuse_hash`: address and TLS settings).
pub struct IdleConnections {
    by_peer: Arc<ByPeer>,
    /// How many idle, over all peers (`upstream_idle_connections`).
    count: IntGauge,
    /// The sweeper, started with the first connection kept on the runtime that kept it
    /// (and again should that runtime have ended).
    sweeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl IdleConnections {
    pub fn new(count: IntGauge) -> IdleConnections {
        IdleConnections {
            by_peer: Arc::default(),
            count,
            sweeper: Mutex::default(),
        }
    }

    /// An idle connection to `peer` that is still open and quiet, if there is one.
    pub fn take(&self, peer: u64) -> Option<Stream> {
        let mut by_peer = self.by_peer.lock().expect("idle connections lock");
        let idle = by_peer.get_mut(&peer)?;
        let mut taken = None;
        while let Some((mut stream, until)) = idle.pop() {
            if Instant::now() < until && is_open_and_quiet(&mut stream) {
                taken = Some(stream);
                break;
            }
        }
        self.count.set(total(&by_peer));
        taken
    }

    /// Keeps `stream` for the next exchange with `peer`, for at most `life` (`idle_life`);
    /// the oldest past `MAX_IDLE_PER_PEER` is closed.
    pub fn put(&self, peer: u64, stream: Stream, life: Duration) {
        self.keep_sweeping();
        let mut by_peer = self.by_peer.lock().expect("idle connections lock");
        let idle = by_peer.entry(peer).or_default();
        if idle.len() >= MAX_IDLE_PER_PEER {
            idle.remove(0);
        }
        idle.push((stream, Instant::now() + life));
        self.count.set(total(&by_peer));
    }

    fn keep_sweeping(&self) {
        let mut sweeper = self.sweeper.lock().expect("idle sweeper lock");
        if sweeper.as_ref().is_none_or(|task| task.is_finished()) {
            let by_peer = Arc::downgrade(&self.by_peer);
            let sweep = sweep_every(by_peer, self.count.clone());
            *sweeper = Some(tokio::spawn(sweep));
        }
    }

    /// How many connections idle, over all peers.
    #[cfg(test)]
    fn len(&self) -> usize {
        let by_peer = self.by_peer.lock().expect("idle connections lock");
        usize::try_from(total(&by_peer)).unwrap_or(usize::MAX)
    }
}

fn total(by_peer: &HashMap<u64, Vec<(Stream, Instant)>>) -> i64 {
    by_peer.values().map(|idle| idle.len() as i64).sum()
}

/// Sweeps the pool every `SWEEP_EVERY` until the pool is dropped.
async fn sweep_every(by_peer: Weak<ByPeer>, count: IntGauge) {
    let mut ticks = tokio::time::interval(SWEEP_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(by_peer) = by_peer.upgrade() else {
            return;
        };
        count.set(sweep(&by_peer));
    }
}

/// Closes every idle connection the upstream closed, that holds stray bytes or that
/// idled past its time, and forgets peers left with none; how many are left.
fn sweep(by_peer: &ByPeer) -> i64 {
    let now = Instant::now();
    let mut by_peer = by_peer.lock().expect("idle connections lock");
    by_peer.retain(|_, idle| {
        idle.retain_mut(|(stream, until)| now < *until && is_open_and_quiet(stream));
        !idle.is_empty()
    });
    total(&by_peer)
}

/// Whether an idle connection has nothing to read now: an upstream never speaks first on
/// an idle HTTP/1.1 connection, so anything there (its close, or stray bytes) ends it.
fn is_open_and_quiet(stream: &mut Stream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    let mut cx = Context::from_waker(Waker::noop());
    // Outside tokio's cooperative budget: an exhausted budget would read as "nothing there".
    let read = tokio::task::unconstrained(std::future::poll_fn(|cx| {
        Poll::Ready(Pin::new(&mut *stream).poll_read(cx, &mut buf))
    }));
    let polled = std::pin::pin!(read).as_mut().poll(&mut cx);
    matches!(polled, Poll::Ready(Poll::Pending))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn gauge() -> IntGauge {
        IntGauge::new("idle", "idle").unwrap()
    }

    fn stream() -> (Stream, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(64);
        (Box::new(ours), theirs)
    }

    #[tokio::test]
    async fn an_idle_connection_is_taken_once_and_only_while_open_quiet_and_recent() {
        let idle = IdleConnections::new(gauge());
        let (open, _peer_open) = stream();
        idle.put(1, open, IDLE_MOST);
        assert_eq!(idle.len(), 1);
        assert!(idle.take(2).is_none(), "another peer's");
        assert!(idle.take(1).is_some());
        assert!(idle.take(1).is_none(), "taken once");
        assert_eq!(idle.count.get(), 0, "the gauge follows takes");

        let (closed, peer_closed) = stream();
        idle.put(1, closed, IDLE_MOST);
        drop(peer_closed);
        assert!(idle.take(1).is_none(), "closed while it idled");

        let (chatty, mut peer_chatty) = stream();
        idle.put(1, chatty, IDLE_MOST);
        peer_chatty.write_all(b"HTTP/1.1 408").await.unwrap();
        assert!(idle.take(1).is_none(), "stray bytes");

        let (unkept, _peer_unkept) = stream();
        idle.put(1, unkept, Duration::ZERO);
        assert!(idle.take(1).is_none(), "a life of zero is not taken");
    }

    #[test]
    fn an_idle_connection_lives_less_than_its_upstream_said_it_keeps_it() {
        let life = |values: &[&str]| idle_life(values.iter().map(|v| v.as_bytes()));
        assert_eq!(life(&[]), IDLE_UNHINTED, "no hint");
        assert_eq!(life(&["timeout=5"]), Duration::from_secs(4), "Node's");
        assert_eq!(
            life(&["max=100, Timeout = \"30\""]),
            Duration::from_secs(29)
        );
        assert_eq!(
            life(&["timeout=10", "timeout=3"]),
            Duration::from_secs(2),
            "least"
        );
        assert_eq!(life(&["timeout=1"]), Duration::ZERO, "too short to keep");
        assert_eq!(life(&["timeout=0"]), Duration::ZERO);
        assert_eq!(life(&["timeout=86400"]), IDLE_MOST, "bounded");
        assert_eq!(
            life(&["timeout=soon", "max=5"]),
            IDLE_UNHINTED,
            "unreadable"
        );
        assert!(
            IDLE_UNHINTED < Duration::from_secs(5),
            "under common servers' 5 s"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_not_taken_past_its_life() {
        let idle = IdleConnections::new(gauge());
        let (old, _peer_old) = stream();
        idle.put(1, old, IDLE_UNHINTED);
        tokio::time::advance(IDLE_UNHINTED - Duration::from_millis(1)).await;
        let young = idle.take(1).expect("taken within its life");
        idle.put(1, young, Duration::from_secs(1));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(idle.take(1).is_none(), "idle past its life");
    }

    #[tokio::test(start_paused = true)]
    async fn the_sweeper_closes_what_a_peer_never_used_again_closed() {
        let idle = IdleConnections::new(gauge());
        let (gone, peer_gone) = stream();
        idle.put(1, gone, IDLE_MOST);
        let (kept, _peer_kept) = stream();
        idle.put(2, kept, IDLE_MOST);
        drop(peer_gone);
        // Neither peer is used again; the sweeper alone closes peer 1's connection.
        tokio::time::sleep(SWEEP_EVERY * 2).await;
        assert_eq!(idle.len(), 1, "only the open one idles");
        assert_eq!(idle.count.get(), 1, "the gauge follows the sweep");
        let by_peer = idle.by_peer.lock().unwrap();
        assert!(
            !by_peer.contains_key(&1),
            "a peer left with none is forgotten"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_sweeper_closes_what_idled_past_the_limit_and_ends_with_its_pool() {
        let idle = IdleConnections::new(gauge());
        let (old, _peer_old) = stream();
        idle.put(1, old, Duration::from_secs(7));
        let weak = Arc::downgrade(&idle.by_peer);
        tokio::time::sleep(SWEEP_EVERY * 3).await;
        assert_eq!(idle.len(), 0, "idled past its limit, with no put or take");
        drop(idle);
        tokio::time::sleep(SWEEP_EVERY * 2).await;
        assert!(weak.upgrade().is_none(), "the sweeper holds no pool alive");
    }

    #[tokio::test]
    async fn a_peer_keeps_at_most_its_bound_the_newest_taken_first() {
        let idle = IdleConnections::new(gauge());
        let mut peers = Vec::new();
        for _ in 0..MAX_IDLE_PER_PEER + 3 {
            let (ours, theirs) = stream();
            idle.put(7, ours, IDLE_MOST);
            peers.push(theirs);
        }
        assert_eq!(idle.len(), MAX_IDLE_PER_PEER);
        assert_eq!(idle.count.get(), MAX_IDLE_PER_PEER as i64, "and puts");
        // The newest is taken first: closing its peer makes it unusable, the next is taken.
        drop(peers.pop());
        assert!(idle.take(7).is_some());
        assert_eq!(idle.len(), MAX_IDLE_PER_PEER - 2);
    }
}
