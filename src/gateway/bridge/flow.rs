//! An interactive call (`tools/call`, `prompts/get`, `resources/read`) as rounds: the
//! first opens an upstream session and posts the call; each retry opens the sealed
//! `requestState`, posts the answers and resumes the call's stream. Between rounds the
//! upstream keeps running and the gateway holds nothing but the reaper's entry.

use super::hold::{Held, NotHeld};
use super::reply::{decorate, ClientReply};
use super::session::Attached;
use super::streams::{next_chunk, open_session_stream, resume_call, Settled, Source, Streams};
use super::{
    end_session, finish_with, fresh_call_id, upstream_failed, upstream_for, upstream_params,
    Incoming,
};
use crate::config::{Limits, ResumeMode};
use crate::gateway::learnt::SessionReplay;
use crate::gateway::passthrough::sleep_or_never;
use crate::gateway::{peers, Arrival, Gateway};
use crate::metrics::InUse;
use crate::mrtr::modern::{code as mcode, gateway_code as gcode, ModernRequest};
use crate::mrtr::replay::{self, Claim};
use crate::mrtr::state::{
    binding, now_ms, now_secs, FlowState, HeldAt, Known, UpstreamId, DEFERRED,
};
use crate::mrtr::translate::{Action, Round, RoundLimits};
use crate::protocol::jsonrpc::code;
use crate::protocol::sse;
use crate::upstream::exchange::{ExchangeError, Response};
use crate::upstream::legacy_session::{read_single, LegacySession, SessionError};
use crate::upstream::UpstreamGroup;
use pingora::protocols::http::ServerSession;
use serde_json::{json, Map, Value};
use std::time::Duration;
use tokio::time::Instant;

/// How often the bridge follows an upstream that closes the call's stream mid-call.
const MAX_RESUMPTIONS: usize = 8;
const INVALID_STATE: &str = "Invalid or expired requestState";

/// How a round ended.
enum RoundEnd {
    Complete(Value),
    Questions,
    MissingCapability(Value),
    Failed(String),
    /// The upstream sent no message for the round's silence limit.
    Silent,
    ClientGone,
    /// The gateway began draining: the flow goes on, on another replica.
    Draining,
}

/// What every step of one client request needs.
#[derive(Clone, Copy)]
struct Call<'a> {
    gw: &'a Gateway,
    group: &'a UpstreamGroup,
    request: &'a ModernRequest,
    /// The associated data of this request's `requestState`.
    bind: [u8; 32],
    /// The data-layer session the request runs in, if it carries a cookie.
    data_session: Option<&'a Attached>,
    /// The request as it arrived, to forward a retry to the replica holding its flow.
    incoming: &'a Incoming,
}

pub(super) async fn interactive(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: ModernRequest,
    reply: ClientReply,
    incoming: &Incoming,
    data_session: Option<&Attached>,
) -> &'static str {
    let bind = binding(
        &incoming.principal,
        &request.method,
        request.target.as_deref(),
        request.params.get("arguments"),
    );
    let call = Call {
        gw,
        group,
        request: &request,
        bind,
        data_session,
        incoming,
    };
    if let Err(text) = check_retry_limits(&request, &gw.config.limits) {
        reply
            .error(session, 400, code::INVALID_PARAMS, &text, None)
            .await;
        return "bad_request";
    }
    let _active = InUse::new(&gw.metrics.active_rounds);
    match request.params.get("requestState").and_then(Value::as_str) {
        None => start(&call, session, reply, None).await,
        Some(text) => resume(&call, session, reply, text).await,
    }
}

/// Refuses a retry whose `requestState` or `inputResponses` exceed the limits, before
/// any decoding.
fn check_retry_limits(request: &ModernRequest, limits: &Limits) -> Result<(), String> {
    if let Some(state) = request.params.get("requestState").and_then(Value::as_str) {
        if state.len() > limits.max_request_state_bytes {
            return Err(format!(
                "requestState is {} bytes, above the limit of {}",
                state.len(),
                limits.max_request_state_bytes
            ));
        }
    }
    let Some(responses) = request.params.get("inputResponses") else {
        return Ok(());
    };
    let count = responses.as_object().map_or(0, |r| r.len());
    if count > limits.max_input_requests_per_round {
        return Err(format!(
            "inputResponses has {count} entries, above the limit of {}",
            limits.max_input_requests_per_round
        ));
    }
    let size = serde_json::to_vec(responses).map_or(usize::MAX, |v| v.len());
    if size > limits.max_input_responses_bytes {
        return Err(format!(
            "inputResponses is {size} bytes, above the limit of {}",
            limits.max_input_responses_bytes
        ));
    }
    Ok(())
}

/// Why a round may not go to the client: too many questions at once, or too many rounds.
fn round_over_limits(limits: &Limits, flow: &FlowState, round: &Round) -> Option<String> {
    if round.question_count() > limits.max_input_requests_per_round {
        return Some(format!(
            "the server asked {} questions in one round, above the limit of {}",
            round.question_count(),
            limits.max_input_requests_per_round
        ));
    }
    (flow.round > limits.max_rounds).then(|| {
        format!(
            "the call needed more than {} rounds, the limit",
            limits.max_rounds
        )
    })
}

/// The sealed state of a round that may go to the client; `Err` says why it may not: too
/// many rounds, or a state longer than the gateway would accept back.
fn issue_state(call: &Call<'_>, flow: &FlowState, round: &Round) -> Result<String, String> {
    let limits = &call.gw.config.limits;
    if let Some(text) = round_over_limits(limits, flow, round) {
        return Err(text);
    }
    flow.seal_within(
        &call.gw.keys.load(),
        &call.bind,
        limits.max_request_state_bytes,
    )
    .map_err(|e| e.to_string())
}

