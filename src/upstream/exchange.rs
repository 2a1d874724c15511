//! One HTTP exchange with an upstream endpoint over pingora's HTTP/1.1 client session:
//! send the request, read the response header within the response timeout, then hand
//! out body chunks. New connections (TCP, TLS) are pingora's transport connector's; a
//! response read to its end leaves its connection idle for the next exchange
//! (`upstream::idle`); one abandoned midway is shut down, so a half-read stream is never
//! reused. Interim (1xx) responses are
//! skipped, a protocol switch refused, and a failed attempt made again only when the
//! request provably did not run.

use super::idle::{idle_life, IdleConnections, IDLE_MOST};
use super::DeleteLater;
use super::{Endpoint, Timeouts};
use crate::metrics::{InUse, Metrics};
use crate::protocol::headers::says_close;
use crate::tls::upstream::{handshake_failure, HandshakeFailure};
use bytes::{Bytes, BytesMut};
use pingora::connectors::TransportConnector;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::v1::client::{http_req_header_to_wire, HttpSession};
use pingora::protocols::Stream;
use pingora::upstreams::peer::HttpPeer;
use pingora::upstreams::peer::Peer;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Most bytes of a body nobody wants that are read off to keep its connection, and the
/// longest wait for them: a refusal's body comes with its header, and one that dribbles
/// must not hold the exchange that waits behind it.
const DISCARD_LIMIT: usize = 64 << 10;
const DISCARD_WAIT: Duration = Duration::from_millis(250);
/// Most interim (1xx) responses skipped before an upstream's final response.
pub const MAX_INTERIM_RESPONSES: usize = 8;

/// Which connection an exchange goes out on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Connection {
    /// An idle one when there is one, else a new one.
    Pooled,
    /// A new one: for a GET that replaces an SSE stream the session had moments before
    /// (a retry's resumption, a client's reconnection). A server holds one GET stream
    /// per session, and one connection per call's stream, and answers a second one 409
    /// (or, resuming, an empty stream) until it has read the close of the first. Its
    /// event loop reads that close before a connection opened after it; a request on a
    /// pooled connection can be read first.
    New,
}

/// What went wrong in an exchange. Its text names no endpoint: it is what a client may be
/// told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangeFailure {
    /// Could not connect (refused, unreachable, connect timeout).
    Connect,
    /// Could not open a connection on this side: the replica is out of file descriptors
    /// (EMFILE, ENFILE). Nothing was sent, and the upstream is not at fault.
    NoDescriptor,
    /// The endpoint's certificate did not verify (an unknown issuer, expired, not valid
    /// for the endpoint's name): nothing was sent.
    Untrusted,
    /// The TLS handshake failed otherwise (the endpoint does not speak TLS, or refused
    /// the gateway's certificate or protocol versions): nothing was sent.
    Handshake,
    /// Connected, but no complete response header in time.
    Timeout,
    /// The upstream broke the exchange (reset, malformed HTTP).
    Broken,
    /// The body is larger than the reader accepts (bytes).
    TooLarge(usize),
    /// The connection closed or reset after the whole request went out and before any
    /// response, and the request (not idempotent) was not sent again: it may have run.
    Unanswered,
    /// The upstream answered against the protocol: a switch of protocols the gateway
    /// never asked for, or interim responses without end. The text says which.
    Protocol(&'static str),
}

impl fmt::Display for ExchangeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExchangeFailure::Connect => write!(f, "is unreachable"),
            ExchangeFailure::NoDescriptor => write!(
                f,
                "could not be connected to: this gateway replica has no file descriptor free; retry later"
            ),
            ExchangeFailure::Untrusted => {
                write!(f, "presented a certificate the gateway does not trust")
            }
            ExchangeFailure::Handshake => write!(f, "failed the TLS handshake"),
            ExchangeFailure::Timeout => {
                write!(f, "did not answer in time (the group's response_timeout_ms)")
            }
            ExchangeFailure::Broken => write!(f, "broke the exchange"),
            ExchangeFailure::TooLarge(max) => write!(f, "sent a body larger than {max} bytes"),
            ExchangeFailure::Unanswered => write!(
                f,
                "closed the connection without answering; the request may have run, so it was not sent again"
            ),
            ExchangeFailure::Protocol(what) => write!(f, "{what}"),
        }
    }
}

/// A failed exchange: what went wrong, with which endpoint, and pingora's error as its
/// source when there is one. Its text is for logs; clients are told the `failure` alone.
#[derive(Debug)]
pub struct ExchangeError {
    failure: ExchangeFailure,
    /// `None` for a response read from memory.
    endpoint: Option<SocketAddr>,
    source: Option<pingora::BError>,
}

impl ExchangeError {
    /// No (whole) answer from `endpoint` in time.
    pub fn late(endpoint: Option<SocketAddr>) -> ExchangeError {
        ExchangeError::new(ExchangeFailure::Timeout, endpoint)
    }

