//! Legacy pass-through: a 2024-11-05 … 2025-11-25 client talks to its upstream through
//! the gateway unchanged, except that the `Mcp-Session-Id` it sees is a sealed token
//! naming the upstream endpoint and session. Any replica opens the token and routes the
//! request there; a token that does not open is answered 404 and reaches no upstream.
//! A legacy client's request ids go up wrapped per upstream session and come back as
//! they were (`protocol::request_ids`), so a store shared by sessions keeps their streams
//! apart; the SSE event ids it gets are sealed to its upstream session, and it resumes
//! only from those (`protocol::event_ids`).

use super::bridge::probe::session_replay;
use super::learnt::SessionReplay;
use super::Gateway;
use super::{cors, precise_sleep, respond};
use crate::metrics::{request_label, InUse};
use crate::outcome::{Class, Outcome, Refusal, Report};
use crate::protocol::event_ids::{self, EventIds, Rewrite, Stream};
use crate::protocol::headers::{self, LAST_EVENT_ID, MCP_SESSION_ID};
use crate::protocol::jsonrpc::{code, Body};
use crate::protocol::request_ids::{self, IdTag, Unwrap};
use crate::protocol::revision::Revision;
use crate::protocol::session_token::{SessionToken, MAX_UPSTREAM_SESSION_LEN};
use crate::protocol::sse::{self, BoundaryTracker};
use crate::protocol::target::upstream_target;
use crate::protocol::trace::TraceContext;
use crate::protocol::{forwarded, oauth};
use crate::upstream::exchange::{Connection, ExchangeError, ExchangeFailure, Response};
use crate::upstream::legacy_session::{send_initialize, Caller, LegacySession};
use crate::upstream::{Endpoint, UpstreamGroup};
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::ServerSession;
use serde_json::Value;
use std::time::Duration;

/// Where a request goes: the endpoint and, inside a session, the upstream's session id.
struct Route {
    endpoint: Endpoint,
    upstream_session: Option<String>,
    /// The client's token, echoed back unchanged while the upstream session is the same.
    client_token: Option<String>,
}

/// Whose request pass-through serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Client {
    /// A 2024-11-05 … 2025-11-25 client: its request ids go up wrapped and its event ids
    /// come back sealed.
    Legacy,
    /// A 2026-07-28 client relayed to an upstream that speaks that revision, which keeps
    /// no streams to resume: its messages pass as they are.
    ModernRelayed,
}

impl Client {
    /// The `era` label of its requests in the metrics.
    fn era(self) -> &'static str {
        match self {
            Client::Legacy => "legacy",
            Client::ModernRelayed => "modern_relayed",
        }
    }
}

/// Serves one request of `client` unchanged but for its session, ids and event ids;
/// `body` is the POST body already read and classified.
pub async fn serve(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    body: Bytes,
    parsed: Option<Body>,
    client: Client,
    principal: &[u8; 32],
) {
    let started = std::time::Instant::now();
    let method = request_label(
        &session.req_header().method,
        parsed.as_ref().and_then(Body::method),
        parsed.is_some(),
    );
    let legacy = client == Client::Legacy;
    let outcome = serve_inner(gw, session, group, body, parsed.as_ref(), principal, legacy);
    gw.record(client.era(), method, &outcome.await, started);
}