/// Whether this replica sheds new calls now: more interactive requests are in progress
/// than `bridge.shed_above_active_rounds` (this one included), or more flows are held
/// than `bridge.shed_above_held_flows`.
fn shedding(gw: &Gateway) -> bool {
    let bridge = &gw.config.bridge;
    let (rounds, held) = (
        bridge.shed_above_active_rounds,
        bridge.shed_above_held_flows,
    );
    (rounds > 0 && gw.metrics.active_rounds.get() > rounds as i64)
        || (held > 0 && gw.held.usage().0 > held)
}

/// Starts a call, or, under load shedding, defers it. `deferred` is the state of a call
/// deferred earlier, whose flow id, start and deadline carry over.
async fn start(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    deferred: Option<FlowState>,
) -> &'static str {
    let Call { gw, group, .. } = *call;
    let mut flow = deferred.unwrap_or_else(|| FlowState {
        group: group.name.clone(),
        endpoint: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
        upstream_session: String::new(),
        call_id: UpstreamId::Number(0),
        pending: Vec::new(),
        last_event_id: None,
        round_start: None,
        round: DEFERRED,
        expires_at: 0,
        flow_deadline: now_secs() + gw.config.bridge.max_flow_seconds,
        started_ms: now_ms(),
        reissue: false,
        data_session: call.data_session.is_some(),
        known: Vec::new(),
        flow_id: rand::random(),
        held: None,
        session_event_id: None,
    });
    name_flow(&flow);
    if shedding(gw) {
        return defer(call, session, reply, flow).await;
    }
    flow.round = 1;
    run_call(call, session, reply, flow, call.data_session).await
}

/// Posts the call in the data-layer session, or in a new upstream session, and runs its
/// first round there. A re-run (round above 1) is watched by this replica's reaper at
/// once, since this request opened its session.
async fn run_call(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    mut flow: FlowState,
    data_session: Option<&Attached>,
) -> &'static str {
    let Call {
        gw, group, request, ..
    } = *call;
    let upstream = match upstream_for(gw, group, request, data_session).await {
        Ok(upstream) => upstream,
        Err(e) => return upstream_failed(gw, reply, session, group, &e).await,
    };
    let session_stream = session_stream(&upstream, None).await;
    let id = fresh_call_id();
    let message = json!({"jsonrpc": "2.0", "id": id, "method": request.method, "params": upstream_params(request)});
    let call_response = match upstream.post(&message).await {
        Ok(r) => r,
        Err(e) => {
            end_session(gw, &upstream).await;
            return upstream_failed(gw, reply, session, group, &e).await;
        }
    };
    flow.endpoint = upstream.endpoint.addr;
    flow.upstream_session = upstream.session_id.clone().unwrap_or_default();
    flow.call_id = UpstreamId::Number(id);
    flow.data_session = upstream.persistent;
    if flow.round > 1 && !watch(gw, &upstream, &flow) {
        return refuse_overloaded(gw, session, reply, &upstream).await;
    }
    let streams = Streams::new(Some(call_response), session_stream);
    let round = new_round(call, &flow);
    run_round(call, session, reply, upstream, flow, streams, round).await
}

/// Whether an upstream failure means the call is lost: its session is gone, or its
/// endpoint does not take connections.
fn is_lost(e: &SessionError) -> bool {
    matches!(
        e,
        SessionError::Gone | SessionError::Exchange(ExchangeError::Connect(_))
    )
}

/// Whether the call is a `restartable` tool's (never in a data-layer session, whose
/// state a re-run would not restore).
fn restartable(call: &Call<'_>) -> bool {
    let request = call.request;
    let tool = request.target.as_deref().unwrap_or_default();
    request.method == "tools/call"
        && call.data_session.is_none()
        && call.group.tools.get(tool).is_some_and(|t| t.restartable)
}

/// After the upstream lost the call (its session is gone or its endpoint is down, before
/// any answer of this retry reached it): a `restartable` tool runs again in a new
/// session, its repeated questions answered from the answers given so far and in this
/// retry; any other call ends with `FLOW_LOST`, for the client to issue again.
async fn lost(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    mut flow: FlowState,
    cause: Lost,
) -> &'static str {
    let gw = call.gw;
    let flow_id = format!("{:016x}", flow.flow_id);
    if !restartable(call) {
        tracing::info!(flow = flow_id, "the call was lost; not restartable");
        let group = &call.group.name;
        let what = match cause {
            Lost::Upstream => format!("upstream group '{group}' lost this call between rounds (its session is gone or its endpoint is down)"),
            Lost::Unresumable => format!("upstream group '{group}' no longer has this call's events (a Last-Event-ID resumption came back empty; the group's later calls are held)"),
            Lost::Holder => format!("the gateway replica holding this call's upstream streams is gone or no longer holds them (upstream group '{group}' cannot resume streams, so its calls are held)"),
        };
        let text = format!("{what}, and the tool is not marked restartable, so it is not run again: issue the call again");
        reply
            .error(session, 502, gcode::FLOW_LOST, &text, None)
            .await;
        return "upstream_error";
    }
    let responses = input_responses(call.request);
    for pending in &flow.pending {
        if let (Some(fingerprint), Some(answer)) =
            (pending.fingerprint, responses.get(&pending.key))
        {
            flow.known.push(Known {
                fingerprint,
                answer: answer.to_string(),
                used: true,
            });
        }
    }
    for known in &mut flow.known {
        known.used = false;
    }
    tracing::info!(
        flow = flow_id,
        answers = flow.known.len(),
        "upstream lost the call; running it again"
    );
    gw.metrics.call_restarts.inc();
    flow.pending.clear();
    flow.last_event_id = None;
    flow.round_start = None;
    flow.reissue = false;
    flow.held = None;
    flow.round += 1;
    run_call(call, session, reply, flow, None).await
}