    /// `failure`, with `endpoint`, without a source.
    pub fn new(failure: ExchangeFailure, endpoint: Option<SocketAddr>) -> ExchangeError {
        Fault::new(failure).at(endpoint)
    }

    pub fn failure(&self) -> ExchangeFailure {
        self.failure
    }

    pub fn endpoint(&self) -> Option<SocketAddr> {
        self.endpoint
    }
}

impl fmt::Display for ExchangeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.endpoint {
            Some(addr) => write!(f, "upstream {addr} {}", self.failure),
            None => write!(f, "the in-memory upstream {}", self.failure),
        }
    }
}

impl std::error::Error for ExchangeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A failure not yet placed at an endpoint.
#[derive(Debug)]
struct Fault {
    failure: ExchangeFailure,
    source: Option<pingora::BError>,
}

impl Fault {
    fn new(failure: ExchangeFailure) -> Fault {
        Fault {
            failure,
            source: None,
        }
    }

    fn at(self, endpoint: Option<SocketAddr>) -> ExchangeError {
        ExchangeError {
            failure: self.failure,
            endpoint,
            source: self.source,
        }
    }
}

/// The client every exchange goes through, with its idle connections; it counts
/// upstream latency, the connections in use and upstream session events into its
/// gateway's metrics.
pub struct UpstreamClient {
    transport: TransportConnector,
    idle: IdleConnections,
    pub metrics: Arc<Metrics>,
    /// Largest message read whole from a response (`Response::max_message`).
    max_message: usize,
    /// Late answers to `initialize` awaited in the background, to end the sessions they
    /// open (`legacy_session`): each holds a connection, so they are bounded.
    pub late_answers: Arc<tokio::sync::Semaphore>,
    /// Where the DELETEs of unused sessions that failed go (`LegacySession::abandon`).
    pub delete_later: Option<Arc<dyn DeleteLater>>,
}

/// How many late answers to `initialize` are awaited at once.
pub const MAX_LATE_ANSWERS: usize = 256;

impl UpstreamClient {
    pub fn new(metrics: Arc<Metrics>) -> UpstreamClient {
        UpstreamClient {
            transport: TransportConnector::new(None),
            idle: IdleConnections::new(metrics.upstream_idle_connections.clone()),
            metrics,
            max_message: crate::config::DEFAULT_MAX_UPSTREAM_MESSAGE_BYTES,
            late_answers: Arc::new(tokio::sync::Semaphore::new(MAX_LATE_ANSWERS)),
            delete_later: None,
        }
    }

    /// With `later` keeping the DELETEs of unused sessions that failed.
    pub fn with_delete_later(mut self, later: Arc<dyn DeleteLater>) -> UpstreamClient {
        self.delete_later = Some(later);
        self
    }

    /// With `bytes` the largest message read whole from its responses.
    pub fn with_max_message(mut self, bytes: usize) -> UpstreamClient {
        self.max_message = bytes;
        self
    }
}

impl Default for UpstreamClient {
    /// A client with metrics of its own (tests).
    fn default() -> Self {
        Self::new(Arc::default())
    }
}

fn is_timeout(e: &pingora::Error) -> bool {
    use pingora::ErrorType::*;
    matches!(e.etype(), ReadTimedout | WriteTimedout | ConnectTimedout)
}

impl UpstreamClient {
    fn peer(endpoint: &Endpoint, timeouts: &Timeouts) -> HttpPeer {
        let mut peer = HttpPeer::new(endpoint.addr, false, String::new());
        if let Some(tls) = &endpoint.tls {
            tls.configure(&mut peer);
        }
        peer.options.connection_timeout = Some(timeouts.connect);
        peer.options.total_connection_timeout = Some(timeouts.connect);
        peer.options.idle_timeout = Some(IDLE_MOST);
        peer
    }

    /// Sends `request` with `body` and waits for the response header. A failed attempt
    /// is made again, once, on a fresh connection only when the request provably did not
    /// run (`Reached::may_retry`): an MCP POST is not idempotent.
    pub async fn send(
        &self,
        endpoint: &Endpoint,
        timeouts: &Timeouts,
        request: RequestHeader,
        body: Bytes,
    ) -> Result<Response, ExchangeError> {
        self.send_on(Connection::Pooled, endpoint, timeouts, request, body)
            .await
    }

