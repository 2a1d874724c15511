//! The MRTR bridge: 2026-07-28 requests served by legacy upstreams.
//!
//! Each request gets an upstream session opened with the client's declared capabilities.
//! `tools/call`, `prompts/get` and `resources/read` run as rounds: server requests that
//! arrive on the call's stream or the session's GET stream are gathered (within a quiet
//! window) into an `InputRequiredResult` whose sealed `requestState` points at the waiting
//! upstream call. The retry, on any replica, posts the answers and resumes the call's
//! stream with `Last-Event-ID`. The upstream keeps running in between: its connections
//! are closed, never cancelled, and no per-flow memory stays on the gateway.

use super::respond;
use super::Gateway;
use crate::metrics::method_label;
use crate::mrtr::modern::{
    code as mcode, ModernHeaders, ModernRequest, Refusal, SUPPORTED_VERSIONS,
};
use crate::mrtr::state::{binding, FlowState, UpstreamId};
use crate::mrtr::translate::{Action, Round};
use crate::protocol::jsonrpc::code;
use crate::protocol::sse;
use crate::upstream::exchange::Response;
use crate::upstream::legacy_session::{
    read_single, LegacySession, SessionError, MAX_UPSTREAM_MESSAGE,
};
use crate::upstream::UpstreamGroup;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use serde_json::{json, Map, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// How often the bridge follows an upstream that closes the call's stream mid-call.
const MAX_RESUMPTIONS: usize = 8;
/// The id the gateway gives every call upstream (each flow has its own session).
const CALL_ID: i64 = 1;
const INVALID_STATE: &str = "Invalid or expired requestState";

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The client's response: JSON at the end, or SSE once a notification has been sent.
struct ClientReply {
    id: Value,
    accepts_sse: bool,
    streaming: bool,
}

impl ClientReply {
    async fn notify(&mut self, session: &mut ServerSession, message: &Value) {
        if !self.accepts_sse {
            return;
        }
        if !self.streaming {
            let Ok(mut header) = ResponseHeader::build(200, Some(4)) else {
                return;
            };
            let _ = header.insert_header("content-type", "text/event-stream");
            let _ = header.insert_header("cache-control", "no-cache");
            let _ = header.insert_header("x-accel-buffering", "no");
            let _ = header.insert_header("transfer-encoding", "chunked");
            if session
                .write_response_header(Box::new(header))
                .await
                .is_err()
            {
                return;
            }
            self.streaming = true;
        }
        let event = sse::Event::message(None, message.to_string()).encode();
        let _ = session.write_response_body(Bytes::from(event), false).await;
    }

    async fn result(self, session: &mut ServerSession, result: Value) {
        self.finish(
            session,
            200,
            json!({"jsonrpc": "2.0", "id": self.id, "result": result}),
        )
        .await;
    }

    async fn error(
        self,
        session: &mut ServerSession,
        status: u16,
        code: i64,
        message: &str,
        data: Option<Value>,
    ) {
        let mut error = json!({"code": code, "message": message});
        if let Some(data) = data {
            error["data"] = data;
        }
        self.finish(
            session,
            status,
            json!({"jsonrpc": "2.0", "id": self.id, "error": error}),
        )
        .await;
    }

    async fn finish(&self, session: &mut ServerSession, status: u16, message: Value) {
        if self.streaming {
            let event = sse::Event::message(None, message.to_string()).encode();
            let _ = session.write_response_body(Bytes::from(event), true).await;
        } else {
            respond::write(
                session,
                status,
                "application/json",
                Bytes::from(message.to_string()),
            )
            .await;
        }
    }
}

/// Adds what every 2026-07-28 result carries.
fn decorate(mut result: Value, server_info: &Value, cacheable: bool) -> Value {
    if let Some(r) = result.as_object_mut() {
        r.entry("resultType").or_insert(json!("complete"));
        let meta = r.entry("_meta").or_insert(json!({}));
        if let Some(meta) = meta.as_object_mut() {
            meta.insert(
                "io.modelcontextprotocol/serverInfo".into(),
                server_info.clone(),
            );
        }
        if cacheable {
            r.entry("ttlMs").or_insert(json!(0));
            r.entry("cacheScope").or_insert(json!("private"));
        }
    }
    result
}

/// The params sent upstream: the client's, less what only the 2026-07-28 wire carries.
fn upstream_params(params: &Map<String, Value>) -> Value {
    let mut p = params.clone();
    p.remove("inputResponses");
    p.remove("requestState");
    if let Some(meta) = p.get_mut("_meta").and_then(Value::as_object_mut) {
        meta.retain(|k, _| !k.starts_with("io.modelcontextprotocol/"));
        if meta.is_empty() {
            p.remove("_meta");
        }
    }
    Value::Object(p)
}

pub async fn serve(gw: &Gateway, session: &mut ServerSession, group: &UpstreamGroup, body: &[u8]) {
    let message: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let method = message["method"].as_str().unwrap_or_default().to_string();
    let outcome = serve_inner(gw, session, group, &message).await;
    gw.metrics
        .requests
        .with_label_values(&["modern", method_label(Some(&method)), outcome])
        .inc();
}

async fn serve_inner(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    message: &Value,
) -> &'static str {
    let (Some(method), Some(id)) = (message["method"].as_str(), message.get("id")) else {
        if message.get("method").is_some() {
            respond::write(session, 202, "application/json", Bytes::new()).await;
            return "ok";
        }
        respond::error(
            session,
            400,
            None,
            code::INVALID_REQUEST,
            "clients send no JSON-RPC responses in protocol version 2026-07-28",
        )
        .await;
        return "bad_request";
    };
    let header = |name: &str| session.get_header(name).and_then(|v| v.to_str().ok());
    let headers = ModernHeaders {
        protocol_version: header("mcp-protocol-version"),
        method: header("mcp-method"),
        name: header("mcp-name"),
    };
    let accepts_sse = header("accept").is_some_and(|a| a.contains("text/event-stream"));
    let request = match ModernRequest::validate(id.clone(), method, message.get("params"), headers)
    {
        Ok(r) => r,
        Err(Refusal {
            status,
            code,
            message: text,
            data,
        }) => {
            let reply = ClientReply {
                id: id.clone(),
                accepts_sse: false,
                streaming: false,
            };
            reply.error(session, status, code, &text, data).await;
            return "bad_request";
        }
    };
    let reply = ClientReply {
        id: id.clone(),
        accepts_sse,
        streaming: false,
    };
    match method {
        "server/discover" => discover(gw, session, group, &request, reply).await,
        "tools/call" | "prompts/get" | "resources/read" => {
            interactive(gw, session, group, request, reply).await
        }
        "tools/list"
        | "prompts/list"
        | "resources/list"
        | "resources/templates/list"
        | "completion/complete" => one_shot(gw, session, group, &request, reply).await,
        other => {
            let text = format!("Method not found: {other}");
            reply
                .error(session, 404, code::METHOD_NOT_FOUND, &text, None)
                .await;
            "bad_request"
        }
    }
}