/// What lost a call between rounds.
#[derive(Clone, Copy)]
enum Lost {
    /// The upstream: its session is gone, or its endpoint is down.
    Upstream,
    /// The upstream no longer has the call's events: a resumption came back empty.
    Unresumable,
    /// The replica that held the call's upstream streams (hold mode).
    Holder,
}

/// A retry's answers by input key.
fn input_responses(request: &ModernRequest) -> Map<String, Value> {
    request
        .params
        .get("inputResponses")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default()
}

/// The session's GET stream, where a legacy server sends requests not tied to a call.
/// A data-layer session has none: calls in it may run at once, and only each call's own
/// stream says which call a server request belongs to.
async fn session_stream(upstream: &LegacySession<'_>, after: Option<&str>) -> Option<Response> {
    if upstream.persistent {
        return None;
    }
    open_session_stream(upstream, after).await
}

/// A round's translator, for the call continuing from the flow's stream position.
fn new_round(call: &Call<'_>, flow: &FlowState) -> Round {
    let request = call.request;
    let forward_logs = request.log_level.is_some();
    let capabilities = request.client_capabilities.clone();
    let limits = &call.gw.config.limits;
    let round = Round::new(
        flow.call_id.clone(),
        capabilities,
        forward_logs,
        flow.last_event_id.clone(),
    )
    .bounded(RoundLimits {
        max_questions: limits.max_input_requests_per_round,
        max_bytes: limits.max_input_requests_bytes,
    })
    .session_from(flow.session_event_id.clone());
    if restartable(call) {
        return round.restartable(flow.known.clone());
    }
    round
}

