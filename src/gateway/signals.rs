//! The process's stopping signals: SIGTERM and SIGQUIT drain, SIGINT stops fast. They are
//! caught from before the listeners open (`catch_early`), because pingora watches for
//! signals only once its services have started: a SIGTERM in between (a pod deleted as
//! it starts) would otherwise end the process at once, listeners open, without a drain.
//! `Signals` is the watch pingora's main loop awaits; it acts on a signal caught early.
//! SIGHUP (reload the files) is caught from then on too, so that one sent while the
//! gateway starts (a certificate renewed) does not end it: the reloader, once it runs,
//! reloads for it (`take_early_hangup`).

use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use signal_hook_registry::SigId;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Mutex;

/// The first stopping signal caught before `Signals` watched; 0 for none.
static CAUGHT_EARLY: AtomicI32 = AtomicI32::new(0);

/// The early handlers, removed once `Signals` watches.
static EARLY_HANDLERS: Mutex<Vec<SigId>> = Mutex::new(Vec::new());

/// Whether a SIGHUP came before the reloader watched, and the handler that records it.
static HANGUP_EARLY: AtomicBool = AtomicBool::new(false);
static EARLY_HANGUP_HANDLER: Mutex<Option<SigId>> = Mutex::new(None);

const STOPPING: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGQUIT, libc::SIGINT];

/// Records the first SIGTERM, SIGQUIT or SIGINT from now on instead of letting it end the
/// process; `Signals` acts on it once pingora's main loop watches.
pub fn catch_early() -> std::io::Result<()> {
    let mut handlers = EARLY_HANDLERS.lock().unwrap_or_else(|e| e.into_inner());
    for signal in STOPPING {
        let record = move || {
            let _ = CAUGHT_EARLY.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
        };
        // SAFETY: the action only stores to an atomic, which is async-signal-safe.
        handlers.push(unsafe { signal_hook_registry::register(signal, record) }?);
    }
    let record = || HANGUP_EARLY.store(true, Ordering::SeqCst);
    // SAFETY: as above.
    let hangup = unsafe { signal_hook_registry::register(libc::SIGHUP, record) }?;
    let mut early = EARLY_HANGUP_HANDLER
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(earlier) = early.replace(hangup) {
        signal_hook_registry::unregister(earlier);
    }
    Ok(())
}

/// Whether a SIGHUP came before now, once the reloader watches for its own: the early
/// handler is removed.
pub fn take_early_hangup() -> bool {
    let early = EARLY_HANGUP_HANDLER
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(handler) = early {
        signal_hook_registry::unregister(handler);
    }
    HANGUP_EARLY.swap(false, Ordering::SeqCst)
}

/// What pingora does on `signal`: SIGINT stops fast, the others drain.
fn shutdown_on(signal: libc::c_int) -> ShutdownSignal {
    match signal {
        libc::SIGINT => ShutdownSignal::FastShutdown,
        _ => ShutdownSignal::GracefulTerminate,
    }
}

/// The process's signals as pingora's main loop awaits them. Pingora's own watch takes
/// SIGQUIT for a socket handover to a new process through a fixed path in `/tmp`, which
/// this binary does not use: it would keep the replica ready and accepting for ten
/// seconds of retries, and hand the listening socket to whatever listens on that path.
/// Here SIGQUIT drains as SIGTERM does.
pub struct Signals;

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        use tokio::signal::unix::{signal, SignalKind};
        let watched = (
            signal(SignalKind::terminate()),
            signal(SignalKind::quit()),
            signal(SignalKind::interrupt()),
        );
        let (Ok(mut term), Ok(mut quit), Ok(mut interrupt)) = watched else {
            tracing::error!("cannot watch for signals; the process stops only when killed");
            return std::future::pending().await;
        };
        // Watched from here on: what came before is in CAUGHT_EARLY.
        let early = std::mem::take(&mut *EARLY_HANDLERS.lock().unwrap_or_else(|e| e.into_inner()));
        for handler in early {
            signal_hook_registry::unregister(handler);
        }
        let caught = CAUGHT_EARLY.load(Ordering::SeqCst);
        if caught != 0 {
            tracing::info!(
                signal = caught,
                "a stopping signal came while the gateway started"
            );
            return shutdown_on(caught);
        }
        tokio::select! {
            _ = term.recv() => ShutdownSignal::GracefulTerminate,
            _ = quit.recv() => ShutdownSignal::GracefulTerminate,
            _ = interrupt.recv() => ShutdownSignal::FastShutdown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGTERM before the watch begins neither ends the process nor is lost: the watch
    /// answers it with a drain as soon as it begins.
    #[tokio::test]
    async fn a_sigterm_before_the_watch_begins_drains_once_it_does() {
        catch_early().expect("handlers registered");
        // SAFETY: raising a signal this process handles.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        let answer = tokio::time::timeout(std::time::Duration::from_secs(10), Signals.recv());
        let answer = answer.await.expect("answered at once");
        assert!(matches!(answer, ShutdownSignal::GracefulTerminate));
    }

    /// A SIGHUP before the reloader watches does not end the process, and is kept for
    /// the reloader to act on once.
    #[test]
    fn a_sighup_before_the_reloader_watches_is_kept_for_it() {
        catch_early().expect("handlers registered");
        // SAFETY: raising a signal this process handles.
        assert_eq!(unsafe { libc::raise(libc::SIGHUP) }, 0);
        assert!(take_early_hangup(), "kept");
        assert!(!take_early_hangup(), "taken once");
    }
}
