//! The admin listener: `/healthz` (the process serves), `/readyz` (503 once draining, so
//! balancers stop sending new work) and `/metrics` (Prometheus text format).

use crate::metrics::Metrics;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct AdminApp {
    pub metrics: Arc<Metrics>,
    pub draining: Arc<AtomicBool>,
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
            "/readyz" if self.draining.load(Ordering::Relaxed) => {
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

/// Sets the draining flag when pingora begins shutting down.
pub struct DrainWatch {
    pub draining: Arc<AtomicBool>,
}

#[async_trait]
impl BackgroundService for DrainWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
        self.draining.store(true, Ordering::Relaxed);
        tracing::info!("draining: /readyz now answers 503");
    }
}
