//! The MRTR bridge: 2026-07-28 requests served by legacy upstreams.
//!
//! Each request gets an upstream session opened with the client's declared capabilities.
//! `tools/call`, `prompts/get` and `resources/read` run as rounds: server requests that
//! arrive on the call's stream or the session's GET stream are gathered (within a quiet
//! window) into an `InputRequiredResult` whose sealed `requestState` points at the waiting
//! upstream call. The retry, on any replica, reopens the call's streams (`Last-Event-ID`)
//! and posts the answers. The upstream keeps running in between: its connections are
//! closed, never cancelled. A resumable flow leaves only bounded bookkeeping between
//! rounds (the opening replica's reaper entry, a used state's replay-table entry); a held
//! one (`hold`) keeps its streams open on its owner. Each call runs as a `mrtr::flow::Flow`
//! driven by `call`.

mod call;
pub mod hold;
pub mod one_shot;
pub(crate) mod probe;
mod reply;
mod session;
mod streams;
pub mod warm;

use super::respond;
use super::upstream_side::Asker;
use super::{Arrival, Gateway};
use crate::gateway::reaper::Reaper;
use crate::metrics::method_label;
use crate::mrtr::data_session::META_KEY;
pub(crate) use crate::mrtr::flow::fresh_call_id;
use crate::mrtr::flow::{Failure, FailureKind};
use crate::mrtr::modern::{
    check_header_version, gateway_code as scode, ModernHeaders, ModernRequest, SUPPORTED_VERSIONS,
};
use crate::mrtr::state::FlowState;
use crate::mrtr::translate::Round;
use crate::outcome::Report;
use crate::outcome::{Class, Outcome, Refusal};
use crate::protocol::jsonrpc::{self, code, Body};
use crate::protocol::oauth;
use crate::upstream::legacy_session::{
    read_single, Caller, LegacySession, SessionError, SessionFailure,
};
use crate::upstream::UpstreamGroup;
use bytes::Bytes;
use one_shot::{KeptSessions, Shape};
use pingora::protocols::http::ServerSession;
use reply::{decorate, ClientReply};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::time::Instant;
use tracing::Instrument;

/// The params sent upstream: the client's, less what only the 2026-07-28 wire carries,
/// with the request's trace context in `_meta` unless the client put one there.
pub(crate) fn upstream_params(request: &ModernRequest) -> Value {
    let mut p = request.params.clone();
    request.trace.fill_meta(&mut p);
    p.remove("inputResponses");
    p.remove("requestState");
    // 2026-07-28 has no `task` param (its tasks extension does not use one, and its
    // servers ignore it); a 2025-11-25 server would take it for a legacy task and answer
    // a CreateTaskResult, or refuse the tool, neither of which the client asked for.
    p.remove("task");
    if let Some(meta) = p.get_mut("_meta").and_then(Value::as_object_mut) {
        // The session cookie is the gateway's; SEP-1655 client-held state keys
        // (`modelcontextprotocol.io/state/*`) and every other key go through.
        meta.retain(|k, _| !k.starts_with("io.modelcontextprotocol/") && k != META_KEY);
        if meta.is_empty() {
            p.remove("_meta");
        }
    }
    Value::Object(p)
}

/// `params` (an object, as `upstream_params` gives them) with `token` as their progress
/// token in place of the client's.
pub(crate) fn with_progress_token(mut params: Value, token: i64) -> Value {
    if let Some(p) = params.as_object_mut() {
        let meta = p.entry("_meta").or_insert_with(|| json!({}));
        if let Some(meta) = meta.as_object_mut() {
            meta.insert("progressToken".into(), json!(token));
        }
    }
    params
}

/// How the bridge serves each 2026-07-28 method it knows.
enum Kind {
    Discover,
    /// May need input from the client: run as rounds.
    Interactive,
    /// Forwarded once on a fresh upstream session.
    OneShot,
    SessionCreate,
    SessionDelete,
}

impl Kind {
    fn of(method: &str) -> Option<Kind> {
        match method {
            "server/discover" => Some(Kind::Discover),
            "tools/call" | "prompts/get" | "resources/read" => Some(Kind::Interactive),
            "tools/list"
            | "prompts/list"
            | "resources/list"
            | "resources/templates/list"
            | "completion/complete" => Some(Kind::OneShot),
            "session/create" => Some(Kind::SessionCreate),
            "session/delete" => Some(Kind::SessionDelete),
            _ => None,
        }
    }
}

