//! The admin listener: `/healthz` (the process serves), `/readyz` (503 once draining, so
//! balancers stop sending new work) and `/metrics` (Prometheus text format); and the
//! drain signal that long requests watch to end cleanly when a graceful shutdown begins.
//!
//! The admin listener is an `OwnListener`, a background service with its own socket rather
//! than a pingora listening service: pingora closes its listeners at SIGTERM, and the
//! admin side must stay up through the grace period, so probes see 503 and Prometheus
//! sees the drain. The peer listener is one too.

use super::connections::Crowding;
use crate::metrics::Metrics;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::apps::ServerApp;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch, Semaphore};

/// Most connections an own listener serves at once. Past it, a new connection takes the
/// place of one let go (`MakeRoom`), or else is told the listener is full.
pub const MAX_OWN_CONNECTIONS: usize = 1024;
/// Longest an admin connection is served.
pub const ADMIN_CONNECTION_TIME: Duration = Duration::from_secs(10);
/// How long an own listener waits after a failed accept before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

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

    pub fn is_near_end(&self) -> bool {
        *self.0.borrow() >= Stage::NearEnd
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
    bounds: ConnectionBounds,
    crowding: Arc<Crowding>,
    name: &'static str,
}

/// How many connections an own listener serves, for how long, and which one a full
/// listener lets go.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionBounds {
    /// Most served at once (`MAX_OWN_CONNECTIONS`); from nine tenths of it on, the
    /// listener is crowded (`Crowding`).
    pub max_connections: usize,
    /// Longest a connection is served; `None`: as long as it lasts.
    pub connection_time: Option<Duration>,
    /// Longest a new connection may stay silent (`limits.header_timeout_ms`).
    pub first_byte_within: Duration,
    pub make_room: MakeRoom,
}

/// Which connection a full listener lets go for a newcomer. Connections opened and left
/// silent, or stalled after a byte, hold places and do no work: a flood of them (on a port
/// any Pod of the cluster can reach) must not keep a probe or a scrape out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MakeRoom {
    /// The oldest that has sent nothing yet, and no other: a connection that spoke may
    /// carry a forwarded retry, whose answer would be lost (the peer listener).
    Silent,
    /// The oldest that has sent nothing yet, else the oldest of all: every request is
    /// answered at once, so an old connection is stalled or idle (the admin listener).
    SilentThenOldest,
}

impl<A> OwnListener<A> {
    /// Binds `addr` for the app `app` makes; an app that keeps connections alive between
    /// requests watches the crowding it is given, and closes them while it is crowded.
    pub fn bind(
        name: &'static str,
        app: impl FnOnce(watch::Receiver<bool>) -> A,
        addr: &str,
        bounds: ConnectionBounds,
    ) -> std::io::Result<OwnListener<A>> {
        let socket = std::net::TcpListener::bind(addr)?;
        socket.set_nonblocking(true)?;
        let crowding = Arc::new(Crowding::new(bounds.max_connections));
        Ok(OwnListener {
            app: Arc::new(app(crowding.subscribe())),
            socket: std::sync::Mutex::new(Some(socket)),
            bounds,
            crowding,
            name,
        })
    }
}

/// The connections a listener serves, oldest first, each with whether it has sent
/// anything yet and the means to let it go.
#[derive(Default)]
struct Places {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<BTreeMap<u64, Place>>,
}

struct Place {
    let_go: oneshot::Sender<()>,
    spoke: bool,
}

/// A connection's place, taken at its accept (so that it may be let go before its task
/// first runs), and what tells it to go.
struct Accepted {
    id: u64,
    let_go: oneshot::Receiver<()>,
}

impl Places {
    /// `tcp`'s place, as having spoken if its first bytes are there already: in a burst,
    /// the accept loop runs ahead of the connections' tasks, and a request waiting to be
    /// read must not count as silence.
    fn accepted(&self, tcp: &tokio::net::TcpStream) -> Accepted {
        let (sender, let_go) = oneshot::channel();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let place = Place {
            let_go: sender,
            spoke: bytes_waiting(tcp),
        };
        self.lock().insert(id, place);
        Accepted { id, let_go }
    }

