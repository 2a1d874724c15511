//! Socket options the shell sets on connections it ends: both the clients' (a response
//! given up) and the upstreams' (a connection whose orderly close did not go out).

/// Sets SO_LINGER to 0 s on the socket `fd`: its close sends a reset, and frees what it
/// had queued.
pub fn reset_on_close(fd: i32) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt(2) on a descriptor the caller's connection owns, reading
    // `linger`, which is the option's type and size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "SO_LINGER not set on a connection given up");
    }
}
