//! The HTTP/2 client preface, bounded by the header timeout. Pingora's HTTP/2 handshake
//! waits for the client's preface (the connection preface, then a SETTINGS frame: RFC
//! 9113 §3.4) without a bound, and its idle timeout starts only after it: a client that
//! negotiated `h2` and then sent nothing held its connection, and a slot under
//! `limits.max_client_connections`, for as long as it liked. An HTTP/1.1 request's header
//! meets `limits.header_timeout_ms`; so does the preface here: `PrefaceBy` wraps an
//! HTTP/2 connection's stream, and a read still short of the preface at the deadline
//! fails, which ends the handshake and closes the connection.

use async_trait::async_trait;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::tls::{SslDigest, TlsRef};
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client preface's length: the 24-byte magic, then a SETTINGS frame's 9-byte header
/// (its payload, a multiple of six bytes, may be empty).
const PREFACE_BYTES: usize = 24 + 9;

/// A stream whose first `PREFACE_BYTES` must arrive by a deadline.
#[derive(Debug)]
pub struct PrefaceBy {
    inner: Stream,
    /// Until the preface is in: bytes still due, and the deadline.
    due: Option<(usize, Pin<Box<tokio::time::Sleep>>)>,
}

impl PrefaceBy {
    /// `stream`, whose client preface must arrive within `limit`.
    pub fn wrap(stream: Stream, limit: Duration) -> Stream {
        let deadline = Box::pin(tokio::time::sleep(limit));
        Box::new(PrefaceBy {
            inner: stream,
            due: Some((PREFACE_BYTES, deadline)),
        })
    }
}

impl AsyncRead for PrefaceBy {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        let Some((left, deadline)) = self.due.as_mut() else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) => {
                let got = buf.filled().len() - before;
                *left = left.saturating_sub(got);
                if *left == 0 || got == 0 {
                    self.due = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    tracing::debug!("an HTTP/2 client preface took longer than the header timeout");
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no HTTP/2 client preface within limits.header_timeout_ms",
                    )))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for PrefaceBy {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[async_trait]
impl Shutdown for PrefaceBy {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await
    }
}

impl UniqueID for PrefaceBy {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for PrefaceBy {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for PrefaceBy {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }
}

impl GetProxyDigest for PrefaceBy {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
}

impl GetSocketDigest for PrefaceBy {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }
}

#[async_trait]
impl Peek for PrefaceBy {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

    #[tokio::test(start_paused = true)]
    async fn a_preface_short_at_the_deadline_fails_the_read() {
        let (client, server) = tokio::io::duplex(1024);
        let mut stream = PrefaceBy::wrap(Box::new(server), Duration::from_secs(5));
        let mut client = client;
        client.write_all(&PREFACE[..10]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(stream.read(&mut buf).await.unwrap(), 10);
        let late = stream.read(&mut buf).await;
        assert_eq!(
            late.map_err(|e| e.kind()).err(),
            Some(io::ErrorKind::TimedOut)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_preface_reads_wait_as_long_as_they_like() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut stream = PrefaceBy::wrap(Box::new(server), Duration::from_secs(5));
        client.write_all(PREFACE).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(stream.read(&mut buf).await.unwrap(), PREFACE.len());
        tokio::time::sleep(Duration::from_secs(60)).await;
        client.write_all(b"more").await.unwrap();
        assert_eq!(stream.read(&mut buf).await.unwrap(), 4);
    }
}