async fn serve_inner(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    body: Bytes,
    parsed: Option<&Body>,
    binding: &[u8; 32],
    legacy: bool,
) -> Outcome {
    let id = parsed.and_then(Body::id).cloned();
    let mut route = match route(gw, session, group, binding) {
        Ok(route) => route,
        Err(refusal) => return refuse(session, legacy, id.as_ref(), refusal).await,
    };
    let resumption = match resumption(gw, session, group, &route, binding, legacy).await {
        Ok(resumption) => resumption,
        Err(refusal) => return refuse(session, legacy, id.as_ref(), refusal).await,
    };
    let method = &session.req_header().method;
    let stream = match (&resumption, method == http::Method::GET) {
        (Some(resumed), _) => resumed.stream,
        (None, true) => Stream::Session,
        (None, false) => Stream::Call,
    };
    let wraps_ids = legacy && (method == http::Method::POST || method == http::Method::GET);
    // The upstream session's tag (a random one before the upstream gave a session), or
    // the one a resumed call's ids went up under, which its event ids carry.
    let sealed_tag = resumption.as_ref().and_then(|r| r.tag.clone());
    let own_tag = sealed_tag.is_some() || route.upstream_session.is_none();
    let id_tag = wraps_ids.then(|| match (sealed_tag, &route.upstream_session) {
        (Some(tag), _) => tag,
        (None, Some(upstream)) => IdTag::of_session(upstream),
        (None, None) => IdTag::random(),
    });
    let body = match wrap_ids(body, id_tag.as_ref()) {
        Ok(body) => body,
        Err(e) => {
            let refusal = Refusal::new(Class::BadRequest, code::INVALID_REQUEST, e.to_string());
            return refuse(session, legacy, id.as_ref(), refusal).await;
        }
    };
    // An `initialize` whose answer cannot be relayed has its session ended, naming the
    // revision asked for.
    let initialize = parsed
        .is_some_and(Body::is_initialize)
        .then(|| body.clone());
    // A client's GET opens its session's stream or resumes one, often right after it
    // left the previous one (a reconnection).
    let connection = if method == http::Method::GET {
        Connection::New
    } else {
        Connection::Pooled
    };
    let mut tried = Vec::new();
    let mut response = loop {
        let mut request = upstream_request(gw, session, &route, &body);
        if wraps_ids {
            // A content-coded body could not be unwrapped on its way back. Asking for
            // `identity` by name: a request without `Accept-Encoding` accepts any coding.
            let identity = http::HeaderValue::from_static("identity");
            let _ = request.insert_header(http::header::ACCEPT_ENCODING, identity);
        }
        if legacy {
            request.remove_header(LAST_EVENT_ID);
        }
        if let Some(resumed) = &resumption {
            let _ = request.insert_header(LAST_EVENT_ID, resumed.upstream_id.clone());
        }
        let client = &gw.upstreams.client;
        let (endpoint, timeouts) = (&route.endpoint, &group.timeouts);
        let sent = match &initialize {
            // A session a late answer opens is ended: the client never learns of it. An
            // `initialize` sent within a session is not: the session is the client's.
            Some(init) if route.upstream_session.is_none() => {
                let version = requested_revision(init);
                let caller = || Caller {
                    headers: gw.admission.end_to_end(session, group),
                    ..Caller::default()
                };
                let sending = (request, body.clone());
                // Once per session: on the heap, so that every request's future stays small.
                let init = send_initialize(client, endpoint, timeouts, sending, version, caller);
                Box::pin(init).await
            }
            _ => {
                let sending = client.send_on(connection, endpoint, timeouts, request, body.clone());
                sending.await
            }
        };
        let e = match sent {
            Ok(response) => break response,
            Err(e) => e,
        };
        tried.push(route.endpoint.addr);
        // A request outside any session that could not connect ran nowhere: another
        // healthy endpoint takes it (before a health check has marked the first down).
        let elsewhere = (route.upstream_session.is_none()
            && e.failure() == ExchangeFailure::Connect)
            .then(|| group.pick_other(&tried))
            .flatten();
        match elsewhere {
            Some(next) => route.endpoint = next,
            None => {
                tracing::warn!(group = %group.name, error = %Report(&e), "upstream exchange failed");
                return refuse(session, legacy, id.as_ref(), upstream_refusal(group, &e)).await;
            }
        }
    };
    let coded = response.is_encoded();
    if wraps_ids && coded && response.is_jsonrpc() {
        let opened = session_opened(&route, response.header());
        gw.upstreams.client.finish(response).await;
        if let Some(upstream_session) = opened {
            let asked = initialize.as_deref();
            end_unrelayed_session(gw, session, group, &route, upstream_session, asked).await;
        }
        return refuse(session, legacy, id.as_ref(), coded_against_identity(group)).await;
    }
    if let Some(sid) = uncarried_session(&route, response.header()) {
        gw.upstreams.client.finish(response).await;
        if let Some(sid) = sid {
            end_unrelayed_session(gw, session, group, &route, sid, initialize.as_deref()).await;
        }
        return refuse(
            session,
            legacy,
            id.as_ref(),
            uncarried_session_refusal(group),
        )
        .await;
    }
    // A session-less `initialize` whose client left while it was sent has opened a
    // session nobody will learn of.
    let opened = initialize
        .as_deref()
        .and(session_opened(&route, response.header()));
    if let Some(upstream_session) = opened {
        if respond::client_left(session).await {
            gw.upstreams.client.finish(response).await;
            let asked = initialize.as_deref();
            end_unrelayed_session(gw, session, group, &route, upstream_session, asked).await;
            return Outcome::ClientGone;
        }
    }
    count_session_event(gw, session, &route, response.header());
    let header = client_response_header(gw, session, group, &route, binding, response.header());
    let rewrite = id_tag.filter(|_| !coded).map(|tag| {
        let sealed_tag = own_tag.then(|| tag.clone());
        let rewrite = (stream, sealed_tag);
        BodyRewrite::new(gw, &route, binding, &response, rewrite, tag)
    });
    let status = response.header().status.as_u16();
    let outcome = relay(
        gw,
        session,
        header,
        &mut response,
        rewrite,
        id.as_ref(),
        None,
    )
    .await;
    gw.upstreams.client.finish(response).await;
    counted_as(status, outcome)
}

