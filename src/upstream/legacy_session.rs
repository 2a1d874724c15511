//! A legacy upstream session driven on behalf of a modern client: `initialize` with the
//! client's declared capabilities (legacy servers register tools by them), then
//! `notifications/initialized`, then calls, answers to server requests, resumption GETs,
//! and finally DELETE.

use super::exchange::{Connection, ExchangeError, ExchangeFailure, Response, UpstreamClient};
use super::{Endpoint, Timeouts};
use crate::protocol::headers::{EndToEnd, MCP_SESSION_ID};
use crate::protocol::jsonrpc::{self, Cancellation};
use crate::protocol::revision::Revision;
use crate::protocol::session_token::{SessionToken, MAX_UPSTREAM_SESSION_LEN};
use crate::protocol::sse;
use crate::protocol::target::upstream_target;
use crate::protocol::trace::TraceContext;
use bytes::Bytes;
use pingora::http::RequestHeader;
use serde_json::{json, Value};
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

/// Longest wait for the DELETE of a session nobody will use (`LegacySession::abandon`),
/// and for the upstream to take a call's cancellation (`cancel`).
pub const ABANDON_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);
/// How much longer than the response timeout a late answer to `initialize` is awaited,
/// to end the session it opens.
const LATE_INITIALIZE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// A session value's parts, owned: what a detached exchange takes along.
struct Detached {
    client: Arc<UpstreamClient>,
    timeouts: Timeouts,
    endpoint: Endpoint,
    session_id: Option<String>,
    version: Revision,
    caller: Caller,
    persistent: bool,
}

impl Detached {
    fn session(&self) -> LegacySession<'_> {
        LegacySession {
            client: &self.client,
            endpoint: self.endpoint.clone(),
            timeouts: &self.timeouts,
            session_id: self.session_id.clone(),
            version: self.version,
            caller: self.caller.clone(),
            persistent: self.persistent,
        }
    }
}

pub struct LegacySession<'a> {
    pub client: &'a UpstreamClient,
    pub endpoint: Endpoint,
    pub timeouts: &'a Timeouts,
    pub session_id: Option<String>,
    /// The revision the session negotiated (what the gateway asked for until then).
    pub version: Revision,
    /// The client request the session acts for now.
    pub caller: Caller,
    /// A data-layer session's: it outlives the flows run in it, which never delete it.
    pub persistent: bool,
}

/// The client request an upstream session acts for: its trace context and the end-to-end
/// headers (credentials among them) that every request of the session carries. A retry
/// acts for itself: its own headers replace the previous round's. Requests the gateway
/// makes on its own (reaping an abandoned session) act for no one and carry none.
#[derive(Clone, Debug, Default)]
pub struct Caller {
    pub trace: TraceContext,
    pub headers: EndToEnd,
}

/// Why the upstream could not be driven. Its text names no endpoint: it is what a client
/// may be told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionFailure {
    /// The group has no healthy endpoint for a new session.
    NoEndpoint,
    Exchange(ExchangeFailure),
    /// The upstream answered something other than what the protocol requires.
    Protocol(String),
    /// The upstream refused the request with this HTTP status (4xx or 5xx; a 404 in an
    /// established session is `Gone`, a 401 or 403 `Denied`).
    Refused(u16),
    /// The upstream denied the caller access (401 or 403), with its challenge
    /// (`WWW-Authenticate`), which the client must see to authenticate.
    Denied {
        status: u16,
        challenge: Option<String>,
    },
    /// The upstream no longer has the session (HTTP 404, or a 401 without a challenge).
    Gone,
}

impl fmt::Display for SessionFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionFailure::NoEndpoint => write!(f, "has no healthy endpoint"),
            SessionFailure::Exchange(e) => write!(f, "{e}"),
            SessionFailure::Protocol(e) => write!(f, "{e}"),
            SessionFailure::Refused(status) => write!(f, "refused the request (HTTP {status})"),
            SessionFailure::Denied { status: 401, .. } => {
                write!(f, "requires authorization (HTTP 401)")
            }
            SessionFailure::Denied { status, .. } => write!(f, "denied access (HTTP {status})"),
            SessionFailure::Gone => write!(f, "no longer has the session"),
        }
    }
}

