//! The MCP listener's TLS handshakes, bounded: pingora gives each one 60 s, and counts a
//! connection only once its handshake is done, so clients that open connections and
//! stall in their handshake (a ClientHello's first bytes, then nothing) could hold a
//! descriptor each for a minute, uncounted, until the process ran out of them.
//!
//! Before a handshake starts (`PreTlsProcess`) its socket is noted by its kernel cookie
//! (`SO_COOKIE`, never reused while the system runs), at most `max` at once (a
//! connection beyond that is closed at once; before refusing one, the notes of sockets
//! closed meanwhile, by handshakes that failed, are dropped, at most every
//! `SWEEP_EVERY`: a sweep asks the kernel about every note, under the lock, and a flood
//! of connections over the bound would otherwise sweep for each); the listener's app marks
//! it done when the connection reaches it. One still in its handshake after `limit` (the
//! header timeout) is shut down, which ends the handshake's read. Linux only; elsewhere
//! nothing is bounded beyond pingora's own.

use async_trait::async_trait;
use pingora::listeners::PreTlsProcess;
use pingora::protocols::l4::stream::Stream as L4Stream;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Least time between two sweeps of the notes for closed sockets.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// The handshakes in progress on one listener.
pub struct Handshakes {
    pending: Mutex<Pending>,
    max: usize,
    limit: Duration,
}

#[derive(Default)]
struct Pending {
    /// By socket cookie, the descriptor it was on.
    notes: HashMap<u64, RawFd>,
    swept_at: Option<Instant>,
}

impl Handshakes {
    pub fn new(max: usize, limit: Duration) -> Arc<Handshakes> {
        Arc::new(Handshakes {
            pending: Mutex::default(),
            max,
            limit,
        })
    }

    /// The connection on `fd` finished its handshake (the listener's app has it).
    pub fn done(&self, fd: RawFd) {
        if let Some(cookie) = socket_cookie(fd) {
            self.lock().notes.remove(&cookie);
        }
    }

    /// How many handshakes are in progress.
    pub fn in_progress(&self) -> usize {
        self.lock().notes.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().expect("handshakes lock")
    }

    /// Notes a handshake starting on `fd`; false when `max` are in progress already.
    fn start(self: &Arc<Self>, fd: RawFd) -> bool {
        self.start_at(fd, Instant::now())
    }

    fn start_at(self: &Arc<Self>, fd: RawFd, now: Instant) -> bool {
        let Some(cookie) = socket_cookie(fd) else {
            return true;
        };
        {
            let mut pending = self.lock();
            let may_sweep = pending
                .swept_at
                .is_none_or(|at| now.saturating_duration_since(at) >= SWEEP_EVERY);
            if pending.notes.len() >= self.max && may_sweep {
                // A handshake that failed left its note: its socket is gone (or its
                // descriptor is another socket's now).
                pending.swept_at = Some(now);
                let notes = &mut pending.notes;
                notes.retain(|cookie, fd| socket_cookie(*fd) == Some(*cookie));
            }
            if pending.notes.len() >= self.max {
                return false;
            }
            pending.notes.insert(cookie, fd);
        }
        let handshakes = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(handshakes.limit).await;
            let stalled = handshakes.lock().notes.remove(&cookie).is_some();
            // The descriptor still names this connection (the cookie is the socket's),
            // whose handshake has not finished: shutting it down ends its read.
            if stalled && socket_cookie(fd) == Some(cookie) {
                tracing::debug!("a TLS handshake took longer than the header timeout");
                // SAFETY: shutdown(2) on a descriptor this process owns; it only ends the
                // socket's traffic, the descriptor stays its owner's to close.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }
        });
        true
    }
}

/// The `PreTlsProcess` that bounds a listener's handshakes.
pub struct HandshakeGuard(pub Arc<Handshakes>);

