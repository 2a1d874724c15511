//! The MCP listener's connection cap. Each client connection holds buffers and a task
//! while it lives, idle or not; above `limits.max_client_connections` a new one is read
//! just far enough to be answered 503 with a JSON-RPC error and `Connection: close` (on
//! HTTP/2, its first stream, then GOAWAY), then closed, rather than reset or left to
//! exhaust the file descriptors. A TLS connection is counted once its handshake is done.
//!
//! Pingora's `HttpServerApp` sees requests, not connections, so the cap is a `ServerApp`
//! wrapped around the listener's app (whose `ServerApp` is pingora's own), holding a slot
//! for as long as that app serves the connection. The peer listener is not counted here:
//! its `OwnListener` has a bound of its own (crowded alike), so a flood of clients cannot
//! starve the retries other replicas forward.

use super::preface::PrefaceBy;
use crate::metrics::Metrics;
use crate::protocol::jsonrpc::code;
use crate::tls::handshakes::Handshakes;
use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::http::v2::{self, server::H2Accept};
use pingora::protocols::http::ServerSession;
use pingora::protocols::{Digest, Stream, ALPN};
use pingora::server::ShutdownWatch;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Longest a connection over the cap may take to send the request it is refused.
const REFUSAL_READ_LIMIT: Duration = Duration::from_secs(1);

/// Counts the connections served at once, up to a maximum.
pub struct ConnectionCap {
    open: AtomicUsize,
    max: usize,
    crowding: Crowding,
    metrics: Arc<Metrics>,
}

/// Whether a listener's connections nearly reach its cap (nine tenths of it): while they
/// do, a connection between requests is closed rather than kept, and answers say
/// `Connection: close`, until enough idle ones went; so kept-alive connections idle
/// between requests cannot fill the cap (nginx's manner). Shared by the MCP listener's
/// cap and the own listeners'.
pub struct Crowding {
    from: usize,
    crowded: watch::Sender<bool>,
}

impl Crowding {
    pub fn new(max: usize) -> Crowding {
        Crowding {
            from: (max - max / 10).max(1),
            crowded: watch::Sender::new(false),
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.crowded.subscribe()
    }

    /// Publishes whether `open()` connections crowd the cap, read under the channel's
    /// lock: of admissions and drops racing, the last to publish shows the latest count.
    pub fn publish(&self, open: impl FnOnce() -> usize) {
        self.crowded.send_if_modified(|crowded| {
            let now = open() >= self.from;
            std::mem::replace(crowded, now) != now
        });
    }
}

/// A connection's place under the cap, given back when dropped.
pub struct Slot<'c>(&'c ConnectionCap);

impl ConnectionCap {
    pub fn new(max: usize, metrics: Arc<Metrics>) -> ConnectionCap {
        ConnectionCap {
            open: AtomicUsize::new(0),
            max,
            crowding: Crowding::new(max),
            metrics,
        }
    }

    /// Whether the cap is nearly reached (nine tenths of it): while it is, a connection
    /// between requests is closed rather than kept.
    pub fn crowding(&self) -> watch::Receiver<bool> {
        self.crowding.subscribe()
    }

    /// A slot for one more connection, or `None` at the maximum.
    pub fn admit(&self) -> Option<Slot<'_>> {
        let below = |open: usize| (open < self.max).then_some(open + 1);
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, below)
            .ok()?;
        self.note_open();
        Some(Slot(self))
    }

    /// Publishes how many connections are open (the gauge) and whether they crowd the
    /// cap.
    fn note_open(&self) {
        self.crowding.publish(|| {
            let open = self.open.load(Ordering::Acquire);
            self.metrics.client_connections.set(open as i64);
            open
        });
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.note_open();
    }
}

/// An app whose connections are capped.
pub struct Capped<A> {
    pub app: Arc<A>,
    pub cap: ConnectionCap,
    /// A TLS listener's handshakes in progress: a connection that reaches the app has
    /// finished its own.
    pub handshakes: Option<Arc<Handshakes>>,
    /// How long an HTTP/2 connection's client preface may take (the header timeout).
    pub preface_within: Duration,
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Capped<A> {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        if let Some(handshakes) = &self.handshakes {
            handshakes.done(stream.id());
        }
        let Some(_slot) = self.cap.admit() else {
            self.cap.metrics.client_connections_refused.inc();
            refuse(stream).await;
            return None;
        };
        let stream = match stream.selected_alpn_proto() {
            Some(ALPN::H2) => PrefaceBy::wrap(stream, self.preface_within),
            _ => stream,
        };
        let mut next = self.app.process_new(stream, shutdown).await;
        while let Some(stream) = next {
            next = self.app.process_new(stream, shutdown).await;
        }
        None
    }