async fn run_round(
    call: &Call<'_>,
    session: &mut ServerSession,
    mut reply: ClientReply,
    upstream: LegacySession<'_>,
    mut flow: FlowState,
    mut streams: Streams,
    mut round: Round,
) -> &'static str {
    let Call {
        gw, group, request, ..
    } = *call;
    let server_info = &gw.server_info(group);
    let pacing = Pacing {
        quiet_window: Duration::from_millis(gw.config.bridge.quiet_window_ms),
        poll: Duration::from_millis(gw.config.bridge.resume_poll_ms),
        keepalive: (gw.config.sse_keepalive_ms > 0)
            .then(|| Duration::from_millis(gw.config.sse_keepalive_ms)),
        silence: Duration::from_secs(gw.config.bridge.round_silence_seconds),
    };
    let end = drive(
        call,
        session,
        &upstream,
        &mut reply,
        &mut round,
        &mut streams,
        pacing,
    )
    .await;
    let cacheable = request.method == "resources/read";
    match end {
        RoundEnd::Complete(message) if round.absorb_url_required(&message) => {
            streams.close(gw).await;
            if !round.accepts_url_elicitation() {
                end_session(gw, &upstream).await;
                let data = json!({"requiredCapabilities": {"elicitation": {"url": {}}}});
                reply
                    .error(
                        session,
                        400,
                        mcode::MISSING_REQUIRED_CLIENT_CAPABILITY,
                        "the server needs URL-mode elicitation, which this request did not declare",
                        Some(data),
                    )
                    .await;
                return "missing_capability";
            }
            if flow.round == 1 && !watch(gw, &upstream, &flow) {
                return refuse_overloaded(gw, session, reply, &upstream).await;
            }
            flow.reissue = true;
            flow.pending.clear();
            flow.last_event_id = None;
            flow.round_start = None;
            flow.expires_at = state_expiry(gw, &flow);
            ask_client(call, session, reply, &upstream, flow, &round, server_info).await
        }
        RoundEnd::Complete(message) => {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            observe_completed(gw, &flow);
            finish_with(reply, session, message, server_info, cacheable).await
        }
        RoundEnd::Questions
            if round.last_event_id().is_none() && group.resume == ResumeMode::Resumable =>
        {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            let text = format!("upstream group '{}' is configured `resume: resumable`, but its SSE events carry no ids, so its calls cannot be resumed: configure `resume: auto` or `hold`", group.name);
            reply
                .error(session, 502, code::INTERNAL_ERROR, &text, None)
                .await;
            "upstream_error"
        }
        RoundEnd::Questions | RoundEnd::Draining
            if flow.round == 1 && !watch(gw, &upstream, &flow) =>
        {
            streams.close(gw).await;
            refuse_overloaded(gw, session, reply, &upstream).await
        }
        end @ (RoundEnd::Questions | RoundEnd::Draining) => {
            // A round cut short by draining goes to the client like one with questions:
            // whatever was asked, possibly nothing (a requestState-only result, retried at
            // once), with a state from which any replica resumes the call. A round of an
            // upstream that cannot resume is held here instead (never cut by draining).
            let resumable = resumes(call, &round);
            gw.note_resumable(group, resumable);
            if matches!(end, RoundEnd::Draining) {
                let flow_id = format!("{:016x}", flow.flow_id);
                tracing::info!(flow = flow_id, "round handed over: draining");
            }
            flow.reissue = false;
            flow.pending = round.pending().to_vec();
            flow.last_event_id = round.last_event_id().map(str::to_string);
            flow.round_start = round.round_start().map(str::to_string);
            flow.session_event_id = round.session_resume_from().map(str::to_string);
            if restartable(call) {
                flow.known = round.known().to_vec();
            }
            flow.expires_at = state_expiry(gw, &flow);
            if !resumable {
                return hold(call, session, reply, &upstream, flow, streams, &round).await;
            }
            streams.close(gw).await;
            ask_client(call, session, reply, &upstream, flow, &round, server_info).await
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
        RoundEnd::Silent => {
            streams.close(gw).await;
            end_session(gw, &upstream).await;
            let target = request.target.as_deref().unwrap_or_default();
            let text = format!(
                "upstream group '{}' sent nothing for {} s (bridge.round_silence_seconds) while the gateway waited for {} '{target}' to answer or ask (round {})",
                group.name, gw.config.bridge.round_silence_seconds, request.method, flow.round
            );
            reply
                .error(session, 504, code::INTERNAL_ERROR, &text, None)
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

/// How a round paces itself.
#[derive(Clone, Copy)]
struct Pacing {
    /// After a question, how long to wait for more before answering the round.
    quiet_window: Duration,
    /// How long a call stream may stay silent before it is polled again.
    poll: Duration,
    /// How long the client's response may stay silent before a keep-alive comment.
    keepalive: Option<Duration>,
    /// How long the upstream may send no message at all before the round ends in error.
    silence: Duration,
}

/// Following the call's stream across upstream reconnections.
struct Follow {
    /// The upstream's SSE `retry` hint: the wait before reconnecting after it ends a stream.
    retry: Duration,
    /// Stream ends in a row without a message in between.
    empty_ends: usize,
    last_activity: Instant,
    /// When the upstream last sent a message (not a priming event or a comment).
    last_message: Instant,
    /// The call's stream was reopened (not the call's own POST stream).
    reopened: bool,
    /// Resumptions in a row that ended without a single event.
    empty_resumptions: u32,
}

/// Longest `retry` hint honoured.
const MAX_RETRY: Duration = Duration::from_secs(10);

async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Reopens the call's stream after the last event seen, waiting `wait` first.
async fn reopen_call(
    upstream: &LegacySession<'_>,
    round: &Round,
    streams: &mut Streams,
    wait: Duration,
) -> Result<(), RoundEnd> {
    streams.call = None;
    let Some(last) = round.last_event_id().map(str::to_string) else {
        return Err(RoundEnd::Failed(
            "the call's stream ended without a result".into(),
        ));
    };
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    let response = resume_call(upstream, &last)
        .await
        .map_err(|e| RoundEnd::Failed(e.to_string()))?;
    streams.replace_call(response);
    Ok(())
}

/// Reads the upstream streams until the call completes or a round of questions is whole:
/// the quiet window passed after the last new question, or the round is full.
///
/// The call's stream is followed across reconnections: when the upstream ends it
/// mid-call (SEP-1699 polling) it is reopened with `Last-Event-ID` after the upstream's
/// `retry` hint; when it stays silent for the poll interval it is reopened at once, which
/// recovers events an upstream stored but did not deliver to a resumed connection.
async fn drive(
    call: &Call<'_>,
    session: &mut ServerSession,
    upstream: &LegacySession<'_>,
    reply: &mut ClientReply,
    round: &mut Round,
    streams: &mut Streams,
    pacing: Pacing,
) -> RoundEnd {
    if let Some(call) = streams.call.as_mut() {
        if !call.is_sse() {
            return match read_single(call).await {
                Ok(message) => RoundEnd::Complete(message),
                Err(e) => RoundEnd::Failed(e.to_string()),
            };
        }
    }
    // Questions carried over from a held round's retry are asked after the quiet window,
    // even if the upstream (waiting for their answers) says nothing more.
    let mut quiet_until = round
        .has_questions()
        .then(|| Instant::now() + pacing.quiet_window);
    let mut follow = Follow {
        retry: Duration::from_secs(1),
        empty_ends: 0,
        last_activity: Instant::now(),
        last_message: Instant::now(),
        reopened: streams.call_resumed,
        empty_resumptions: 0,
    };
    loop {
        if round.is_full() {
            return RoundEnd::Questions;
        }
        let Some((source, event)) = streams.backlog.pop_front() else {
            if let Some(end) = read_more(
                call,
                session,
                upstream,
                reply,
                round,
                streams,
                pacing,
                &mut follow,
                quiet_until,
            )
            .await
            {
                return end;
            }
            continue;
        };
        let asked = round.question_count();
        if let Some(end) =
            on_event(upstream, session, reply, round, source, event, &mut follow).await
        {
            return end;
        }
        if round.question_count() > asked {
            quiet_until = Some(Instant::now() + pacing.quiet_window);
        }
    }
}

/// Waits for the next chunk of either upstream stream and parses it into the backlog,
/// following the call's stream, sending keep-alives, and noticing the client leave or the
/// gateway drain. `Some` ends the round.
#[allow(clippy::too_many_arguments)]
async fn read_more(
    call: &Call<'_>,
    session: &mut ServerSession,
    upstream: &LegacySession<'_>,
    reply: &mut ClientReply,
    round: &Round,
    streams: &mut Streams,
    pacing: Pacing,
    follow: &mut Follow,
    quiet_until: Option<Instant>,
) -> Option<RoundEnd> {
    // Only a stream with event ids can be reopened; one without is waited for.
    let resumable = streams.call.is_some() && round.last_event_id().is_some();
    let poll_at = (quiet_until.is_none() && resumable).then(|| follow.last_activity + pacing.poll);
    let (source, chunk) = tokio::select! {
        c = next_chunk(&mut streams.call) => (Source::Call, c),
        c = next_chunk(&mut streams.session) => (Source::Session, c),
        _ = sleep_until_or_never(quiet_until) => return Some(RoundEnd::Questions),
        _ = tokio::time::sleep_until(follow.last_message + pacing.silence) => return Some(RoundEnd::Silent),
        _ = sleep_until_or_never(poll_at) => {
            if let Err(end) = reopen_call(upstream, round, streams, Duration::ZERO).await {
                return Some(end);
            }
            follow.last_activity = Instant::now();
            follow.reopened = true;
            return None;
        }
        _ = session.read_body_or_idle(true) => return Some(RoundEnd::ClientGone),
        // Only a resumable round can be handed over; others finish here.
        _ = call.gw.drain.wait(), if resumes(call, round) => return Some(RoundEnd::Draining),
        _ = sleep_or_never(pacing.keepalive) => {
            if reply.keep_alive(session).await {
                call.gw.metrics.sse_keepalives.inc();
            }
            return None;
        }
    };
    match (source, chunk) {
        (_, Some(Ok(Some(bytes)))) => {
            if source == Source::Call {
                follow.last_activity = Instant::now();
            }
            streams
                .push(source, &bytes)
                .err()
                .map(|e| RoundEnd::Failed(e.to_string()))
        }
        (Source::Session, _) => {
            streams.session = None;
            None
        }
        // A resumption that ends without a single event: the upstream no longer has the
        // call's events (its store forgot them), so following it further gets nothing.
        (Source::Call, Some(Ok(None)) | Some(Err(_)))
            if follow.reopened && streams.call_events == 0 =>
        {
            if follow.empty_resumptions >= EMPTY_RETRIES {
                call.gw.note_replay_refused(call.group, "an empty stream");
                return Some(RoundEnd::Failed(
                    "a Last-Event-ID resumption of the call's stream came back empty: the upstream no longer has the call's events".into(),
                ));
            }
            let wait = EMPTY_BACKOFF * 2u32.pow(follow.empty_resumptions);
            follow.empty_resumptions += 1;
            if let Err(end) = reopen_call(upstream, round, streams, wait).await {
                return Some(end);
            }
            None
        }
        (Source::Call, Some(Ok(None)) | Some(Err(_))) => {
            follow.empty_ends += 1;
            if follow.empty_ends > MAX_RESUMPTIONS {
                return Some(RoundEnd::Failed(
                    "the upstream kept closing the call's stream".into(),
                ));
            }
            if let Err(end) = reopen_call(upstream, round, streams, follow.retry).await {
                return Some(end);
            }
            follow.last_activity = Instant::now();
            follow.reopened = true;
            None
        }
        (Source::Call, None) => None,
    }
}

/// Feeds one upstream event to the round and carries out what it asks. `Some` ends the
/// round.
async fn on_event(
    upstream: &LegacySession<'_>,
    session: &mut ServerSession,
    reply: &mut ClientReply,
    round: &mut Round,
    source: Source,
    event: sse::Event,
    follow: &mut Follow,
) -> Option<RoundEnd> {
    match (source, &event.id) {
        (Source::Call, Some(id)) => round.saw_call_event(id),
        (Source::Session, Some(id)) => round.saw_session_event(id),
        _ => {}
    }
    if let (Source::Call, Some(ms)) = (source, event.retry) {
        follow.retry = Duration::from_millis(ms).min(MAX_RETRY);
    }
    if event.data.is_empty() {
        return None;
    }
    follow.last_message = Instant::now();
    if source == Source::Call {
        follow.empty_ends = 0;
    }
    let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
        return Some(RoundEnd::Failed(
            "the upstream sent an event that is not JSON".into(),
        ));
    };
    let actions = match source {
        Source::Call => round.on_message(message),
        Source::Session => round.on_session_message(message),
    };
    for action in actions {
        match action {
            Action::Notify(n) => reply.notify(session, &n).await,
            Action::AnswerUpstream(a) => {
                if let Err(e) = upstream.post_and_expect_accepted(&a).await {
                    return Some(RoundEnd::Failed(e.to_string()));
                }
            }
            Action::Complete(m) => return Some(RoundEnd::Complete(m)),
            Action::MissingCapability { required, .. } => {
                return Some(RoundEnd::MissingCapability(required))
            }
            Action::Fail(why) => return Some(RoundEnd::Failed(why)),
        }
    }
    None
}

/// After a URL-elicitation-required error: the user has visited the URLs, so the call is
/// posted again, under a new id, in the same upstream session.
async fn reissue(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    upstream: LegacySession<'_>,
    mut flow: FlowState,
) -> &'static str {
    let Call {
        gw, group, request, ..
    } = *call;
    let next_id = fresh_call_id();
    let message = json!({"jsonrpc": "2.0", "id": next_id, "method": request.method, "params": upstream_params(request)});
    let call_stream = match upstream.post(&message).await {
        Ok(r) => r,
        Err(e) => return upstream_failed(gw, reply, session, group, &e).await,
    };
    flow.call_id = UpstreamId::Number(next_id);
    flow.reissue = false;
    flow.round += 1;
    let streams = Streams::new(Some(call_stream), session_stream(&upstream, None).await);
    let round = new_round(call, &flow);
    run_round(call, session, reply, upstream, flow, streams, round).await
}

/// When a state sealed now expires: a round's TTL, never past the flow's deadline.
fn state_expiry(gw: &Gateway, flow: &FlowState) -> u64 {
    (now_secs() + gw.config.bridge.request_state_ttl_seconds).min(flow.flow_deadline)
}

/// Whether a round that ends now waits resumable, rather than held on this replica.
fn resumes(call: &Call<'_>, round: &Round) -> bool {
    call.gw.resumes(call.group, round.last_event_id().is_some())
}

/// Holds the flow on this replica with its upstream streams open, and asks the client;
/// the state names this replica and the slot. A round over the limits, or one the table
/// cannot take, ends with an error instead.
async fn hold(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    upstream: &LegacySession<'_>,
    mut flow: FlowState,
    streams: Streams,
    round: &Round,
) -> &'static str {
    let gw = call.gw;
    let server_info = &gw.server_info(call.group);
    // The state will name the slot; the largest slot number sizes it.
    flow.held = Some(HeldAt {
        owner: gw.peers.advertise,
        slot: u64::MAX,
    });
    if issue_state(call, &flow, round).is_err() {
        // Refused before taking a slot: `ask_client` answers the client with the reason.
        streams.close(gw).await;
        return ask_client(call, session, reply, upstream, flow, round, server_info).await;
    }
    let held = Held::new(
        flow.flow_id,
        flow.expires_at,
        upstream.endpoint.clone(),
        *upstream.timeouts,
        upstream.session_id.clone().filter(|_| !upstream.persistent),
        streams,
        round.input_requests().clone(),
        flow.pending.clone(),
    );
    let slot = match gw.held.hold(held) {
        Ok(slot) => slot,
        Err((refused, held)) => {
            held.abandon(gw).await;
            let (status, text) = match refused {
                NotHeld::Full => (503, "too many flows are held on this replica; retry later".to_string()),
                NotHeld::TooLarge(bytes) => (502, format!("the round's questions take {bytes} bytes, above bridge.max_held_bytes_per_flow ({})", gw.config.bridge.max_held_bytes_per_flow)),
            };
            reply
                .error(session, status, code::INTERNAL_ERROR, &text, None)
                .await;
            return "overloaded";
        }
    };
    gw.metrics.held_event("held");
    flow.held = Some(HeldAt {
        owner: gw.peers.advertise,
        slot,
    });
    ask_client(call, session, reply, upstream, flow, round, server_info).await
}

