//! Interactive calls (`tools/call`, `prompts/get`, `resources/read`) in the shell: what a
//! request brings (its sealed state, opened and claimed; a held flow, taken from the
//! table or forwarded to the replica holding it), and the one async driver that runs a
//! [`Flow`]: it carries out each command with the upstream session and the client's
//! response, and feeds back what happened, until the flow finishes. The decisions are the
//! flow's (`mrtr::flow`); this is the only async code of a bridged call.

use super::hold::{Held, HeldSession, NotHeld};
use super::one_shot::Shape;
use super::reply::{decorate_as_is, ClientReply};
use super::session::{self, Attached};
use super::streams::{
    answer_of, next_chunk, open_session_stream, resume_call, PendingResponse, SessionStream,
    Source, Streams, SESSION_STREAM_PATIENCE,
};
use super::warm;
use super::{
    counted_principal, end_session, end_session_later, finish_with, upstream_for, upstream_params,
    with_progress_token, Incoming,
};
use crate::config::{Limits, QuietWindowFor};
use crate::gateway::learnt::SessionReplay;
use crate::gateway::precise_sleep::sleep_until_or_never;
use crate::gateway::reaper::{Abandoned, NotWatched, Whose};
use crate::gateway::{peers, respond, Arrival, Gateway, UpstreamSide};
use crate::metrics::InUse;
use crate::mrtr::flow::{
    CallReply, Command, Ending, Failure, FailureKind, Flow, FlowConfig, Input, Learnt, Lost, Note,
    Stream, StreamGet,
};
use crate::mrtr::modern::{check_answers, ModernRequest};
use crate::mrtr::replay::{self, Claim, StateDigest};
use crate::mrtr::state::{binding, now_ms, now_secs, FlowState, HeldAt, UpstreamCall, Waiting};
use crate::mrtr::translate::{Relay, RoundLimits};
use crate::outcome::{Class, Outcome, Refusal, Report};
use crate::protocol::jsonrpc::{self, code, Cancellation};
use crate::protocol::sse::Event;
use crate::upstream::exchange::{Connection, ExchangeFailure, Response};
use crate::upstream::legacy_session::{
    read_single, Caller, LegacySession, SessionError, SessionFailure,
};
use crate::upstream::UpstreamGroup;
use pingora::protocols::http::ServerSession;
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};

const INVALID_STATE: &str = "Invalid or expired requestState";

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

/// The upstream side of a running flow, and the retry's replay claim.
struct Io<'g> {
    upstream: Option<LegacySession<'g>>,
    streams: Streams,
    claim: Option<StateDigest>,
    /// The drain signal was passed to the flow (it fires for good once set).
    drain_told: bool,
    /// So was the grace period's last stretch.
    near_end_told: bool,
    /// The client's leaving was passed to the flow (its connection stays readable-at-end,
    /// so the flow is told once and never woken by it again).
    client_gone_told: bool,
    /// A session of this shape opens ahead of demand once the client has its answer:
    /// the upstream is busy with this call until then.
    warm_after: Option<Shape>,
    /// A held flow's retry: the credentials of the round that held it, which end the
    /// call upstream if the upstream denies the retry's own (a token that expired while
    /// the client was away).
    holder_caller: Option<Caller>,
}

pub(super) async fn interactive(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: ModernRequest,
    reply: ClientReply,
    incoming: &Incoming,
    data_session: Option<&Attached>,
) -> Outcome {
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
    if let Err(too_large) = check_retry_limits(&request, &gw.config.limits) {
        if too_large.state {
            count_state_rejection(gw, group, "too_long");
        }
        let refusal = Refusal::new(Class::BadRequest, code::INVALID_PARAMS, too_large.text);
        return refuse(session, reply, refusal).await;
    }
    let _active = InUse::new(&gw.runtime.metrics.active_rounds);
    let now = Instant::now();
    let Some(text) = request.params.get("requestState").and_then(Value::as_str) else {
        let flow = Flow::new_call(config(&call, known_scoped(&call)), now);
        name_flow(flow.flow_id());
        return drive(&call, session, reply, flow, Io::new(None, None)).await;
    };
    let state = match open_state(&call, text) {
        Ok(state) => state,
        Err(reason) => return refuse_state(gw, session, reply, group, reason).await,
    };
    name_flow(state.flow_id);
    // An answer that does not fit its question is refused before the state is claimed
    // or forwarded: the same state may be retried.
    let answers = input_responses(&request);
    if let Err(refusal) = check_answers(state.waiting.pending(), &answers) {
        return refuse(session, reply, refusal).await;
    }
    let used = replay::digest(text);
    match &state.waiting {
        Waiting::Held { at, .. } if !gw.flows.peers.is_me(at.owner) => {
            let owner = at.owner;
            return to_holder(&call, session, reply, state, used, owner).await;
        }
        Waiting::Held { .. } => {}
        // Peers forward only retries of held flows: any other state reaching the peer
        // listener (which checks no Host, Origin or connection cap) is not served there.
        _ if call.incoming.arrival == Arrival::Peer => {
            tracing::info!("a retry of a flow no replica holds on the peer listener");
            return super::refused_on_peer_listener(session).await;
        }
        _ => {}
    }
    if let Err(refused) = claim(&call, used, &state) {
        return refused.answer(gw, session, reply, group).await;
    }
    continue_flow(&call, session, reply, state, answers, used).await
}

/// Why a state could not be claimed on this replica.
enum NotClaimed {
    /// It was used here already.
    Replayed,
    /// The table of used states is full.
    Full,
    /// The caller's share of it is.
    PrincipalFull,
    /// The state expired while the claim waited.
    Expired,
}

impl NotClaimed {
    async fn answer(
        self,
        gw: &Gateway,
        session: &mut ServerSession,
        reply: ClientReply,
        group: &UpstreamGroup,
    ) -> Outcome {
        match self {
            NotClaimed::Replayed => refuse_state(gw, session, reply, group, "replayed").await,
            NotClaimed::Expired => refuse_state(gw, session, reply, group, "expired").await,
            NotClaimed::Full => {
                let text = "this replica's replay guard is full: it remembers every requestState it acted on until that state expires, and holds bridge.max_used_states of them; retry later";
                refuse(session, reply, Refusal::internal(Class::Overloaded, text)).await
            }
            NotClaimed::PrincipalFull => {
                let text = "this caller's share of this replica's replay guard is full: it remembers every requestState the caller's retries acted on until that state expires, and holds bridge.max_used_states_per_principal of them per caller; retry later";
                refuse(session, reply, Refusal::internal(Class::Overloaded, text)).await
            }
        }
    }
}

/// Claims `state` (whose digest is `used`) on this replica: a state is used once per
/// replica, whatever the retry then does with it.
fn claim(call: &Call<'_>, used: StateDigest, state: &FlowState) -> Result<(), NotClaimed> {
    let gw = call.gw;
    let principal = counted_principal(gw, &call.incoming.principal);
    let claim = gw
        .sealing
        .used_states
        .lock()
        .expect("used-states lock")
        .claim(used, state.expires_at, principal.as_ref(), now_secs());
    match claim {
        Claim::Fresh => Ok(()),
        Claim::Replayed => Err(NotClaimed::Replayed),
        Claim::Full => Err(NotClaimed::Full),
        Claim::PrincipalFull => Err(NotClaimed::PrincipalFull),
        Claim::Expired => Err(NotClaimed::Expired),
    }
}

