//! Writing responses to the client: complete ones (JSON-RPC errors in the protocol's own
//! form, small JSON or text bodies), always framed with a Content-Length; the framing of a
//! body whose length is not known yet; ending a response that cannot be completed; and
//! every response header's last word on the connection (`write_header`).

use super::admin::Drain;
use crate::protocol::jsonrpc;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// Writes a whole response; returns whether the client took it (a failed write means it
/// left, or stopped reading: there is nothing to add).
pub async fn write(
    session: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Bytes,
) -> bool {
    let Ok(header) = ResponseHeader::build(status, Some(3)) else {
        return false;
    };
    write_with(session, header, content_type, body).await
}

/// Writes a whole response under a header the caller started (extra headers set). The
/// answer to a HEAD request has the header alone, its `Content-Length` the body's: over
/// HTTP/1.1 pingora drops the body itself, but over HTTP/2 it would send it, and a
/// client's HTTP/2 library refuses DATA on a HEAD's stream (a protocol error).
pub async fn write_with(
    session: &mut ServerSession,
    mut header: ResponseHeader,
    content_type: &str,
    body: Bytes,
) -> bool {
    let _ = header.insert_header("content-type", content_type);
    let _ = header.insert_header("content-length", body.len());
    super::cors::decorate(session, &mut header);
    let body = match session.req_header().method == http::Method::HEAD {
        true => Bytes::new(),
        false => body,
    };
    write_header(session, header).await.is_ok() && write_body(session, body, true).await.is_ok()
}

/// Frames a response body of unknown length: chunked for HTTP/1.1 clients. HTTP/1.0 has
/// no chunked coding, so an HTTP/1.0 client's body ends when the connection closes. An
/// HTTP/2 body is framed by its DATA frames and ends with the stream.
/// A 1xx, 204 or 304 response has no body (RFC 9112 §6.3) and gets no framing header:
/// `Transfer-Encoding` on one makes a client wait for chunks that never come.
pub fn frame_unknown_length(session: &mut ServerSession, header: &mut ResponseHeader) {
    if has_no_body(header.status) {
        header.remove_header(&http::header::TRANSFER_ENCODING);
        return;
    }
    header.remove_header(&http::header::CONTENT_LENGTH);
    match session.req_header().version {
        http::Version::HTTP_10 | http::Version::HTTP_09 => {
            header.remove_header(&http::header::TRANSFER_ENCODING);
            session.set_keepalive(None);
        }
        http::Version::HTTP_2 => {
            header.remove_header(&http::header::TRANSFER_ENCODING);
        }
        _ => {
            let _ = header.insert_header(http::header::TRANSFER_ENCODING, "chunked");
        }
    }
}

/// Whether a response of `status` never has a body (RFC 9112 §6.3): 1xx, 204, 304.
pub fn has_no_body(status: http::StatusCode) -> bool {
    status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED
}

/// Ends a response that cannot be completed because its upstream aborted the body (a bad
/// chunk, a reset, a body short of its length): the connection is shut without the
/// body's end, so the client sees the truncation (no terminal chunk, fewer bytes than its
/// Content-Length) instead of a complete-looking body. Nothing reaches the client after
/// this: pingora's `finish` then finds the connection's write side shut.
pub async fn abort(session: &mut ServerSession) {
    session.set_keepalive(None);
    // The shutdown flushes what is queued first (a TLS connection's close_notify goes
    // behind it): to a client that stopped reading, it would wait for ever. Past the
    // bound the connection is given up.
    if tokio::time::timeout(SHUTDOWN_WITHIN, session.shutdown())
        .await
        .is_err()
    {
        give_up(session);
    }
}

/// Ends a response whose write failed (the client left, or took nothing within
/// `limits.client_write_timeout_ms`), or whose client closed its side while it streamed:
/// an HTTP/2 stream is reset; an HTTP/1 connection is given up, reset as soon as the
/// request's handling returns.
pub async fn cut(session: &mut ServerSession) {
    match session {
        ServerSession::H1(_) => give_up(session),
        _ => abort(session).await,
    }
}

/// A connection the gateway gave up on: its request's handling drops it at once (pingora's
/// `finish` would flush, and wait on a client that reads nothing, for ever), and its socket
/// lingers 0 s (closing it resets it: what the kernel still holds for the client is freed
/// at once, not offered for minutes to a reader that takes nothing).
#[derive(Clone, Copy, Debug)]
pub struct GivenUp;

fn give_up(session: &mut ServerSession) {
    session.set_keepalive(None);
    let socket = session.digest().and_then(|d| d.socket_digest.as_ref());
    if let (Some(_), Some(stream)) = (socket, session.stream()) {
        crate::socket::reset_on_close(stream.id());
    }
    session.req_header_mut().extensions_mut().insert(GivenUp);
}