/// A failure to drive the upstream: what went wrong and where (an endpoint, or the group
/// that had none), with the failed exchange as its source. Its text is for logs.
#[derive(Debug)]
pub struct SessionError {
    failure: SessionFailure,
    at: Where,
    source: Option<ExchangeError>,
}

#[derive(Debug)]
enum Where {
    Group(String),
    Endpoint(Option<SocketAddr>),
}

impl SessionError {
    pub fn failure(&self) -> &SessionFailure {
        &self.failure
    }

    /// `group` has no healthy endpoint.
    pub fn no_endpoint(group: &str) -> SessionError {
        SessionError {
            failure: SessionFailure::NoEndpoint,
            at: Where::Group(group.to_string()),
            source: None,
        }
    }

    /// `failure` at `endpoint` (`None`: a response read from memory).
    pub fn at(endpoint: Option<SocketAddr>, failure: SessionFailure) -> SessionError {
        SessionError {
            failure,
            at: Where::Endpoint(endpoint),
            source: None,
        }
    }

    fn protocol(endpoint: Option<SocketAddr>, what: impl Into<String>) -> SessionError {
        SessionError::at(endpoint, SessionFailure::Protocol(what.into()))
    }
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.at {
            Where::Group(group) => write!(f, "upstream group '{group}' {}", self.failure),
            Where::Endpoint(Some(addr)) => write!(f, "upstream {addr} {}", self.failure),
            Where::Endpoint(None) => write!(f, "the in-memory upstream {}", self.failure),
        }
    }
}

impl std::error::Error for SessionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl SessionFailure {
    /// Whether a legacy session's exchange failed as it would with a server that speaks
    /// only 2026-07-28: a request refused (HTTP 400, 404, 405) or answered against the
    /// 2025 transport. `UpstreamSide::doubt_era` takes it as a hint, never as a verdict.
    pub fn doubts_legacy_era(&self) -> bool {
        matches!(
            self,
            SessionFailure::Refused(400 | 404 | 405) | SessionFailure::Protocol(_)
        )
    }
}

impl From<ExchangeError> for SessionError {
    fn from(e: ExchangeError) -> Self {
        SessionError {
            failure: SessionFailure::Exchange(e.failure()),
            at: Where::Endpoint(e.endpoint()),
            source: Some(e),
        }
    }
}

impl<'a> LegacySession<'a> {
    /// The session's id if it is one of a flow's own, which ends with the flow: none for
    /// a data-layer session, which outlives its flows.
    pub fn own_session(&self) -> Option<&str> {
        self.session_id.as_deref().filter(|_| !self.persistent)
    }

    /// Opens a session: initialize, then notifications/initialized. Returns the
    /// InitializeResult.
    pub async fn open(
        client: &'a Arc<UpstreamClient>,
        endpoint: Endpoint,
        timeouts: &'a Timeouts,
        capabilities: &Value,
        client_info: &Value,
        caller: &Caller,
    ) -> Result<(LegacySession<'a>, Value), SessionError> {
        let mut session = LegacySession {
            client: client.as_ref(),
            endpoint,
            timeouts,
            session_id: None,
            version: Revision::REQUESTED,
            caller: caller.clone(),
            persistent: false,
        };
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": Revision::REQUESTED.to_string(), "capabilities": capabilities, "clientInfo": client_info}});
        let mut response = session.post_initialize(client, init).await?;
        session.session_id = session_id_of(&response);
        let message = read_single(&mut response).await;
        // An SSE answer's stream ends just after its message (SDK servers close it).
        client.release(response, timeouts.response).await;
        let handshake = match session.uncarried_session() {
            None => session.finish_handshake(message).await,
            Some(e) => Err(e),
        };
        match handshake {
            Ok(result) => Ok((session, result)),
            Err(e) => {
                // The upstream may hold a session nobody will use: end it, not leave it
                // to the upstream's own expiry (many SDK servers keep sessions forever).
                if session.session_id.is_some() {
                    client.metrics.upstream_session("opened");
                    session.abandon().await;
                }
                Err(e)
            }
        }
    }