/// A claimed retry goes on: a held flow on the streams this replica holds (or lost, when
/// it no longer does), any other in the upstream session its state names.
async fn continue_flow(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    state: FlowState,
    responses: Map<String, Value>,
    used: StateDigest,
) -> Outcome {
    let gw = call.gw;
    // Each flow takes the time after its config (the wall clock of its state's expiry),
    // once the awaits before it are over.
    let Some(upstream_call) = state.waiting.call().cloned() else {
        // Deferred: the call starts now.
        let flow = Flow::retry(
            config(call, known_scoped(call)),
            state,
            responses,
            None,
            Instant::now(),
        );
        return drive(call, session, reply, flow, Io::new(None, Some(used))).await;
    };
    let endpoint = match &state.waiting {
        Waiting::Held { at, .. } => match gone_and_held(gw, session, at, state.flow_id).await {
            (true, Some(held)) => {
                // A forwarding replica that gave up on this replica (frozen, or too slow:
                // its client was told the call is lost, to issue it again), or a client
                // that left: the call must not go on behind its back.
                gw.runtime.metrics.held_event("abandoned");
                tracing::info!(
                    "a held flow's retry arrived from a client already gone; its call is ended"
                );
                Box::pin(held.abandon(gw)).await;
                return Outcome::ClientGone;
            }
            (false, Some(held)) if !gw.upstreams.groups.holds(&held.endpoint) => {
                // Its endpoint left the group (a DNS group's pod that left may have given
                // its address to another server): the answers, credentials and session id
                // are not sent there; the call is lost with it, as a resumable one is.
                Box::pin(held.abandon(gw)).await;
                let lost = Lost::Upstream;
                let flow =
                    Flow::call_lost(config(call, false), state, responses, lost, Instant::now());
                return drive(call, session, reply, flow, Io::new(None, Some(used))).await;
            }
            (false, Some(held)) => {
                gw.runtime.metrics.held_event("resumed");
                let mut upstream = resume(call, held.endpoint.clone(), &upstream_call);
                upstream.persistent = upstream_call.data_session;
                let io = Io {
                    streams: held.streams,
                    holder_caller: held.session.map(|s| s.caller),
                    ..Io::new(Some(upstream), Some(used))
                };
                let questions = Some(held.questions);
                let flow = Flow::retry(
                    config(call, false),
                    state,
                    responses,
                    questions,
                    Instant::now(),
                );
                return drive(call, session, reply, flow, io).await;
            }
            (_, None) => {
                gw.runtime.metrics.held_event("lost");
                let lost = Lost::Holder;
                let io = Io::new(named_session(call, &upstream_call), Some(used));
                let flow =
                    Flow::call_lost(config(call, false), state, responses, lost, Instant::now());
                return drive(call, session, reply, flow, io).await;
            }
        },
        _ => call.group.endpoint(upstream_call.endpoint),
    };
    let Some(endpoint) = endpoint else {
        // The endpoint has left the group (a pod replaced, an endpoint taken out of the
        // list): never asked, the call is lost with it, as with an endpoint that is down.
        let flow_id = format!("{:016x}", state.flow_id);
        tracing::info!(
            flow = flow_id,
            "the call's upstream endpoint has left the group"
        );
        let lost = Lost::Upstream;
        let flow = Flow::call_lost(config(call, false), state, responses, lost, Instant::now());
        return drive(call, session, reply, flow, Io::new(None, Some(used))).await;
    };
    let mut upstream = resume(call, endpoint, &upstream_call);
    upstream.persistent = upstream_call.data_session;
    gw.runtime.metrics.upstream_session("reused");
    let scoped = match &state.waiting {
        Waiting::Resumable { positions, .. } if positions.session_from.is_some() => {
            let verdict = Box::pin(super::probe::session_replay(
                &gw.upstreams,
                call.group,
                &upstream.endpoint,
                &upstream.caller,
                positions.upstream.sessions_kept_apart,
            ))
            .await;
            verdict == SessionReplay::Scoped
        }
        _ => false,
    };
    let flow = Flow::retry(config(call, scoped), state, responses, None, Instant::now());
    drive(
        call,
        session,
        reply,
        flow,
        Io::new(Some(upstream), Some(used)),
    )
    .await
}

fn resume<'g>(
    call: &Call<'g>,
    endpoint: crate::upstream::Endpoint,
    upstream_call: &UpstreamCall,
) -> LegacySession<'g> {
    let gw = call.gw;
    let mut upstream = LegacySession::resume(
        &gw.upstreams.client,
        endpoint,
        &call.group.timeouts,
        upstream_call.session.clone(),
        upstream_call.version,
    );
    upstream.caller = super::caller(call.request);
    upstream
}

impl Io<'_> {
    fn new<'g>(upstream: Option<LegacySession<'g>>, claim: Option<StateDigest>) -> Io<'g> {
        Io {
            upstream,
            streams: Streams::new(None, None),
            claim,
            drain_told: false,
            near_end_told: false,
            client_gone_told: false,
            warm_after: None,
            holder_caller: None,
        }
    }
}

/// Whether the group's store is known to keep sessions apart (its GET streams resume),
/// without probing: a new call's rounds ping before they end where it is not.
fn known_scoped(call: &Call<'_>) -> bool {
    let facts = call.gw.upstreams.learnt.get(&call.group.name);
    facts.session_replay == SessionReplay::Scoped
}

/// What a flow is told at its start about this request, its group and this replica.
fn config(call: &Call<'_>, session_replay_scoped: bool) -> FlowConfig {
    let Call {
        gw, group, request, ..
    } = *call;
    let bridge = &gw.config.bridge;
    let limits = &gw.config.limits;
    let learnt = gw.upstreams.learnt.get(&group.name);
    let kid_len = gw.sealing.keys.load().current().kid().len();
    let wall_ms = now_ms();
    FlowConfig {
        group: group.name.clone(),
        method: request.method.clone(),
        target: request.target.clone().unwrap_or_default(),
        capabilities: request.client_capabilities.clone(),
        relay: Relay {
            progress_token: request.progress_token.clone(),
            log_level: request.log_level,
        },
        restartable: restartable(call),
        data_session: call.data_session.is_some(),
        round_limits: RoundLimits {
            max_questions: limits.max_input_requests_per_round,
            max_bytes: limits.max_input_requests_bytes,
        },
        max_rounds: limits.max_rounds,
        max_state_plaintext: crate::seal::max_plaintext_len(
            kid_len,
            limits.max_request_state_bytes,
        ),
        max_state_bytes: limits.max_request_state_bytes,
        kid_len,
        quiet_window: Duration::from_millis(bridge.quiet_window_ms),
        asks_at_once: asks_at_once(gw, group, request),
        poll: Duration::from_millis(bridge.resume_poll_ms),
        answer_timeout: group.timeouts.response,
        silence: Duration::from_secs(bridge.round_silence_seconds),
        silence_seconds: bridge.round_silence_seconds,
        keepalive: (gw.config.sse_keepalive_ms > 0)
            .then(|| Duration::from_millis(gw.config.sse_keepalive_ms)),
        request_state_ttl_seconds: bridge.request_state_ttl_seconds,
        max_flow_seconds: bridge.max_flow_seconds,
        resume: group.resume,
        replay_refused: learnt.replay_refused,
        primes: learnt.resumption_primes,
        session_replay_scoped,
        sessions_kept_apart: learnt.session_replay.kept_apart(),
        shedding: shedding(gw),
        now_secs: wall_ms / 1000,
        now_ms: wall_ms,
        flow_id: rand::random(),
    }
}