/// A 2026-07-28 POST as the shell read it.
pub struct Incoming {
    /// The body as it arrived, to relay or forward unchanged.
    pub body: Bytes,
    pub parsed: Body,
    pub principal: [u8; 32],
    pub arrival: Arrival,
}

pub async fn serve(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    incoming: Incoming,
) {
    let started = std::time::Instant::now();
    let most = gw.config.limits.max_json_values;
    if jsonrpc::holds_more_values_than(&incoming.body, most) {
        let text = format!(
            "the request body holds more than {most} JSON values, the most the gateway reads (limits.max_json_values)"
        );
        respond::error(
            session,
            413,
            incoming.parsed.id(),
            code::INVALID_REQUEST,
            &text,
        )
        .await;
        let refusal = Refusal::new(Class::TooLarge, code::INVALID_REQUEST, text);
        gw.record("modern", "other", &Outcome::Refused(refusal), started);
        return;
    }
    let message = match parse_single(&incoming) {
        Ok(message) => message,
        Err(text) => {
            let id = incoming.parsed.id();
            respond::error(session, 400, id, code::INVALID_REQUEST, &text).await;
            let refusal = Refusal::new(Class::BadRequest, code::INVALID_REQUEST, text);
            gw.record("modern", "other", &Outcome::Refused(refusal), started);
            return;
        }
    };
    let method = method_label(message["method"].as_str());
    // The flow id is recorded into this span once known, so the access line carries it.
    let span = tracing::info_span!("request", flow = tracing::field::Empty);
    // Boxed before it is wrapped: built in place once, not copied into the wrapper and
    // again with this future when `Gateway::handle` boxes it.
    let served = Box::pin(serve_inner(gw, session, group, &message, &incoming))
        .instrument(span.clone())
        .await;
    match served {
        Served::Relay => {
            let Incoming {
                body,
                parsed,
                principal,
                ..
            } = incoming;
            let client = super::passthrough::Client::ModernRelayed;
            super::passthrough::serve(gw, session, group, body, Some(parsed), client, &principal)
                .await;
            // A 2025 server answers a request without a session 400 (or 404): one that
            // was found to speak only 2026-07-28 may have been redeployed.
            let status = session.response_written().map(|h| h.status.as_u16());
            if matches!(status, Some(400 | 404)) {
                gw.upstreams.doubt_era(group, true);
            }
        }
        Served::Done(outcome) => span.in_scope(|| gw.record("modern", method, &outcome, started)),
    }
}

/// The one JSON-RPC message of a 2026-07-28 POST, whole; `Err` says what is wrong with a
/// body that passed the envelope check (classification leaves params unread).
fn parse_single(incoming: &Incoming) -> Result<Value, String> {
    if matches!(incoming.parsed, Body::Batch(_)) {
        return Err(
            "protocol version 2026-07-28 has no JSON-RPC batches: send one message per request"
                .into(),
        );
    }
    jsonrpc::from_slice_lenient(&incoming.body).map_err(|e| {
        // serde_json's own bound, which keeps a body from exhausting a worker's stack.
        let depth = if e.to_string().starts_with("recursion limit exceeded") {
            " (it reads values nested at most 128 deep)"
        } else {
            ""
        };
        format!("the request body is not a JSON-RPC message the gateway can read{depth}: {e}")
    })
}

/// What became of a request: answered here (with its metrics outcome), or to be relayed
/// unchanged to an upstream that speaks 2026-07-28.
enum Served {
    Done(Outcome),
    Relay,
}

/// The headers that mirror a 2026-07-28 request's body.
const MIRRORED: [&str; 3] = ["MCP-Protocol-Version", "Mcp-Method", "Mcp-Name"];