    /// `send`, on the `connection` asked for.
    pub async fn send_on(
        &self,
        connection: Connection,
        endpoint: &Endpoint,
        timeouts: &Timeouts,
        request: RequestHeader,
        body: Bytes,
    ) -> Result<Response, ExchangeError> {
        let peer = Self::peer(endpoint, timeouts);
        let started = Instant::now();
        let in_use = InUse::new(&self.metrics.upstream_connections);
        let idempotent = is_idempotent(&request.method);
        let at = Some(endpoint.addr);
        let (http, reused) = self
            .connect(&peer, connection)
            .await
            .map_err(|f| f.at(at))?;
        let (mut http, written) =
            match Self::write_and_read_header(http, timeouts, &request, &body).await {
                Ok(answered) => answered,
                Err(failed) if failed.reached.may_retry(idempotent, reused) => {
                    let http = (self.connect(&peer, Connection::New).await)
                        .map_err(|f| f.at(at))?
                        .0;
                    Self::write_and_read_header(http, timeouts, &request, &body)
                        .await
                        .map_err(|failed| failed.into_fault().at(at))?
                }
                Err(failed) => return Err(failed.into_fault().at(at)),
            };
        http.read_timeout = timeouts.stream_idle;
        self.metrics
            .upstream_duration
            .with_label_values(&[match endpoint.peer {
                true => "peer",
                false => endpoint.authority.as_str(),
            }])
            .observe(started.elapsed().as_secs_f64());
        Ok(Response {
            http: Box::new(http),
            endpoint: at,
            // A connection whose request was cut short serves no other.
            pool: (written == Written::Whole).then(|| Box::new(peer)),
            answer_within: timeouts.response,
            max_message: self.max_message,
            _in_use: Some(in_use),
        })
    }

    /// An idle connection to the peer when `connection` allows one (one the upstream
    /// closed while it idled is not used), or a new one; and whether it was idle. A failed
    /// connection is never tried again: a handshake that failed would fail again.
    async fn connect(
        &self,
        peer: &HttpPeer,
        connection: Connection,
    ) -> Result<(HttpSession, bool), Fault> {
        let idle = (connection == Connection::Pooled)
            .then(|| self.idle.take(peer.reuse_hash()))
            .flatten();
        if let Some(stream) = idle {
            return Ok((HttpSession::new(stream), true));
        }
        // Pingora's connect future holds a TLS handshake: on the heap, so that it does not
        // sit in every future that sends a request.
        let stream = Box::pin(self.transport.new_stream(peer))
            .await
            .map_err(|e| Fault {
                failure: connect_failure(&e),
                source: Some(e),
            })?;
        Ok((HttpSession::new(stream), false))
    }

    /// Writes the request and reads the final response header; a failed attempt's
    /// connection is shut.
    async fn write_and_read_header(
        http: HttpSession,
        timeouts: &Timeouts,
        request: &RequestHeader,
        body: &Bytes,
    ) -> Result<(HttpSession, Written), Failed> {
        let (mut http, written) = write_request(http, timeouts.response, request, body).await;
        let written = match written {
            Ok(()) => Written::Whole,
            // The upstream may have answered before it read the whole body (a 413, a 401
            // with its challenge) and closed: that answer, there to read, is the
            // exchange's, not a failure (nor a reason to send the request again).
            Err(failed)
                if failed.reached == Reached::Nothing
                    && failed.fault.failure == ExchangeFailure::Broken
                    && answered_early(&mut http).await =>
            {
                return Ok((http, Written::Cut));
            }
            Err(failed) => {
                close(&mut http).await;
                return Err(failed);
            }
        };
        http.read_timeout = Some(timeouts.response);
        // Each read waits at most the response timeout, and so does the whole header: an
        // upstream that trickles it a byte at a time is not waited for without end.
        let header = tokio::time::timeout(timeouts.response, read_final_header(&mut http))
            .await
            .unwrap_or_else(|_| {
                let late = Fault::new(ExchangeFailure::Timeout);
                Err(Failed::at(Reached::Beyond, late))
            });
        match header {
            Ok(()) => Ok((http, written)),
            Err(failed) => {
                close(&mut http).await;
                Err(failed)
            }
        }
    }

    /// Reads off the rest of a body nobody wants (a refusal, a 202's, a DELETE's), within
    /// `limit` and `DISCARD_WAIT`, so that its connection can serve the next exchange; a
    /// body over `DISCARD_LIMIT`, or slower than that, closes it instead.
    pub async fn discard(&self, mut response: Response, limit: Duration) {
        let limit = limit.min(DISCARD_WAIT);
        let _ = tokio::time::timeout(limit, response.read_all(DISCARD_LIMIT)).await;
        self.finish(response).await;
    }

    /// Returns a response's connection to the pool: at once when its body was read to
    /// its end, else once the rest is read off in the background (`discard`), so that
    /// the caller does not wait for a stream the server is about to end.
    pub async fn release(self: &Arc<Self>, mut response: Response, limit: Duration) {
        if response.http.is_body_done() {
            return self.finish(response).await;
        }
        let client = Arc::clone(self);
        tokio::spawn(async move { client.discard(response, limit).await });
    }