    /// Marks a place as having spoken; `false` if it was let go meanwhile (its connection
    /// is then not served: a request begun would be cut).
    fn spoke(&self, id: u64) -> bool {
        let mut open = self.lock();
        open.get_mut(&id).map(|place| place.spoke = true).is_some()
    }

    fn left(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Lets a connection go, as `policy` allows; `false` if none could be.
    fn make_room(&self, policy: MakeRoom) -> bool {
        let mut open = self.lock();
        let silent = open.iter().find(|(_, p)| !p.spoke).map(|(id, _)| *id);
        let chosen = match policy {
            MakeRoom::Silent => silent,
            MakeRoom::SilentThenOldest => silent.or_else(|| open.keys().next().copied()),
        };
        let place = chosen.and_then(|id| open.remove(&id));
        place.is_some_and(|p| p.let_go.send(()).is_ok())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Place>> {
        self.open.lock().expect("listener places lock")
    }
}

/// Whether bytes (or the peer's close) are waiting on `tcp` now; nothing is taken.
fn bytes_waiting(tcp: &tokio::net::TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: recv(2) on the descriptor `tcp` owns, open for this call, peeking at most
    // one byte into a local without waiting.
    let peeked = unsafe {
        libc::recv(
            tcp.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    peeked >= 0
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> BackgroundService for OwnListener<A> {
    async fn start(&self, shutdown: ShutdownWatch) {
        let socket = self.socket.lock().expect("listener socket lock").take();
        let Some(listener) = socket.and_then(|s| tokio::net::TcpListener::from_std(s).ok()) else {
            tracing::error!(listener = self.name, "the listener cannot start");
            return;
        };
        let max = self.bounds.max_connections;
        let slots = Arc::new(Semaphore::new(max));
        let places = Arc::new(Places::default());
        let refusing = Arc::new(Semaphore::new(REFUSING_AT_ONCE));
        loop {
            let tcp = match listener.accept().await {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors (EMFILE) fails every accept until one is freed:
                    // a moment's wait, not a spin at full CPU.
                    tracing::debug!(listener = self.name, error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let slot = match slots.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    // Full: the connection let go gives its slot up at once. With none
                    // (every one carries a request), the newcomer is told so at once:
                    // left connected and unanswered, a forwarding replica's check
                    // would take this replica for frozen, and give up its flows.
                    if !places.make_room(self.bounds.make_room) {
                        refuse_full(tcp, &refusing);
                        continue;
                    }
                    let Ok(slot) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    slot
                }
            };
            let open = move |slots: &Semaphore| max - slots.available_permits();
            self.crowding.publish(|| open(&slots));
            let (app, shutdown, places) = (self.app.clone(), shutdown.clone(), places.clone());
            let (bounds, accepted) = (self.bounds, places.accepted(&tcp));
            let (slots, crowding) = (slots.clone(), self.crowding.clone());
            tokio::spawn(async move {
                let Accepted { id, let_go } = accepted;
                let served = async {
                    // `peek` completes only on a byte or the close (`readable` may wake
                    // spuriously).
                    let mut byte = [0u8; 1];
                    let first = tokio::time::timeout(bounds.first_byte_within, tcp.peek(&mut byte));
                    if matches!(first.await, Ok(Ok(_))) && places.spoke(id) {
                        let stream: pingora::protocols::Stream = Box::new(Stream::from(tcp));
                        serve_connection(app, stream, shutdown).await;
                    }
                };
                let bounded = async {
                    match bounds.connection_time {
                        Some(limit) => {
                            let _ = tokio::time::timeout(limit, served).await;
                        }
                        None => served.await,
                    }
                };
                tokio::select! {
                    _ = bounded => {}
                    _ = let_go => {}
                }
                places.left(id);
                drop(slot);
                crowding.publish(|| open(&slots));
            });
        }
    }
}

/// Newcomers told at once that a full listener has no place, and the longest each
/// telling takes; past that many, a newcomer is closed unanswered.
const REFUSING_AT_ONCE: usize = 64;
const REFUSE_WITHIN: Duration = Duration::from_secs(1);

/// What a newcomer to a full listener is told: a JSON-RPC error, as every refusal.
const FULL: &str = r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"every connection of this listener carries a request; try again"}}"#;

/// Tells `tcp` the listener is full (503), within `REFUSE_WITHIN`, then closes it; what
/// it sent is read first, so that closing does not reset the answer away.
fn refuse_full(mut tcp: tokio::net::TcpStream, refusing: &Arc<Semaphore>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(permit) = refusing.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let told = async {
            let answer = format!("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{FULL}", FULL.len());
            tcp.write_all(answer.as_bytes()).await?;
            tcp.shutdown().await?;
            let mut sink = [0u8; 4096];
            while tcp.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        };
        let _ = tokio::time::timeout(REFUSE_WITHIN, told).await;
        drop(permit);
    });
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

    const SECONDS_5: Duration = Duration::from_secs(5);

    /// A listener serving 4 connections at most, with `policy`, and its address.
    fn listening(policy: MakeRoom) -> std::net::SocketAddr {
        listening_with(4, policy, |_| Hello)
    }

    /// A listener serving `max` connections at most, with `policy`, and its address.
    fn listening_with<A: ServerApp + Send + Sync + 'static>(
        max: usize,
        policy: MakeRoom,
        app: impl FnOnce(watch::Receiver<bool>) -> A,
    ) -> std::net::SocketAddr {
        let bounds = ConnectionBounds {
            max_connections: max,
            connection_time: Some(Duration::from_secs(30)),
            first_byte_within: Duration::from_secs(30),
            make_room: policy,
        };
        let listener = OwnListener::bind("test", app, "127.0.0.1:0", bounds).unwrap();
        let addr = {
            let socket = listener.socket.lock().unwrap();
            socket.as_ref().unwrap().local_addr().unwrap()
        };
        let (running, shutdown) = watch::channel(false);
        tokio::spawn(async move {
            let _running = running;
            listener.start(shutdown).await
        });
        addr
    }