async fn serve_inner(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    message: &Value,
    incoming: &Incoming,
) -> Served {
    let principal = &incoming.principal;
    // A 2026-07-28 upstream gets every message unchanged: notifications, and methods the
    // bridge does not know (`subscriptions/listen`, extensions), as known without a probe.
    let method = message["method"].as_str();
    let bridged = method.map(|m| Kind::of(m).is_some() && message.get("id").is_some());
    if bridged == Some(false)
        && incoming.arrival != Arrival::Peer
        && gw.upstreams.relays_as_known(group) == Some(true)
    {
        return Served::Relay;
    }
    let (Some(method), Some(id)) = (method, message.get("id")) else {
        if message.get("method").is_some() {
            respond::write(session, 202, "application/json", Bytes::new()).await;
            return Served::Done(Outcome::Ok);
        }
        let text = "clients send no JSON-RPC responses in protocol version 2026-07-28";
        respond::error(session, 400, None, code::INVALID_REQUEST, text).await;
        let refusal = Refusal::new(Class::BadRequest, code::INVALID_REQUEST, text);
        return Served::Done(Outcome::Refused(refusal));
    };
    let header = |name: &str| session.get_header(name).and_then(|v| v.to_str().ok());
    let differs = |name: &str| {
        let mut values = session.req_header().headers.get_all(name).iter();
        let first = values.next();
        values.any(|v| Some(v) != first)
    };
    let headers = ModernHeaders {
        protocol_version: header("mcp-protocol-version"),
        method: header("mcp-method"),
        name: header("mcp-name"),
        traceparent: header("traceparent"),
        tracestate: header("tracestate"),
        repeated: MIRRORED.into_iter().find(|name| differs(name)),
        unreadable: MIRRORED
            .into_iter()
            .find(|name| (session.get_header(*name)).is_some_and(|value| value.to_str().is_err())),
    };
    let accepts_sse = header("accept").is_some_and(|a| a.contains("text/event-stream"));
    let reply = ClientReply {
        id: id.clone(),
        accepts_sse: false,
        streaming: None,
        streams: gw.runtime.metrics.active_client_streams.clone(),
        cookie: None,
    };
    if let Err(refusal) = check_header_version(headers.protocol_version) {
        return Served::Done(reply.refuse(session, refusal).await);
    }
    let Some(kind) = Kind::of(method) else {
        let text = format!("Method not found: {method}");
        reply
            .error(session, 404, code::METHOD_NOT_FOUND, &text, None)
            .await;
        let refusal = Refusal::new(Class::BadRequest, code::METHOD_NOT_FOUND, text);
        return Served::Done(Outcome::Refused(refusal));
    };
    let mut request =
        match ModernRequest::validate(id.clone(), method, message.get("params"), headers) {
            Ok(r) => r,
            Err(refusal) => return Served::Done(reply.refuse(session, refusal).await),
        };
    request.headers = gw.admission.end_to_end(session, group);
    if incoming.arrival == Arrival::Peer && !is_retry(&kind, &request) {
        return Served::Done(refused_on_peer_listener(session).await);
    }
    // Only a request that passed validation may make the gateway probe the upstream. The
    // peer listener relays nothing and probes nothing: it serves held flows only.
    let asking = || asker(gw, group, &request, principal);
    if incoming.arrival != Arrival::Peer && gw.upstreams.relays(group, asking).await {
        if is_retry(&kind, &request) && sealed_here(gw, &request) {
            // A flow bridged before the upstream became a 2026-07-28 server: its state
            // means nothing to that server.
            let text = format!("upstream group '{}' now speaks protocol version 2026-07-28 and no longer has this bridged call: issue the call again", group.name);
            let refusal = Refusal::new(Class::UpstreamError, scode::FLOW_LOST, text);
            return Served::Done(reply.refuse(session, refusal).await);
        }
        return Served::Relay;
    }
    let reply = ClientReply {
        accepts_sse,
        ..reply
    };
    let mut attached = None;
    if matches!(
        kind,
        Kind::Interactive | Kind::OneShot | Kind::SessionDelete
    ) {
        match session::attach(gw, group, &request, principal) {
            Ok(a) => attached = a,
            Err(refused) => {
                let refusing = session::refuse(gw, session, group, &request, reply, refused);
                return Served::Done(Box::pin(refusing).await);
            }
        }
    }
    // Every result in a session carries its cookie, refreshed; `session/delete`'s revokes it.
    let cookie = match (&mut attached, &kind) {
        (Some(a), Kind::Interactive | Kind::OneShot) => Some(session::refreshed(gw, a, principal)),
        _ => None,
    };
    let reply = ClientReply { cookie, ..reply };
    let attached = attached.as_ref();
    Served::Done(match kind {
        Kind::Discover => discover(gw, session, group, &request, reply, principal).await,
        Kind::Interactive => {
            call::interactive(gw, session, group, request, reply, incoming, attached).await
        }
        Kind::OneShot => one_shot(gw, session, group, &request, reply, attached, principal).await,
        Kind::SessionCreate => {
            session::create(gw, session, group, &request, reply, principal).await
        }
        Kind::SessionDelete => session::delete(gw, session, group, &request, attached, reply).await,
    })
}