    /// Returns a fully read response's connection to the pool, or closes it.
    pub async fn finish(&self, response: Response) {
        let Response {
            mut http,
            pool,
            _in_use,
            ..
        } = response;
        match pool {
            Some(peer) if http.is_body_done() => {
                // Kept only if pingora finds it reusable: the body read to its end, no
                // byte past it, keep-alive on both sides; and for less than the upstream
                // keeps it.
                http.respect_keepalive();
                let header = http.resp_header();
                // pingora drops the `Content-Length` of a header framed both ways and
                // keeps its `Transfer-Encoding`: only then is the header as received read.
                let chunked = header.is_some_and(|h| h.headers.contains_key("transfer-encoding"));
                let life = match chunked && framed_twice(&http.get_headers_raw_bytes()) {
                    true => Duration::ZERO,
                    false => idle_life(
                        (header.into_iter())
                            .flat_map(|header| header.headers.get_all("keep-alive"))
                            .map(|value| value.as_bytes()),
                    ),
                };
                // Pingora reads only the first `Connection` field: a `close` in another
                // would pool a connection the upstream is closing.
                let closing = header.is_some_and(|h| says_close(&h.headers));
                if life.is_zero() || closing || !http.will_keepalive() {
                    return close(&mut http).await;
                }
                // Pingora's `reuse` closes a body that ended in an error itself, unbounded.
                let reused = tokio::time::timeout(CLOSE_WITHIN, http.reuse()).await;
                if let Ok(Some(stream)) = reused {
                    self.idle.put(peer.reuse_hash(), stream, life);
                }
            }
            _ => close(&mut http).await,
        }
    }
}

/// The longest an upstream connection's orderly close waits to go out.
const CLOSE_WITHIN: Duration = Duration::from_secs(1);

/// Closes an upstream connection no exchange will use again: its TLS `close_notify` and
/// FIN within `CLOSE_WITHIN`, else a reset. A TLS stream's shutdown first writes what
/// its session still holds, and an upstream that stopped reading, its window shut, would
/// keep that (and the request waiting on it) for ever.
async fn close(http: &mut HttpSession) {
    if tokio::time::timeout(CLOSE_WITHIN, http.shutdown())
        .await
        .is_err()
    {
        crate::socket::reset_on_close(http.stream().id());
    }
}

/// Whether a response says its length both ways, `Content-Length` and
/// `Transfer-Encoding`: it was read by the latter, but RFC 9112 (6.3) counts it a sign of
/// response splitting, so its connection is closed rather than given to the next request
/// (which may be another caller's).
fn framed_twice(raw_header: &[u8]) -> bool {
    let has = |wanted: &str| {
        raw_header.split(|&b| b == b'\n').any(|line| {
            let name = line
                .iter()
                .position(|&b| b == b':')
                .map(|colon| &line[..colon]);
            name.is_some_and(|name| name.trim_ascii().eq_ignore_ascii_case(wanted.as_bytes()))
        })
    };
    has("content-length") && has("transfer-encoding")
}

/// What a response header read from an upstream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderKind {
    /// The final response.
    Final,
    /// An interim response (100, 103, …): skipped; the final one follows.
    Interim,
    /// `101 Switching Protocols`: the gateway never asks for an upgrade.
    Switch,
}

impl HeaderKind {
    pub fn of(status: u16) -> HeaderKind {
        match status {
            101 => HeaderKind::Switch,
            100..=199 => HeaderKind::Interim,
            _ => HeaderKind::Final,
        }
    }
}

/// Whether a request went out whole, or was cut short by an upstream that answered it
/// early and closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Written {
    Whole,
    Cut,
}

/// How long a failed write waits for the early answer that may have come before it: one
/// that came is in the socket's buffer already.
const EARLY_ANSWER_WAIT: Duration = Duration::from_millis(250);

/// After a failed write, whether the upstream's final response header is there to read
/// (it is then read).
async fn answered_early(http: &mut HttpSession) -> bool {
    let header = tokio::time::timeout(EARLY_ANSWER_WAIT, read_final_header(http)).await;
    matches!(header, Ok(Ok(())))
}

/// Writes `request` and its `body` with one flush, within `limit`, so a small request
/// leaves in one segment (pingora's client flushes its header before the body: two writes
/// per POST, and a second read at the upstream). The session is rebuilt on the same
/// connection, as pingora builds it, and handed back either way. A write that fails sent
/// the request short of its end, which no upstream acts on (a body shorter than its
/// `Content-Length` is no request): nothing ran; unless the upstream answered early
/// (`answered_early`), it may be made again. A write that times out is not made again, as
/// after any timeout.
async fn write_request(
    http: HttpSession,
    limit: Duration,
    request: &RequestHeader,
    body: &Bytes,
) -> (HttpSession, Result<(), Failed>) {
    let nothing = |failure: ExchangeFailure| Failed::at(Reached::Nothing, Fault::new(failure));
    let Some(header) = http_req_header_to_wire(request) else {
        let cannot = ExchangeFailure::Protocol("cannot carry the request's target");
        return (http, Err(nothing(cannot)));
    };
    let mut wire = BytesMut::with_capacity(header.len() + body.len());
    wire.extend_from_slice(&header);
    wire.extend_from_slice(body);
    let mut stream = http.into_inner();
    let written = tokio::time::timeout(limit, async {
        stream.write_all(&wire).await?;
        stream.flush().await
    })
    .await;
    let written = match written {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Failed::at(
            Reached::Nothing,
            Fault {
                failure: ExchangeFailure::Broken,
                source: Some(pingora::Error::because(
                    pingora::ErrorType::WriteError,
                    "while writing the request",
                    e,
                )),
            },
        )),
        Err(_) => Err(Failed::at(
            Reached::Beyond,
            Fault::new(ExchangeFailure::Timeout),
        )),
    };
    (HttpSession::new(stream), written)
}