/// Ends a round by sending the client its questions with the sealed state, unless the
/// round is over the limits: then the call ends with an error naming the limit.
async fn ask_client(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    upstream: &LegacySession<'_>,
    flow: FlowState,
    round: &Round,
    server_info: &Value,
) -> &'static str {
    let gw = call.gw;
    let sealed = match issue_state(call, &flow, round) {
        Ok(sealed) => sealed,
        Err(text) => {
            end_session(gw, upstream).await;
            tracing::info!(flow = format!("{:016x}", flow.flow_id), %text, "round over the limits");
            reply
                .error(session, 502, code::INTERNAL_ERROR, &text, None)
                .await;
            return "over_limit";
        }
    };
    tracing::info!(
        flow = format!("{:016x}", flow.flow_id),
        round = flow.round,
        questions = flow.pending.len(),
        reissue = flow.reissue,
        "input required"
    );
    let result = decorate(round.input_required(sealed), server_info, false);
    reply.result(session, result).await;
    gw.metrics
        .input_required
        .with_label_values(&[call.request.method.as_str()])
        .inc();
    "input_required"
}

/// Defers a call under load shedding: a `requestState`-only InputRequiredResult whose
/// retry, on any replica, starts the call. Nothing went upstream.
async fn defer(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    mut flow: FlowState,
) -> &'static str {
    let gw = call.gw;
    flow.expires_at = state_expiry(gw, &flow);
    let sealed = flow.seal(&gw.keys.load(), &call.bind);
    gw.metrics.shed.inc();
    tracing::info!(
        flow = format!("{:016x}", flow.flow_id),
        "call deferred: shedding load"
    );
    let result = json!({"resultType": "input_required", "requestState": sealed});
    reply
        .result(
            session,
            decorate(result, &gw.server_info(call.group), false),
        )
        .await;
    "shed"
}