/// Whether a request's `requestState` is one this gateway sealed (it opens with its keys).
fn sealed_here(gw: &Gateway, request: &ModernRequest) -> bool {
    let state = request.params.get("requestState").and_then(Value::as_str);
    state.is_some_and(|text| FlowState::open_unbound(&gw.sealing.keys.load(), text).is_ok())
}

/// Whether a request retries an interactive call (it carries a `requestState`).
fn is_retry(kind: &Kind, request: &ModernRequest) -> bool {
    matches!(kind, Kind::Interactive) && request.params.get("requestState").is_some()
}

/// The client request an upstream session acts for.
pub(crate) fn caller(request: &ModernRequest) -> Caller {
    Caller {
        trace: request.trace.clone(),
        headers: request.headers.clone(),
    }
}

/// Who `request` asks the upstream as, for `principal`: its declared capabilities,
/// client and credentials, and the one-shot shape they make.
fn asker(
    gw: &Gateway,
    group: &UpstreamGroup,
    request: &ModernRequest,
    principal: &[u8; 32],
) -> Asker {
    Asker {
        capabilities: Value::Object(request.client_capabilities.clone()),
        client_info: client_info(request),
        caller: caller(request),
        shape: one_shot_shape(group, request, principal),
        owner: counted_principal(gw, principal),
    }
}

/// The principal whose share of a per-replica table a request takes: `None` for
/// anonymous requests, which share one principal and count only against the whole table.
pub(super) fn counted_principal(gw: &Gateway, principal: &[u8; 32]) -> Option<[u8; 32]> {
    let anonymous = gw.admission.authenticator.load().anonymous() == Some(*principal);
    (!anonymous).then_some(*principal)
}

/// The shape of the upstream session `request`'s one-shot methods run on.
fn one_shot_shape(group: &UpstreamGroup, request: &ModernRequest, principal: &[u8; 32]) -> Shape {
    KeptSessions::shape(
        &group.name,
        &Value::Object(request.client_capabilities.clone()),
        &client_info(request),
        principal,
        &request.headers.digest(),
    )
}

pub(crate) fn client_info(request: &ModernRequest) -> Value {
    request.params["_meta"]
        .get("io.modelcontextprotocol/clientInfo")
        .cloned()
        .unwrap_or_else(|| json!({"name": "mrtr-gateway", "version": env!("CARGO_PKG_VERSION")}))
}

pub(crate) async fn upstream_failed(
    gw: &Gateway,
    reply: ClientReply,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    e: &SessionError,
) -> Outcome {
    if *e.failure() == SessionFailure::Gone && reply.cookie.is_some() {
        return session::ended(gw, session, reply).await;
    }
    if let SessionFailure::Denied { status, challenge } = e.failure() {
        tracing::info!(group = %group.name, error = %Report(e), "upstream denied the caller");
        let refusal = Failure::denied(*status, challenge.clone(), e.failure().to_string())
            .refusal(&group.name);
        let refusal = public_challenge(gw, session, group, refusal);
        return reply.refuse(session, refusal).await;
    }
    let class = match e.failure() {
        SessionFailure::NoEndpoint => Class::NoUpstream,
        SessionFailure::Exchange(failure) => Class::from(*failure),
        _ => Class::UpstreamError,
    };
    if e.failure().doubts_legacy_era() {
        gw.upstreams.doubt_era(group, false);
    }
    tracing::warn!(group = %group.name, error = %Report(e), "bridged upstream exchange failed");
    let text = format!("upstream group '{}' failed: {}", group.name, e.failure());
    reply.refuse(session, Refusal::internal(class, text)).await
}

