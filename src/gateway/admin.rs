//! The admin listener: `/healthz` (the process serves), `/readyz` (503 once draining, so
//! balancers stop sending new work) and `/metrics` (Prometheus text format); and the
//! drain signal that long requests watch to end cleanly when a graceful shutdown begins.
//!
//! The admin listener is an `OwnListener`, a background service with its own socket rather
//! than a pingora listening service: pingora closes its listeners at SIGTERM, and the
//! admin side must stay up through the grace period, so probes see 503 and Prometheus
//! sees the drain. The peer listener is one too.

use crate::metrics::Metrics;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::apps::ServerApp;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch, Semaphore};

/// Most connections an own listener serves at once. Past it, a new connection takes the
/// place of the oldest that has sent nothing yet, or else waits for a free one.
const MAX_OWN_CONNECTIONS: usize = 1024;
/// Longest an admin connection is served.
pub const ADMIN_CONNECTION_TIME: Duration = Duration::from_secs(10);

/// Where a graceful shutdown stands. Streams end cleanly when it begins: a bridged round
/// hands its flow to another replica, a relayed SSE stream ends between two events. A
/// round that cannot be handed over (its upstream cannot resume it) runs on through the
/// grace period, until its last stretch (`near_end`): then it ends, with its upstream
/// call, rather than be cut when the process exits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Serving,
    Draining,
    NearEnd,
}

pub struct Drain(watch::Sender<Stage>);

impl Default for Drain {
    fn default() -> Self {
        Drain(watch::Sender::new(Stage::Serving))
    }
}

impl Drain {
    pub fn begin(&self) {
        self.0
            .send_if_modified(|stage| raise(stage, Stage::Draining));
    }

    /// The grace period is in its last stretch: what still runs must end now.
    pub fn near_end(&self) {
        self.0
            .send_if_modified(|stage| raise(stage, Stage::NearEnd));
    }

    pub fn is_draining(&self) -> bool {
        *self.0.borrow() >= Stage::Draining
    }

    /// Completes once draining has begun.
    pub async fn wait(&self) {
        self.wait_for(Stage::Draining).await
    }

    /// Completes once the grace period is in its last stretch.
    pub async fn wait_near_end(&self) {
        self.wait_for(Stage::NearEnd).await
    }

    async fn wait_for(&self, stage: Stage) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|now| *now >= stage).await;
    }
}

fn raise(stage: &mut Stage, to: Stage) -> bool {
    let raised = *stage < to;
    *stage = (*stage).max(to);
    raised
}

pub struct AdminApp {
    pub metrics: Arc<Metrics>,
    pub drain: Arc<Drain>,
    pub reaper: Arc<super::reaper::Reaper>,
    pub held: Arc<super::bridge::hold::HeldFlows>,
}