/// What a relayed answer counts as: one the upstream sent with an error status counts as
/// that error (its 401 as `unauthorized`), though relayed as it came.
fn counted_as(status: u16, relayed: Outcome) -> Outcome {
    let class = match status {
        401 => Class::Unauthorized,
        403 => Class::Forbidden,
        404 => Class::SessionEnded,
        413 => Class::TooLarge,
        400..=499 => Class::BadRequest,
        500..=599 => Class::UpstreamError,
        _ => return relayed,
    };
    match relayed {
        Outcome::Ok => {
            let text = format!("the upstream answered HTTP {status}");
            Outcome::Refused(Refusal::new(class, code::INTERNAL_ERROR, text))
        }
        other => other,
    }
}

/// Where a legacy client's GET resumes, as its `Last-Event-ID` says.
struct Resumed {
    stream: Stream,
    /// The tag the call's request ids went up under, where it was not its session's.
    tag: Option<IdTag>,
    /// The upstream's own event id.
    upstream_id: http::HeaderValue,
}

/// Where a legacy client's GET resumes: the stream and the upstream's own event id in
/// its `Last-Event-ID`, which must be one the gateway sealed for the request's upstream
/// session. `None` without one, for a session GET stream whose upstream store may be
/// shared by sessions (it is then reopened fresh), for other methods (where the header
/// means nothing and is not forwarded), and when the client is not `legacy` (its header
/// goes up as it is).
async fn resumption(
    gw: &Gateway,
    session: &ServerSession,
    group: &UpstreamGroup,
    route: &Route,
    principal: &[u8; 32],
    legacy: bool,
) -> Result<Option<Resumed>, Refusal> {
    let resumes = legacy && session.req_header().method == http::Method::GET;
    let Some(client_position) = session.get_header(LAST_EVENT_ID).filter(|_| resumes) else {
        return Ok(None);
    };
    let binding = event_ids::binding(principal, route.upstream_session.as_deref());
    let opened = match client_position.to_str() {
        Ok(text) => event_ids::open(&gw.sealing.keys.load(), &binding, text)
            .map_err(|e| e.reason())
            .and_then(|p| match http::HeaderValue::from_bytes(&p.upstream_id) {
                Ok(upstream_id) => Ok(Resumed {
                    stream: p.stream,
                    tag: p.tag,
                    upstream_id,
                }),
                Err(_) => Err("bad_payload"),
            }),
        Err(_) => Err("malformed"),
    };
    let resumed = opened.map_err(|reason| {
        let rejections = &gw.runtime.metrics.event_id_rejections;
        rejections.with_label_values(&[reason]).inc();
        tracing::info!(group = %group.name, reason, "Last-Event-ID refused");
        let text = "Last-Event-ID is not an event id this gateway sent in this session; resume from one it sent, or reconnect without one";
        Refusal::new(Class::BadRequest, code::INVALID_REQUEST, text)
    })?;
    if resumed.stream == Stream::Session {
        let caller = Caller {
            trace: TraceContext::default(),
            headers: gw.admission.end_to_end(session, group),
        };
        // Rare, and its future large: on the heap, so that every request's stays small.
        let replay = session_replay(&gw.upstreams, group, &route.endpoint, &caller, None);
        let replay = Box::pin(replay).await;
        if replay != SessionReplay::Scoped {
            tracing::debug!(group = %group.name, ?replay, "session GET stream reopened fresh");
            return Ok(None);
        }
    }
    Ok(Some(resumed))
}

/// A legacy client's response as it streams: the upstream's SSE event ids sealed to the
/// upstream session, then the client's request ids given back.
pub(crate) struct BodyRewrite {
    event_ids: Option<EventIds>,
    request_ids: Unwrap,
}