/// A denial's challenge as the client must see it: its `resource_metadata` names the
/// group's metadata at the gateway's public URL, not the upstream's address.
pub(crate) fn public_challenge(
    gw: &Gateway,
    session: &ServerSession,
    group: &UpstreamGroup,
    refusal: Refusal,
) -> Refusal {
    let Some(challenge) = &refusal.challenge else {
        return refusal;
    };
    let public = gw.admission.public_resource(session, group);
    let challenge = oauth::rewrite_challenge(challenge, &public);
    refusal.with_challenge(Some(challenge))
}

/// The upstream's capabilities as the bridge can honour them: list-changed notifications
/// and resource subscriptions need `subscriptions/listen`, which the bridge does not serve
/// yet, so they are not advertised; nor are 2025-11-25 tasks, whose wire form 2026-07-28
/// does not share (the bridge answers `tasks/*` -32601). Data-layer sessions are the
/// gateway's own, under `experimental.session`.
fn modern_capabilities(upstream: &Value) -> Value {
    let mut caps = upstream.clone();
    let Some(map) = caps.as_object_mut() else {
        return json!({"experimental": {"session": session_capability()}});
    };
    map.remove("tasks");
    for (_, cap) in map.iter_mut() {
        if let Some(cap) = cap.as_object_mut() {
            cap.remove("listChanged");
            cap.remove("subscribe");
        }
    }
    let experimental = map.entry("experimental").or_insert(json!({}));
    if !experimental.is_object() {
        *experimental = json!({});
    }
    experimental["session"] = session_capability();
    caps
}

fn session_capability() -> Value {
    json!({"version": 1, "features": crate::mrtr::data_session::FEATURES})
}

async fn discover(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    reply: ClientReply,
    principal: &[u8; 32],
) -> Outcome {
    let asker = asker(gw, group, request, principal);
    let init = match gw.upstreams.initialize_result(group, &asker).await {
        Ok(init) => init,
        Err(e) => return upstream_failed(gw, reply, session, group, &e).await,
    };
    let mut result = json!({"supportedVersions": SUPPORTED_VERSIONS, "capabilities": modern_capabilities(&init["capabilities"])});
    if let Some(instructions) = init.get("instructions") {
        result["instructions"] = instructions.clone();
    }
    let result = decorate(result, &init["serverInfo"], true);
    Outcome::answered(reply.result(session, result).await)
}

/// A one-shot method (a list, completion): on the data-layer session it runs in, else on
/// the session kept for its shape (`one_shot`), opened (and kept) when there is none.
async fn one_shot(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    reply: ClientReply,
    attached: Option<&session::Attached>,
    principal: &[u8; 32],
) -> Outcome {
    if attached.is_some() || !gw.upstreams.kept_sessions.enabled() {
        let upstream = match upstream_for(gw, group, request, attached).await {
            Ok(upstream) => upstream,
            Err(e) => return upstream_failed(gw, reply, session, group, &e).await,
        };
        let answer = ask_once(gw, &upstream, request).await;
        end_session(&gw.upstreams.reaper, &upstream).await;
        return answered(gw, session, (group, request), reply, answer).await;
    }
    let shape = one_shot_shape(group, request, principal);
    let mut retired = Vec::new();
    let kept = gw.upstreams.kept_sessions.take_live(&shape, Instant::now());
    let kept = kept.unwrap_or_else(|idle| {
        retired.push(*idle);
        None
    });
    // What was let go is deleted however the request ends.
    let outcome = async {
        let timeouts = &group.timeouts;
        if let Some(kept) = kept {
            let resumed = one_shot::resume(&gw.upstreams.client, group, timeouts, &kept);
            if resumed.is_none() {
                // Its endpoint left the group: it serves no one any more.
                gw.upstreams.kept_sessions.forget(&shape, &kept.session_id);
            }
            if let Some(mut upstream) = resumed {
                upstream.caller = caller(request);
                match ask_once(gw, &upstream, request).await {
                    // The upstream forgot the session, or its endpoint takes no connection:
                    // either way it did not take the request, which goes again on a new
                    // session (on a healthy endpoint).
                    Err(e) if FailureKind::from(e.failure()).may_be_forgotten_session() => {
                        gw.upstreams.kept_sessions.forget(&shape, &kept.session_id)
                    }
                    answer => {
                        gw.runtime.metrics.upstream_session("reused");
                        return answered(gw, session, (group, request), reply, answer).await;
                    }
                }
            }
        }
        let upstream = match upstream_for(gw, group, request, None).await {
            Ok(upstream) => upstream,
            Err(e) => return upstream_failed(gw, reply, session, group, &e).await,
        };
        let answer = ask_once(gw, &upstream, request).await;
        match (
            &answer,
            one_shot::Kept::of(&group.name, &upstream, Instant::now()),
        ) {
            (Ok(_), Some(kept)) => {
                let owner = counted_principal(gw, principal);
                retired.extend(gw.upstreams.kept_sessions.keep(shape, owner, kept))
            }
            _ => end_session(&gw.upstreams.reaper, &upstream).await,
        }
        answered(gw, session, (group, request), reply, answer).await
    }
    .await;
    one_shot::retire(&gw.upstreams, retired).await;
    outcome
}