/// Whether the request's connection was given up (`give_up`): it is dropped, not finished.
pub fn given_up(session: &ServerSession) -> bool {
    session.req_header().extensions.get::<GivenUp>().is_some()
}

/// Whether the client has closed its connection already: one read, without waiting.
pub async fn client_left(session: &mut ServerSession) -> bool {
    let read = tokio::time::timeout(Duration::ZERO, session.read_body_or_idle(true)).await;
    matches!(read, Ok(Err(_)))
}

/// The longest `abort` waits for a connection's orderly shutdown.
const SHUTDOWN_WITHIN: Duration = Duration::from_secs(1);

/// A JSON-RPC error with an HTTP status.
pub async fn error(
    session: &mut ServerSession,
    status: u16,
    id: Option<&Value>,
    code: i64,
    message: &str,
) {
    let body = jsonrpc::error_body(id, code, message, None);
    write(session, status, "application/json", body.into()).await;
}

/// A 405 with the methods the endpoint serves in `Allow` (RFC 9110 §15.5.6) and a
/// JSON-RPC error saying what to use.
pub async fn method_not_allowed(session: &mut ServerSession, allow: &str, message: &str) {
    invalid_request_with(session, 405, ("allow", allow), message).await;
}

/// An error with status `status`, one header that says what would be accepted (`Allow`,
/// `Accept-Encoding`), and a JSON-RPC invalid-request error saying what was wrong.
pub async fn invalid_request_with(
    session: &mut ServerSession,
    status: u16,
    (name, value): (&'static str, &str),
    message: &str,
) {
    let Ok(mut header) = ResponseHeader::build(status, Some(4)) else {
        return;
    };
    let _ = header.insert_header(name, value);
    let body = jsonrpc::error_body(None, jsonrpc::code::INVALID_REQUEST, message, None);
    write_with(session, header, "application/json", body.into()).await;
}

/// Writes a response header. Once the replica drains, the connection closes after this
/// response and the header says so (`Connection: close`): the client sends its next
/// request on a new connection, to a replica that takes it, rather than on this one.
/// Nothing is written on a connection already given up (a write that timed out part-way
/// through a header): a second header would follow the first's bytes.
pub async fn write_header(
    session: &mut ServerSession,
    header: ResponseHeader,
) -> pingora::Result<()> {
    if given_up(session) {
        return Err(pingora::Error::explain(
            pingora::ErrorType::WriteError,
            "the connection was given up",
        ));
    }
    let drain = session.req_header().extensions.get::<Arc<Drain>>();
    if drain.is_some_and(|d| d.is_draining()) {
        session.set_keepalive(None);
    }
    let bound = session.get_write_timeout();
    let writing = session.write_response_header(Box::new(header));
    let written = within(bound, writing).await;
    if written.is_err() {
        cut(session).await;
    }
    written
}

/// Writes the interim `100 Continue` to a client that expects it before its body; a
/// write that fails cuts the connection, as `write_header` does.
pub async fn write_continue(session: &mut ServerSession) -> pingora::Result<()> {
    let bound = session.get_write_timeout();
    let written = within(bound, session.write_continue_response()).await;
    if written.is_err() {
        cut(session).await;
    }
    written
}

/// `writing` within `bound` (the request's write timeout). Pingora bounds the writes of a
/// response's body by it, not those of a header, which it flushes when no body follows
/// (a 202, a 204, an interim 100) or the body's length is unknown: a client that stops
/// reading, its window shut by pipelined requests' answers, would hold it for ever.
async fn within<F>(bound: Option<Duration>, writing: F) -> pingora::Result<()>
where
    F: std::future::Future<Output = pingora::Result<()>>,
{
    let Some(bound) = bound else {
        return writing.await;
    };
    match tokio::time::timeout(bound, writing).await {
        Ok(written) => written,
        Err(_) => pingora::Error::e_explain(
            pingora::ErrorType::WriteTimedout,
            "the client took no response header within the write timeout",
        ),
    }
}

/// Most bytes handed to one client write: each write waits at most
/// `limits.client_write_timeout_ms`, so a large body goes in pieces, and only a client
/// that takes less than a piece in that time (a couple of kilobytes a second) is cut.
const WRITE_PIECE: usize = 64 << 10;

/// Writes (part of) a response body, `end` on the last, in pieces of at most
/// `WRITE_PIECE`. A write that fails (the client left, or stopped reading) cuts the
/// response (`cut`): a client still there sees the truncation at once, and nothing more
/// is written.
pub async fn write_body(session: &mut ServerSession, mut body: Bytes, end: bool) -> Result<(), ()> {
    if given_up(session) {
        return Err(());
    }
    while body.len() > WRITE_PIECE {
        let piece = body.split_to(WRITE_PIECE);
        if session.write_response_body(piece, false).await.is_err() {
            cut(session).await;
            return Err(());
        }
    }
    if session.write_response_body(body, end).await.is_err() {
        cut(session).await;
        return Err(());
    }
    Ok(())
}