/// Whether the rounds of `request` wait the quiet window after a question: its call was
/// seen asking several questions at once (or every round waits, by configuration).
fn asks_at_once(gw: &Gateway, group: &UpstreamGroup, request: &ModernRequest) -> bool {
    let target = request.target.as_deref().unwrap_or_default();
    gw.config.bridge.quiet_window_for == QuietWindowFor::All
        || (gw.upstreams.learnt).asks_at_once(&group.name, &request.method, target)
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

/// Whether this replica sheds new calls now: more interactive requests are in progress
/// than `bridge.shed_above_active_rounds` (this one included), or more flows are held
/// than `bridge.shed_above_held_flows`.
fn shedding(gw: &Gateway) -> bool {
    let bridge = &gw.config.bridge;
    let (rounds, held) = (
        bridge.shed_above_active_rounds,
        bridge.shed_above_held_flows,
    );
    (rounds > 0 && gw.runtime.metrics.active_rounds.get() > rounds as i64)
        || (held > 0 && gw.flows.held.usage().0 > held)
}

/// Opens a retry's state: sealed under a key of the ring, bound to this request and
/// principal, not expired, and of this group. The endpoint it names is looked up in the
/// group when the flow goes on: one that has left it is not asked (the call is lost).
fn open_state(call: &Call<'_>, text: &str) -> Result<FlowState, &'static str> {
    let gw = call.gw;
    let state = FlowState::open(&gw.sealing.keys.load(), &call.bind, text, now_secs())
        .map_err(|e| e.reason())?;
    if state.group != call.group.name {
        return Err("other_group");
    }
    // A call goes on in the session it began in, which its state names: a cookie the
    // retry carries must name that one (the result carries the cookie it names), and a
    // call begun outside any session takes none. A call begun in one needs its cookie:
    // without it the retry would run as outside any session (a lost call's restartable
    // tool run again in a session of its own, against the session policy).
    match (state.waiting.call(), call.data_session) {
        (Some(upstream), Some(attached)) => {
            let began_in = upstream.data_session.then_some(upstream.session.as_str());
            if began_in != Some(attached.cookie.upstream_session.as_str()) {
                return Err("other_session");
            }
        }
        (Some(upstream), None) if upstream.data_session => return Err("other_session"),
        _ => {}
    }
    // A call deferred before it began starts in a session if and only if it was made in
    // one: without the cookie, a tool the policy runs only in a session would run outside.
    if let Waiting::Deferred { data_session } = state.waiting {
        if data_session != call.data_session.is_some() {
            return Err("other_session");
        }
    }
    Ok(state)
}

/// A retry's field over its limit: what to tell the client, and whether it is the
/// `requestState` (which the state rejection metric counts).
struct TooLarge {
    text: String,
    state: bool,
}

/// Refuses a retry whose `requestState` or `inputResponses` exceed the limits, before
/// any decoding. The limits are no secret: the client is told which one it passed.
fn check_retry_limits(request: &ModernRequest, limits: &Limits) -> Result<(), TooLarge> {
    let too_large = |state, text| Err(TooLarge { text, state });
    if let Some(state) = request.params.get("requestState").and_then(Value::as_str) {
        if state.len() > limits.max_request_state_bytes {
            let (len, max) = (state.len(), limits.max_request_state_bytes);
            return too_large(
                true,
                format!("requestState is {len} bytes, above the limit of {max}"),
            );
        }
    }
    let Some(responses) = request.params.get("inputResponses") else {
        return Ok(());
    };
    let count = responses.as_object().map_or(0, |r| r.len());
    if count > limits.max_input_requests_per_round {
        let max = limits.max_input_requests_per_round;
        return too_large(
            false,
            format!("inputResponses has {count} entries, above the limit of {max}"),
        );
    }
    let size = serde_json::to_vec(responses).map_or(usize::MAX, |v| v.len());
    if size > limits.max_input_responses_bytes {
        let max = limits.max_input_responses_bytes;
        return too_large(
            false,
            format!("inputResponses is {size} bytes, above the limit of {max}"),
        );
    }
    Ok(())
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

/// What the client of a forwarded retry is told when this replica's shutdown cuts it.
const CUT_BY_SHUTDOWN: &str = "this gateway replica is shutting down while the replica holding the call continued this retry; the call was ended there, after this retry's answers may have reached it: check whether it ran before issuing it again";

/// The retry of a flow held by another replica: forwarded to it, whose answer the client
/// gets; or, when it cannot be reached (or this request came from a peer that thought
/// this replica held it), the flow is lost with it.
async fn to_holder(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    state: FlowState,
    used: StateDigest,
    owner: Option<std::net::SocketAddr>,
) -> Outcome {
    let gw = call.gw;
    if call.incoming.arrival == Arrival::Peer {
        // Peers forward a retry only to the owner its state names: this one came from
        // elsewhere, and continuing (or re-running) the flow here would run it twice.
        tracing::info!("a retry for another replica's flow on the peer listener");
        return super::refused_on_peer_listener(session).await;
    }
    // How a streamed answer this replica's shutdown cuts ends: with the call's error.
    let id = Some(&call.request.id);
    let ended = jsonrpc::error_body(id, code::INTERNAL_ERROR, CUT_BY_SHUTDOWN, None);
    let ended = Event::message(None, String::from_utf8_lossy(&ended).into_owned());
    let last_word = bytes::Bytes::from(ended.encode());
    let (why, lost) = match owner {
        None => (
            "held by a replica without a peer listener".to_string(),
            Lost::Holder,
        ),
        Some(owner) => {
            let forwarded = peers::forward(gw, session, owner, &call.incoming.body, &last_word);
            match Box::pin(forwarded).await {
                Ok(Outcome::Drained) => {
                    let forwards = &gw.runtime.metrics.peer_forwards;
                    forwards.with_label_values(&["shutting_down"]).inc();
                    return Outcome::Drained;
                }
                // The owner stopped answering mid-answer: the client's answer was cut.
                Ok(cut @ Outcome::Refused(_)) => {
                    let forwards = &gw.runtime.metrics.peer_forwards;
                    forwards.with_label_values(&["owner_gone"]).inc();
                    return cut;
                }
                Ok(_) => {
                    gw.runtime
                        .metrics
                        .peer_forwards
                        .with_label_values(&["ok"])
                        .inc();
                    return Outcome::Forwarded;
                }
                Err(peers::NotForwarded::OwnerGone { why, sent }) => (
                    why,
                    if sent {
                        Lost::HolderMidRetry
                    } else {
                        Lost::Holder
                    },
                ),
                Err(peers::NotForwarded::ShuttingDown { sent }) => {
                    let forwards = &gw.runtime.metrics.peer_forwards;
                    forwards.with_label_values(&["shutting_down"]).inc();
                    let text = match sent {
                    true => CUT_BY_SHUTDOWN,
                    false => "this gateway replica is shutting down and sent nothing to the replica holding the call: send the same retry again, to another replica; its requestState is still good",
                };
                    let refusal = Refusal::internal(Class::Overloaded, text);
                    return reply.refuse(session, refusal).await;
                }
                Err(
                    unsent
                    @ (peers::NotForwarded::NoDescriptor | peers::NotForwarded::PeersUnknown),
                ) => {
                    // Nothing went to the owner, which may hold the flow still: the same
                    // retry may be sent again, unclaimed here.
                    let text = match unsent {
                        peers::NotForwarded::PeersUnknown => "this gateway replica does not know its peers yet (their DNS name has not answered with any): it cannot reach the replica holding the flow; send the same retry again later",
                        _ => "this gateway replica has no file descriptor free to reach the replica holding the flow; send the same retry again later",
                    };
                    let refusal = Refusal::internal(Class::Overloaded, text);
                    return reply.refuse(session, refusal).await;
                }
            }
        }
    };
    gw.runtime
        .metrics
        .peer_forwards
        .with_label_values(&["owner_gone"])
        .inc();
    let flow_id = format!("{:016x}", state.flow_id);
    tracing::info!(flow = flow_id, owner = ?owner, %why, "the replica holding the flow cannot continue it");
    // The lost flow may run its tool again (a restartable one): once per state here, as
    // any retry is.
    if let Err(refused) = claim(call, used, &state) {
        return refused.answer(gw, session, reply, call.group).await;
    }
    let responses = input_responses(call.request);
    // A holder that never saw this retry is gone or unreachable: the call its state names
    // is ended from here (the flow says so); one that did may be running it on.
    let upstream = match (lost, state.waiting.call()) {
        (Lost::Holder, Some(upstream_call)) => named_session(call, upstream_call),
        _ => None,
    };
    let flow = Flow::call_lost(config(call, false), state, responses, lost, Instant::now());
    drive(call, session, reply, flow, Io::new(upstream, Some(used))).await
}

/// The upstream session a state names, to end its call in: none when its endpoint has
/// left the group (which gets neither the session id nor credentials).
fn named_session<'g>(call: &Call<'g>, upstream_call: &UpstreamCall) -> Option<LegacySession<'g>> {
    let endpoint = call.group.endpoint(upstream_call.endpoint)?;
    let mut upstream = resume(call, endpoint, upstream_call);
    upstream.persistent = upstream_call.data_session;
    Some(upstream)
}

/// Whether the client has closed its connection already (read once, without waiting),
/// and the held flow at `at`, taken from the table.
async fn gone_and_held(
    gw: &Gateway,
    session: &mut ServerSession,
    at: &HeldAt,
    flow_id: u64,
) -> (bool, Option<Box<Held>>) {
    let gone = respond::client_left(session).await;
    (gone, gw.flows.held.take(at.slot, flow_id))
}

/// Runs `flow` to its end: carries out its commands, feeds it what the upstream streams,
/// the client and the clock bring, and answers the client as it finishes.
async fn drive<'g>(
    call: &Call<'g>,
    session: &mut ServerSession,
    mut reply: ClientReply,
    mut flow: Flow,
    mut io: Io<'g>,
) -> Outcome {
    // Closing the streams and deleting the session, when they come right before the
    // finish, follow it: the client has its answer first, and neither it nor the next
    // request on its connection waits for them (the DELETE goes out in the background).
    // A cancellation follows the finish too, awaited (bounded): only calls the flow gave
    // up on have one.
    let (mut close_pending, mut delete_pending) = (false, false);
    let mut cancel_pending = None;
    loop {
        while let Some(command) = flow.poll_command() {
            if let Command::Finish(ending) = command {
                let outcome = finish(call, session, reply, &flow, ending).await;
                if close_pending && !delete_pending {
                    close_streams(call, &mut io).await;
                }
                if let (Some(cancelled), Some(upstream)) = (cancel_pending, &io.upstream) {
                    let reaper = &call.gw.upstreams.reaper;
                    let _first_try = Box::pin(reaper.cancel(upstream, &cancelled, "gave_up")).await;
                }
                if let Some(shape) = io.warm_after.take() {
                    let owner = counted_principal(call.gw, &call.incoming.principal);
                    warm::warm_up(call.gw, call.group, call.request, shape, owner);
                }
                if let Some(upstream) = io.upstream.take().filter(|_| delete_pending) {
                    // The streams left open end with the session.
                    let open = if close_pending {
                        take_streams(&mut io)
                    } else {
                        Streams::new(None, None)
                    };
                    end_session_later(call.gw, upstream, open).await;
                }
                return outcome;
            }
            match command {
                Command::CloseStreams => {
                    close_pending = true;
                    continue;
                }
                Command::DeleteSession => {
                    delete_pending = true;
                    continue;
                }
                Command::Cancel(cancelled) => {
                    cancel_pending = Some(cancelled);
                    continue;
                }
                _ => {}
            }
            if std::mem::take(&mut close_pending) {
                close_streams(call, &mut io).await;
            }
            if std::mem::take(&mut delete_pending) {
                delete_session(call, &mut io).await;
            }
            let woke = match command {
                Command::Get(get) => get_or_cut(call, session, &mut io, &flow, get).await,
                command => execute(call, session, &mut reply, &mut io, &flow, command)
                    .await
                    .map_or(Woke::Read, Woke::Input),
            };
            tell(&mut flow, woke);
        }
        // While the call's answer is awaited, only the session's stream is read.
        let from_session = || io.streams.backlog.front().map(|(s, _)| *s) == Some(Source::Session);
        if flow.is_reading() || (flow.is_posting() && from_session()) {
            if let Some((source, event)) = io.streams.backlog.pop_front() {
                let stream = stream_of(source);
                flow.handle(Input::Event { stream, event }, Instant::now());
                continue;
            }
        }
        let woke = wait(call, session, &mut io, &flow).await;
        tell(&mut flow, woke);
    }
}