/// Names the flow in the request's span, so its access line carries the flow id; the id
/// travels in the state, so every round on every replica logs the same one.
fn name_flow(flow: &FlowState) {
    tracing::Span::current().record("flow", format!("{:016x}", flow.flow_id));
}

/// Counts a flow that reached its result: its rounds and its duration across them.
fn observe_completed(gw: &Gateway, flow: &FlowState) {
    gw.metrics.flow_rounds.observe(f64::from(flow.round));
    let ms = now_ms().saturating_sub(flow.started_ms);
    gw.metrics.flow_duration.observe(ms as f64 / 1000.0);
}

/// Refuses a new flow the reaper has no room to watch: it would otherwise go unwatched.
async fn refuse_overloaded(
    gw: &Gateway,
    session: &mut ServerSession,
    reply: ClientReply,
    upstream: &LegacySession<'_>,
) -> &'static str {
    end_session(gw, upstream).await;
    let text = "too many flows are waiting for input on this replica; retry later";
    reply
        .error(session, 503, code::INTERNAL_ERROR, text, None)
        .await;
    "overloaded"
}

/// Has the reaper watch a new flow's upstream session until the flow's deadline.
fn watch(gw: &Gateway, upstream: &LegacySession<'_>, flow: &FlowState) -> bool {
    let Some(sid) = upstream
        .session_id
        .as_ref()
        .filter(|_| !upstream.persistent)
    else {
        return true;
    };
    gw.reaper.watch(
        &upstream.endpoint,
        upstream.timeouts,
        sid,
        flow.flow_deadline,
    )
}

async fn resume(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    text: &str,
) -> &'static str {
    let Call { gw, group, .. } = *call;
    let bind = &call.bind;
    let opened = FlowState::open(&gw.keys.load(), bind, text, now_secs())
        .map_err(|e| e.reason())
        .and_then(|state| {
            if state.group != group.name {
                return Err("unknown_endpoint");
            }
            if state.round == DEFERRED {
                return Ok((state, None));
            }
            let endpoint = group.endpoint(state.endpoint).ok_or("unknown_endpoint")?;
            Ok((state, Some(endpoint)))
        });
    let (flow, endpoint) = match opened {
        Ok(o) => o,
        Err(reason) => return refuse_state(gw, session, reply, group, reason).await,
    };
    name_flow(&flow);
    if let Some(held) = flow.held.filter(|h| !gw.peers.is_me(h.owner)) {
        return to_holder(call, session, reply, flow, held.owner).await;
    }
    let used = replay::digest(text);
    let claim =
        gw.used_states
            .lock()
            .expect("used-states lock")
            .claim(used, flow.expires_at, now_secs());
    match claim {
        Claim::Fresh => {}
        Claim::Replayed => return refuse_state(gw, session, reply, group, "replayed").await,
        Claim::Full => {
            let text = "too many retries are in flight on this replica; retry later";
            reply
                .error(session, 503, code::INTERNAL_ERROR, text, None)
                .await;
            return "overloaded";
        }
    }
    let Some(endpoint) = endpoint else {
        return start(call, session, reply, Some(flow)).await;
    };
    let held = match flow.held {
        None => None,
        Some(at) => match gw.held.take(at.slot, flow.flow_id) {
            Some(held) => Some(held),
            None => {
                gw.metrics.held_event("lost");
                return lost(call, session, reply, flow, Lost::Holder).await;
            }
        },
    };
    let mut upstream = LegacySession::resume(
        &gw.client,
        endpoint,
        &group.timeouts,
        flow.upstream_session.clone(),
    );
    upstream.trace = call.request.trace.clone();
    upstream.persistent = flow.data_session;
    gw.metrics.upstream_session("reused");
    continue_flow(call, session, reply, upstream, flow, held, used).await
}