fn client_info(request: &ModernRequest) -> Value {
    request.params["_meta"]
        .get("io.modelcontextprotocol/clientInfo")
        .cloned()
        .unwrap_or_else(|| json!({"name": "mrtr-gateway", "version": env!("CARGO_PKG_VERSION")}))
}

async fn upstream_failed(
    reply: ClientReply,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    e: &SessionError,
) -> &'static str {
    tracing::warn!(group = %group.name, error = %e, "bridged upstream exchange failed");
    let text = format!("upstream group '{}' failed: {e}", group.name);
    reply
        .error(session, 502, code::INTERNAL_ERROR, &text, None)
        .await;
    "upstream_error"
}

async fn discover(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    reply: ClientReply,
) -> &'static str {
    let init = match gw.initialize_result(group, &client_info(request)).await {
        Ok(init) => init,
        Err(e) => return upstream_failed(reply, session, group, &e).await,
    };
    let mut result =
        json!({"supportedVersions": SUPPORTED_VERSIONS, "capabilities": init["capabilities"]});
    if let Some(instructions) = init.get("instructions") {
        result["instructions"] = instructions.clone();
    }
    reply
        .result(session, decorate(result, &init["serverInfo"], true))
        .await;
    "ok"
}

async fn one_shot(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    reply: ClientReply,
) -> &'static str {
    let Some(endpoint) = group.pick() else {
        reply
            .error(
                session,
                503,
                code::INTERNAL_ERROR,
                "no healthy upstream endpoint is available",
                None,
            )
            .await;
        return "no_upstream";
    };
    let caps = Value::Object(request.client_capabilities.clone());
    let opened = LegacySession::open(
        &gw.client,
        endpoint,
        &group.timeouts,
        &caps,
        &client_info(request),
    )
    .await;
    let (upstream, init) = match opened {
        Ok(o) => o,
        Err(e) => return upstream_failed(reply, session, group, &e).await,
    };
    gw.remember_initialize(group, &init);
    let call = json!({"jsonrpc": "2.0", "id": CALL_ID, "method": request.method, "params": upstream_params(&request.params)});
    let answer = match upstream.post(&call).await {
        Ok(mut response) => {
            let message = read_single(&mut response).await;
            gw.client.finish(response).await;
            message
        }
        Err(e) => Err(e),
    };
    upstream.delete().await;
    match answer {
        Ok(message) => finish_with(reply, session, message, &init["serverInfo"], true).await,
        Err(e) => upstream_failed(reply, session, group, &e).await,
    }
}