/// Tells the flow what woke the driver.
fn tell(flow: &mut Flow, woke: Woke) {
    match woke {
        Woke::Input(input) => flow.handle(input, Instant::now()),
        Woke::Time => flow.handle_timeout(Instant::now()),
        Woke::Read => {}
    }
}

/// What woke the driver.
enum Woke {
    Input(Input),
    /// The flow's timeout is due.
    Time,
    /// A chunk was parsed into the backlog, or a command needs no answer.
    Read,
}

/// Waits for the next thing the flow must know: a chunk on a stream it reads, the client
/// leaving, the gateway draining, or its timeout. What the upstream has already sent
/// comes before a timeout that is due: the timeout fires only once the streams have
/// nothing more to read now (the I/O driver is polled first), so a quiet window of zero
/// ends a round as soon as the upstream has nothing more to say.
async fn wait(call: &Call<'_>, session: &mut ServerSession, io: &mut Io<'_>, flow: &Flow) -> Woke {
    let reading = flow.is_reading();
    let timeout = flow.poll_timeout().map(tokio::time::Instant::from_std);
    if reading && timeout.is_some_and(|t| t <= tokio::time::Instant::now()) {
        tokio::task::yield_now().await;
    }
    // Told once, when the flow can act on it: a drain that begins while the call's answer
    // is awaited (or a resumption backs off) waits for the round to read.
    let drain = !io.drain_told && reading;
    // The grace period's last stretch ends a round that cannot be handed over, and a call
    // whose answer has not come.
    let near_end = !io.near_end_told && (reading || flow.awaits_call());
    let session_stream = reading || flow.is_posting();
    let (source, chunk) = tokio::select! {
        biased;
        _ = call.gw.runtime.drain.wait(), if drain => {
            io.drain_told = true;
            return Woke::Input(Input::Draining);
        }
        _ = call.gw.runtime.drain.wait_near_end(), if near_end => {
            io.near_end_told = true;
            return Woke::Input(Input::GraceEnding);
        }
        _ = session.read_body_or_idle(true), if !io.client_gone_told => {
            io.client_gone_told = true;
            return Woke::Input(Input::ClientGone);
        }
        answer = answer_of(&mut io.streams.posted) => {
            io.streams.posted = None;
            return Woke::Input(call_answered(call, io, answer).await);
        }
        // The session's GET stream, slow to open, joins once it does.
        opened = answer_of(&mut io.streams.session_opening), if session_stream => {
            io.streams.session_opening = None;
            if let Ok(stream) = opened {
                io.streams.replace_session(Some(stream));
            }
            return Woke::Read;
        }
        c = next_chunk(&mut io.streams.call), if reading => (Source::Call, c),
        c = next_chunk(&mut io.streams.session), if session_stream => (Source::Session, c),
        _ = sleep_until_or_never(timeout) => return Woke::Time,
    };
    match chunk {
        Some(Ok(Some(bytes))) => match io.streams.push(source, &bytes) {
            Ok(_) => Woke::Read,
            // An event over the size limit, which a resumption would send again: the
            // stream is of no further use, and neither is the call.
            Err(too_large) => {
                io.streams.take_stream(source);
                let stream = stream_of(source);
                let which = match stream {
                    Stream::Call => "the call's stream",
                    Stream::Session => "the session's GET stream",
                };
                let message = format!(
                    "{too_large} (limits.max_upstream_message_bytes, the gateway's limit for one upstream message) on {which}"
                );
                let failure = Failure::new(FailureKind::Broken, message);
                Woke::Input(Input::StreamBroken { stream, failure })
            }
        },
        // Ended, or broken: either way the stream is over; one that ended keeps its
        // connection for the next exchange.
        _ => {
            if let Some(ended) = io.streams.take_stream(source) {
                call.gw.upstreams.client.finish(ended).await;
            }
            Woke::Input(Input::StreamEnded(stream_of(source)))
        }
    }
}