#[async_trait]
impl PreTlsProcess for HandshakeGuard {
    async fn process(&self, stream: &mut L4Stream) -> pingora::Result<()> {
        if self.0.start(stream.as_raw_fd()) {
            return Ok(());
        }
        Err(pingora::Error::explain(
            pingora::ErrorType::AcceptError,
            "too many TLS handshakes in progress",
        ))
    }
}

/// The kernel's cookie of the socket on `fd`: unique among the sockets since boot.
#[cfg(target_os = "linux")]
fn socket_cookie(fd: RawFd) -> Option<u64> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `cookie`, which has them.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cookie)
}

#[cfg(not(target_os = "linux"))]
fn socket_cookie(_fd: RawFd) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stalled_handshake_is_shut_down_and_a_finished_one_is_left() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let handshakes = Handshakes::new(2, Duration::from_millis(50));
        let _stalled_client = std::net::TcpStream::connect(addr).unwrap();
        let (stalled, _) = listener.accept().unwrap();
        let _done_client = std::net::TcpStream::connect(addr).unwrap();
        let (done, _) = listener.accept().unwrap();
        let _third_client = std::net::TcpStream::connect(addr).unwrap();
        let (third, _) = listener.accept().unwrap();
        assert!(handshakes.start(stalled.as_raw_fd()));
        assert!(handshakes.start(done.as_raw_fd()));
        assert!(!handshakes.start(third.as_raw_fd()), "over the bound");
        handshakes.done(done.as_raw_fd());
        assert_eq!(handshakes.in_progress(), 1);
        let stalled = tokio::net::TcpStream::from_std({
            stalled.set_nonblocking(true).unwrap();
            stalled
        })
        .unwrap();
        // A read on the stalled socket ends (0 bytes) once it is shut down.
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), async {
            stalled.readable().await.unwrap();
            stalled.try_read(&mut buf)
        })
        .await;
        assert!(matches!(read, Ok(Ok(0))), "{read:?}");
        assert_eq!(handshakes.in_progress(), 0);
        // The finished one is untouched: its peer can still write to it.
        let mut done_client = _done_client;
        use std::io::Write;
        assert!(done_client.write_all(b"x").is_ok());
        let mut byte = [0u8; 1];
        use std::io::Read;
        let mut done = done;
        done.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(done.read(&mut byte).unwrap(), 1);
    }

    /// A loopback connection to `listener`: its client end, and the accepted end.
    fn accepted(listener: &std::net::TcpListener) -> (std::net::TcpStream, std::net::TcpStream) {
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (client, listener.accept().unwrap().0)
    }

    #[tokio::test]
    async fn a_handshake_whose_socket_closed_leaves_no_slot_taken() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let handshakes = Handshakes::new(1, Duration::from_secs(60));
        let accept = || accepted(&listener);
        let (_client, failed) = accept();
        assert!(handshakes.start(failed.as_raw_fd()));
        drop(failed);
        let (_client, next) = accept();
        assert!(
            handshakes.start(next.as_raw_fd()),
            "the closed one's note is dropped"
        );
        let (_client, over) = accept();
        assert!(!handshakes.start(over.as_raw_fd()), "a live one's is not");
    }

    /// Notes are swept at most every `SWEEP_EVERY`: connections over the bound arriving
    /// faster are refused without asking the kernel about every note again.
    #[tokio::test]
    async fn closed_sockets_notes_are_swept_at_most_every_100_ms() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let handshakes = Handshakes::new(1, Duration::from_secs(60));
        let accept = || accepted(&listener);
        let t0 = Instant::now();
        let (_c1, first) = accept();
        assert!(handshakes.start_at(first.as_raw_fd(), t0));
        drop(first);
        let (_c2, second) = accept();
        assert!(handshakes.start_at(second.as_raw_fd(), t0), "swept");
        drop(second);
        let (_c3, third) = accept();
        let soon = t0 + SWEEP_EVERY / 2;
        assert!(
            !handshakes.start_at(third.as_raw_fd(), soon),
            "not swept again yet"
        );
        assert!(
            handshakes.start_at(third.as_raw_fd(), t0 + SWEEP_EVERY),
            "swept"
        );
    }
}
