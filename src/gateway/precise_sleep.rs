//! Sleeps precise to the microsecond for the short waits that end a round (the quiet
//! window). Tokio's timer rounds every deadline up to its next millisecond tick and the
//! reactor's `epoll_wait` rounds its timeout up to a millisecond again, so a 1 ms wait
//! took 2 to 3 ms: most of a bridged round on a fast upstream. On Linux a wait shorter
//! than [`PRECISE_BELOW`] arms a `timerfd` registered with the reactor instead, which
//! wakes on time; anything longer, any other platform, or a timerfd the kernel refuses
//! uses tokio's timer.

use std::time::Duration;
use tokio::time::Instant;

/// Waits shorter than this use a timerfd; a millisecond or two late does not matter
/// for the longer ones (stream polls, silence, keep-alives).
pub const PRECISE_BELOW: Duration = Duration::from_millis(20);

/// Returns at `deadline`, at once when it has passed.
pub async fn sleep_until(deadline: Instant) {
    let now = Instant::now();
    if deadline <= now {
        return;
    }
    let wait = deadline - now;
    if wait < PRECISE_BELOW && timerfd::sleep(wait).await.is_ok() {
        return;
    }
    tokio::time::sleep_until(deadline).await
}

/// `sleep_until` `at`, or forever when there is none.
pub async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(target_os = "linux")]
mod timerfd {
    use nix::sys::time::TimeSpec;
    use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
    use std::os::fd::{AsFd, AsRawFd, RawFd};
    use std::time::Duration;
    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;

    /// A timerfd as tokio's `AsyncFd` wants it.
    struct Timer(TimerFd);

    impl AsRawFd for Timer {
        fn as_raw_fd(&self) -> RawFd {
            self.0.as_fd().as_raw_fd()
        }
    }

    /// Waits `wait` on a one-shot timerfd (closed when the wait ends or is dropped).
    pub async fn sleep(wait: Duration) -> std::io::Result<()> {
        let flags = TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC;
        let timer = TimerFd::new(ClockId::CLOCK_MONOTONIC, flags)?;
        let when = Expiration::OneShot(TimeSpec::from_duration(wait));
        timer.set(when, TimerSetTimeFlags::empty())?;
        // SAFETY: `Timer` owns its descriptor for as long as the `AsyncFd` lives, and
        // `as_raw_fd` always returns that one.
        let timer = unsafe { AsyncFd::register_with_interest(Timer(timer), Interest::READABLE) }
            .map_err(std::io::Error::from)?;
        let _ready = timer.readable().await?;
        Ok(())
    }
}

#[cfg(not(target_os = "linux"))]
mod timerfd {
    use std::time::Duration;

    /// No timerfd here: the caller falls back to tokio's timer.
    pub async fn sleep(_wait: Duration) -> std::io::Result<()> {
        Err(std::io::ErrorKind::Unsupported.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use futures::FutureExt;

    #[tokio::test]
    async fn a_passed_deadline_is_ready_on_the_first_poll() {
        let past = Instant::now() - Duration::from_millis(1);
        assert!(sleep_until(past).now_or_never().is_some());
        // A deadline of now: tokio's own sleep would wait for its next millisecond tick.
        assert!(sleep_until(Instant::now()).now_or_never().is_some());
    }

    #[tokio::test]
    async fn short_and_long_waits_last_at_least_their_length() {
        for wait in [
            Duration::from_micros(300),
            PRECISE_BELOW + Duration::from_millis(1),
        ] {
            let started = Instant::now();
            sleep_until(started + wait).await;
            assert!(started.elapsed() >= wait, "{wait:?}");
        }
    }
}