/// The retry of a flow held by another replica: forwarded to it, whose answer the client
/// gets; or, when it cannot be reached (or this request came from a peer that thought
/// this replica held it), the flow is lost with it.
async fn to_holder(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    flow: FlowState,
    owner: Option<std::net::SocketAddr>,
) -> &'static str {
    let gw = call.gw;
    let why = match owner {
        _ if call.incoming.arrival == Arrival::Peer => {
            "forwarded here, but held by another replica".to_string()
        }
        None => "held by a replica without a peer listener".to_string(),
        Some(owner) => match peers::forward(gw, session, owner, &call.incoming.body).await {
            Ok(_) => {
                gw.metrics.peer_forwards.with_label_values(&["ok"]).inc();
                return "forwarded";
            }
            Err(why) => why,
        },
    };
    gw.metrics
        .peer_forwards
        .with_label_values(&["owner_gone"])
        .inc();
    let flow_id = format!("{:016x}", flow.flow_id);
    tracing::info!(flow = flow_id, owner = ?owner, %why, "the replica holding the flow cannot continue it");
    lost(call, session, reply, flow, Lost::Holder).await
}

/// Posts a retry's answers upstream and goes on with the call: on the held streams, or by
/// resuming the call's stream with `Last-Event-ID`. A resumable flow's streams are
/// reopened (and settled) *before* any answer goes up, so that what the answers cause
/// (the next question, the result) finds a stream to go out on: servers forget a call's
/// events once its result is sent, and send a session's requests only to a connected GET
/// stream. `used` is the state's replay digest, released when the upstream provably got
/// none of its answers.
async fn continue_flow(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    upstream: LegacySession<'_>,
    mut flow: FlowState,
    held: Option<Box<Held>>,
    used: replay::StateDigest,
) -> &'static str {
    let Call { gw, group, .. } = *call;
    let responses = input_responses(call.request);
    let all_answered = flow.pending.iter().all(|p| responses.contains_key(&p.key));
    // With every answer given, continue after the last event; otherwise replay the round
    // from its start so the unanswered questions are asked again.
    let from = if all_answered {
        flow.last_event_id.clone()
    } else {
        flow.round_start.clone().or(flow.last_event_id.clone())
    };
    let mut reopened = None;
    if held.is_none() && !flow.reissue {
        match reopen(call, &upstream, &flow, from.as_deref()).await {
            Ok(streams) => reopened = Some(streams),
            Err(unresumable) => {
                // Nothing was posted: the same state may be retried.
                release(gw, &used);
                return resume_failed(call, session, reply, &upstream, flow, unresumable).await;
            }
        }
    }
    let mut answered = Vec::new();
    for pending in flow.pending.clone() {
        let Some(answer) = responses.get(&pending.key) else {
            continue;
        };
        let message =
            json!({"jsonrpc": "2.0", "id": pending.upstream_id.to_json(), "result": answer});
        if let Err(e) = upstream.post_and_expect_accepted(&message).await {
            let nothing_posted = answered.is_empty();
            if let Some(streams) = reopened {
                streams.close(gw).await;
            }
            if let Some(held) = held {
                held.abandon(gw).await;
            } else if nothing_posted && never_delivered(&e) {
                // The upstream has no answer of this state's (it was unreachable, or
                // refused the answer): the same state may be retried.
                release(gw, &used);
            }
            if nothing_posted && is_lost(&e) && !flow.data_session {
                return lost(call, session, reply, flow, Lost::Upstream).await;
            }
            return upstream_failed(gw, reply, session, group, &e).await;
        }
        answered.push(pending.upstream_id.clone());
        if let Some(fingerprint) = pending.fingerprint {
            flow.known.push(Known {
                fingerprint,
                answer: answer.to_string(),
                used: true,
            });
        }
    }
    if let Some(held) = held {
        return continue_held(call, session, reply, upstream, flow, held, answered).await;
    }
    let Some(streams) = reopened else {
        return reissue(call, session, reply, upstream, flow).await;
    };
    if all_answered {
        flow.round += 1;
    }
    flow.last_event_id = from;
    let mut round = new_round(call, &flow);
    round.skip(answered);
    run_round(call, session, reply, upstream, flow, streams, round).await
}

/// Releases a state's replay claim: the upstream provably got none of its answers.
fn release(gw: &Gateway, used: &replay::StateDigest) {
    gw.used_states
        .lock()
        .expect("used-states lock")
        .release(used);
}

/// Why a retry could not get back into its call's streams.
enum Unresumable {
    /// The resumption failed (the session is gone, the endpoint is down, it was refused).
    Failed(SessionError),
    /// The resumption came back empty: the upstream no longer has the call's events.
    Empty,
}

/// How long a retry waits for a resumed stream's priming event: from an upstream known
/// to prime, and (once, to learn) from one not known yet.
const SETTLE_PRIMED: Duration = Duration::from_secs(2);
const SETTLE_UNKNOWN: Duration = Duration::from_millis(300);

/// How often an empty resumption is tried again, after how long at first (doubling),
/// before the upstream is taken not to have the call's events: an upstream that still
/// holds the previous connection of the stream can answer one with an empty stream
/// (the Python SDK registers a stream id once), and drops that connection soon after.
const EMPTY_RETRIES: u32 = 2;
const EMPTY_BACKOFF: Duration = Duration::from_millis(100);