fn stream_of(source: Source) -> Stream {
    match source {
        Source::Call => Stream::Call,
        Source::Session => Stream::Session,
    }
}

/// Carries out a GET of the flow's streams, unless something the flow must hear comes
/// first, which cuts it (the GET changes nothing upstream): its timeout (the round's
/// silence, its deadline), the client leaving, the grace period's last stretch.
async fn get_or_cut<'g>(
    call: &Call<'g>,
    session: &mut ServerSession,
    io: &mut Io<'g>,
    flow: &Flow,
    get: StreamGet,
) -> Woke {
    let at = flow.poll_timeout().map(tokio::time::Instant::from_std);
    let (client_gone_told, near_end_told) = (io.client_gone_told, io.near_end_told);
    let got = async {
        match get {
            StreamGet::Open { stream, after } => open_stream(call, io, stream, after).await,
            StreamGet::Reopen {
                after,
                session_after,
            } => reopen(call, io, &after, session_after.as_deref()).await,
        }
    };
    let cut = tokio::select! {
        biased;
        input = got => return Woke::Input(input),
        _ = sleep_until_or_never(at) => Woke::Time,
        _ = session.read_body_or_idle(true), if !client_gone_told => Woke::Input(Input::ClientGone),
        _ = call.gw.runtime.drain.wait_near_end(), if !near_end_told => Woke::Input(Input::GraceEnding),
    };
    match &cut {
        Woke::Input(Input::ClientGone) => io.client_gone_told = true,
        Woke::Input(Input::GraceEnding) => io.near_end_told = true,
        _ => {}
    }
    cut
}

/// Carries out one command; returns what the flow must be told of its outcome. A step
/// whose future is large and not on every flow's path (opening a session, holding,
/// cancelling) awaits it boxed, so that the request's future, which pingora moves onto
/// the heap per request, stays small (ARCHITECTURE.md, "A request's future stays small").
async fn execute<'g>(
    call: &Call<'g>,
    session: &mut ServerSession,
    reply: &mut ClientReply,
    io: &mut Io<'g>,
    flow: &Flow,
    command: Command,
) -> Option<Input> {
    let Call {
        gw, group, request, ..
    } = *call;
    match command {
        Command::OpenSession => Some(Box::pin(open_session(call, io)).await),
        Command::PostCall { id } => post_call(call, io, id),
        Command::Post(message) => {
            let upstream = io.upstream.as_mut()?;
            let posted = upstream.post_and_expect_accepted(&message).await;
            let denied = |e: &SessionError| matches!(e.failure(), SessionFailure::Denied { .. });
            if let Some(holder) = posted
                .as_ref()
                .err()
                .filter(|e| denied(e))
                .and(io.holder_caller.take())
            {
                // Whatever follows (the call's end) goes up as the holding round did.
                upstream.caller = holder;
            }
            Some(Input::Posted(posted.map_err(|e| failure(&e))))
        }
        Command::Barrier { id } => {
            if let Some(upstream) = &io.upstream {
                barrier(call, upstream, id).await;
            }
            Some(Input::BarrierPassed)
        }
        Command::CancelFirst(cancelled) => {
            let upstream = io.upstream.as_ref()?;
            // Kept to be sent again when the upstream may take it later; the answer is
            // the first attempt's.
            let reaper = &gw.upstreams.reaper;
            let posted = Box::pin(reaper.cancel(upstream, &cancelled, "gave_up")).await;
            Some(Input::Posted(posted.map_err(|e| failure(&e))))
        }
        Command::Notify(message) => {
            let written = reply.notify(session, &message).await;
            written.err().and_then(|()| client_gone(io))
        }
        Command::KeepAlive => match reply.keep_alive(session).await {
            Ok(written) => {
                if written {
                    gw.runtime.metrics.sse_keepalives.inc();
                }
                None
            }
            Err(()) => client_gone(io),
        },
        Command::Watch {
            until,
            call: call_id,
        } => {
            let upstream = io.upstream.as_ref()?;
            let session = upstream.session_id.as_deref()?;
            let what = match &call_id {
                Some(id) => Abandoned::Call { session, id },
                None => Abandoned::Session(session),
            };
            let whose = Whose {
                headers: &upstream.caller.headers,
                principal: counted_principal(gw, &call.incoming.principal),
            };
            let reaper = &gw.upstreams.reaper;
            let watch = || {
                let version = upstream.version;
                reaper.watch(
                    &upstream.endpoint,
                    upstream.timeouts,
                    what,
                    whose,
                    version,
                    until,
                )
            };
            let mut watched = watch();
            if let Err(refused) = watched {
                // Entries of flows that ended on other replicas may fill it: freed, then
                // the watch is asked again.
                let whose_share = (refused == NotWatched::PrincipalFull).then_some(whose.principal);
                if reaper
                    .reclaim(&gw.upstreams.client, whose_share.flatten())
                    .await
                    > 0
                {
                    watched = watch();
                }
            }
            Some(Input::Watched(
                watched.map_err(|refused| not_watched(gw, refused)),
            ))
        }
        Command::Unwatch { call } => {
            let upstream = io.upstream.as_ref()?;
            let session = upstream.session_id.as_deref()?;
            let what = Abandoned::Call { session, id: &call };
            gw.upstreams.reaper.forget(&upstream.endpoint, what);
            None
        }
        Command::Hold {
            questions,
            expires_at,
            cancel_on_expiry,
        } => {
            let held = hold(call, io, flow, questions, expires_at, cancel_on_expiry);
            Some(Box::pin(held).await)
        }
        Command::ReleaseClaim => {
            if let Some(used) = io.claim.take() {
                gw.sealing
                    .used_states
                    .lock()
                    .expect("used-states lock")
                    .release(&used);
            }
            None
        }
        Command::Learn(learnt) => {
            learn(&gw.upstreams, group, request, learnt);
            None
        }
        Command::Note(Note::Restarted) => {
            gw.runtime.metrics.call_restarts.inc();
            tracing::info!(method = %request.method, "upstream lost the call; running it again");
            None
        }
        Command::Note(Note::HandedOver) => {
            tracing::info!("round handed over: draining");
            None
        }
        Command::Note(Note::Unprimed) => {
            let metrics = &gw.runtime.metrics;
            metrics
                .resumptions_unprimed
                .with_label_values(&[&group.name])
                .inc();
            tracing::info!(group = %group.name, "resumed call stream sent no priming event in time; answers posted after the wait");
            None
        }
        // The driver carries these out itself: the ends (closing the streams, deleting the
        // session, a cancellation) right before the next command, or after the finish.
        Command::Get(_)
        | Command::Finish(_)
        | Command::CloseStreams
        | Command::DeleteSession
        | Command::Cancel(_) => None,
    }
}