/// Refuses what the peer listener does not serve (anything but a retry of a flow this
/// replica holds), as the outcome of the request.
pub(super) async fn refused_on_peer_listener(session: &mut ServerSession) -> Outcome {
    super::refuse_on_peer_listener(session).await;
    let text = "the peer listener serves only retries of flows this replica holds";
    Outcome::Refused(Refusal::new(Class::Forbidden, code::INVALID_REQUEST, text))
}

/// Posts a one-shot request and reads its one answer.
async fn ask_once(
    gw: &Gateway,
    upstream: &LegacySession<'_>,
    request: &ModernRequest,
) -> Result<Value, SessionError> {
    let id = fresh_call_id();
    let call = json!({"jsonrpc": "2.0", "id": id, "method": request.method, "params": upstream_params(request)});
    let mut response = upstream.post(&call).await?;
    let message = read_single(&mut response).await;
    gw.upstreams.client.finish(response).await;
    message
}

async fn answered(
    gw: &Gateway,
    session: &mut ServerSession,
    (group, request): (&UpstreamGroup, &ModernRequest),
    reply: ClientReply,
    answer: Result<Value, SessionError>,
) -> Outcome {
    match answer {
        Ok(message) => {
            finish_with(
                reply,
                session,
                message,
                &gw.upstreams.server_info(group, request),
                true,
            )
            .await
        }
        Err(e) => upstream_failed(gw, reply, session, group, &e).await,
    }
}

/// The upstream session a request runs in: its data-layer session's, or a fresh one
/// opened with the request's declared capabilities.
pub(crate) async fn upstream_for<'g>(
    gw: &'g Gateway,
    group: &'g UpstreamGroup,
    request: &ModernRequest,
    attached: Option<&session::Attached>,
) -> Result<LegacySession<'g>, SessionError> {
    if let Some(attached) = attached {
        let upstream = attached.upstream(gw, group, request);
        gw.runtime.metrics.upstream_session("reused");
        return Ok(upstream);
    }
    let caps = Value::Object(request.client_capabilities.clone());
    let (upstream, _init) = gw
        .upstreams
        .open_upstream(group, &caps, &client_info(request), &caller(request))
        .await?;
    Ok(upstream)
}

/// Deletes the flow's upstream session and stops the reaper watching it; a data-layer
/// session's outlives the flow. A DELETE the upstream may take later (no connection, a
/// cut or a failed TLS handshake, no answer in time, a 5xx, a 408, 409, 425 or 429) is
/// handed to the reaper to send again: the SDK servers keep a session until it is
/// deleted.
pub(crate) async fn end_session(reaper: &Reaper, upstream: &LegacySession<'_>) {
    let Some(sid) = upstream.own_session() else {
        return;
    };
    reaper.forget(&upstream.endpoint, sid);
    reaper.delete(upstream).await;
}

/// How long a deleted session's streams are given to end once the DELETE is answered:
/// servers end them before answering it, so only the last bytes are in flight.
const STREAMS_END_WITH_SESSION: std::time::Duration = std::time::Duration::from_millis(50);