impl BodyRewrite {
    /// The rewrite of `response` to `principal`, which is (or resumes) `stream`, its event
    /// ids carrying `sealed_tag` where `id_tag` is not the session's.
    fn new(
        gw: &Gateway,
        route: &Route,
        principal: &[u8; 32],
        response: &Response,
        (stream, sealed_tag): (Stream, Option<IdTag>),
        id_tag: IdTag,
    ) -> BodyRewrite {
        // Only SSE carries event ids: a JSON response takes no key ring and no binding.
        let event_ids = response.is_sse().then(|| {
            let opened = response.header().headers.get(MCP_SESSION_ID);
            let upstream_session = opened
                .and_then(|v| v.to_str().ok())
                .or(route.upstream_session.as_deref());
            EventIds::new(Rewrite {
                ring: gw.sealing.keys.load(),
                binding: event_ids::binding(principal, upstream_session),
                stream,
                tag: sealed_tag,
            })
        });
        BodyRewrite {
            event_ids,
            request_ids: Unwrap::new(id_tag),
        }
    }

    fn push(&mut self, chunk: Bytes) -> Bytes {
        let chunk = match self.event_ids.as_mut() {
            Some(event_ids) => event_ids.push(chunk),
            None => chunk,
        };
        self.request_ids.push(chunk)
    }

    /// Whether a response to the client's request went by: a client that leaves after
    /// it left with its answer.
    fn answered(&self) -> bool {
        self.request_ids.unwrapped() > 0
    }

    fn finish(&mut self) -> Bytes {
        let rest = self
            .event_ids
            .as_mut()
            .map(EventIds::finish)
            .unwrap_or_default();
        concat(self.request_ids.push(rest), self.request_ids.finish())
    }
}

fn concat(head: Bytes, tail: Bytes) -> Bytes {
    match (head.is_empty(), tail.is_empty()) {
        (_, true) => head,
        (true, _) => tail,
        _ => [head, tail].concat().into(),
    }
}

/// The POST body with its request ids wrapped under `tag`, if there is one; the same body
/// when it has none.
fn wrap_ids(body: Bytes, tag: Option<&IdTag>) -> Result<Bytes, request_ids::WrapError> {
    let Some(tag) = tag.filter(|_| !body.is_empty()) else {
        return Ok(body);
    };
    Ok(request_ids::wrap_body(&body, tag)?.map_or(body, Bytes::from))
}

/// Counts a request in an existing upstream session, and a session the client deleted.
/// (A session the upstream opens is counted where its token is sealed.)
fn count_session_event(
    gw: &Gateway,
    session: &ServerSession,
    route: &Route,
    upstream: &ResponseHeader,
) {
    if route.upstream_session.is_none() {
        return;
    }
    let deleted =
        session.req_header().method == http::Method::DELETE && upstream.status.is_success();
    gw.runtime
        .metrics
        .upstream_session(if deleted { "deleted" } else { "reused" });
}

fn route(
    gw: &Gateway,
    session: &ServerSession,
    group: &UpstreamGroup,
    binding: &[u8],
) -> Result<Route, Refusal> {
    let Some(token) = session.get_header(MCP_SESSION_ID) else {
        let none = "no healthy upstream endpoint is available";
        let endpoint = group
            .pick()
            .ok_or_else(|| Refusal::new(Class::NoUpstream, code::INVALID_REQUEST, none))?;
        return Ok(Route {
            endpoint,
            upstream_session: None,
            client_token: None,
        });
    };
    let reject = |reason: &str| {
        gw.runtime
            .metrics
            .session_rejections
            .with_label_values(&[reason])
            .inc();
        tracing::info!(group = %group.name, reason, "session token refused");
        let text = "Session not found: the Mcp-Session-Id is unknown, expired or not valid here; start a new session with initialize";
        Refusal::new(Class::SessionRejected, code::INVALID_REQUEST, text)
    };
    let text = token.to_str().map_err(|_| reject("malformed"))?;
    let opened = SessionToken::open(&gw.sealing.keys.load(), binding, text)
        .map_err(|e| reject(e.reason()))?;
    if opened.group != group.name {
        return Err(reject("other_group"));
    }
    let endpoint = group
        .endpoint(opened.endpoint)
        .ok_or_else(|| reject("unknown_endpoint"))?;
    Ok(Route {
        endpoint,
        upstream_session: Some(opened.upstream_session),
        client_token: Some(text.to_string()),
    })
}