/// A write to the client failed (it left, or stopped reading within the write timeout):
/// the flow is told the client is gone, once.
fn client_gone(io: &mut Io<'_>) -> Option<Input> {
    (!std::mem::replace(&mut io.client_gone_told, true)).then_some(Input::ClientGone)
}

/// Closes the flow's upstream streams (never cancelling the call).
async fn close_streams(call: &Call<'_>, io: &mut Io<'_>) {
    take_streams(io).close(&call.gw.upstreams.client).await;
}

fn take_streams(io: &mut Io<'_>) -> Streams {
    std::mem::replace(&mut io.streams, Streams::new(None, None))
}

/// Deletes the flow's upstream session (unless it is a data-layer session's).
async fn delete_session(call: &Call<'_>, io: &mut Io<'_>) {
    if let Some(upstream) = &io.upstream {
        end_session(&call.gw.upstreams.reaper, upstream).await;
    }
}

/// Opens the call's upstream session: the request's data-layer session, a warm one, or a
/// new one. A flow that asks again replaces a warm session the upstream forgot: with one
/// opened now.
async fn open_session<'g>(call: &Call<'g>, io: &mut Io<'g>) -> Input {
    let (gw, group, request) = (call.gw, call.group, call.request);
    let replacing = io.upstream.is_some();
    let shape = (call.data_session.is_none() && gw.config.bridge.warm_sessions_per_shape > 0)
        .then(|| warm::shape_of(group, request, &call.incoming.principal));
    if let Some(shape) = shape.as_ref().filter(|_| !replacing) {
        if let Some((upstream, stream)) = warm::take(gw, group, request, shape) {
            io.warm_after = Some(*shape);
            return opened(io, upstream, true, stream);
        }
    }
    match upstream_for(gw, group, request, call.data_session).await {
        Ok(upstream) => {
            // A server that gives no session id keeps no sessions: nothing to warm.
            let sessions = upstream.session_id.is_some();
            let recurs = |s: &_| sessions && gw.upstreams.warm.recurs(s, Instant::now());
            io.warm_after = shape.filter(recurs);
            opened(io, upstream, false, None)
        }
        Err(e) => {
            let mut failed = failure(&e);
            failed.message = format!("opening a session (initialize): {}", failed.message);
            Input::SessionFailed(failed)
        }
    }
}

/// The flow's session is `upstream`, with its GET stream if one came open with it.
fn opened<'g>(
    io: &mut Io<'g>,
    upstream: LegacySession<'g>,
    warm: bool,
    session_stream: Option<Response>,
) -> Input {
    let input = Input::SessionOpened {
        endpoint: upstream.endpoint.addr,
        session: upstream.session_id.clone(),
        version: upstream.version,
        warm,
        session_stream: session_stream.is_some(),
    };
    io.upstream = Some(upstream);
    io.streams.replace_session(session_stream);
    input
}

async fn open_stream(
    call: &Call<'_>,
    io: &mut Io<'_>,
    stream: Stream,
    after: Option<String>,
) -> Input {
    let Some(upstream) = io.upstream.as_ref() else {
        let result = Err(Failure::new(FailureKind::Broken, "no upstream session"));
        return Input::StreamOpened { stream, result };
    };
    let result = match (stream, after) {
        (Stream::Call, Some(after)) => {
            io.streams.call = None;
            resume_call(upstream, &after)
                .await
                .map(|response| io.streams.replace_call(response))
                .map_err(|e| failure(&e))
        }
        (Stream::Call, None) => Err(Failure::new(
            FailureKind::Broken,
            "a call's stream is resumed only after an event",
        )),
        (Stream::Session, after) => {
            io.streams.replace_session(None);
            let opened = session_stream(call, upstream, after.as_deref(), Connection::Pooled);
            let (stream, opening, _) = opened.await;
            io.streams.replace_session(stream);
            io.streams.session_opening = opening;
            Ok(())
        }
    };
    Input::StreamOpened { stream, result }
}

/// A retry's streams: the call's resumed after `after` and the session's (after
/// `session_after`, or fresh), opened at once; answered with when the call's answered.
async fn reopen(
    call: &Call<'_>,
    io: &mut Io<'_>,
    after: &str,
    session_after: Option<&str>,
) -> Input {
    let Io {
        upstream, streams, ..
    } = io;
    let Some(upstream) = upstream.as_ref() else {
        let result = Err(Failure::new(FailureKind::Broken, "no upstream session"));
        return Input::Reopened {
            result,
            call_at: Instant::now(),
            session_resumed: false,
        };
    };
    (streams.call, streams.session) = (None, None);
    // Two exchanges side by side: on the heap, so that they do not sit in every request's
    // future (`a_requests_future_is_small`).
    let ((resumed, call_at), session) = Box::pin(async {
        tokio::join!(
            async { (resume_call(upstream, after).await, Instant::now()) },
            session_stream(call, upstream, session_after, Connection::New)
        )
    })
    .await;
    let (session, opening, session_resumed) = session;
    streams.replace_session(session);
    streams.session_opening = opening;
    let result = resumed
        .map(|response| streams.replace_call(response))
        .map_err(|e| {
            let mut failed = failure(&e);
            failed.message = format!("resuming the call's stream: {}", failed.message);
            failed
        });
    Input::Reopened {
        result,
        call_at,
        session_resumed,
    }
}

/// The session's GET stream, if the upstream opens one within `SESSION_STREAM_PATIENCE`,
/// or its GET still going; a server found to keep a closed one (409 to a new GET) is
/// asked once, others again briefly. A retry's replaces the stream the round closed: on a
/// `Connection::New`. Also says whether it resumes after `after` (not when it is fresh).
async fn session_stream(
    call: &Call<'_>,
    upstream: &LegacySession<'_>,
    after: Option<&str>,
    connection: Connection,
) -> (Option<Response>, Option<PendingResponse>, bool) {
    let (upstreams, group) = (&call.gw.upstreams, &call.group.name);
    let patient = !upstreams.learnt.get(group).session_stream_kept;
    let client = &upstreams.client;
    let patience = SESSION_STREAM_PATIENCE;
    let (opened, resumed) =
        open_session_stream(upstream, client, after, patient, connection, patience).await;
    match opened {
        SessionStream::Open(stream) => (Some(stream), None, resumed),
        SessionStream::Opening(get) => {
            tracing::info!(group = %group, "the upstream is slow to open the session's GET stream; the flow goes on, and the stream joins when it opens");
            (None, Some(get), resumed)
        }
        SessionStream::None { kept } => {
            if kept && patient {
                upstreams.note_session_stream_kept(call.group);
            }
            (None, None, false)
        }
    }
}