    async fn cleanup(&self) {
        self.app.cleanup().await
    }
}

const REFUSAL: &str = "the gateway serves its maximum number of client connections; retry later";

/// Reads the request of a connection over the cap (briefly) and answers it 503; over TLS
/// with HTTP/2 negotiated, its first stream's.
async fn refuse(stream: Stream) {
    if matches!(stream.selected_alpn_proto(), Some(ALPN::H2)) {
        return refuse_h2(stream).await;
    }
    let mut session = ServerSession::new_http1(stream);
    let read = tokio::time::timeout(REFUSAL_READ_LIMIT, session.read_request()).await;
    if !matches!(read, Ok(Ok(true))) {
        return;
    }
    super::refuse_and_close(&mut session, 503, code::INTERNAL_ERROR, REFUSAL).await;
    let _ = session.finish().await;
}

/// Waits for `f` at most `REFUSAL_READ_LIMIT`.
fn limit<F: std::future::Future>(f: F) -> tokio::time::Timeout<F> {
    tokio::time::timeout(REFUSAL_READ_LIMIT, f)
}

/// Answers the first stream of an HTTP/2 connection over the cap 503, then closes the
/// connection (GOAWAY) once the answer went out, or after `REFUSAL_READ_LIMIT`. The connection is driven all along: an
/// HTTP/2 stream's frames move only while its connection is polled.
async fn refuse_h2(stream: Stream) {
    let Ok(Ok(mut connection)) = limit(v2::server::handshake(stream, None)).await else {
        return;
    };
    let digest = Arc::new(Digest::default());
    let accepted = limit(v2::server::HttpSession::from_h2_conn(
        &mut connection,
        digest,
    ))
    .await;
    if let Ok(Ok(Some(H2Accept::Session(h2)))) = accepted {
        let mut session = ServerSession::new_http2(h2);
        let answer = async {
            super::refuse_and_close(&mut session, 503, code::INTERNAL_ERROR, REFUSAL).await;
            let _ = session.finish().await;
        };
        let driven = std::future::poll_fn(|cx| connection.poll_closed(cx));
        let refused = async {
            tokio::select! {
                _ = answer => true,
                _ = driven => false,
            }
        };
        // Bounded: a client that opens no flow-control window would hold the answer, and
        // the connection, uncounted, for ever.
        if let Ok(false) = limit(refused).await {
            return;
        }
    }
    connection.graceful_shutdown();
    let _ = limit(std::future::poll_fn(|cx| connection.poll_closed(cx))).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_admits_up_to_its_maximum_and_frees_slots() {
        let metrics = Arc::new(Metrics::new());
        let cap = ConnectionCap::new(2, metrics.clone());
        let (a, b) = (cap.admit().unwrap(), cap.admit().unwrap());
        assert!(cap.admit().is_none());
        assert_eq!(metrics.client_connections.get(), 2);
        drop(a);
        assert_eq!(metrics.client_connections.get(), 1);
        let c = cap.admit().expect("a freed slot");
        drop((b, c));
        assert_eq!(metrics.client_connections.get(), 0);
    }

    #[test]
    fn the_cap_is_crowded_from_nine_tenths_until_it_falls_below() {
        let cap = ConnectionCap::new(20, Arc::new(Metrics::new()));
        let crowding = cap.crowding();
        let mut slots: Vec<_> = (0..17).map(|_| cap.admit().unwrap()).collect();
        assert!(!*crowding.borrow(), "17 of 20");
        slots.push(cap.admit().unwrap());
        assert!(*crowding.borrow(), "18 of 20");
        slots.pop();
        assert!(!*crowding.borrow(), "back to 17");
        let tiny = ConnectionCap::new(1, Arc::new(Metrics::new()));
        let slot = tiny.admit();
        assert!(
            *tiny.crowding().borrow(),
            "a cap of one is crowded when used"
        );
        drop(slot);
        assert!(!*tiny.crowding().borrow());
    }
}