/// Answers with `refusal`, as a JSON-RPC error in reply to `id`.
/// Answers the client with `refusal`: under its class's status, except that a 2026-07-28
/// client (not `legacy`) gets a failure on the server's side as 200 carrying the error, as
/// a bridged one does (`bridge::reply`; README, "Errors 2026-07-28 clients see").
async fn refuse(
    session: &mut ServerSession,
    legacy: bool,
    id: Option<&Value>,
    refusal: Refusal,
) -> Outcome {
    let status = match refusal.class.status() {
        server_side if server_side >= 500 && !legacy => 200,
        status => status,
    };
    respond::error(session, status, id, refusal.code, &refusal.message).await;
    Outcome::Refused(refusal)
}

/// The request sent upstream: the client's, with the upstream path, host and session,
/// and forwarding headers naming the client.
fn upstream_request(
    gw: &Gateway,
    session: &ServerSession,
    route: &Route,
    body: &Bytes,
) -> RequestHeader {
    let client = session.req_header();
    let method = client.method.as_str();
    // The client's query came as part of its request URI, so the target is one too.
    let target = upstream_target(&route.endpoint.path, client.uri.query());
    // The method is one the gateway serves; the target, an endpoint's and a client's
    // query of at most `MAX_TARGET_BYTES` each, both valid URI parts.
    let mut req = RequestHeader::build_no_case(method, target.as_bytes(), Some(16))
        .expect("method and target are valid");
    let hop = gw.admission.hop(session);
    let trusted = hop.is_some_and(|hop| hop.trusted);
    for (name, value) in headers::forwardable_request(&client.headers) {
        if forwarded::passes(name.as_str(), trusted) {
            let _ = req.append_header(name, value);
        }
    }
    if let Some(hop) = hop {
        for (name, value) in forwarded::forwarding_headers(&client.headers, &hop) {
            let _ = req.insert_header(name, value);
        }
    }
    let _ = req.insert_header("host", route.endpoint.authority.as_str());
    if let Some(upstream) = &route.upstream_session {
        let _ = req.insert_header(MCP_SESSION_ID, upstream.as_str());
    }
    if method == "POST" || !body.is_empty() {
        let _ = req.insert_header("content-length", body.len());
    }
    req
}

/// The response header the client gets: the upstream's, with its session id sealed and
/// a challenge's `resource_metadata` naming the group's metadata at the gateway.
fn client_response_header(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    route: &Route,
    binding: &[u8],
    upstream: &ResponseHeader,
) -> ResponseHeader {
    let mut out = relayed_header(session, upstream);
    if matches!(upstream.status.as_u16(), 401 | 403) {
        let public = gw.admission.public_resource(session, group);
        let challenges: Vec<String> = upstream
            .headers
            .get_all(http::header::WWW_AUTHENTICATE)
            .iter()
            // A value that is not ASCII (an error_description in UTF-8) is kept.
            .map(|v| String::from_utf8_lossy(v.as_bytes()))
            .map(|c| oauth::rewrite_challenge(&c, &public))
            .collect();
        out.remove_header(&http::header::WWW_AUTHENTICATE);
        for challenge in challenges {
            let _ = out.append_header(http::header::WWW_AUTHENTICATE, challenge);
        }
    }
    if let Some(sid) = upstream.headers.get(MCP_SESSION_ID) {
        let token = valid_session_id(sid)
            .and_then(|sid| client_session_token(gw, group, route, binding, sid));
        match token {
            Some(token) => {
                let _ = out.insert_header(MCP_SESSION_ID, token);
            }
            None => {
                tracing::warn!(group = %group.name, "upstream sent an invalid Mcp-Session-Id; dropped")
            }
        }
    }
    out
}

/// A response header for the client copied from the next hop's: its status and
/// end-to-end headers, framed by its `Content-Length` or as a body of unknown length
/// (`respond::frame_unknown_length`), and SSE marked unbuffered for proxies in front.
pub(crate) fn relayed_header(
    session: &mut ServerSession,
    upstream: &ResponseHeader,
) -> ResponseHeader {
    let mut out = ResponseHeader::build_no_case(upstream.status, Some(upstream.headers.len() + 2))
        .expect("a status read from the upstream is valid");
    for (name, value) in headers::forwardable(&upstream.headers) {
        let _ = out.append_header(name.clone(), value.clone());
    }
    // A 1xx or 204 carries no Content-Length (RFC 9110 §8.6); a 304's is the
    // representation's, and passes.
    let status = upstream.status;
    let no_length = status.is_informational() || status == http::StatusCode::NO_CONTENT;
    if let Some(length) = upstream.headers.get(http::header::CONTENT_LENGTH) {
        if !no_length {
            let _ = out.insert_header(http::header::CONTENT_LENGTH, length.clone());
        }
    } else {
        respond::frame_unknown_length(session, &mut out);
    }
    // Media types ignore case.
    let sse = b"text/event-stream";
    let is_sse = upstream
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.as_bytes().get(..sse.len()))
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(sse));
    if is_sse {
        let _ = out.insert_header("x-accel-buffering", "no");
    }
    out
}