/// Deletes the flow's upstream session and stops the reaper watching it.
async fn end_session(gw: &Gateway, upstream: &LegacySession<'_>) {
    upstream.delete().await;
    if let Some(sid) = &upstream.session_id {
        gw.reaper.forget(upstream.endpoint, sid);
    }
}

/// Answers the client with the upstream's final response to the call.
async fn finish_with(
    reply: ClientReply,
    session: &mut ServerSession,
    message: Value,
    server_info: &Value,
    cacheable: bool,
) -> &'static str {
    match message.get("result") {
        Some(result) => {
            reply
                .result(session, decorate(result.clone(), server_info, cacheable))
                .await;
            "ok"
        }
        None => {
            let error = &message["error"];
            let text = error["message"].as_str().unwrap_or("upstream error");
            reply
                .error(
                    session,
                    200,
                    error["code"].as_i64().unwrap_or(code::INTERNAL_ERROR),
                    text,
                    error.get("data").cloned(),
                )
                .await;
            "upstream_error"
        }
    }
}

/// The upstream streams of a flow in progress.
struct Streams {
    call: Option<Response>,
    call_parser: sse::Parser,
    session: Option<Response>,
    session_parser: sse::Parser,
}

/// Server requests answered on this retry, to ignore if the upstream replays them.
struct Answered(Vec<UpstreamId>);

/// How a round ended.
enum RoundEnd {
    Complete(Value),
    Questions,
    MissingCapability(Value),
    Failed(String),
    ClientGone,
}

async fn interactive(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: ModernRequest,
    reply: ClientReply,
) -> &'static str {
    let principal = gw.principal(session);
    let bind = binding(
        &principal,
        &request.method,
        request.target.as_deref(),
        request.params.get("arguments"),
    );
    match request.params.get("requestState").and_then(Value::as_str) {
        None => start(gw, session, group, &request, reply, &bind).await,
        Some(text) => resume(gw, session, group, &request, reply, &bind, text).await,
    }
}