/// Reads response headers until the final one, skipping at most
/// `MAX_INTERIM_RESPONSES` interim ones; a switch of protocols is refused.
async fn read_final_header(http: &mut HttpSession) -> Result<(), Failed> {
    for interim in 0..=MAX_INTERIM_RESPONSES {
        if let Err(e) = http.read_response().await {
            // Pingora marks a connection that closed or reset before a response header
            // `ReusedOnly`, but not a TLS one closed without `close_notify`; after an
            // interim response the upstream surely has the request.
            let closed = matches!(e.retry, pingora::RetryType::ReusedOnly) || cut_short(&e);
            let unanswered = interim == 0 && closed;
            let reached = if unanswered {
                Reached::Unanswered
            } else {
                Reached::Beyond
            };
            return Err(Failed::at(reached, read_error(e)));
        }
        let status = http.resp_header().map_or(0, |h| h.status.as_u16());
        let refused = match HeaderKind::of(status) {
            HeaderKind::Final => return Ok(()),
            HeaderKind::Interim => continue,
            HeaderKind::Switch => {
                "answered with 101 Switching Protocols, though no upgrade was asked for"
            }
        };
        let refused = Fault::new(ExchangeFailure::Protocol(refused));
        return Err(Failed::at(Reached::Beyond, refused));
    }
    let endless = "sent more interim (1xx) responses than the gateway accepts";
    let endless = Fault::new(ExchangeFailure::Protocol(endless));
    Err(Failed::at(Reached::Beyond, endless))
}

/// Whether a read failed as the peer's TCP close under TLS without `close_notify` (rustls'
/// `UnexpectedEof`, which carries no OS error code, so pingora does not take it for a
/// close): as unanswered as a plain close.
fn cut_short(e: &pingora::Error) -> bool {
    let cause = e.root_cause().downcast_ref::<std::io::Error>();
    cause.is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof)
}

/// GET and DELETE may be sent again (RFC 9110 §9.2.2); a POST carries a JSON-RPC
/// message, and a `tools/call` sent twice runs twice.
fn is_idempotent(method: &http::Method) -> bool {
    matches!(
        *method,
        http::Method::GET | http::Method::DELETE | http::Method::HEAD
    )
}

/// How far a failed attempt got, which decides whether it may be made again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reached {
    /// The request did not reach the upstream whole (its write failed): nothing can have
    /// run.
    Nothing,
    /// The request went out whole, then the connection closed or reset before any
    /// response: the upstream may have run it.
    Unanswered,
    /// Anything later or less clear: a timeout, a malformed, interim-only or partial
    /// response.
    Beyond,
}

impl Reached {
    /// Whether an attempt that failed here may be made again on a fresh connection: when
    /// nothing can have run, or when an idempotent request met a pooled connection that
    /// closed without answering (the race of a keep-alive close). Never after a timeout.
    pub fn may_retry(self, idempotent: bool, reused: bool) -> bool {
        match self {
            Reached::Nothing => true,
            Reached::Unanswered => idempotent && reused,
            Reached::Beyond => false,
        }
    }
}

/// A failed attempt: how far it got, and what went wrong.
struct Failed {
    reached: Reached,
    fault: Fault,
}

impl Failed {
    fn at(reached: Reached, fault: Fault) -> Failed {
        Failed { reached, fault }
    }

    /// The caller's fault; an unanswered request not made again says so.
    fn into_fault(self) -> Fault {
        match (self.reached, self.fault.failure) {
            (Reached::Unanswered, ExchangeFailure::Broken) => Fault {
                failure: ExchangeFailure::Unanswered,
                source: self.fault.source,
            },
            _ => self.fault,
        }
    }
}

/// What a failed connection attempt was: a TLS handshake that failed (the certificate
/// did not verify, or otherwise), or no connection.
fn connect_failure(e: &pingora::Error) -> ExchangeFailure {
    if out_of_descriptors(e) {
        return ExchangeFailure::NoDescriptor;
    }
    match handshake_failure(e) {
        Some(HandshakeFailure::Untrusted) => ExchangeFailure::Untrusted,
        Some(HandshakeFailure::Failed) => ExchangeFailure::Handshake,
        None => ExchangeFailure::Connect,
    }
}