    /// POSTs `initialize`. An answer not in within the response timeout fails the open,
    /// but is still awaited in the background, up to `LATE_INITIALIZE_PATIENCE` more: an
    /// upstream that was only slow opens the session all the same, and nobody else will
    /// ever learn its id, so the session it names is ended.
    async fn post_initialize(
        &self,
        client: &Arc<UpstreamClient>,
        init: Value,
    ) -> Result<Response, SessionError> {
        let patience = self.timeouts.response + LATE_INITIALIZE_PATIENCE;
        let answer = self.post_detached(client.clone(), init, patience);
        let ender = || self.detached(client.clone(), *self.timeouts);
        initialize_in_time(answer, &self.endpoint, self.timeouts, ender).await
    }

    /// The error for a session id the 2025 transport forbids (it must be visible ASCII),
    /// or one longer than a session token or a state carries: no request of the session
    /// could name it.
    fn uncarried_session(&self) -> Option<SessionError> {
        SessionToken::validate_upstream_session(self.session_id.as_deref()?).err()?;
        let text = format!("opened a session whose Mcp-Session-Id the gateway cannot carry (it must be 1 to {MAX_UPSTREAM_SESSION_LEN} visible ASCII characters)");
        Some(SessionError::protocol(Some(self.endpoint.addr), text))
    }

    /// Checks the answer to `initialize` and sends `notifications/initialized`; returns
    /// the InitializeResult.
    async fn finish_handshake(
        &mut self,
        answer: Result<Value, SessionError>,
    ) -> Result<Value, SessionError> {
        let result = answer?.get("result").cloned().ok_or_else(|| {
            SessionError::protocol(Some(self.endpoint.addr), "did not initialize")
        })?;
        // Anything but a date is not a revision: the session keeps the one asked for.
        if let Some(v) = result["protocolVersion"].as_str().and_then(Revision::parse) {
            self.version = v;
        }
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        self.post_and_expect_accepted(&initialized).await?;
        self.client.metrics.upstream_session("opened");
        Ok(result)
    }