async fn start(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    reply: ClientReply,
    bind: &[u8; 32],
) -> &'static str {
    let Some(endpoint) = group.pick() else {
        reply
            .error(
                session,
                503,
                code::INTERNAL_ERROR,
                "no healthy upstream endpoint is available",
                None,
            )
            .await;
        return "no_upstream";
    };
    let caps = Value::Object(request.client_capabilities.clone());
    let (upstream, init) = match LegacySession::open(
        &gw.client,
        endpoint,
        &group.timeouts,
        &caps,
        &client_info(request),
    )
    .await
    {
        Ok(o) => o,
        Err(e) => return upstream_failed(reply, session, group, &e).await,
    };
    gw.remember_initialize(group, &init);
    let session_stream = upstream.get(None).await.ok();
    let call = json!({"jsonrpc": "2.0", "id": CALL_ID, "method": request.method, "params": upstream_params(&request.params)});
    let call_response = match upstream.post(&call).await {
        Ok(r) => r,
        Err(e) => {
            upstream.delete().await;
            return upstream_failed(reply, session, group, &e).await;
        }
    };
    let flow = FlowState {
        group: group.name.clone(),
        endpoint: endpoint.addr,
        upstream_session: upstream.session_id.clone().unwrap_or_default(),
        call_id: UpstreamId::Number(CALL_ID),
        pending: Vec::new(),
        last_event_id: None,
        round_start: None,
        round: 1,
        expires_at: 0,
        flow_deadline: now_secs() + gw.config.bridge.max_flow_seconds,
        flow_id: rand::random(),
    };
    let streams = Streams::new(Some(call_response), session_stream);
    let answered = Answered(Vec::new());
    run_round(
        gw,
        session,
        group,
        request,
        reply,
        bind,
        upstream,
        flow,
        streams,
        answered,
        &init["serverInfo"],
    )
    .await
}

impl Streams {
    fn new(call: Option<Response>, session: Option<Response>) -> Streams {
        Streams {
            call,
            call_parser: sse::Parser::new(MAX_UPSTREAM_MESSAGE),
            session,
            session_parser: sse::Parser::new(MAX_UPSTREAM_MESSAGE),
        }
    }

    async fn close(self, gw: &Gateway) {
        for response in [self.call, self.session].into_iter().flatten() {
            gw.client.finish(response).await;
        }
    }
}