/// Whether a connection failed for want of a file descriptor on this side: an I/O error
/// EMFILE or ENFILE anywhere in its causes.
fn out_of_descriptors(e: &pingora::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = e.cause.as_deref().map(|c| c as _);
    while let Some(error) = cause {
        let errno = error
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error);
        if matches!(errno, Some(libc::EMFILE | libc::ENFILE)) {
            return true;
        }
        // A pingora error among the causes (itself, or boxed) keeps its own in `cause`.
        let inner = (error.downcast_ref::<pingora::Error>())
            .or_else(|| error.downcast_ref::<pingora::BError>().map(|e| &**e));
        cause = match inner {
            Some(inner) => inner.cause.as_deref().map(|c| c as _),
            None => error.source(),
        };
    }
    false
}

fn read_error(mut e: pingora::BError) -> Fault {
    // Pingora's error for a response header it cannot parse quotes the bytes it read
    // (`buf: …`): the upstream's `Set-Cookie`, its session id. Only the parse error
    // (`cause`) is kept for the logs.
    if e.etype == pingora::ErrorType::InvalidHTTPHeader {
        e.context = None;
    }
    let failure = if is_timeout(&e) {
        ExchangeFailure::Timeout
    } else {
        ExchangeFailure::Broken
    };
    Fault {
        failure,
        source: Some(e),
    }
}

/// Sends a request on `stream` and reads the response header as an exchange does
/// (interim responses skipped, a protocol switch refused); the body is then read with
/// `next_chunk`. The stream belongs to no pool. For the `upstream_response` fuzz target
/// and tests, which feed an upstream's response from memory.
pub async fn read_response_from(stream: Stream) -> Result<Response, ExchangeError> {
    let http = HttpSession::new(stream);
    let request =
        RequestHeader::build("POST", b"/mcp", Some(2)).map_err(|e| read_error(e).at(None))?;
    let timeouts = Timeouts {
        connect: IN_MEMORY_LIMIT,
        response: IN_MEMORY_LIMIT,
        stream_idle: Some(IN_MEMORY_LIMIT),
    };
    let body = Bytes::from_static(b"{}");
    let (mut http, _) = UpstreamClient::write_and_read_header(http, &timeouts, &request, &body)
        .await
        .map_err(|failed| failed.into_fault().at(None))?;
    http.read_timeout = timeouts.stream_idle;
    Ok(Response {
        http: Box::new(http),
        endpoint: None,
        pool: None,
        answer_within: IN_MEMORY_LIMIT,
        max_message: crate::config::DEFAULT_MAX_UPSTREAM_MESSAGE_BYTES,
        _in_use: None,
    })
}

/// Every wait of `read_response_from`: its stream is in memory.
const IN_MEMORY_LIMIT: Duration = Duration::from_secs(1);

/// A response whose header has arrived. The session lives on the heap: a response is held
/// across awaits by every future that reads one, and pingora's session is over a kilobyte.
pub struct Response {
    http: Box<HttpSession>,
    /// Where it came from; `None` for a response read from memory.
    endpoint: Option<SocketAddr>,
    /// Where the connection goes back once the response is read whole; `None` for a
    /// stream that belongs to no pool.
    pool: Option<Box<HttpPeer>>,
    /// The longest an answer may take after its header: a body read whole, or the one
    /// message an SSE answer is read for (the exchange's response timeout).
    pub(crate) answer_within: Duration,
    /// The largest message read from it whole: a JSON body, one SSE event
    /// (`limits.max_upstream_message_bytes`).
    max_message: usize,
    /// Counts this connection in use until the response is finished or dropped.
    _in_use: Option<InUse>,
}

impl Response {
    /// The endpoint that sent it; `None` for a response read from memory.
    pub fn endpoint(&self) -> Option<SocketAddr> {
        self.endpoint
    }

    pub fn header(&self) -> &ResponseHeader {
        self.http
            .resp_header()
            .expect("send() returns only after the response header was read")
    }

    /// Whether the body is an SSE stream (the media type is case-insensitive).
    pub fn is_sse(&self) -> bool {
        self.has_media_type(b"text/event-stream")
    }

    /// Whether the body carries JSON-RPC messages: a JSON body or an SSE stream.
    pub fn is_jsonrpc(&self) -> bool {
        self.is_sse() || self.has_media_type(b"application/json")
    }

