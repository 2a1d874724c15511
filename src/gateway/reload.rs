//! Reloading, without a restart, the files the gateway reads at start: the keys file, a
//! JWT principal's JWKS, and the MCP listener's certificate and key (watched as one). Each
//! is re-read when its contents change (polled, which also catches a Kubernetes Secret's
//! symlink swap) and on SIGHUP. A file that does not parse is logged and counted, and what
//! is in use is kept. A poll that finds new contents failing tries them again at the next
//! poll before it reports them: a writer that replaces files one after another (the
//! certificate, then its key; certbot's per-file symlinks) is caught between the two.

use crate::metrics::Metrics;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// Parses a file and puts the result in use; `Ok` carries a summary for the log.
pub type Apply = Box<dyn Fn(&Path) -> Result<String, String> + Send + Sync>;

/// One file, or files that are put in use together, to keep current.
pub struct WatchedFile {
    /// The metric label and log name: `keys`, `jwks` or `tls`.
    pub name: &'static str,
    /// The files; `apply` gets the first.
    pub paths: Vec<PathBuf>,
    pub apply: Apply,
    seen: Mutex<Seen>,
}

/// What a poll finds: a digest of the files' contents, or why they could not be read.
type Found = Result<[u8; 32], String>;

/// What a watched file's polls have found, by digest of its contents.
#[derive(Default)]
struct Seen {
    /// What was last applied or reported (unreadable files too), so unchanged files cost
    /// no parse and a failure is reported once.
    settled: Option<Found>,
    /// What failed once (new contents, or files gone), to be tried again before it is
    /// reported.
    failed_once: Option<Found>,
}

impl WatchedFile {
    pub fn new(name: &'static str, path: PathBuf, apply: Apply) -> WatchedFile {
        Self::together(name, vec![path], apply)
    }

    /// Files put in use together (a certificate and its key): a change to any of them
    /// applies them all.
    pub fn together(name: &'static str, paths: Vec<PathBuf>, apply: Apply) -> WatchedFile {
        // What is in use was read before this watch began, and the files may have changed
        // since (a Secret updated while the process started): applied again after the
        // digest, the contents in use are those digested, or newer ones the first poll
        // finds changed. Contents that do not apply now are left to the polls.
        let found = digest_of(&paths);
        let applied = found.is_ok() && paths.first().is_some_and(|first| apply(first).is_ok());
        let seen = Seen {
            settled: applied.then_some(found),
            failed_once: None,
        };
        WatchedFile {
            name,
            paths,
            apply,
            seen: Mutex::new(seen),
        }
    }

    /// Re-reads the files if they changed (or always, when `forced`); `None` if unchanged,
    /// or if new contents failed for the first time (polled, not forced).
    fn reload(&self, forced: bool) -> Option<Result<String, String>> {
        let found = digest_of(&self.paths);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if !forced && seen.settled.as_ref() == Some(&found) {
            return None;
        }
        let outcome = match &found {
            Ok(_) => (self.apply)(self.paths.first()?),
            Err(unreadable) => Err(unreadable.clone()),
        };
        if outcome.is_err() && !forced && seen.failed_once.as_ref() != Some(&found) {
            seen.failed_once = Some(found);
            return None;
        }
        // Remember even what fails, so an error is logged once, not every poll.
        *seen = Seen {
            settled: Some(found),
            failed_once: None,
        };
        Some(outcome)
    }
}

/// One digest of the contents of every file, in order.
fn digest_of(paths: &[PathBuf]) -> Result<[u8; 32], String> {
    let mut hasher = Sha256::new();
    for path in paths {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        hasher.update(Sha256::digest(&bytes));
    }
    Ok(hasher.finalize().into())
}

pub struct Reloader {
    files: Vec<WatchedFile>,
    metrics: Arc<Metrics>,
    poll: Duration,
}

impl Reloader {
    pub fn new(files: Vec<WatchedFile>, metrics: Arc<Metrics>, poll: Duration) -> Reloader {
        Reloader {
            files,
            metrics,
            poll,
        }
    }