    /// A session opened earlier, possibly by another replica, which negotiated `version`;
    /// an empty `session_id` is a server that keeps no sessions.
    pub fn resume(
        client: &'a UpstreamClient,
        endpoint: Endpoint,
        timeouts: &'a Timeouts,
        session_id: String,
        version: Revision,
    ) -> LegacySession<'a> {
        LegacySession {
            client,
            endpoint,
            timeouts,
            session_id: (!session_id.is_empty()).then_some(session_id),
            version,
            caller: Caller::default(),
            persistent: false,
        }
    }

    fn request(&self, method: &str, body_len: usize, last_event_id: Option<&str>) -> RequestHeader {
        // The client's query came as part of its request URI, so the target is one too.
        let target = upstream_target(&self.endpoint.path, self.caller.headers.query());
        // The endpoint's path and the client's query are at most `MAX_TARGET_BYTES` each
        // (configuration, admission), and valid URI parts. No case map: pingora writes
        // standard names title-cased and the rest as given (names are case-insensitive).
        let mut req = RequestHeader::build_no_case(method, target.as_bytes(), Some(16))
            .expect("valid method and target");
        for (name, value) in self.caller.headers.iter() {
            let _ = req.append_header(name.clone(), value.clone());
        }
        let _ = req.insert_header("host", self.endpoint.authority.as_str());
        let accept = if method == "GET" {
            "text/event-stream"
        } else {
            "application/json, text/event-stream"
        };
        let _ = req.insert_header("accept", accept);
        // The bridge reads every body itself: uncoded (no header would allow any coding).
        let _ = req.insert_header("accept-encoding", "identity");
        let _ = req.insert_header("mcp-protocol-version", self.version.header_value());
        if let Some(sid) = &self.session_id {
            let _ = req.insert_header(MCP_SESSION_ID, sid.as_str());
        }
        if let Some(id) = last_event_id {
            let _ = req.insert_header("last-event-id", id);
        }
        for (name, value) in self.caller.trace.headers() {
            let _ = req.insert_header(name, value);
        }
        if method == "POST" {
            let _ = req.insert_header("content-type", "application/json");
            let _ = req.insert_header("content-length", body_len);
        }
        req
    }

    /// POSTs one JSON-RPC message and returns the response with its header read.
    pub async fn post(&self, message: &Value) -> Result<Response, SessionError> {
        let body = Bytes::from(jsonrpc::text_of(message));
        let req = self.request("POST", body.len(), None);
        let response = self
            .client
            .send(&self.endpoint, self.timeouts, req, body)
            .await?;
        let status = response.header().status.as_u16();
        if status >= 400 {
            let refused = self.refused(&response);
            self.discard(response).await;
            return Err(refused);
        }
        Ok(response)
    }

    /// POSTs a `ping` under `id`: a barrier behind what the session queued, a question
    /// whether the session still exists, or a primed stream's first event id.
    pub async fn ping(&self, id: impl Into<Value>) -> Result<Response, SessionError> {
        let id: Value = id.into();
        self.post(&serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "ping"}))
            .await
    }

    /// `post`, as a future that owns what it needs, so that it can outlive this session
    /// value (a held flow keeps it), and waits for the response header up to `patience`
    /// rather than the response timeout.
    pub fn post_detached(
        &self,
        client: Arc<UpstreamClient>,
        message: Value,
        patience: std::time::Duration,
    ) -> impl std::future::Future<Output = Result<Response, SessionError>> + Send + 'static {
        let timeouts = Timeouts {
            response: patience,
            ..*self.timeouts
        };
        // Only the header waits that long: the answer after it comes in the usual time.
        let answer_within = self.timeouts.response;
        let owned = self.detached(client, timeouts);
        async move {
            let mut response = owned.session().post(&message).await?;
            response.answer_within = answer_within;
            Ok(response)
        }
    }

    /// `get`, as a future that owns what it needs, so that it can outlive this session
    /// value (a stream that opens late joins the flow, or is held with it).
    pub fn get_detached(
        &self,
        client: Arc<UpstreamClient>,
        last_event_id: Option<String>,
        connection: Connection,
    ) -> impl std::future::Future<Output = Result<Response, SessionError>> + Send + 'static {
        let owned = self.detached(client, *self.timeouts);
        async move {
            let session = owned.session();
            session.get(last_event_id.as_deref(), connection).await
        }
    }

    /// What this session value is made of, owned, under `timeouts`.
    fn detached(&self, client: Arc<UpstreamClient>, timeouts: Timeouts) -> Detached {
        Detached {
            client,
            timeouts,
            endpoint: self.endpoint.clone(),
            session_id: self.session_id.clone(),
            version: self.version,
            caller: self.caller.clone(),
            persistent: self.persistent,
        }
    }

    /// Reads off a response's unwanted body within the response timeout, keeping its
    /// connection for the next exchange.
    async fn discard(&self, response: Response) {
        self.client.discard(response, self.timeouts.response).await;
    }

    /// POSTs a notification or a response, which the upstream must accept with 202.
    pub async fn post_and_expect_accepted(&self, message: &Value) -> Result<(), SessionError> {
        let response = self.post(message).await?;
        let status = response.header().status.as_u16();
        self.discard(response).await;
        match status {
            200..=299 => Ok(()),
            other => Err(SessionError::protocol(
                Some(self.endpoint.addr),
                format!("answered a notification or response with HTTP {other}, not 202"),
            )),
        }
    }

    /// GET on the session: the standalone stream, or a resumption after `last_event_id`
    /// (counted in `upstream_resumptions_total`), on `connection` (`New` when the GET
    /// replaces a stream the session had).
    pub async fn get(
        &self,
        last_event_id: Option<&str>,
        connection: Connection,
    ) -> Result<Response, SessionError> {
        let got = self.get_stream(last_event_id, connection).await;
        if last_event_id.is_some() {
            let outcome = if got.is_ok() { "ok" } else { "failed" };
            self.client
                .metrics
                .upstream_resumptions
                .with_label_values(&[outcome])
                .inc();
        }
        got
    }

    /// A GET on the session, not counted as a resumption (probes).
    pub(crate) async fn get_stream(
        &self,
        last_event_id: Option<&str>,
        connection: Connection,
    ) -> Result<Response, SessionError> {
        let req = self.request("GET", 0, last_event_id);
        let response = self
            .client
            .send_on(connection, &self.endpoint, self.timeouts, req, Bytes::new())
            .await?;
        let status = response.header().status.as_u16();
        if status != 200 {
            let refused = self.refused(&response);
            self.discard(response).await;
            return Err(refused);
        }
        if !response.is_sse() {
            self.discard(response).await;
            return Err(SessionError::protocol(
                Some(self.endpoint.addr),
                "answered a GET of its session without an SSE stream",
            ));
        }
        Ok(response)
    }

    /// Why the upstream refused a request: a 404 in an established session means the
    /// session is gone; a 401 or 403 denies the caller, with the upstream's challenge.
    /// A 401 without a challenge is no authentication challenge (RFC 9110 §15.5.2 requires
    /// one): in an established session it is how rmcp 0.16 says it does not know the
    /// session (`Unauthorized: Session not found`), so it too means the session is gone.
    fn refused(&self, response: &Response) -> SessionError {
        let status = response.header().status.as_u16();
        // Every challenge, as one list (RFC 9110 §11.6.1 lets one field carry several);
        // a value that is not ASCII (an error_description in UTF-8) is kept, not lost.
        let challenges: Vec<String> = response
            .header()
            .headers
            .get_all(http::header::WWW_AUTHENTICATE)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect();
        let challenge = (!challenges.is_empty()).then(|| challenges.join(", "));
        let in_session = self.session_id.is_some();
        let failure = match status {
            404 if in_session => SessionFailure::Gone,
            401 if in_session && challenge.is_none() => SessionFailure::Gone,
            401 | 403 => SessionFailure::Denied { status, challenge },
            _ => SessionFailure::Refused(status),
        };
        SessionError::at(Some(self.endpoint.addr), failure)
    }

    /// Ends the upstream session: `Ok(true)` once it has ended (one the upstream no longer
    /// knows has), `Ok(false)` from a server that does not let clients end sessions (405,
    /// as the transport allows: it ends them itself); a denied or otherwise refused
    /// DELETE, or one not answered, is the error.
    pub async fn end(&self) -> Result<bool, SessionError> {
        match self.delete_counting("deleted").await {
            Ok(()) => Ok(true),
            Err(e) if *e.failure() == SessionFailure::Gone => Ok(true),
            Err(e) if *e.failure() == SessionFailure::Refused(405) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Ends a session nobody will use, on the way to reporting a failure: within
    /// `ABANDON_LIMIT`, so that an upstream that stopped answering does not hold the
    /// failure's report for another response timeout. A DELETE that failed goes to the
    /// client's `DeleteLater` (the gateway's reaper), to be sent again.
    pub async fn abandon(&self) {
        let ended = within(ABANDON_LIMIT, Some(self.endpoint.addr), self.end()).await;
        if let Err(e) = ended {
            match &self.client.delete_later {
                Some(later) => later.delete_later(self, &e),
                None => {
                    let error = crate::outcome::Report(&e);
                    tracing::info!(%error, "the upstream did not delete an unused session");
                }
            }
        }
    }

    /// POSTs a call's cancellation (`notifications/cancelled`), within `ABANDON_LIMIT`;
    /// one the upstream takes is counted under `why` (`gave_up`, `abandoned`).
    pub async fn cancel(
        &self,
        cancellation: &Cancellation,
        why: &'static str,
    ) -> Result<(), SessionError> {
        let notification = cancellation.to_json();
        let posting = self.post_and_expect_accepted(&notification);
        let posted = within(ABANDON_LIMIT, Some(self.endpoint.addr), posting).await;
        if posted.is_ok() {
            self.client.metrics.upstream_cancelled(why);
        }
        posted
    }

    /// Whether the upstream no longer has the session: it refuses a `ping` in it as an
    /// unknown session. A session that answers, or fails any other way, is not gone.
    pub async fn is_gone(&self) -> bool {
        match self.ping("mrtr-gateway-reaper").await {
            Err(e) => *e.failure() == SessionFailure::Gone,
            Ok(mut response) => {
                let _ = read_single(&mut response).await;
                self.discard(response).await;
                false
            }
        }
    }

    /// Ends the session of a flow its client abandoned (best effort); `Err` when it may
    /// still be there.
    pub async fn reap(&self) -> Result<(), SessionError> {
        self.delete_counting("reaped").await
    }

    async fn delete_counting(&self, event: &'static str) -> Result<(), SessionError> {
        if self.session_id.is_none() {
            return Ok(());
        }
        let req = self.request("DELETE", 0, None);
        let response = self
            .client
            .send(&self.endpoint, self.timeouts, req, Bytes::new())
            .await?;
        let status = response.header().status;
        let refused = (!status.is_success()).then(|| self.refused(&response));
        self.discard(response).await;
        // A refused DELETE (401 without credentials, 404 for a session already gone)
        // ended nothing.
        match refused {
            None => {
                self.client.metrics.upstream_session(event);
                Ok(())
            }
            Some(refused) => {
                tracing::info!(%status, event, "the upstream did not delete a session");
                Err(refused)
            }
        }
    }
}

/// `exchange` with `endpoint` (`None`: a response read from memory), bounded by `limit`:
/// one that takes longer fails as late.
pub async fn within<T>(
    limit: std::time::Duration,
    endpoint: Option<SocketAddr>,
    exchange: impl std::future::Future<Output = Result<T, SessionError>>,
) -> Result<T, SessionError> {
    match tokio::time::timeout(limit, exchange).await {
        Ok(done) => done,
        Err(_) => Err(ExchangeError::late(endpoint).into()),
    }
}

/// How long an `initialize` may take before it fails as late: the connection's own time
/// (a connect that fails within it goes to another endpoint), then the response's.
fn in_time(timeouts: &Timeouts) -> std::time::Duration {
    timeouts.connect + timeouts.response
}

/// Awaits `answer`, the exchange of an `initialize` with `endpoint`, while it is in time
/// (`in_time`). Past that the request fails as late, and `answer` goes on in the
/// background (`end_late_session`), with the way to end its session that `ender` gives.
async fn initialize_in_time<E: From<ExchangeError> + Send + 'static>(
    answer: impl std::future::Future<Output = Result<Response, E>> + Send + 'static,
    endpoint: &Endpoint,
    timeouts: &Timeouts,
    ender: impl FnOnce() -> Detached,
) -> Result<Response, E> {
    let mut answer = Box::pin(answer);
    if let Ok(answered) = tokio::time::timeout(in_time(timeouts), &mut answer).await {
        return answered;
    }
    end_late_session(answer, ender());
    Err(ExchangeError::late(Some(endpoint.addr)).into())
}

