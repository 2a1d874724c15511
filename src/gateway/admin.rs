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
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};

/// Most connections an own listener serves at once; more wait for a free slot.
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
            name,
        })
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
        let slots = Arc::new(Semaphore::new(MAX_OWN_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (app, shutdown) = (self.app.clone(), shutdown.clone());
            let limit = self.connection_time;
            tokio::spawn(async move {
                let stream: pingora::protocols::Stream = Box::new(Stream::from(tcp));
                let served = serve_connection(app, stream, shutdown);
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
