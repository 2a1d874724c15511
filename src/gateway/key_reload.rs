//! Keeping the key ring current without a restart: the keys file is re-read when its
//! contents change (polled, which also catches a Kubernetes Secret's symlink swap) and on
//! SIGHUP. A file that does not parse is logged and counted, and the ring in use is kept.

use crate::keys::{KeyRing, SharedKeyRing};
use crate::metrics::Metrics;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};

pub struct KeyReloader {
    keys: Arc<SharedKeyRing>,
    metrics: Arc<Metrics>,
    /// The keys file; `None` when the keys came from elsewhere (SIGHUP is then a no-op).
    path: Option<PathBuf>,
    poll: Duration,
    /// A digest of the contents last loaded, so an unchanged file costs no parse.
    loaded: Mutex<Option<[u8; 32]>>,
}

impl KeyReloader {
    pub fn new(
        keys: Arc<SharedKeyRing>,
        metrics: Arc<Metrics>,
        path: Option<PathBuf>,
        poll: Duration,
    ) -> KeyReloader {
        let loaded = path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .map(|b| Sha256::digest(b).into());
        KeyReloader {
            keys,
            metrics,
            path,
            poll,
            loaded: Mutex::new(loaded),
        }
    }

    /// Reloads if the file changed (or always, when `forced`).
    fn reload(&self, forced: bool) {
        let Some(path) = &self.path else {
            if forced {
                tracing::info!("SIGHUP: the keys come from the environment; nothing to reload");
            }
            return;
        };
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => return self.failed(&format!("keys_file {}: {e}", path.display())),
        };
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if !forced && *loaded == Some(digest) {
            return;
        }
        let ring = match KeyRing::load_file(path) {
            Ok(ring) => ring,
            Err(e) => {
                // Remember the bad contents so the error is logged once, not every poll.
                *loaded = Some(digest);
                return self.failed(&e);
            }
        };
        *loaded = Some(digest);
        let kids: Vec<String> = ring.kids().map(str::to_string).collect();
        self.metrics.keys_loaded.set(kids.len() as i64);
        self.metrics.key_reloads.with_label_values(&["ok"]).inc();
        self.keys.store(ring);
        tracing::info!(current = %kids[0], keys = ?kids, "key ring reloaded");
    }

    fn failed(&self, why: &str) {
        self.metrics.key_reloads.with_label_values(&["error"]).inc();
        tracing::error!(
            error = why,
            "key ring not reloaded; keeping the keys in use"
        );
    }
}

async fn next_hangup(hangup: &mut Option<Signal>) {
    match hangup {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

#[async_trait]
impl BackgroundService for KeyReloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hangup = signal(SignalKind::hangup())
            .map_err(
                |e| tracing::warn!(error = %e, "no SIGHUP handler; the keys file is still polled"),
            )
            .ok();
        if hangup.is_some() {
            tracing::info!(
                watching = self.path.is_some(),
                "key reloader started: SIGHUP reloads the keys file"
            );
        }
        let mut tick = tokio::time::interval(self.poll);
        loop {
            tokio::select! {
                _ = tick.tick() => self.reload(false),
                _ = next_hangup(&mut hangup) => self.reload(true),
                _ = shutdown.changed() => return,
            }
        }
    }
}