/// Ends, in the background, the session that a late answer to `initialize` opens:
/// `answer` is the exchange still awaiting the header (for `LATE_INITIALIZE_PATIENCE`
/// beyond the response timeout, which has passed), `ender` the session's way to the
/// upstream (endpoint, timeouts, the caller's credentials), its id still unknown.
fn end_late_session<E: Send + 'static>(
    answer: impl std::future::Future<Output = Result<Response, E>> + Send + 'static,
    ender: Detached,
) {
    // Each holds a connection: past the bound, one is given up as the timeout left it.
    let Ok(permit) = ender.client.late_answers.clone().try_acquire_owned() else {
        tracing::info!("too many late answers to initialize awaited; one more is given up, and the session it may open is left to the upstream");
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let Ok(response) = answer.await else {
            return;
        };
        let session_id = session_id_of(&response);
        ender.client.finish(response).await;
        if let Some(id) = session_id {
            let mut late = ender.session();
            late.session_id = Some(id);
            ender.client.metrics.upstream_session("opened");
            late.abandon().await;
        }
    });
}

/// Sends a legacy client's `initialize` as pass-through does (`request` and `body` as
/// they go upstream), within the response timeout; a later answer fails it as late, and
/// the session it opens, which the client will never learn of, is ended (as
/// `LegacySession::open` does for its own), with the credentials `caller` gives: the
/// client's.
pub async fn send_initialize(
    client: &Arc<UpstreamClient>,
    endpoint: &Endpoint,
    timeouts: &Timeouts,
    (request, body): (RequestHeader, Bytes),
    version: Revision,
    caller: impl FnOnce() -> Caller,
) -> Result<Response, ExchangeError> {
    let patient = Timeouts {
        response: timeouts.response + LATE_INITIALIZE_PATIENCE,
        ..*timeouts
    };
    let (sending, to, answer_within) = (client.clone(), endpoint.clone(), timeouts.response);
    let answer = async move {
        let sent = sending.send_on(Connection::Pooled, &to, &patient, request, body);
        // Only the header waits that long: the answer after it comes in the usual time.
        sent.await.map(|mut response| {
            response.answer_within = answer_within;
            response
        })
    };
    let ender = || Detached {
        client: client.clone(),
        timeouts: *timeouts,
        endpoint: endpoint.clone(),
        session_id: None,
        version,
        caller: caller(),
        persistent: false,
    };
    initialize_in_time(answer, endpoint, timeouts, ender).await
}

