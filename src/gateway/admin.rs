//! The admin listener: `/healthz` (the process serves), `/readyz` (503 once draining, so
//! balancers stop sending new work) and `/metrics` (Prometheus text format); and the
//! drain signal that long requests watch to end cleanly when a graceful shutdown begins.

use crate::metrics::Metrics;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::Arc;
use tokio::sync::watch;

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