/// Sends the call; its answer is awaited beside the session's stream (`wait`), since some
/// servers send a POST stream's header only with its first event. The POST owns what it
/// needs, so a round that ends before the answer can hold it with the flow's streams; its
/// header may take the flow's whole life (the flow bounds the wait while nothing else
/// comes: `FlowConfig::answer_timeout`).
fn post_call(call: &Call<'_>, io: &mut Io<'_>, id: i64) -> Option<Input> {
    let Some(upstream) = io.upstream.as_ref() else {
        let failure = Failure::new(FailureKind::Broken, "no upstream session");
        return Some(Input::CallPosted(Err(failure)));
    };
    let request = call.request;
    // The call's own id is its progress token upstream: whichever round is reading then,
    // its request's token (if it gave one) is what the client sees (`Relay`).
    let params = with_progress_token(upstream_params(request), id);
    let message = json!({"jsonrpc": "2.0", "id": id, "method": request.method, "params": params});
    let client = call.gw.upstreams.client.clone();
    let patience = Duration::from_secs(call.gw.config.bridge.max_flow_seconds);
    io.streams.posted = Some(Box::pin(upstream.post_detached(client, message, patience)));
    None
}

/// What the flow is told of the call's answer: its stream, its one message, or a failure.
async fn call_answered(
    call: &Call<'_>,
    io: &mut Io<'_>,
    answer: Result<Response, SessionError>,
) -> Input {
    let mut response = match answer {
        Ok(response) => response,
        Err(e) => return Input::CallPosted(Err(failure(&e))),
    };
    if response.is_sse() {
        io.streams.replace_call(response);
        return Input::CallPosted(Ok(CallReply::Stream));
    }
    let message = read_single(&mut response).await;
    call.gw.upstreams.client.finish(response).await;
    Input::CallPosted(message.map(CallReply::Message).map_err(|e| failure(&e)))
}

/// The longest a round's barrier ping may take: a server slower than this to answer it
/// is taken to have sent what it had queued (the round then waits its quiet window).
const BARRIER_PATIENCE: Duration = Duration::from_secs(1);

/// Pings the call's session under `id` and reads the answer (an error answers as well as
/// a result), within `BARRIER_PATIENCE`.
async fn barrier(call: &Call<'_>, upstream: &LegacySession<'_>, id: i64) {
    let client = &call.gw.upstreams.client;
    let exchange = async {
        let mut response = upstream.ping(id).await?;
        let answer = read_single(&mut response).await;
        client.release(response, BARRIER_PATIENCE).await;
        answer.map(drop)
    };
    let outcome = tokio::time::timeout(BARRIER_PATIENCE, exchange).await;
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "the round's barrier ping failed"),
        Err(_) => tracing::debug!("the round's barrier ping went unanswered"),
    }
}

/// The client's answer when the reaper would not watch its flow.
fn not_watched(gw: &Gateway, refused: NotWatched) -> Refusal {
    let text = match refused {
        NotWatched::Full => {
            "too many flows are waiting for input on this replica; retry later".to_string()
        }
        NotWatched::PrincipalFull => format!(
            "this caller already has {} flows on this replica waiting for its answers (bridge.max_watched_sessions_per_principal): answer them, or retry once abandoned ones expire",
            gw.config.bridge.max_watched_sessions_per_principal
        ),
    };
    Refusal::internal(Class::Overloaded, text)
}

/// Puts the flow's streams (with their unread events) in this replica's table.
async fn hold(
    call: &Call<'_>,
    io: &mut Io<'_>,
    flow: &Flow,
    questions: Map<String, Value>,
    expires_at: u64,
    cancel: Option<Cancellation>,
) -> Input {
    let gw = call.gw;
    let Some(upstream) = io.upstream.as_ref() else {
        let refusal = Refusal::internal(Class::UpstreamError, "no upstream session to hold");
        return Input::Held(Err(refusal));
    };
    let streams = std::mem::replace(&mut io.streams, Streams::new(None, None));
    // A data-layer session is never deleted with a flow: without its call's cancellation
    // it is left alone.
    let session = upstream.session_id.clone();
    let session = session
        .filter(|_| !upstream.persistent || cancel.is_some())
        .map(|id| HeldSession {
            id,
            version: upstream.version,
            cancel,
            // Its own exchanges carry no trace of the request that held it.
            caller: Caller {
                headers: upstream.caller.headers.clone(),
                ..Caller::default()
            },
        });
    let held = Held::new(
        flow.flow_id(),
        expires_at,
        upstream.endpoint.clone(),
        *upstream.timeouts,
        session,
        streams,
        questions,
    );
    match gw
        .flows
        .held
        .hold(held, counted_principal(gw, &call.incoming.principal))
    {
        Ok(slot) => {
            gw.runtime.metrics.held_event("held");
            Input::Held(Ok(HeldAt {
                owner: gw.flows.peers.advertise,
                slot,
            }))
        }
        Err((refused, held)) => {
            Box::pin(held.abandon(gw)).await;
            let refusal = match refused {
                NotHeld::Full => Refusal::internal(
                    Class::Overloaded,
                    "too many flows are held on this replica; retry later",
                ),
                NotHeld::PrincipalFull => Refusal::internal(
                    Class::Overloaded,
                    format!(
                        "this caller already has {} flows held on this replica waiting for its answers (bridge.max_held_flows_per_principal): answer them, or retry once abandoned ones expire",
                        gw.config.bridge.max_held_flows_per_principal
                    ),
                ),
                NotHeld::Closed => Refusal::internal(
                    Class::Overloaded,
                    "this replica is shutting down and can no longer hold the call until its retry; issue the call again",
                ),
                NotHeld::TooLarge(bytes) => Refusal::internal(
                    Class::OverLimit,
                    format!(
                        "the round's questions take {bytes} bytes, above bridge.max_held_bytes_per_flow ({})",
                        gw.config.bridge.max_held_bytes_per_flow
                    ),
                ),
            };
            Input::Held(Err(refusal))
        }
    }
}

fn learn(upstreams: &UpstreamSide, group: &UpstreamGroup, request: &ModernRequest, learnt: Learnt) {
    match learnt {
        Learnt::Resumable(resumable) => {
            upstreams.note_resumable(group, resumable);
            upstreams
                .learnt
                .update(&group.name, |facts| facts.note_round_served());
        }
        Learnt::ReplayRefused { empty } => {
            let how = if empty {
                "an empty stream"
            } else {
                "a refusal"
            };
            upstreams.note_replay_refused(group, how);
        }
        Learnt::EventIdsUnusable(unusable) => upstreams.note_replay_refused(group, unusable.why()),
        Learnt::ResumptionFailed => upstreams.note_resumption_failed(group),
        Learnt::ResumptionWorked => {
            upstreams
                .learnt
                .update(&group.name, |facts| facts.failing_resumptions = None);
        }
        Learnt::Primes(primes) => {
            upstreams
                .learnt
                .update(&group.name, |facts| facts.resumption_primes = Some(primes));
        }
        Learnt::AsksAtOnce => upstreams.note_asks_at_once(group, request),
    }
}

/// The flow's view of an upstream failure; the detail (endpoint, cause) goes to the log.
fn failure(e: &SessionError) -> Failure {
    tracing::info!(error = %Report(e), "upstream exchange of a bridged call failed");
    Failure::from(e)
}