/// The session id a response names (`Mcp-Session-Id`), if readable; an empty one names
/// none.
fn session_id_of(response: &Response) -> Option<String> {
    let id = response.header().headers.get(MCP_SESSION_ID)?;
    let id = id.to_str().ok().filter(|id| !id.is_empty())?;
    Some(id.to_string())
}

/// Reads the single JSON-RPC message of a response: a JSON body, or the first message
/// event of an SSE body; within the exchange's answer time (`Response::answer_within`).
pub async fn read_single(response: &mut Response) -> Result<Value, SessionError> {
    let at = response.endpoint();
    within(response.answer_within(), at, read_single_now(response)).await
}

async fn read_single_now(response: &mut Response) -> Result<Value, SessionError> {
    let at = response.endpoint();
    let invalid =
        |e: serde_json::Error| SessionError::protocol(at, format!("sent invalid JSON: {e}"));
    if !response.is_sse() {
        let body = response.read_all(response.max_message()).await?;
        if body.is_empty() {
            let status = response.header().status.as_u16();
            let what = format!("answered with HTTP {status} and no JSON-RPC message");
            return Err(SessionError::protocol(at, what));
        }
        return jsonrpc::from_slice_lenient(&body).map_err(invalid);
    }
    let mut parser = sse::Parser::new(response.max_message());
    let mut events = Vec::new();
    while let Some(chunk) = response.next_chunk().await? {
        parser
            .push(&chunk, &mut events)
            .map_err(|e| SessionError::protocol(at, format!("sent a malformed stream: {e}")))?;
        // The answer is the first response on the stream: a notification (a log line, a
        // progress report) or a server request before it is not, and neither is an event
        // of another type than `message` (a framework's keep-alive).
        for event in events
            .drain(..)
            .filter(|e| e.is_message() && !e.data.is_empty())
        {
            let message: Value =
                jsonrpc::from_slice_lenient(event.data.as_bytes()).map_err(invalid)?;
            if message.get("method").is_none() {
                return Ok(message);
            }
        }
    }
    Err(SessionError::protocol(
        at,
        "ended its stream without a message",
    ))
}