async fn next_chunk(response: &mut Option<Response>) -> Option<Result<Option<Bytes>, String>> {
    match response {
        Some(r) => Some(r.next_chunk().await.map_err(|e| e.to_string())),
        None => std::future::pending().await,
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_round(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    mut reply: ClientReply,
    bind: &[u8; 32],
    upstream: LegacySession<'_>,
    mut flow: FlowState,
    mut streams: Streams,
    answered: Answered,
    server_info: &Value,
) -> &'static str {
    let forward_logs = request.log_level.is_some();
    let mut round = Round::new(
        flow.call_id.clone(),
        request.client_capabilities.clone(),
        forward_logs,
        flow.last_event_id.clone(),
    );
    round.skip(answered.0);
    let quiet = Duration::from_millis(gw.config.bridge.quiet_window_ms);
    let end = drive(
        session,
        &upstream,
        &mut reply,
        &mut round,
        &mut streams,
        quiet,
    )
    .await;
    let cacheable = request.method == "resources/read";
    match end {
        RoundEnd::Complete(message) => {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            finish_with(reply, session, message, server_info, cacheable).await
        }
        RoundEnd::Questions if round.last_event_id().is_none() => {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            let text = format!("upstream group '{}' cannot resume streams (its SSE events carry no ids), so its interactive calls cannot be bridged yet", group.name);
            reply
                .error(session, 502, code::INTERNAL_ERROR, &text, None)
                .await;
            "upstream_error"
        }
        RoundEnd::Questions if flow.round == 1 && !watch(gw, &upstream, &flow) => {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            reply
                .error(
                    session,
                    503,
                    code::INTERNAL_ERROR,
                    "too many flows are waiting for input on this replica; retry later",
                    None,
                )
                .await;
            "overloaded"
        }
        RoundEnd::Questions => {
            streams.close(gw).await;
            flow.pending = round.pending().to_vec();
            flow.last_event_id = round.last_event_id().map(str::to_string);
            flow.round_start = round.round_start().map(str::to_string);
            flow.expires_at =
                (now_secs() + gw.config.bridge.request_state_ttl_seconds).min(flow.flow_deadline);
            let sealed = flow.seal(&gw.keys, bind);
            tracing::info!(
                flow = format!("{:016x}", flow.flow_id),
                round = flow.round,
                questions = flow.pending.len(),
                "input required"
            );
            reply
                .result(
                    session,
                    decorate(round.input_required(sealed), server_info, false),
                )
                .await;
            "input_required"
        }
        RoundEnd::MissingCapability(required) => {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            let data = json!({"requiredCapabilities": required});
            reply
                .error(
                    session,
                    400,
                    mcode::MISSING_REQUIRED_CLIENT_CAPABILITY,
                    "the server needs a client capability this request did not declare",
                    Some(data),
                )
                .await;
            "missing_capability"
        }
        RoundEnd::Failed(why) => {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            let text = format!(
                "upstream group '{}' failed during the call: {why}",
                group.name
            );
            reply
                .error(session, 502, code::INTERNAL_ERROR, &text, None)
                .await;
            "upstream_error"
        }
        RoundEnd::ClientGone => {
            // A 2026-07-28 client closing its response cancels the request.
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            "client_gone"
        }
    }
}

/// Reads the upstream streams until the call completes or a round of questions is whole.
async fn drive(
    session: &mut ServerSession,
    upstream: &LegacySession<'_>,
    reply: &mut ClientReply,
    round: &mut Round,
    streams: &mut Streams,
    quiet_window: Duration,
) -> RoundEnd {
    if let Some(call) = streams.call.as_mut() {
        if !is_sse(call) {
            return match read_single(call).await {
                Ok(message) => RoundEnd::Complete(message),
                Err(e) => RoundEnd::Failed(e.to_string()),
            };
        }
    }
    let mut quiet_until: Option<Instant> = None;
    let mut resumptions = 0;
    loop {
        let quiet = async {
            match quiet_until {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let (from_call, chunk) = tokio::select! {
            c = next_chunk(&mut streams.call) => (true, c),
            c = next_chunk(&mut streams.session) => (false, c),
            _ = quiet => return RoundEnd::Questions,
            _ = session.read_body_or_idle(true) => return RoundEnd::ClientGone,
        };
        let events = match chunk {
            Some(Ok(Some(bytes))) => {
                let parser = if from_call {
                    &mut streams.call_parser
                } else {
                    &mut streams.session_parser
                };
                let mut events = Vec::new();
                if let Err(e) = parser.push(&bytes, &mut events) {
                    return RoundEnd::Failed(e.to_string());
                }
                events
            }
            Some(Ok(None)) | Some(Err(_)) if !from_call => {
                streams.session = None;
                continue;
            }
            Some(Ok(None)) | Some(Err(_)) => {
                // The upstream closed the call's stream mid-call (SSE polling): resume it.
                streams.call = None;
                resumptions += 1;
                let Some(last) = round.last_event_id().map(str::to_string) else {
                    return RoundEnd::Failed("the call's stream ended without a result".into());
                };
                if resumptions > MAX_RESUMPTIONS {
                    return RoundEnd::Failed("the upstream kept closing the call's stream".into());
                }
                match upstream.get(Some(&last)).await {
                    Ok(r) => streams.call = Some(r),
                    Err(e) => return RoundEnd::Failed(e.to_string()),
                }
                streams.call_parser = sse::Parser::new(MAX_UPSTREAM_MESSAGE);
                continue;
            }
            None => continue,
        };
        for event in events {
            if from_call {
                if let Some(id) = &event.id {
                    round.saw_call_event(id);
                }
            }
            if event.data.is_empty() {
                continue;
            }
            let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
                return RoundEnd::Failed("the upstream sent an event that is not JSON".into());
            };
            for action in round.on_message(message) {
                match action {
                    Action::Notify(n) => reply.notify(session, &n).await,
                    Action::AnswerUpstream(a) => {
                        if let Err(e) = upstream.post_and_expect_accepted(&a).await {
                            return RoundEnd::Failed(e.to_string());
                        }
                    }
                    Action::Complete(m) => return RoundEnd::Complete(m),
                    Action::MissingCapability { required, .. } => {
                        return RoundEnd::MissingCapability(required)
                    }
                }
            }
        }
        if round.has_questions() {
            quiet_until = Some(Instant::now() + quiet_window);
        }
    }
}

/// Has the reaper watch a new flow's upstream session until the flow's deadline.
fn watch(gw: &Gateway, upstream: &LegacySession<'_>, flow: &FlowState) -> bool {
    let Some(sid) = &upstream.session_id else {
        return true;
    };
    gw.reaper.watch(
        upstream.endpoint,
        upstream.timeouts,
        sid,
        flow.flow_deadline,
    )
}

fn is_sse(response: &Response) -> bool {
    response
        .header()
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

#[allow(clippy::too_many_arguments)]
async fn resume(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    reply: ClientReply,
    bind: &[u8; 32],
    text: &str,
) -> &'static str {
    let opened = FlowState::open(&gw.keys, bind, text, now_secs())
        .map_err(|e| e.reason())
        .and_then(|state| {
            let endpoint = (state.group == group.name)
                .then(|| group.endpoint(state.endpoint))
                .flatten();
            endpoint.map(|e| (state, e)).ok_or("unknown_endpoint")
        });
    let (mut flow, endpoint) = match opened {
        Ok(o) => o,
        Err(reason) => {
            gw.metrics
                .state_rejections
                .with_label_values(&[reason])
                .inc();
            tracing::info!(group = %group.name, reason, "requestState refused");
            reply
                .error(session, 400, code::INVALID_PARAMS, INVALID_STATE, None)
                .await;
            return "state_rejected";
        }
    };
    let upstream = LegacySession::resume(
        &gw.client,
        endpoint,
        &group.timeouts,
        flow.upstream_session.clone(),
    );
    let responses = request
        .params
        .get("inputResponses")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut answered = Vec::new();
    for pending in &flow.pending {
        let Some(answer) = responses.get(&pending.key) else {
            continue;
        };
        let message =
            json!({"jsonrpc": "2.0", "id": pending.upstream_id.to_json(), "result": answer});
        if let Err(e) = upstream.post_and_expect_accepted(&message).await {
            return upstream_failed(reply, session, group, &e).await;
        }
        answered.push(pending.upstream_id.clone());
    }
    // With every answer given, continue after the last event; otherwise replay the round
    // from its start so the unanswered questions are asked again.
    let all_answered = answered.len() == flow.pending.len();
    let from = if all_answered {
        flow.last_event_id.clone()
    } else {
        flow.round_start.clone().or(flow.last_event_id.clone())
    };
    let call = match upstream.get(from.as_deref()).await {
        Ok(r) => r,
        Err(e) => return upstream_failed(reply, session, group, &e).await,
    };
    let session_stream = upstream.get(None).await.ok();
    if all_answered {
        flow.round += 1;
    }
    flow.last_event_id = from;
    let server_info = gw.server_info(group);
    let streams = Streams::new(Some(call), session_stream);
    let answered = Answered(answered);
    run_round(
        gw,
        session,
        group,
        request,
        reply,
        bind,
        upstream,
        flow,
        streams,
        answered,
        &server_info,
    )
    .await
}