fn client_session_token(
    gw: &Gateway,
    group: &UpstreamGroup,
    route: &Route,
    binding: &[u8],
    sid: &str,
) -> Option<String> {
    if route.upstream_session.as_deref() == Some(sid) {
        return route.client_token.clone();
    }
    gw.runtime.metrics.upstream_session("opened");
    let token = SessionToken {
        group: group.name.clone(),
        endpoint: route.endpoint.addr,
        upstream_session: sid.to_string(),
        issued_at: crate::mrtr::state::now_secs(),
    };
    let version = gw.config.bridge.sealing_version();
    Some(token.seal_as(&gw.sealing.keys.load(), binding, version))
}

/// The longest response with a Content-Length whose ids are unwrapped in one piece, under
/// its new length; a longer one streams, its length unknown.
const MAX_WHOLE_BODY: usize = 1 << 20;

/// Streams the upstream body to the client as it arrives, until either side ends, with
/// a legacy client's body rewritten as it goes (`BodyRewrite`); `id` is the client's
/// request's, for an error answered instead of a body that did not come whole. With a
/// `last_word` (an SSE event), a POST's SSE stream still running when this replica's grace
/// period nears its end ends with it, between two events (`Outcome::Drained`).
pub(crate) async fn relay(
    gw: &Gateway,
    session: &mut ServerSession,
    mut header: ResponseHeader,
    upstream: &mut Response,
    mut rewrite: Option<BodyRewrite>,
    id: Option<&Value>,
    last_word: Option<&Bytes>,
) -> Outcome {
    if gw.admission.cors.is_gateways() {
        cors::strip_upstreams(&mut header);
        cors::decorate(session, &mut header);
    }
    if let Some(rewriting) = rewrite.as_mut() {
        match content_length(&header) {
            Some(length) if length <= MAX_WHOLE_BODY => {
                return relay_whole(session, header, upstream, length, rewriting, id).await
            }
            Some(_) => respond::frame_unknown_length(session, &mut header),
            None => {}
        }
    }
    // A content-coded stream (gzip from a server's middleware) is relayed as it is: its
    // event boundaries cannot be seen, and a keep-alive comment would corrupt it.
    let sse = upstream.is_sse() && !upstream.is_encoded();
    // Keep-alive comments go between an SSE stream's events, so the upstream's length
    // cannot frame what the client gets.
    if sse && content_length(&header).is_some() {
        respond::frame_unknown_length(session, &mut header);
    }
    if respond::write_header(session, header).await.is_err() {
        return Outcome::ClientGone;
    }
    let _streaming = InUse::new(&gw.runtime.metrics.active_client_streams);
    // A session's GET stream never ends by itself; a POST's stream ends with its response.
    let endless = sse && session.req_header().method == http::Method::GET;
    let last_word = last_word.filter(|_| sse && !endless);
    pump(gw, session, upstream, (sse, endless), rewrite, last_word).await
}

fn content_length(header: &ResponseHeader) -> Option<usize> {
    let value = header.headers.get(http::header::CONTENT_LENGTH)?;
    // A length that does not parse is the upstream's problem: stream under no length.
    Some(value.to_str().ok()?.parse().unwrap_or(usize::MAX))
}