/// The flow's view of an upstream failure: what it decides on.
impl From<&SessionFailure> for FailureKind {
    fn from(failure: &SessionFailure) -> FailureKind {
        match failure {
            SessionFailure::NoEndpoint => FailureKind::NoEndpoint,
            SessionFailure::Gone => FailureKind::Gone,
            SessionFailure::Refused(status) => FailureKind::Refused(*status),
            SessionFailure::Denied { status, .. } => FailureKind::Denied(*status),
            SessionFailure::Exchange(ExchangeFailure::Connect) => FailureKind::Unreachable,
            SessionFailure::Exchange(ExchangeFailure::NoDescriptor) => FailureKind::NotSent,
            SessionFailure::Exchange(ExchangeFailure::Timeout) => FailureKind::Timeout,
            SessionFailure::Exchange(
                ExchangeFailure::Broken
                | ExchangeFailure::Unanswered
                | ExchangeFailure::Handshake
                | ExchangeFailure::Untrusted,
            ) => FailureKind::Cut,
            SessionFailure::Exchange(_) | SessionFailure::Protocol(_) => FailureKind::Broken,
        }
    }
}

/// The flow's view of an upstream failure: what it decides on, its message, and a
/// denial's challenge.
impl From<&SessionError> for Failure {
    fn from(e: &SessionError) -> Failure {
        let failure = e.failure();
        Failure {
            challenge: match failure {
                SessionFailure::Denied { challenge, .. } => challenge.clone(),
                _ => None,
            },
            ..Failure::new(FailureKind::from(failure), failure.to_string())
        }
    }
}

/// Answers the client as the flow ended.
async fn finish(
    call: &Call<'_>,
    session: &mut ServerSession,
    reply: ClientReply,
    flow: &Flow,
    ending: Ending,
) -> Outcome {
    let Call {
        gw, group, request, ..
    } = *call;
    let server_info = &gw.upstreams.server_info(group, request);
    match ending {
        Ending::Complete {
            message,
            rounds,
            started_ms,
        } => {
            gw.runtime.metrics.flow_rounds.observe(f64::from(rounds));
            let ms = now_ms().saturating_sub(started_ms);
            gw.runtime.metrics.flow_duration.observe(ms as f64 / 1000.0);
            let cacheable = request.method == "resources/read";
            finish_with(reply, session, message, server_info, cacheable).await
        }
        Ending::InputRequired {
            mut state,
            input_requests,
            shed,
        } => {
            // What the state tells another replica of the store is its endpoint's own
            // verdict, not the group's latest (which may be another endpoint's).
            if let Waiting::Resumable {
                call, positions, ..
            } = &mut state.waiting
            {
                let store = gw.upstreams.learnt.store(&group.name, call.endpoint);
                positions.upstream.sessions_kept_apart = store.session_replay.kept_apart();
            }
            let sealed = match state.seal_layout_within(
                &gw.sealing.keys.load(),
                &call.bind,
                gw.config.limits.max_request_state_bytes,
                gw.config.bridge.seal_previous_version,
            ) {
                Ok(sealed) => sealed,
                Err(too_large) => {
                    let refusal = Refusal::internal(Class::OverLimit, too_large.to_string());
                    return refuse(session, reply, refusal).await;
                }
            };
            let mut result = json!({"resultType": "input_required", "requestState": sealed});
            if !input_requests.is_empty() {
                result["inputRequests"] = Value::Object(input_requests.clone());
            }
            let flow_id = format!("{:016x}", flow.flow_id());
            if shed {
                gw.runtime.metrics.shed.inc();
                tracing::info!(flow = flow_id, "call deferred: shedding load");
            } else {
                let reissue = matches!(state.waiting, Waiting::Reissue { .. });
                tracing::info!(
                    flow = flow_id,
                    round = state.round,
                    questions = input_requests.len(),
                    reissue,
                    "input required"
                );
                gw.runtime
                    .metrics
                    .input_required
                    .with_label_values(&[request.method.as_str()])
                    .inc();
            }
            let result = decorate_as_is(result, server_info, false);
            if !reply.result(session, result).await {
                // The state never reached the client: the flow is abandoned (the reaper
                // ends it at its deadline).
                Outcome::ClientGone
            } else if shed {
                Outcome::Shed
            } else {
                Outcome::InputRequired
            }
        }
        Ending::Refused(refusal) if refusal.class == Class::SessionEnded => {
            session::ended(gw, session, reply).await;
            Outcome::Refused(refusal)
        }
        Ending::Refused(refusal) => {
            if matches!(
                refusal.class,
                Class::UpstreamError | Class::UpstreamTimeout | Class::NoUpstream
            ) {
                tracing::warn!(group = %group.name, error = %refusal.message, "bridged call failed");
            } else {
                tracing::info!(group = %group.name, error = %refusal.message, "bridged call refused");
            }
            let refusal = super::public_challenge(gw, session, group, refusal);
            refuse(session, reply, refusal).await
        }
        Ending::ClientGone => {
            // Closed, or half-closed and still reading: cut, so that a streaming reply
            // does not end like a whole one (a terminal chunk at `finish`), its result
            // missing.
            respond::cut(session).await;
            Outcome::ClientGone
        }
    }
}

async fn refuse(session: &mut ServerSession, reply: ClientReply, refusal: Refusal) -> Outcome {
    reply.refuse(session, refusal).await
}

/// Answers a `requestState` that was refused, with one uniform error whatever the reason;
/// the reason goes to the logs and the rejection metric.
async fn refuse_state(
    gw: &Gateway,
    session: &mut ServerSession,
    reply: ClientReply,
    group: &UpstreamGroup,
    reason: &'static str,
) -> Outcome {
    count_state_rejection(gw, group, reason);
    let refusal = Refusal::new(Class::StateRejected, code::INVALID_PARAMS, INVALID_STATE);
    refuse(session, reply, refusal).await
}

/// Counts a refused `requestState` by its reason, and logs the reason.
fn count_state_rejection(gw: &Gateway, group: &UpstreamGroup, reason: &'static str) {
    let rejections = &gw.runtime.metrics.state_rejections;
    rejections.with_label_values(&[reason]).inc();
    tracing::info!(group = %group.name, reason, "requestState refused");
}

/// Names the flow in the request's span, so its access line carries the flow id; the id
/// travels in the state, so every round on every replica logs the same one.
fn name_flow(flow_id: u64) {
    tracing::Span::current().record("flow", format!("{flow_id:016x}"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::exchange::ExchangeError;

    /// What befell the connection (a reset, a close, a TLS handshake: an upstream
    /// restarting, a certificate rotated) is told apart from an answer against the
    /// protocol: only the latter teaches that a group cannot resume.
    #[test]
    fn a_failure_below_http_is_a_cut_and_an_answer_against_the_protocol_is_not() {
        let kind = |f| failure(&SessionError::from(ExchangeError::new(f, None))).kind;
        for below_http in [
            ExchangeFailure::Broken,
            ExchangeFailure::Unanswered,
            ExchangeFailure::Handshake,
            ExchangeFailure::Untrusted,
        ] {
            assert_eq!(kind(below_http), FailureKind::Cut, "{below_http:?}");
        }
        for answered in [
            ExchangeFailure::Protocol("101"),
            ExchangeFailure::TooLarge(9),
        ] {
            assert_eq!(kind(answered), FailureKind::Broken, "{answered:?}");
        }
    }
}