    /// Twice as many connections as the listener serves, each sending `first` (nothing,
    /// or a request's first bytes) and stalling.
    async fn stalled(addr: std::net::SocketAddr, first: &[u8]) -> Vec<TcpStream> {
        let mut stalled = Vec::new();
        for _ in 0..8 {
            let mut connection = TcpStream::connect(addr).await.unwrap();
            connection.write_all(first).await.unwrap();
            stalled.push(connection);
        }
        stalled
    }

    /// A probe's answer, within `within`.
    async fn probe(
        addr: std::net::SocketAddr,
        within: Duration,
    ) -> Result<String, tokio::time::error::Elapsed> {
        probe_at(addr, "/healthz", within).await
    }

    /// The answer to a `GET` of `path`, within `within`.
    async fn probe_at(
        addr: std::net::SocketAddr,
        path: &str,
        within: Duration,
    ) -> Result<String, tokio::time::error::Elapsed> {
        let probe = async {
            let mut probe = TcpStream::connect(addr).await?;
            let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
            probe.write_all(request.as_bytes()).await?;
            let mut answer = String::new();
            probe.read_to_string(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        let answer = tokio::time::timeout(within, probe).await;
        answer.map(|read| read.unwrap())
    }

    /// A connection whose first bytes are there when it is accepted has spoken, though
    /// its task has not looked yet: a full peer listener does not let it go.
    #[tokio::test]
    async fn a_connection_with_bytes_waiting_at_its_accept_has_spoken() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let places = Places::default();
        let mut spoke = TcpStream::connect(addr).await.unwrap();
        spoke.write_all(b"P").await.unwrap();
        let (accepted_spoke, _) = listener.accept().await.unwrap();
        // The byte is in: what `accepted` peeks at without waiting.
        accepted_spoke.peek(&mut [0u8; 1]).await.unwrap();
        let _first = places.accepted(&accepted_spoke);
        assert!(
            !places.make_room(MakeRoom::Silent),
            "a spoken place was let go"
        );
        let _silent = TcpStream::connect(addr).await.unwrap();
        let (accepted_silent, _) = listener.accept().await.unwrap();
        let _second = places.accepted(&accepted_silent);
        assert!(
            places.make_room(MakeRoom::Silent),
            "the silent place is let go"
        );
    }

    /// Connections opened and left silent do not keep a probe out, on either listener:
    /// each newcomer takes the place of the oldest silent one.
    #[tokio::test]
    async fn silent_connections_give_their_places_to_new_ones() {
        for policy in [MakeRoom::Silent, MakeRoom::SilentThenOldest] {
            let addr = listening(policy);
            let _silent = stalled(addr, b"").await;
            let answer = probe(addr, SECONDS_5).await.expect("answered within 5 s");
            assert!(answer.starts_with("HTTP/1.1 200"), "{policy:?}: {answer}");
        }
    }

    /// Connections stalled after their first bytes do not keep a probe out of the admin
    /// listener; on the peer listener they keep their places (one may be a forwarded
    /// retry), and the newcomer is told at once that it is full: any answer shows a
    /// forwarding replica's check that this one lives.
    #[tokio::test]
    async fn stalled_connections_give_their_places_only_on_the_admin_listener() {
        let admin = listening(MakeRoom::SilentThenOldest);
        let _stalled = stalled(admin, b"GET /he").await;
        let answer = probe(admin, SECONDS_5).await.expect("answered within 5 s");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let peer = listening(MakeRoom::Silent);
        let mut stalled = stalled(peer, b"POST /m").await;
        let full = probe(peer, SECONDS_5).await.expect("answered within 5 s");
        assert!(full.starts_with("HTTP/1.1 503"), "{full}");
        let body = full
            .split_once("\r\n\r\n")
            .map(|(_, body)| body)
            .unwrap_or_default();
        let error: serde_json::Value = serde_json::from_str(body).expect("a JSON-RPC error");
        assert_eq!(error["error"]["code"], -32603, "{full}");
        // Once they end, a newcomer is served.
        stalled.clear();
        let answer = probe(peer, SECONDS_5)
            .await
            .expect("answered once a place freed");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    /// Connections kept alive and idle between requests do not keep a forwarded retry out
    /// of the peer listener: from nine tenths of its places on it is crowded, and closes
    /// idle ones until it is not (pingora serves a connection's requests inside one call,
    /// so the listener itself cannot tell an idle connection from a busy one). Twice as
    /// many clients as it has places, each keeping its connection, are all answered.
    #[tokio::test]
    async fn idle_kept_alive_connections_give_their_places_on_the_peer_listener() {
        use crate::gateway::{test_gateway, Arrival, Listener};
        let gw = Arc::new(test_gateway());
        let peer = listening_with(10, MakeRoom::Silent, |crowding| {
            Listener::new(gw, Arrival::Peer, Some(crowding))
        });
        let alive = b"GET /.mrtr-gateway/alive HTTP/1.1\r\nhost: x\r\n\r\n";
        let mut kept = Vec::new();
        for n in 0..20 {
            let mut connection = TcpStream::connect(peer).await.unwrap();
            connection.write_all(alive).await.unwrap();
            let mut answer = [0u8; 512];
            let read = tokio::time::timeout(SECONDS_5, connection.read(&mut answer)).await;
            let read = read.expect("answered within 5 s").unwrap();
            let answer = String::from_utf8_lossy(&answer[..read]).to_string();
            assert!(answer.starts_with("HTTP/1.1 200"), "client {n}: {answer}");
            kept.push(connection);
        }
    }
}