    fn has_media_type(&self, media: &[u8]) -> bool {
        self.header()
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.as_bytes().get(..media.len()))
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case(media))
    }

    /// Whether the body is content-coded (`Content-Encoding` other than `identity`): its
    /// bytes are not the media type's, and nothing may be inserted into them. Empty list
    /// elements name no coding (RFC 9110 §5.6.1).
    pub fn is_encoded(&self) -> bool {
        self.header()
            .headers
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity"))
    }

    /// The next body chunk; `None` at the end of the body.
    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>, ExchangeError> {
        let endpoint = self.endpoint;
        self.http
            .read_body_bytes()
            .await
            .map_err(|e| read_error(e).at(endpoint))
    }

    /// The largest message read from it whole: a JSON body, one SSE event.
    pub fn max_message(&self) -> usize {
        self.max_message
    }

    /// The longest an answer may take after its header (`answer_within`).
    pub fn answer_within(&self) -> Duration {
        self.answer_within
    }

    /// Reads the whole body, refusing more than `max` bytes, within `answer_within`: a
    /// body that stalls or trickles ends with `Timeout` (no byte-by-byte wait without end,
    /// whatever the stream idle limit).
    pub async fn read_all(&mut self, max: usize) -> Result<Bytes, ExchangeError> {
        let endpoint = self.endpoint;
        tokio::time::timeout(self.answer_within, self.read_whole(max))
            .await
            .unwrap_or_else(|_| Err(ExchangeError::late(endpoint)))
    }

    async fn read_whole(&mut self, max: usize) -> Result<Bytes, ExchangeError> {
        let mut body = Vec::new();
        while let Some(chunk) = self.next_chunk().await? {
            if body.len() + chunk.len() > max {
                return Err(Fault::new(ExchangeFailure::TooLarge(max)).at(self.endpoint));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn a_response_framed_both_ways_is_told_from_its_header_as_received() {
        let both = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\ntransfer-encoding: chunked\r\n\r\n";
        assert!(framed_twice(both));
        let length =
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-note: transfer-encoding: no\r\n\r\n";
        assert!(!framed_twice(length));
        assert!(!framed_twice(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        ));
    }

    /// Reads `wire` as an upstream's response: the status and the body, or the error.
    async fn read(wire: &[u8]) -> Result<(u16, Vec<u8>), ExchangeError> {
        let (client, mut upstream) = tokio::io::duplex(wire.len() + 4096);
        upstream.write_all(wire).await.expect("in memory");
        upstream.shutdown().await.expect("in memory");
        let mut response = read_response_from(Box::new(client)).await?;
        let mut body = Vec::new();
        while let Some(chunk) = response.next_chunk().await? {
            body.extend_from_slice(&chunk);
        }
        Ok((response.header().status.as_u16(), body))
    }

    /// Whether a response with these headers is an SSE stream, and a coded one.
    async fn kind(headers: &str) -> (bool, bool) {
        let wire = format!("HTTP/1.1 200 OK\r\n{headers}content-length: 0\r\n\r\n");
        let (client, mut upstream) = tokio::io::duplex(4096);
        upstream
            .write_all(wire.as_bytes())
            .await
            .expect("in memory");
        let response = read_response_from(Box::new(client))
            .await
            .expect("a response");
        (response.is_sse(), response.is_encoded())
    }

    #[tokio::test]
    async fn a_response_is_known_as_sse_and_as_coded_by_its_headers() {
        let sse = "content-type: text/event-stream\r\n";
        assert_eq!(kind(sse).await, (true, false));
        let shouted = "content-type: Text/Event-Stream; charset=utf-8\r\n";
        assert_eq!(
            kind(shouted).await,
            (true, false),
            "media types ignore case"
        );
        assert_eq!(kind("content-type: text/event\r\n").await, (false, false));
        assert_eq!(
            kind("content-type: application/json\r\n").await,
            (false, false)
        );
        let gzip = format!("{sse}content-encoding: gzip\r\n");
        assert_eq!(kind(&gzip).await, (true, true));
        let identity = format!("{sse}content-encoding: Identity\r\n");
        assert_eq!(kind(&identity).await, (true, false));
        let listed = format!("{sse}content-encoding: identity, br\r\n");
        assert_eq!(kind(&listed).await, (true, true));
        // An empty value, or empty elements, name no coding.
        for empty in ["content-encoding:\r\n", "content-encoding: ,identity, \r\n"] {
            assert_eq!(
                kind(&format!("{sse}{empty}")).await,
                (true, false),
                "{empty}"
            );
        }
    }

    #[tokio::test]
    async fn a_response_read_from_memory_skips_interim_ones() {
        let wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
            HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
        assert_eq!(read(wire).await.unwrap(), (200, b"ok".to_vec()));
        let switch = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\nbytes";
        let switched = read(switch).await.unwrap_err();
        assert!(matches!(switched.failure(), ExchangeFailure::Protocol(_)));
        let interim_only = b"HTTP/1.1 100 Continue\r\n\r\n";
        assert!(read(interim_only).await.is_err());
        let endless = b"HTTP/1.1 103 Early Hints\r\n\r\n".repeat(MAX_INTERIM_RESPONSES + 1);
        let endless = read(&endless).await.unwrap_err();
        assert!(matches!(endless.failure(), ExchangeFailure::Protocol(_)));
        assert_eq!(endless.endpoint(), None);
        let bad_chunk = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n";
        assert!(read(bad_chunk).await.is_err());
    }

    #[tokio::test]
    async fn a_request_goes_out_whole_and_a_failed_write_ran_nothing() {
        let request = RequestHeader::build("POST", b"/mcp", None).unwrap();
        let body = Bytes::from_static(b"{\"jsonrpc\":\"2.0\"}");
        let (client, mut upstream) = tokio::io::duplex(4096);
        let http = HttpSession::new(Box::new(client));
        let limit = Duration::from_secs(1);
        let (_, written) = write_request(http, limit, &request, &body).await;
        assert!(written.is_ok());
        let mut wire = vec![0; 4096];
        let n = tokio::io::AsyncReadExt::read(&mut upstream, &mut wire)
            .await
            .unwrap();
        assert_eq!(
            &wire[..n],
            b"POST /mcp HTTP/1.1\r\n\r\n{\"jsonrpc\":\"2.0\"}"
        );

        let (client, upstream) = tokio::io::duplex(4096);
        drop(upstream);
        let http = HttpSession::new(Box::new(client));
        let (_, Err(failed)) = write_request(http, limit, &request, &body).await else {
            panic!("a write to a closed peer fails");
        };
        assert_eq!(failed.reached, Reached::Nothing);
        assert_eq!(failed.fault.failure, ExchangeFailure::Broken);
    }

    /// An upstream that answers before it has read the whole body (a 413, a 401) and
    /// closes: its answer is the exchange's, and the connection is not pooled.
    #[tokio::test]
    async fn an_answer_that_comes_before_the_whole_body_is_the_exchanges() {
        let request = RequestHeader::build("POST", b"/mcp", None).unwrap();
        let body = Bytes::from(vec![b'x'; 64 << 10]);
        let (client, mut upstream) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let mut head = vec![0; 4096];
            let _ = tokio::io::AsyncReadExt::read(&mut upstream, &mut head).await;
            let answer = b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 2\r\n\r\n{}";
            let _ = tokio::io::AsyncWriteExt::write_all(&mut upstream, answer).await;
        });
        let http = HttpSession::new(Box::new(client));
        let timeouts = Timeouts {
            connect: Duration::from_secs(1),
            response: Duration::from_secs(5),
            stream_idle: None,
        };
        let answered = UpstreamClient::write_and_read_header(http, &timeouts, &request, &body);
        let Ok((http, written)) = answered.await else {
            panic!("the early answer is the exchange's");
        };
        assert_eq!(http.resp_header().map(|h| h.status.as_u16()), Some(413));
        assert_eq!(written, Written::Cut);
    }

    /// A replica out of descriptors is not an unreachable upstream: a retry told its call
    /// is lost would issue it again while the upstream still runs it.
    #[test]
    fn a_connection_without_a_descriptor_is_told_from_an_unreachable_upstream() {
        use pingora::ErrorType::{ConnectRefused, SocketError};
        let errno = std::io::Error::from_raw_os_error;
        let emfile = pingora::Error::because(SocketError, "socket", errno(libc::EMFILE));
        assert_eq!(connect_failure(&emfile), ExchangeFailure::NoDescriptor);
        let inner = pingora::Error::because(SocketError, "socket", errno(libc::ENFILE));
        let wrapped = pingora::Error::because(ConnectRefused, "connect", inner);
        assert_eq!(connect_failure(&wrapped), ExchangeFailure::NoDescriptor);
        let refused = pingora::Error::because(ConnectRefused, "connect", errno(libc::ECONNREFUSED));
        assert_eq!(connect_failure(&refused), ExchangeFailure::Connect);
    }

    #[test]
    fn only_requests_that_provably_did_not_run_are_sent_again() {
        for reused in [false, true] {
            for idempotent in [false, true] {
                assert!(Reached::Nothing.may_retry(idempotent, reused));
                assert!(!Reached::Beyond.may_retry(idempotent, reused));
            }
        }
        assert!(Reached::Unanswered.may_retry(true, true));
        assert!(
            !Reached::Unanswered.may_retry(false, true),
            "a POST may have run"
        );
        assert!(!Reached::Unanswered.may_retry(true, false));
        assert!(is_idempotent(&http::Method::GET) && is_idempotent(&http::Method::DELETE));
        assert!(!is_idempotent(&http::Method::POST));
        let timeout = Failed::at(Reached::Beyond, Fault::new(ExchangeFailure::Timeout));
        assert_eq!(timeout.into_fault().failure, ExchangeFailure::Timeout);
        let closed = Failed::at(Reached::Unanswered, Fault::new(ExchangeFailure::Broken));
        assert_eq!(closed.into_fault().failure, ExchangeFailure::Unanswered);
    }

    #[test]
    fn interim_responses_are_skipped_and_a_protocol_switch_refused() {
        for status in [100, 102, 103, 199] {
            assert_eq!(HeaderKind::of(status), HeaderKind::Interim, "{status}");
        }
        assert_eq!(HeaderKind::of(101), HeaderKind::Switch);
        for status in [200, 204, 304, 404, 502] {
            assert_eq!(HeaderKind::of(status), HeaderKind::Final, "{status}");
        }
    }
}
