//! The admin listener: `/healthz` (the process serves), `/readyz` (503 once draining, so
//! balancers stop sending new work) and `/metrics` (Prometheus text format); and the
//! drain signal that long requests watch to end cleanly when a graceful shutdown begins.
//!
//! The admin listener is a background service with its own socket rather than a pingora
//! listening service: pingora closes its listeners at SIGTERM, and the admin side must
//! stay up through the grace period, so probes see 503 and Prometheus sees the drain.

use crate::metrics::Metrics;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::apps::HttpServerApp;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};

/// Most admin connections served at once; more wait for a free slot.
const MAX_ADMIN_CONNECTIONS: usize = 64;
/// Longest an admin connection is served.
const ADMIN_CONNECTION_TIME: Duration = Duration::from_secs(10);

/// Whether a graceful shutdown began. Streams end cleanly on it: a bridged round hands
/// its flow to another replica, a relayed SSE stream ends between two events.
pub struct Drain(watch::Sender<bool>);

impl Default for Drain {
    fn default() -> Self {
        Drain(watch::Sender::new(false))
    }
}

impl Drain {
    pub fn begin(&self) {
        self.0.send_replace(true);
    }

    pub fn is_draining(&self) -> bool {
        *self.0.borrow()
    }

    /// Completes once draining has begun.
    pub async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|draining| *draining).await;
    }
}

pub struct AdminApp {
    pub metrics: Arc<Metrics>,
    pub drain: Arc<Drain>,
    pub reaper: Arc<super::reaper::Reaper>,
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

/// Serves the admin app on its own socket until the process ends, through the grace period.
pub struct AdminListener {
    pub app: Arc<AdminApp>,
    /// Bound when the server is built, so a taken port fails the start.
    pub socket: std::sync::Mutex<Option<std::net::TcpListener>>,
}

impl AdminListener {
    pub fn bind(app: AdminApp, addr: &str) -> std::io::Result<AdminListener> {
        let socket = std::net::TcpListener::bind(addr)?;
        socket.set_nonblocking(true)?;
        Ok(AdminListener {
            app: Arc::new(app),
            socket: std::sync::Mutex::new(Some(socket)),
        })
    }
}

#[async_trait]
impl BackgroundService for AdminListener {
    async fn start(&self, shutdown: ShutdownWatch) {
        let socket = self.socket.lock().expect("admin socket lock").take();
        let Some(listener) = socket.and_then(|s| tokio::net::TcpListener::from_std(s).ok()) else {
            tracing::error!("the admin listener cannot start");
            return;
        };
        let slots = Arc::new(Semaphore::new(MAX_ADMIN_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (app, shutdown) = (self.app.clone(), shutdown.clone());
            tokio::spawn(async move {
                let session = ServerSession::new_http1(Box::new(Stream::from(tcp)));
                let _ = tokio::time::timeout(
                    ADMIN_CONNECTION_TIME,
                    app.process_new_http(session, &shutdown),
                )
                .await;
                drop(slot);
            });
        }
    }
}