/// What a 2026-07-28 `server/discover` sent for a caller showed of the upstream's era.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// A DiscoverResult naming that version.
    Modern,
    /// An answer that is not one (a legacy server's JSON-RPC error, a 404 page).
    NotModern,
    /// The caller was denied (401, 403) or throttled (429): that is the caller's, and
    /// says nothing of the era.
    Denied,
    /// No answer that says anything: not sent, cut, no answer in time, a server error.
    Unanswered,
}

/// Sends a 2026-07-28 `server/discover` for `caller` and tells what its answer shows.
pub async fn answers_modern_discover(
    client: &UpstreamClient,
    endpoint: &Endpoint,
    timeouts: &Timeouts,
    caller: &Caller,
) -> Discovery {
    let version = crate::mrtr::modern::MODERN_VERSION;
    let message = json!({"jsonrpc": "2.0", "id": 0, "method": "server/discover", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": version, "io.modelcontextprotocol/clientCapabilities": {}}}});
    let body = Bytes::from(message.to_string());
    let target = upstream_target(&endpoint.path, caller.headers.query());
    let Ok(mut req) = RequestHeader::build("POST", target.as_bytes(), Some(16)) else {
        return Discovery::Unanswered;
    };
    for (name, value) in caller.headers.iter() {
        let _ = req.append_header(name.clone(), value.clone());
    }
    for (name, value) in [
        ("host", endpoint.authority.as_str()),
        ("accept", "application/json, text/event-stream"),
        ("accept-encoding", "identity"),
        ("content-type", "application/json"),
        ("mcp-protocol-version", version),
        ("mcp-method", "server/discover"),
    ] {
        let _ = req.insert_header(name, value);
    }
    let _ = req.insert_header("content-length", body.len());
    let Ok(mut response) = client.send(endpoint, timeouts, req, body).await else {
        return Discovery::Unanswered;
    };
    let status = response.header().status.as_u16();
    let said_nothing = match status {
        401 | 403 | 429 => Some(Discovery::Denied),
        408 | 500..=599 => Some(Discovery::Unanswered),
        _ => None,
    };
    if let Some(said_nothing) = said_nothing {
        client.discard(response, timeouts.response).await;
        return said_nothing;
    }
    let answer = read_single(&mut response).await;
    client.finish(response).await;
    match answer {
        Ok(m) => {
            let versions = m["result"]["supportedVersions"].as_array();
            match versions.is_some_and(|v| v.iter().any(|x| x == version)) {
                true => Discovery::Modern,
                false => Discovery::NotModern,
            }
        }
        Err(e) if matches!(e.failure(), SessionFailure::Exchange(_)) => Discovery::Unanswered,
        Err(_) => Discovery::NotModern,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::Report;
    use std::time::Duration;

    /// `read_single` of an upstream's response given as `wire`.
    async fn single(wire: &str) -> Result<Value, SessionError> {
        use tokio::io::AsyncWriteExt;
        let (client, mut upstream) = tokio::io::duplex(wire.len() + 4096);
        upstream
            .write_all(wire.as_bytes())
            .await
            .expect("in memory");
        upstream.shutdown().await.expect("in memory");
        let mut response = crate::upstream::exchange::read_response_from(Box::new(client))
            .await
            .expect("a response header");
        read_single(&mut response).await
    }

    #[tokio::test]
    async fn the_single_answer_is_the_first_response_of_its_stream() {
        let stream = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n\
            data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\"}\n\n\
            event: ping\ndata: 02:40\n\n\
            data: {\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"ping\"}\n\n\
            data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n";
        let answer = single(stream).await.expect("the response");
        assert_eq!(answer["id"], 1);
        let empty = single("HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n").await;
        let text = empty.expect_err("no message").to_string();
        assert!(
            text.contains("answered with HTTP 202 and no JSON-RPC message"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_failure_names_its_endpoint_and_cause_in_logs_but_not_to_clients() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("loopback");
        let addr = closed.local_addr().expect("bound");
        drop(closed);
        let endpoint = Endpoint {
            addr,
            authority: addr.to_string(),
            path: "/mcp".into(),
            tls: None,
            peer: false,
        };
        let timeouts = Timeouts {
            connect: Duration::from_secs(2),
            response: Duration::from_secs(2),
            stream_idle: None,
        };
        let client = Arc::new(UpstreamClient::default());
        let nobody = Caller::default();
        let opened = LegacySession::open(
            &client,
            endpoint,
            &timeouts,
            &json!({}),
            &json!({}),
            &nobody,
        )
        .await;
        let e = opened.err().expect("nothing listens there");
        assert_eq!(
            *e.failure(),
            SessionFailure::Exchange(ExchangeFailure::Connect)
        );
        let logged = Report(&e).to_string();
        assert!(
            logged.starts_with(&format!("upstream {addr} is unreachable")),
            "{logged}"
        );
        let exchange = std::error::Error::source(&e).expect("the failed exchange");
        assert!(exchange.source().is_some(), "pingora's error is the cause");
        assert!(
            logged.len() > e.to_string().len(),
            "the cause is in the report"
        );
        let told = e.failure().to_string();
        assert!(!told.contains(&addr.port().to_string()), "{told}");
        let none = SessionError::no_endpoint("tools");
        assert_eq!(
            none.to_string(),
            "upstream group 'tools' has no healthy endpoint"
        );
    }
}