/// `end_session` in the background, for a request that has answered its client: its
/// handler returns without waiting for the DELETE. The flow's `streams` still open are
/// read off after it (servers end them with the session), so that their connections
/// are pooled rather than closed. At most `MAX_BACKGROUND_DELETES` run at once (an
/// upstream that holds DELETEs cannot pile up tasks and connections); past that the
/// handler closes the streams and waits for its own.
async fn end_session_later(gw: &Gateway, upstream: LegacySession<'_>, streams: streams::Streams) {
    let client = gw.upstreams.client.clone();
    let permit = gw.upstreams.background_deletes.clone().try_acquire_owned();
    let (Ok(permit), Some(sid)) = (permit, upstream.own_session()) else {
        streams.close(&client).await;
        return end_session(&gw.upstreams.reaper, &upstream).await;
    };
    let reaper = gw.upstreams.reaper.clone();
    reaper.forget(&upstream.endpoint, sid);
    let (sid, timeouts) = (sid.to_owned(), *upstream.timeouts);
    let (endpoint, version, caller) = (upstream.endpoint, upstream.version, upstream.caller);
    // Boxed, as `warm::warm_up`'s task is: moved once, not copied on spawn and end.
    tokio::spawn(Box::pin(async move {
        let mut session = LegacySession::resume(&client, endpoint, &timeouts, sid, version);
        session.caller = caller;
        reaper.delete(&session).await;
        streams.drain(&client, STREAMS_END_WITH_SESSION).await;
        drop(permit);
    }));
}

/// Resource not found, up to 2025-11-25; reserved, never reused, from 2026-07-28.
const LEGACY_RESOURCE_NOT_FOUND: i64 = -32002;

/// Answers the client with the upstream's final response to the call.
pub(crate) async fn finish_with(
    reply: ClientReply,
    session: &mut ServerSession,
    message: Value,
    server_info: &Value,
    cacheable: bool,
) -> Outcome {
    let malformed = match (message.get("result"), message.get("error")) {
        (Some(result), None) if result.is_object() => {
            let result = decorate(result.clone(), server_info, cacheable);
            return Outcome::answered(reply.result(session, result).await);
        }
        (Some(_), Some(_)) => "carries both a result and an error",
        (Some(_), None) => "carries a result that is not an object",
        (None, Some(error)) if error.is_object() => {
            // The upstream's own JSON-RPC error, passed on as it is, but for the codes
            // 2026-07-28 reserves: -32002 (resource not found up to 2025-11-25) is said
            // with -32602; -32042 (URL elicitation required) arrives here only when
            // none of its elicitations had a url and a message to ask the client with.
            let said = error["message"]
                .as_str()
                .unwrap_or("the upstream answered with an error that has no message");
            let (code, text) = match error["code"].as_i64() {
                Some(LEGACY_RESOURCE_NOT_FOUND) => (code::INVALID_PARAMS, Cow::Borrowed(said)),
                Some(Round::URL_ELICITATION_REQUIRED) => (
                    code::INTERNAL_ERROR,
                    Cow::Owned(format!(
                        "the upstream needs a URL-mode elicitation but named no url and message to ask it with: {said}"
                    )),
                ),
                Some(code) => (code, Cow::Borrowed(said)),
                None => (code::INTERNAL_ERROR, Cow::Borrowed(said)),
            };
            let text = text.as_ref();
            let data = error.get("data").cloned();
            if code == code::METHOD_NOT_FOUND {
                // A method the server does not serve (prompts/list of one without
                // prompts): 404, as 2026-07-28 answers an unknown method, and as the
                // gateway answers one it does not know itself.
                reply.error(session, 404, code, text, data.clone()).await;
                let refusal = Refusal::new(Class::BadRequest, code, text);
                return Outcome::Refused(refusal);
            }
            let mut refusal = Refusal::new(Class::UpstreamError, code, text);
            refusal.data = data;
            return reply.refuse(session, refusal).await;
        }
        (None, Some(_)) => "carries an error that is not an object",
        (None, None) => "carries neither a result nor an error",
    };
    let text = format!("the upstream's response {malformed}, against JSON-RPC");
    reply
        .refuse(session, Refusal::internal(Class::UpstreamError, text))
        .await
}
