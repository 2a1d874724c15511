//! Idle upstream connections, kept for the next exchange with the same peer. Unlike
//! pingora's pool, no task watches an idle connection: a connection is checked when it is
//! taken (a read that must find nothing: a close or stray bytes discard it) and for its
//! idle time, and each peer keeps a bounded number, the most recently used taken first.
//! Releasing and taking one is a lock and a vector operation, not a task spawned per
//! release and a task handoff per reuse.

use pingora::protocols::Stream;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, ReadBuf};

/// Most idle connections kept per peer; past it the oldest is closed.
pub const MAX_IDLE_PER_PEER: usize = 128;

/// Idle connections by peer (pingora's `reuse_hash`: address and TLS settings).
pub struct IdleConnections {
    by_peer: Mutex<HashMap<u64, Vec<(Stream, Instant)>>>,
    /// How long a connection may idle before it is closed instead of used.
    idle_limit: Duration,
}

impl IdleConnections {
    pub fn new(idle_limit: Duration) -> IdleConnections {
        IdleConnections {
            by_peer: Mutex::default(),
            idle_limit,
        }
    }

    /// An idle connection to `peer` that is still open and quiet, if there is one.
    pub fn take(&self, peer: u64) -> Option<Stream> {
        let mut by_peer = self.by_peer.lock().expect("idle connections lock");
        let idle = by_peer.get_mut(&peer)?;
        while let Some((mut stream, since)) = idle.pop() {
            if since.elapsed() < self.idle_limit && is_open_and_quiet(&mut stream) {
                return Some(stream);
            }
        }
        None
    }

    /// Keeps `stream` for the next exchange with `peer`; connections idle past the limit,
    /// and the oldest past `MAX_IDLE_PER_PEER`, are closed.
    pub fn put(&self, peer: u64, stream: Stream) {
        let mut by_peer = self.by_peer.lock().expect("idle connections lock");
        let idle = by_peer.entry(peer).or_default();
        idle.retain(|(_, since)| since.elapsed() < self.idle_limit);
        if idle.len() >= MAX_IDLE_PER_PEER {
            idle.remove(0);
        }
        idle.push((stream, Instant::now()));
    }

    /// How many connections idle, over all peers.
    #[cfg(test)]
    fn len(&self) -> usize {
        let by_peer = self.by_peer.lock().expect("idle connections lock");
        by_peer.values().map(Vec::len).sum()
    }
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

    fn stream() -> (Stream, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(64);
        (Box::new(ours), theirs)
    }

    #[tokio::test]
    async fn an_idle_connection_is_taken_once_and_only_while_open_quiet_and_recent() {
        let idle = IdleConnections::new(Duration::from_secs(60));
        let (open, _peer_open) = stream();
        idle.put(1, open);
        assert_eq!(idle.len(), 1);
        assert!(idle.take(2).is_none(), "another peer's");
        assert!(idle.take(1).is_some());
        assert!(idle.take(1).is_none(), "taken once");

        let (closed, peer_closed) = stream();
        idle.put(1, closed);
        drop(peer_closed);
        assert!(idle.take(1).is_none(), "closed while it idled");

        let (chatty, mut peer_chatty) = stream();
        idle.put(1, chatty);
        peer_chatty.write_all(b"HTTP/1.1 408").await.unwrap();
        assert!(idle.take(1).is_none(), "stray bytes");

        let expired = IdleConnections::new(Duration::ZERO);
        let (old, _peer_old) = stream();
        expired.put(1, old);
        assert!(expired.take(1).is_none(), "idle past the limit");
    }

    #[tokio::test]
    async fn a_peer_keeps_at_most_its_bound_the_newest_taken_first() {
        let idle = IdleConnections::new(Duration::from_secs(60));
        let mut peers = Vec::new();
        for _ in 0..MAX_IDLE_PER_PEER + 3 {
            let (ours, theirs) = stream();
            idle.put(7, ours);
            peers.push(theirs);
        }
        assert_eq!(idle.len(), MAX_IDLE_PER_PEER);
        // The newest is taken first: closing its peer makes it unusable, the next is taken.
        drop(peers.pop());
        assert!(idle.take(7).is_some());
        assert_eq!(idle.len(), MAX_IDLE_PER_PEER - 2);
    }
}