    fn reload_all(&self, forced: bool) {
        if forced && self.files.is_empty() {
            tracing::info!(
                "SIGHUP: no keys file, JWKS file or listener certificate configured; nothing to reload"
            );
        }
        for file in &self.files {
            let Some(outcome) = file.reload(forced) else {
                continue;
            };
            let label = if outcome.is_ok() { "ok" } else { "error" };
            self.metrics
                .reloads
                .with_label_values(&[file.name, label])
                .inc();
            match outcome {
                Ok(summary) => tracing::info!(file = file.name, %summary, "reloaded"),
                Err(e) => tracing::error!(
                    file = file.name,
                    error = %e,
                    "not reloaded; keeping what is in use"
                ),
            }
        }
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
impl BackgroundService for Reloader {
    /// Runs until the process ends, not only until the drain begins: held flows and
    /// forwarded retries are served through the grace period, under the keys in use.
    async fn start(&self, _shutdown: ShutdownWatch) {
        let mut hangup = signal(SignalKind::hangup())
            .map_err(|e| tracing::warn!(error = %e, "no SIGHUP handler; files are still polled"))
            .ok();
        if hangup.is_some() {
            let files: Vec<&str> = self.files.iter().map(|f| f.name).collect();
            tracing::info!(?files, "reloader started: SIGHUP reloads the files");
        }
        if super::signals::take_early_hangup() {
            tracing::info!("SIGHUP came while the gateway started: reloading now");
            self.reload_all(true);
        }
        let mut tick = tokio::time::interval(self.poll);
        loop {
            tokio::select! {
                _ = tick.tick() => self.reload_all(false),
                _ = next_hangup(&mut hangup) => self.reload_all(true),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watched file in a fresh directory whose contents apply when they read "good".
    fn watched(name: &str) -> (WatchedFile, PathBuf) {
        let dir = std::env::temp_dir().join(format!("mrtr-reload-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("file");
        std::fs::write(&path, "good").unwrap();
        let apply: Apply = Box::new(|p: &Path| match std::fs::read_to_string(p) {
            Ok(text) if text.starts_with("good") => Ok(text),
            _ => Err("not good".into()),
        });
        (WatchedFile::new("keys", path.clone(), apply), path)
    }

    /// Contents that changed after the process read them and before the watch began are
    /// put in use when the watch begins, not taken as what is already in use.
    #[test]
    fn contents_changed_before_the_watch_began_are_put_in_use() {
        let dir = std::env::temp_dir().join(format!("mrtr-reload-start-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("file");
        std::fs::write(&path, "good, first").unwrap();
        let in_use = Arc::new(Mutex::new(std::fs::read_to_string(&path).unwrap()));
        std::fs::write(&path, "good, second").unwrap();
        let using = in_use.clone();
        let apply: Apply = Box::new(move |p: &Path| {
            let text = std::fs::read_to_string(p).map_err(|e| e.to_string())?;
            *using.lock().unwrap() = text.clone();
            Ok(text)
        });
        let file = WatchedFile::new("keys", path.clone(), apply);
        assert_eq!(*in_use.lock().unwrap(), "good, second");
        assert_eq!(file.reload(false), None, "unchanged since");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A renewal caught half-written (the certificate replaced, its key not yet) is not
    /// an error when the next poll finds it whole.
    #[test]
    fn contents_caught_mid_write_are_not_reported_if_the_next_poll_applies() {
        let (file, path) = watched("mid-write");
        assert_eq!(file.reload(false), None, "unchanged");
        std::fs::write(&path, "half").unwrap();
        assert_eq!(file.reload(false), None, "failed once: tried again first");
        std::fs::write(&path, "good, renewed").unwrap();
        assert_eq!(file.reload(false), Some(Ok("good, renewed".into())));
        assert_eq!(file.reload(false), None);
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    /// A file that cannot be read (a Secret unmounted) is reported once, after a second
    /// poll finds it still gone, not at every poll; back, it applies again.
    #[test]
    fn a_file_that_cannot_be_read_is_reported_once() {
        let (file, path) = watched("gone");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(file.reload(false), None, "gone once: tried again first");
        assert!(matches!(file.reload(false), Some(Err(e)) if e.contains("file")));
        for _ in 0..3 {
            assert_eq!(file.reload(false), None, "reported once");
        }
        assert!(
            file.reload(true).is_some_and(|r| r.is_err()),
            "a forced reload says"
        );
        std::fs::write(&path, "good, back").unwrap();
        assert_eq!(file.reload(false), Some(Ok("good, back".into())));
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    /// Contents that still fail at the next poll are reported once, and a forced reload
    /// (SIGHUP) reports at once.
    #[test]
    fn contents_that_keep_failing_are_reported_once_and_a_forced_reload_at_once() {
        let (file, path) = watched("failing");
        std::fs::write(&path, "bad").unwrap();
        assert_eq!(file.reload(false), None);
        assert_eq!(file.reload(false), Some(Err("not good".into())));
        assert_eq!(file.reload(false), None, "reported once");
        std::fs::write(&path, "worse").unwrap();
        assert_eq!(file.reload(true), Some(Err("not good".into())));
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }
}