fn reply(status: u16, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .expect("static response parts are valid")
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let json = "application/json";
        match session.req_header().uri.path() {
            "/healthz" => reply(200, json, br#"{"status":"ok"}"#.to_vec()),
            "/readyz" if self.drain.is_draining() => {
                reply(503, json, br#"{"status":"draining"}"#.to_vec())
            }
            "/readyz" => reply(200, json, br#"{"status":"ready"}"#.to_vec()),
            "/metrics" => {
                self.metrics.pending_flows.set(self.reaper.watched() as i64);
                let (held, bytes) = self.held.usage();
                self.metrics.held_flows.set(held as i64);
                self.metrics.held_bytes.set(bytes as i64);
                reply(
                    200,
                    "text/plain; version=0.0.4",
                    self.metrics.render().into_bytes(),
                )
            }
            _ => reply(404, json, br#"{"error":"not found"}"#.to_vec()),
        }
    }
}

/// Begins the drain when pingora begins shutting down.
pub struct DrainWatch {
    pub drain: Arc<Drain>,
    pub metrics: Arc<Metrics>,
}

#[async_trait]
impl BackgroundService for DrainWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
        self.drain.begin();
        self.metrics.draining.set(1);
        tracing::info!(
            "draining: /readyz answers 503, streams end cleanly, in-flight requests finish"
        );
    }
}

/// Serves an app on a socket of its own, as a background service: it keeps accepting
/// until the process ends, through the grace period, where pingora's listening services
/// close at SIGTERM. The admin listener (probes and metrics) and the peer listener (retries
/// of the flows this replica holds) must outlive the drain.
pub struct OwnListener<A> {
    pub app: Arc<A>,
    /// Bound when the server is built, so a taken port fails the start.
    socket: std::sync::Mutex<Option<std::net::TcpListener>>,
    /// Longest a connection is served; `None`: as long as it lasts.
    connection_time: Option<Duration>,
    max_connections: usize,
    name: &'static str,
}

impl<A> OwnListener<A> {
    pub fn bind(
        name: &'static str,
        app: A,
        addr: &str,
        connection_time: Option<Duration>,
    ) -> std::io::Result<OwnListener<A>> {
        let socket = std::net::TcpListener::bind(addr)?;
        socket.set_nonblocking(true)?;
        Ok(OwnListener {
            app: Arc::new(app),
            socket: std::sync::Mutex::new(Some(socket)),
            connection_time,
            max_connections: MAX_OWN_CONNECTIONS,
            name,
        })
    }

    #[cfg(test)]
    fn with_max_connections(mut self, max: usize) -> OwnListener<A> {
        self.max_connections = max;
        self
    }
}

/// The connections of a listener that have sent nothing yet, oldest first, each with the
/// means to let it go. A connection opened and left silent holds a slot and does no work:
/// when every slot is taken, the oldest of these is let go for the newcomer, so that
/// silent connections (a flood of them, on a port any Pod of the cluster can reach) cannot
/// keep a probe or a scrape out.
#[derive(Default)]
struct Silent {
    next: std::sync::atomic::AtomicU64,
    waiting: std::sync::Mutex<std::collections::BTreeMap<u64, oneshot::Sender<()>>>,
}

/// A connection counted as silent from its accept: the listener may let it go before its
/// task first runs.
struct Accepted {
    id: u64,
    let_go: oneshot::Receiver<()>,
}

impl Silent {
    fn accepted(&self) -> Accepted {
        let (sender, let_go) = oneshot::channel();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, sender);
        Accepted { id, let_go }
    }

    /// Waits for `tcp`'s first byte (or its close): `false` if it was let go first.
    async fn first_byte(&self, tcp: &tokio::net::TcpStream, accepted: Accepted) -> bool {
        // `peek` completes only on a byte or the close (`readable` may wake spuriously).
        let mut byte = [0u8; 1];
        let spoke = tokio::select! {
            peeked = tcp.peek(&mut byte) => peeked.is_ok(),
            _ = accepted.let_go => false,
        };
        self.lock().remove(&accepted.id);
        spoke
    }

    /// Lets the oldest silent connection go; `false` if there is none.
    fn let_oldest_go(&self) -> bool {
        let mut waiting = self.lock();
        // One that spoke meanwhile (its receiver gone) is passed over.
        while let Some((_, let_go)) = waiting.pop_first() {
            if let_go.send(()).is_ok() {
                return true;
            }
        }
        false
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, oneshot::Sender<()>>> {
        self.waiting.lock().expect("silent connections lock")
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> BackgroundService for OwnListener<A> {
    async fn start(&self, shutdown: ShutdownWatch) {
        let socket = self.socket.lock().expect("listener socket lock").take();
        let Some(listener) = socket.and_then(|s| tokio::net::TcpListener::from_std(s).ok()) else {
            tracing::error!(listener = self.name, "the listener cannot start");
            return;
        };
        let slots = Arc::new(Semaphore::new(self.max_connections));
        let silent = Arc::new(Silent::default());
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let slot = match slots.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    // Full: the oldest silent connection gives its slot up at once; with
                    // none, the newcomer waits for a connection to end.
                    silent.let_oldest_go();
                    let Ok(slot) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    slot
                }
            };
            let (app, shutdown, silent) = (self.app.clone(), shutdown.clone(), silent.clone());
            let (limit, accepted) = (self.connection_time, silent.accepted());
            tokio::spawn(async move {
                let served = async {
                    if silent.first_byte(&tcp, accepted).await {
                        let stream: pingora::protocols::Stream = Box::new(Stream::from(tcp));
                        serve_connection(app, stream, shutdown).await;
                    }
                };
                match limit {
                    Some(limit) => {
                        let _ = tokio::time::timeout(limit, served).await;
                    }
                    None => served.await,
                }
                drop(slot);
            });
        }
    }
}

/// Serves one connection's requests in turn, while the app keeps it alive.
async fn serve_connection<A: ServerApp + Send + Sync + 'static>(
    app: Arc<A>,
    stream: pingora::protocols::Stream,
    shutdown: ShutdownWatch,
) {
    let mut next = app.process_new(stream, &shutdown).await;
    while let Some(stream) = next {
        next = app.process_new(stream, &shutdown).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    struct Hello;

    #[async_trait]
    impl ServeHttp for Hello {
        async fn response(&self, _: &mut ServerSession) -> Response<Vec<u8>> {
            reply(200, "text/plain", b"ok".to_vec())
        }
    }

    /// Connections opened and left silent, twice as many as the listener serves, do not
    /// keep a probe out: each newcomer takes the place of the oldest silent one.
    #[tokio::test]
    async fn silent_connections_give_their_places_to_new_ones() {
        let listener =
            OwnListener::bind("test", Hello, "127.0.0.1:0", Some(Duration::from_secs(30)))
                .unwrap()
                .with_max_connections(4);
        let addr = {
            let socket = listener.socket.lock().unwrap();
            socket.as_ref().unwrap().local_addr().unwrap()
        };
        let (_running, shutdown) = watch::channel(false);
        tokio::spawn(async move { listener.start(shutdown).await });
        let mut silent = Vec::new();
        for _ in 0..8 {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        let probe = async {
            let mut probe = TcpStream::connect(addr).await?;
            probe
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await?;
            let mut answer = String::new();
            probe.read_to_string(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        let answer = tokio::time::timeout(Duration::from_secs(5), probe).await;
        let answer = answer.expect("answered within 5 s").unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}