/// Relays a body of known `length` read whole and rewritten, under its new length.
async fn relay_whole(
    session: &mut ServerSession,
    mut header: ResponseHeader,
    upstream: &mut Response,
    length: usize,
    rewrite: &mut BodyRewrite,
    id: Option<&Value>,
) -> Outcome {
    let body = match upstream.read_all(length).await {
        Ok(body) => body,
        Err(e) => {
            tracing::warn!(error = %Report(&e), "upstream body not read");
            let refusal = match e.failure() {
                ExchangeFailure::Timeout => Refusal::internal(Class::UpstreamTimeout, BODY_LATE),
                _ => Refusal::internal(Class::UpstreamError, "the upstream broke off the body"),
            };
            return refuse(session, true, id, refusal).await;
        }
    };
    let body = concat(rewrite.push(body), rewrite.finish());
    let _ = header.insert_header(http::header::CONTENT_LENGTH, body.len());
    if respond::write_header(session, header).await.is_err()
        || respond::write_body(session, body, true).await.is_err()
    {
        return Outcome::ClientGone;
    }
    Outcome::Ok
}

/// Relays body chunks. An SSE stream gets keep-alive comments while the upstream is
/// silent. An endless one (a session's GET stream) ends between two events once the
/// gateway drains, and the client reconnects elsewhere; a POST's response, SSE or not, is
/// in flight and is relayed to its end. Any other body (JSON, however framed) must come
/// whole within the group's response timeout, as one read whole does: a body that stalls
/// is cut then.
async fn pump(
    gw: &Gateway,
    session: &mut ServerSession,
    upstream: &mut Response,
    (sse, endless): (bool, bool),
    mut rewrite: Option<BodyRewrite>,
    last_word: Option<&Bytes>,
) -> Outcome {
    let keepalive = (sse && gw.config.sse_keepalive_ms > 0)
        .then(|| Duration::from_millis(gw.config.sse_keepalive_ms));
    let mut position = BoundaryTracker::default();
    // The client has every byte of an event that answers its request: a client that
    // leaves after this left with its answer.
    let mut answered = false;
    // What is left of the response timeout for the upstream to send the rest of a body
    // that is not SSE: only time spent waiting on the upstream counts, not time spent
    // writing to a client that reads slowly (`client_write_timeout_ms` bounds that).
    let mut upstream_time = (!upstream.is_sse()).then(|| upstream.answer_within());
    loop {
        let waiting_since = tokio::time::Instant::now();
        let whole_by = upstream_time.map(|left| waiting_since + left);
        let at_boundary = sse && position.between_events();
        if endless && at_boundary && gw.runtime.drain.is_draining() {
            let _ = respond::write_body(session, Bytes::new(), true).await;
            session.set_keepalive(None);
            return Outcome::Drained;
        }
        let chunk = tokio::select! {
            chunk = upstream.next_chunk() => chunk,
            _ = session.read_body_or_idle(true) => {
                // Closed, or half-closed and still reading: cut, so that what it got does
                // not end like a whole body (a terminal chunk at `finish`).
                respond::cut(session).await;
                return Outcome::answered(answered);
            }
            _ = gw.runtime.drain.wait(), if endless && at_boundary => continue,
            () = gw.runtime.drain.wait_near_end(), if at_boundary && last_word.is_some() => {
                let last = last_word.cloned().unwrap_or_default();
                let _ = respond::write_body(session, last, true).await;
                session.set_keepalive(None);
                return Outcome::Drained;
            }
            _ = precise_sleep::sleep_until_or_never(whole_by) => {
                tracing::warn!("upstream body not sent whole within the response timeout");
                respond::abort(session).await;
                return Outcome::Refused(Refusal::internal(Class::UpstreamTimeout, BODY_LATE));
            }
            _ = sleep_or_never(keepalive), if at_boundary => {
                let comment = Bytes::from_static(sse::KEEP_ALIVE);
                if respond::write_body(session, comment, false).await.is_err() {
                    return Outcome::answered(answered);
                }
                gw.runtime.metrics.sse_keepalives.inc();
                continue;
            }
        };
        if let Some(left) = upstream_time.as_mut() {
            *left = left.saturating_sub(waiting_since.elapsed());
        }
        match chunk {
            Ok(Some(bytes)) => {
                let bytes = match rewrite.as_mut() {
                    Some(rewrite) => rewrite.push(bytes),
                    None => bytes,
                };
                if bytes.is_empty() {
                    continue;
                }
                position.push(&bytes);
                if respond::write_body(session, bytes, false).await.is_err() {
                    return Outcome::answered(answered);
                }
                answered = answered
                    || sse
                        && !endless
                        && position.between_events()
                        && rewrite.as_ref().is_some_and(BodyRewrite::answered);
            }
            Ok(None) => {
                let rest = rewrite
                    .as_mut()
                    .map(BodyRewrite::finish)
                    .unwrap_or_default();
                let _ = respond::write_body(session, rest, true).await;
                return Outcome::Ok;
            }
            Err(e) => {
                tracing::warn!(error = %Report(&e), "upstream stream ended abnormally");
                respond::abort(session).await;
                return Outcome::Refused(Refusal::internal(
                    Class::UpstreamError,
                    "the upstream broke off the body",
                ));
            }
        }
    }
}