/// Reopens a resumable flow's streams for a retry: the call's after `from`, settled,
/// then the session's after its sealed position when the group's store keeps sessions
/// apart (else fresh). A refused resumption, or one that stays empty, tells
/// `resume: auto` that the group cannot resume.
async fn reopen(
    call: &Call<'_>,
    upstream: &LegacySession<'_>,
    flow: &FlowState,
    from: Option<&str>,
) -> Result<Streams, Unresumable> {
    let Call { gw, group, .. } = *call;
    let Some(from) = from else {
        let e = SessionError::Protocol(
            "the state holds no position to resume the call's stream from".into(),
        );
        return Err(Unresumable::Failed(e));
    };
    let mut empty = 0;
    let mut streams = loop {
        let call_stream = resume_call(upstream, from).await.map_err(|e| {
            if matches!(e, SessionError::Refused(_) | SessionError::Protocol(_)) {
                gw.note_replay_refused(group, "a refusal");
            }
            Unresumable::Failed(e)
        })?;
        let mut streams = Streams::resumed(call_stream, None);
        match settle(gw, group, &mut streams).await {
            Ok(Settled::Empty) if empty < EMPTY_RETRIES => {
                streams.close(gw).await;
                tokio::time::sleep(EMPTY_BACKOFF * 2u32.pow(empty)).await;
                empty += 1;
            }
            Ok(Settled::Empty) => {
                streams.close(gw).await;
                gw.note_replay_refused(group, "an empty stream");
                return Err(Unresumable::Empty);
            }
            Ok(_) => break streams,
            Err(e) => {
                streams.close(gw).await;
                return Err(Unresumable::Failed(e));
            }
        }
    };
    let session_after = match flow.session_event_id.as_deref() {
        Some(id) if !upstream.persistent => {
            let verdict = super::probe::session_replay(gw, group, &upstream.endpoint).await;
            (verdict == SessionReplay::Scoped).then_some(id)
        }
        _ => None,
    };
    streams.session = session_stream(upstream, session_after).await;
    Ok(streams)
}

/// Settles a resumed call stream (`Streams::settle`), awaiting the priming event from a
/// group known to prime, and once from one not known yet, to learn it.
async fn settle(
    gw: &Gateway,
    group: &UpstreamGroup,
    streams: &mut Streams,
) -> Result<Settled, SessionError> {
    let primes = gw.learnt.get(&group.name).resumption_primes;
    let limit = if primes == Some(true) {
        SETTLE_PRIMED
    } else {
        SETTLE_UNKNOWN
    };
    let settled = streams.settle(primes != Some(false), limit).await?;
    let learnt = match settled {
        Settled::Primed => Some(true),
        Settled::TimedOut if primes.is_none() => Some(false),
        _ => None,
    };
    if let Some(primes) = learnt {
        gw.learnt
            .update(&group.name, |facts| facts.resumption_primes = Some(primes));
    }
    Ok(settled)
}

/// Answers a retry whose call's streams could not be reopened; nothing was posted.
async fn resume_failed(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    upstream: &LegacySession<'_>,
    flow: FlowState,
    unresumable: Unresumable,
) -> &'static str {
    let Call { gw, group, .. } = *call;
    match unresumable {
        Unresumable::Failed(e) if is_lost(&e) && !flow.data_session => {
            lost(call, session, reply, flow, Lost::Upstream).await
        }
        Unresumable::Failed(e) => upstream_failed(gw, reply, session, group, &e).await,
        Unresumable::Empty if flow.data_session => {
            let e = SessionError::Protocol("a Last-Event-ID resumption came back empty: the upstream no longer has the call's events".into());
            upstream_failed(gw, reply, session, group, &e).await
        }
        Unresumable::Empty => {
            // The call waits for answers it will never get: end its session.
            end_session(gw, upstream).await;
            lost(call, session, reply, flow, Lost::Unresumable).await
        }
    }
}

/// Whether an answer that failed provably never reached the upstream.
fn never_delivered(e: &SessionError) -> bool {
    matches!(
        e,
        SessionError::Exchange(ExchangeError::Connect(_))
            | SessionError::Protocol(_)
            | SessionError::Gone
    )
}

/// Goes on reading a held flow's streams where its round stopped. Questions the retry
/// left unanswered are asked again at once (nothing replays them).
async fn continue_held(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    upstream: LegacySession<'_>,
    mut flow: FlowState,
    held: Box<Held>,
    answered: Vec<UpstreamId>,
) -> &'static str {
    call.gw.metrics.held_event("resumed");
    flow.held = None;
    let mut round = new_round(call, &flow);
    let mut unanswered = 0;
    for pending in &held.pending {
        if answered.contains(&pending.upstream_id) {
            continue;
        }
        if let Some(question) = held.questions.get(&pending.key) {
            round.ask_again(pending.clone(), question.clone());
            unanswered += 1;
        }
    }
    if unanswered == 0 {
        flow.round += 1;
    }
    round.skip(answered);
    run_round(call, session, reply, upstream, flow, held.streams, round).await
}

/// Answers a `requestState` that was refused, with one uniform error whatever the reason;
/// the reason goes to the logs and the rejection metric.
async fn refuse_state(
    gw: &Gateway,
    session: &mut ServerSession,
    reply: ClientReply,
    group: &UpstreamGroup,
    reason: &'static str,
) -> &'static str {
    gw.metrics
        .state_rejections
        .with_label_values(&[reason])
        .inc();
    tracing::info!(group = %group.name, reason, "requestState refused");
    reply
        .error(session, 400, code::INVALID_PARAMS, INVALID_STATE, None)
        .await;
    "state_rejected"
}