/// An upstream's `Mcp-Session-Id` value, when it is one a session token can carry.
fn valid_session_id(value: &http::HeaderValue) -> Option<&str> {
    let sid = value.to_str().ok()?;
    SessionToken::validate_upstream_session(sid)
        .ok()
        .map(|_| sid)
}

/// The session id a response to a session-less request gave that no token can carry
/// (too long, or not visible ASCII), as text when it is UTF-8 (to end the session with);
/// `None` when it gave none, an empty one, or one the gateway carries.
fn uncarried_session(route: &Route, upstream: &ResponseHeader) -> Option<Option<String>> {
    let sid = upstream.headers.get(MCP_SESSION_ID)?;
    let fine = sid.is_empty() || valid_session_id(sid).is_some();
    if fine || route.upstream_session.is_some() {
        return None;
    }
    Some(std::str::from_utf8(sid.as_bytes()).ok().map(str::to_string))
}

/// What the client is told when the session its `initialize` opened cannot be carried.
fn uncarried_session_refusal(group: &UpstreamGroup) -> Refusal {
    tracing::warn!(group = %group.name, "upstream session id cannot be carried");
    let text = format!(
        "upstream group '{}' opened a session whose Mcp-Session-Id the gateway cannot carry (it must be 1 to {MAX_UPSTREAM_SESSION_LEN} visible ASCII characters); the session was ended",
        group.name
    );
    Refusal::internal(Class::UpstreamError, text)
}

/// The upstream session a response to a session-less request (an `initialize`) opened.
fn session_opened(route: &Route, upstream: &ResponseHeader) -> Option<String> {
    let sid = valid_session_id(upstream.headers.get(MCP_SESSION_ID)?)?;
    route.upstream_session.is_none().then(|| sid.to_string())
}

/// The revision an `initialize` body asks for: what its session negotiated, unless the
/// server does not support it (then the one the gateway asks for is the best guess).
fn requested_revision(body: &[u8]) -> Revision {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| Revision::parse(v["params"]["protocolVersion"].as_str()?))
        .unwrap_or_default()
}

/// Ends an upstream session the client never learnt of, since its response was not
/// relayed: nobody else would. `initialize` is the client's, naming the revision the
/// session's requests must name.
async fn end_unrelayed_session(
    gw: &Gateway,
    session: &ServerSession,
    group: &UpstreamGroup,
    route: &Route,
    upstream_session: String,
    initialize: Option<&[u8]>,
) {
    let version = initialize.map_or_else(Revision::default, requested_revision);
    gw.runtime.metrics.upstream_session("opened");
    let client = &gw.upstreams.client;
    let endpoint = route.endpoint.clone();
    let timeouts = &group.timeouts;
    let mut opened = LegacySession::resume(client, endpoint, timeouts, upstream_session, version);
    opened.caller.headers = gw.admission.end_to_end(session, group);
    // Rare, and its future large: on the heap, so that every request's stays small.
    Box::pin(opened.abandon()).await;
}

/// A JSON-RPC body the upstream content-coded although asked for `identity`: the
/// client's request ids cannot be given back in it, so it is not relayed.
fn coded_against_identity(group: &UpstreamGroup) -> Refusal {
    tracing::warn!(group = %group.name, "upstream content-coded a response asked for as identity");
    let text = format!("upstream group '{}' content-coded its response although asked not to; the client's request ids cannot be restored in it", group.name);
    Refusal::internal(Class::UpstreamError, text)
}

/// What the client is told when its request's exchange with `group` failed.
fn upstream_refusal(group: &UpstreamGroup, e: &ExchangeError) -> Refusal {
    let what = e.failure();
    Refusal::internal(
        Class::from(what),
        format!("upstream group '{}' {what}", group.name),
    )
}

/// Why a body that did not come whole in time was cut.
const BODY_LATE: &str =
    "the upstream did not send its whole answer within the group's response_timeout_ms";

/// Sleeps for `period`, or forever when there is none.
pub(crate) async fn sleep_or_never(period: Option<Duration>) {
    match period {
        Some(p) => tokio::time::sleep(p).await,
        None => std::future::pending().await,
    }
}
