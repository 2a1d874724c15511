//! One client request of a bridged interactive call (`tools/call`, `prompts/get`,
//! `resources/read`), as a state machine without I/O, in the manner of quinn-proto: the
//! shell feeds [`Input`]s (what the upstream and the client did) with the time, and
//! carries out the [`Command`]s it polls (what to send, open, close, answer), until the
//! flow finishes with an [`Ending`]. `poll_timeout` says when the flow wants the clock.
//!
//! A request is a new call, or a retry of a sealed [`FlowState`]:
//!
//! ```text
//!  new call ──(shedding)──────────────────────────────────────────▶ Finish(state-only)
//!     │
//!     ▼
//!  Opening ─▶ OpeningSessionStream ─▶ Posting ─▶ Reading ─┬─▶ Finish(result | error)
//!     ▲                                             ▲       ├─▶ Cancelling ─▶ Finish(error)
//!     │                                             │       ├─▶ Watching ─▶ Finish(questions)
//!     │ restartable, lost                           │       └─▶ Holding ──▶ Finish(questions)
//!  retry of Resumable ─▶ Reopening ─▶ Settling ──────────────────────▶ Answering ─┤
//!  retry of Held (taken) ───────────────────────────────────────────▶ Answering ─┤
//!  retry of Reissue ────────────────────────────────────────────────▶ Answering ─▶ Posting
//!  retry of Deferred ─▶ (as a new call)
//! ```
//!
//! A retry reopens what its call waits on before any answer goes up, so what the answers
//! cause finds a stream to go out on: the call's stream and the session's GET stream,
//! both at once. A round ends when the call completes, when the upstream has nothing more
//! to send after a question (for a call known to ask several at once, and a round that
//! will be held: when the quiet window passes after the last new question), when it holds
//! as many questions as it may, or in error; its questions go to the client with the
//! state the next retry resumes from: resumable, or held by this replica. A question that
//! missed its round is replayed before the next round's answers go up, and teaches the
//! shell that the call asks at once. A stream resumed from before the round's first
//! question on it (one left unanswered; on the GET stream, any) first replays the events
//! the round read (the state counts them): the client had their notifications then and
//! the gateway answered their pings then, so only the questions still pending count. The session's GET stream replays nothing where the
//! group's event store is shared by sessions (it reopens fresh), so there a round that
//! would end with questions first pings the session (`Command::Barrier`): the upstream
//! answers after whatever it had queued, on either stream, written before its answer,
//! and the round then reads what the streams hold and ends as any round does.
//!
//! While the call's POST awaits its answer, the session's GET stream is read: some
//! servers send a POST stream's header only with its first event, and ask on the GET
//! stream meanwhile. A message there whose call answer has not come `WITHHELD_AFTER`
//! later starts the round without it (such a round has no call-stream position, so it is
//! held); the answer, when it comes, opens the call's stream in the round it finds.
//!
//! When the gateway drains, a round that can be resumed elsewhere ends at once with what
//! it has (its questions, or none: the state alone), and one that cannot yet is handed
//! over as soon as it can; a retry whose resumed stream settles posts its answers first.
//! A round that can only be held runs to its end here.
//!
//! A client that closes its response cancels the request, in whichever phase it is told
//! (the call's answer awaited, a retry settling or backing off, a round read): the
//! round's streams close and the session is deleted, before or after the answers went up
//! alike. In a data-layer session, which outlives its calls, a call the flow gives up on
//! (the client left, or a limit ended it) is cancelled by id instead (`Command::Cancel`).
//!
//! Nothing here reads a clock, a socket or a key: times are inputs, the state is sealed by
//! the shell (the flow checks that it fits), and the tables (reaper, held flows) are the
//! shell's, asked through commands whose answers come back as inputs. A command that
//! waits for an answer is the last one queued until the answer comes. The shell awaits
//! it to its end, except a GET of the upstream's streams (`Command::Get`), which
//! changes nothing there: it is cut when `poll_timeout` is due (a retry's reopening, or a
//! round's, ends at the round's silence or the flow's deadline), when the client leaves
//! or when the grace period ends, and the flow is told which.

use super::state::{
    FlowState, HeldAt, Known, Pending, Positions, ReadBefore, UpstreamCall, UpstreamFacts,
    UpstreamId, Waiting,
};
use super::translate::{Action, Relay, Round, RoundLimits, UnusableIds};
use crate::config::ResumeMode;
use crate::mrtr::modern::{code as mcode, gateway_code as gcode};
use crate::outcome::{Class, Refusal};
use crate::protocol::jsonrpc::{self, Cancellation};
use crate::protocol::revision::Revision;
use crate::protocol::sse::Event;
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How often the flow follows an upstream that closes the call's stream mid-call.
const MAX_STREAM_ENDS: usize = 8;
/// Most bytes of events held while a resumed stream settles, each event counted with
/// `EVENT_OVERHEAD` more: what a tool sent while its client was away is replayed, but an
/// upstream that replays without end in the settling time is refused, not held.
const MAX_SETTLE_BYTES: usize = 32 << 20;
const EVENT_OVERHEAD: usize = 256;
/// Longest `retry` hint honoured.
const MAX_RETRY: Duration = Duration::from_secs(10);
/// The wait before reopening a stream the upstream ended, without a `retry` hint.
const DEFAULT_RETRY: Duration = Duration::from_secs(1);
/// How often an empty resumption is tried again, after how long at first (doubling:
/// 5 ms to 160 ms, 315 ms in all), before the upstream is taken not to have the call's
/// events: an upstream that has not yet let go of the stream's previous connection
/// answers one with an empty stream, which a retry right after its round meets often,
/// and for a moment only.
const EMPTY_RETRIES: u32 = 6;
const EMPTY_BACKOFF: Duration = Duration::from_millis(5);
/// How long a retry waits for a resumed stream's priming event: from an upstream known
/// to prime, and (once, to learn) from one not known yet.
const SETTLE_PRIMED: Duration = Duration::from_secs(2);
const SETTLE_UNKNOWN: Duration = Duration::from_millis(300);
/// How long after the session's stream spoke the call's answer may still come before the
/// round reads on without it: a server that sends a POST stream's header only with its
/// first event withholds it until the question is answered, while one that sends it at
/// once takes a few milliseconds even when busy.
const WITHHELD_AFTER: Duration = Duration::from_millis(100);
/// Why a held call is given up when its holder is gone, or no longer holds it: nobody
/// will answer the call's questions, and nobody else ends it (a replica that died took
/// its held table and its reaper with it).
const HOLDER_GONE: &str = "the replica holding the call is gone";
/// What a refusal tells the client when nothing of its retry reached the upstream.
const SAME_RETRY_AGAIN: &str = "send the same retry again: its requestState is still good";

/// How long before the flow's deadline a round still reading ends: the replica that
/// opened the flow deletes its session at the deadline (its reaper cannot know that a
/// retry runs elsewhere), and the client should hear of the deadline, not of a session
/// that vanished under its call.
const FLOW_DEADLINE_MARGIN: Duration = Duration::from_secs(1);

/// Which upstream stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// The call's own stream: its POST's response, or a resumption of it.
    Call,
    /// The session's standalone GET stream.
    Session,
}

/// Why an upstream exchange failed, as far as the flow's decisions go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    /// What went wrong, for the client's message.
    pub message: String,
    /// A denial's challenge (`WWW-Authenticate`), which the client must see.
    pub challenge: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// No healthy endpoint to open a session on.
    NoEndpoint,
    /// The endpoint did not take the connection.
    Unreachable,
    /// This replica could not open a connection (out of file descriptors): nothing was
    /// sent, and the upstream has lost nothing.
    NotSent,
    /// The upstream no longer has the session (HTTP 404, or a 401 without a challenge).
    Gone,
    /// The upstream refused the request with this status.
    Refused(u16),
    /// The upstream denied the caller's credentials (401) or access (403): the request
    /// was not processed, and the client may authenticate and retry.
    Denied(u16),
    /// No answer in time.
    Timeout,
    /// The exchange failed below HTTP (a reset, a close, a TLS handshake: an upstream
    /// restarting, a certificate rotated): nothing says what the upstream would have
    /// answered.
    Cut,
    /// Anything else: an answer against the protocol.
    Broken,
}

impl FailureKind {
    /// The upstream gave no answer that says why the request failed: the exchange was
    /// cut below HTTP, failed with a server error, or had no answer in time.
    pub fn unexplained(self) -> bool {
        match self {
            FailureKind::Refused(status) => (500..600).contains(&status),
            kind => matches!(kind, FailureKind::Cut | FailureKind::Timeout),
        }
    }

    /// Nothing says the same request will fail again: the upstream could not be reached,
    /// gave no answer that explains the failure, or refused it for now (a timeout, a
    /// conflict, a throttle).
    pub fn may_pass_later(self) -> bool {
        self.unexplained()
            || match self {
                FailureKind::NoEndpoint | FailureKind::Unreachable | FailureKind::NotSent => true,
                FailureKind::Refused(status) => refused_for_now(status),
                _ => false,
            }
    }

    /// A session failed in a way that shows the request did not run there and the
    /// session may serve no one any more: the upstream forgot it (a 404; or a 400, how
    /// servers built on the TypeScript SDK's examples, server-everything among them,
    /// answer a session they do not know), or its endpoint takes no connection (down, or
    /// gone from the group's answer). A 400 the request itself earned is earned again on
    /// a new session.
    pub fn may_be_forgotten_session(self) -> bool {
        matches!(
            self,
            FailureKind::Gone | FailureKind::Unreachable | FailureKind::Refused(400)
        )
    }

    /// The upstream read the request and refused it as such: the same request will be
    /// refused again, whoever sends it. Not a denial, nor a refusal for now (a timeout,
    /// a conflict, a throttle), nor one the request's own size earned (413, 414, 431:
    /// a smaller request, another caller's, may pass).
    pub fn refused_for_good(self) -> bool {
        matches!(self, FailureKind::Refused(status)
            if (400..500).contains(&status)
                && !refused_for_now(status)
                && !matches!(status, 413 | 414 | 431))
    }
}

/// A refusal that says nothing of a later request: a timeout, a conflict, a throttle.
fn refused_for_now(status: u16) -> bool {
    matches!(status, 408 | 409 | 425 | 429)
}

impl Failure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Failure {
        Failure {
            kind,
            message: message.into(),
            challenge: None,
        }
    }

    /// The upstream denied the caller with `status`, and `challenge`.
    pub fn denied(status: u16, challenge: Option<String>, message: impl Into<String>) -> Failure {
        Failure {
            challenge,
            ..Failure::new(FailureKind::Denied(status), message)
        }
    }

    /// The upstream lost the call: its session is gone, or its endpoint is down.
    pub fn is_lost(&self) -> bool {
        matches!(self.kind, FailureKind::Gone | FailureKind::Unreachable)
    }

    /// The upstream refused the request as such (`FailureKind::refused_for_good`).
    pub fn refused_for_good(&self) -> bool {
        self.kind.refused_for_good()
    }

    /// The request provably did not reach the upstream, or was refused there. A 5xx
    /// proves neither: a proxy's 502 or 504 may follow a server that took the request.
    pub fn never_delivered(&self) -> bool {
        match self.kind {
            FailureKind::Refused(status) => status < 500,
            kind => matches!(
                kind,
                FailureKind::Unreachable
                    | FailureKind::NotSent
                    | FailureKind::Denied(_)
                    | FailureKind::Gone
            ),
        }
    }

    /// The client's error for this failure of `group`'s upstream.
    pub fn refusal(&self, group: &str) -> Refusal {
        if let FailureKind::Denied(status) = self.kind {
            let class = if status == 401 {
                Class::Unauthorized
            } else {
                Class::Forbidden
            };
            let text = format!("upstream group '{group}' {}", self.message);
            let refusal =
                Refusal::new(class, crate::protocol::jsonrpc::code::INVALID_REQUEST, text);
            return refusal.with_challenge(self.challenge.clone());
        }
        let class = match self.kind {
            FailureKind::NoEndpoint => Class::NoUpstream,
            FailureKind::Timeout => Class::UpstreamTimeout,
            FailureKind::NotSent => Class::Overloaded,
            _ => Class::UpstreamError,
        };
        let text = format!("upstream group '{group}' failed: {}", self.message);
        Refusal::internal(class, text)
    }
}

/// What the upstream answered to the call's POST.
#[derive(Clone, Debug, PartialEq)]
pub enum CallReply {
    /// An SSE stream: its events come as `Input::Event` on `Stream::Call`.
    Stream,
    /// One JSON-RPC message (a JSON body).
    Message(Value),
}

/// What happened, fed to the flow with the time.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// `OpenSession`: the session is open (`session` is its id, if the server gave one);
    /// `warm`: it was initialized ahead of demand, and may have been forgotten upstream
    /// since; `session_stream`: its GET stream is open already (opened with it);
    /// `version`: the revision it negotiated.
    SessionOpened {
        endpoint: SocketAddr,
        session: Option<String>,
        version: Revision,
        warm: bool,
        session_stream: bool,
    },
    SessionFailed(Failure),
    /// `StreamGet::Open`: the stream is open, or not.
    StreamOpened {
        stream: Stream,
        result: Result<(), Failure>,
    },
    /// `StreamGet::Reopen`: the call's stream is resumed (at `call_at`, which may be before the
    /// session's stream was done), or not.
    Reopened {
        result: Result<(), Failure>,
        call_at: Instant,
        /// The session's stream resumes after its position (not fresh, nor absent).
        session_resumed: bool,
    },
    /// `PostCall`: the upstream's answer to the call.
    CallPosted(Result<CallReply, Failure>),
    /// `Post`: the upstream took the message (202), or not.
    Posted(Result<(), Failure>),
    /// An event read on an open stream.
    Event {
        stream: Stream,
        event: Event,
    },
    /// An open stream ended (cleanly or broken).
    StreamEnded(Stream),
    /// An open stream broke in a way no resumption mends (it sent an event over the size
    /// limit, which a resumption would send again): the call ends with `failure`.
    StreamBroken {
        stream: Stream,
        failure: Failure,
    },
    /// `Watch`: the reaper took the session, or why it would not (its table is full, or
    /// the caller's share of it).
    Watched(Result<(), Refusal>),
    /// `Hold`: the slot that holds the flow, or why none does.
    Held(Result<HeldAt, Refusal>),
    /// The client closed its response: the request is cancelled.
    ClientGone,
    /// The gateway began draining.
    Draining,
    /// The grace period is in its last stretch: a round that could not be handed over
    /// ends now, with its upstream call, rather than be cut when the process exits.
    GraceEnding,
    /// `Barrier`: the upstream answered the ping, or could not within its bound.
    BarrierPassed,
}

/// A GET of the flow's upstream streams: the only commands the shell may stop carrying out
/// once `poll_timeout` is due (then calling `handle_timeout`), the client leaves or the
/// grace period ends (then telling the flow so). A GET changes nothing upstream; anything
/// posted is awaited to its end (never sent twice, never cut half-delivered).
#[derive(Clone, Debug, PartialEq)]
pub enum StreamGet {
    /// Open `stream` (dropping what was there): the call's resumed after `after`, or the
    /// session's, after `after` or fresh; answer `StreamOpened`.
    Open {
        stream: Stream,
        after: Option<String>,
    },
    /// A retry's reopening: the call's stream resumed after `after` and, beside it, the
    /// session's (after `session_after`, or fresh); answer `Reopened` once both are
    /// done. The session's is optional: without it, questions come on the call's stream
    /// only.
    Reopen {
        after: String,
        session_after: Option<String>,
    },
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Open an upstream session for the call (the request's data-layer session, or a new
    /// one initialized with its capabilities, ahead of demand if one is ready); answer
    /// `SessionOpened` or `SessionFailed`. Asked again in a flow, it replaces a warm
    /// session the upstream no longer has with one opened now.
    OpenSession,
    /// A GET of the upstream's streams, which the shell may cut (`StreamGet`).
    Get(StreamGet),
    /// Post the call under `id`; answer `CallPosted`.
    PostCall { id: i64 },
    /// Post a JSON-RPC response to a server request (an answer, a ping's, a refusal);
    /// answer `Posted`.
    Post(Value),
    /// Write a notification to the client (switching its response to SSE if it accepts it).
    Notify(Value),
    /// Write a keep-alive comment to the client, if its response streams.
    KeepAlive,
    /// Post a `ping` under `id` in the call's session and read its answer, within a
    /// short bound; answer `BarrierPassed` whatever happened. A server answers it after
    /// everything it queued before it: once the answer is in, what the tool had decided to
    /// send on the session's GET stream is on its way.
    Barrier { id: i64 },
    /// Have the reaper watch the session until the flow's deadline (`until`, seconds
    /// since the Unix epoch), to delete it then; or, in a data-layer session, which
    /// outlives the call, the call (its upstream id, `call`), to cancel it then. Answer
    /// `Watched`.
    Watch { until: u64, call: Option<Value> },
    /// Stop watching the data-layer session's call `call` (its upstream id): it has ended.
    Unwatch { call: Value },
    /// Keep the flow's streams (and their unread events) in this replica's table, with
    /// the round's questions; answer `Held`.
    Hold {
        questions: Map<String, Value>,
        /// When the held entry expires with the state.
        expires_at: u64,
        /// In a data-layer session, the `notifications/cancelled` that ends the call if
        /// the entry expires unclaimed (the session, which outlives it, is not deleted).
        cancel_on_expiry: Option<Cancellation>,
    },
    /// Close the flow's upstream streams (never cancelling the call).
    CloseStreams,
    /// Delete the upstream session: the flow opened it and is done with it.
    DeleteSession,
    /// Post this `notifications/cancelled` in the call's data-layer session once the
    /// client has its answer (best effort; no answer): the flow gave up on a call the
    /// session, which outlives its calls, may still be running.
    Cancel(Cancellation),
    /// Post this `notifications/cancelled` in the call's data-layer session now, within
    /// a short bound, and answer `Posted`: whether the session is still there decides the
    /// client's answer.
    CancelFirst(Cancellation),
    /// Release the retry's replay claim: the upstream got none of its answers.
    ReleaseClaim,
    /// Something learnt about the group's upstream.
    Learn(Learnt),
    /// Something to count.
    Note(Note),
    /// The request ends: answer the client so.
    Finish(Ending),
}

/// What a flow learns about its group's upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Learnt {
    /// Whether the group's rounds wait resumable (or held).
    Resumable(bool),
    /// The upstream refused a `Last-Event-ID` resumption (or, `empty`, answered it with an
    /// empty stream): with `resume: auto` its flows are held from then on.
    ReplayRefused { empty: bool },
    /// An event id came twice in one round (on one stream or on both), or one cannot be
    /// sent back as a header: the upstream's ids do not resume its calls. With
    /// `resume: auto` its flows are held from then on.
    EventIdsUnusable(UnusableIds),
    /// A resumption failed without an answer that says the upstream cannot resume: cut
    /// below HTTP, a server error, or no answer in time. One alone says nothing (an
    /// upstream restarting); the shell learns from a run of them.
    ResumptionFailed,
    /// A resumption worked: the call's stream came back and settled (its priming event,
    /// or the settling time passed; from a server known not to prime, once it answered),
    /// ending any run of failed ones. One that ends while it settles says neither: the
    /// call's end replayed and a cut look alike.
    ResumptionWorked,
    /// Whether its resumed streams are primed once live.
    Primes(bool),
    /// The call asked a question before the previous round's answers went up (it was
    /// replayed while the resumed stream settled): the tool asks several questions at
    /// once, and one of them missed its round. Its later rounds wait the quiet window.
    AsksAtOnce,
}

/// Events worth counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Note {
    /// A `restartable` call is run again after its upstream lost it.
    Restarted,
    /// A round cut short by draining goes to the client, for another replica to resume.
    HandedOver,
    /// A retry's resumed call stream sent no priming event within the wait for one
    /// (`SETTLE_UNKNOWN` while the group's priming is not known, `SETTLE_PRIMED` once it
    /// is): the answers go up after that wait.
    Unprimed,
}

/// How the request ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Ending {
    /// The upstream's response to the call, for the client as its result (or error),
    /// after `rounds` rounds of a flow that began at `started_ms`.
    Complete {
        message: Value,
        rounds: u16,
        started_ms: u64,
    },
    /// Questions for the client (possibly none: a state-only result) and the state its
    /// retry resumes from. `shed`: a new call deferred under load shedding.
    InputRequired {
        state: Box<FlowState>,
        input_requests: Map<String, Value>,
        shed: bool,
    },
    Refused(Refusal),
    /// The client left; nothing is answered.
    ClientGone,
}

/// Everything a flow is told at its start.
#[derive(Clone, Debug)]
pub struct FlowConfig {
    pub group: String,
    /// The method, and the tool name or resource uri, for messages.
    pub method: String,
    pub target: String,
    pub capabilities: Map<String, Value>,
    /// What the request asked to be told while it runs: progress, log messages.
    pub relay: Relay,
    /// The tool may be run again when its upstream loses it.
    pub restartable: bool,
    /// The request runs in a data-layer session.
    pub data_session: bool,
    pub round_limits: RoundLimits,
    pub max_rounds: u16,
    /// Largest sealed-state plaintext (binding and state) that stays within the state
    /// limit once sealed.
    pub max_state_plaintext: usize,
    /// The state limit itself, and the sealing key id's length, for the message.
    pub max_state_bytes: usize,
    pub kid_len: usize,
    /// How long a round waits after a question for more, where it waits at all: a round
    /// that will be held, or one of a call that asks several questions at once
    /// (`asks_at_once`). Other rounds end as soon as the upstream has nothing more to
    /// send: a question that misses its round is replayed before the next one's answers
    /// go up, which shows the call asks at once (`Learnt::AsksAtOnce`).
    pub quiet_window: Duration,
    /// The call is known to ask several questions at once (or every round waits).
    pub asks_at_once: bool,
    pub poll: Duration,
    /// How long the call's POST may go unanswered (no response header) while the
    /// upstream sends nothing else: the group's response timeout.
    pub answer_timeout: Duration,
    pub silence: Duration,
    pub silence_seconds: u64,
    pub keepalive: Option<Duration>,
    pub request_state_ttl_seconds: u64,
    pub max_flow_seconds: u64,
    /// The group's `resume` setting, and what is known of it.
    pub resume: ResumeMode,
    pub replay_refused: bool,
    pub primes: Option<bool>,
    /// The group's store keeps sessions apart: a GET stream may be resumed.
    pub session_replay_scoped: bool,
    /// Whether the group's store keeps sessions apart, as this replica has learnt it
    /// (`None`: not yet), for the states the flow seals.
    pub sessions_kept_apart: Option<bool>,
    /// This replica sheds new calls now.
    pub shedding: bool,
    /// This replica can hold flows (a slot, and its peer address if it has one).
    pub now_secs: u64,
    pub now_ms: u64,
    /// A random flow id for a new call.
    pub flow_id: u64,
}

/// What lost a call between rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lost {
    /// The upstream: its session is gone, or its endpoint is down or has left the group.
    Upstream,
    /// The upstream no longer has the call's events: a resumption came back empty.
    Unresumable,
    /// The replica holding the call's streams is gone or no longer holds them.
    Holder,
    /// The replica holding the call's streams stopped answering while it continued this
    /// retry: the answers may have reached the call, which may have run to its end.
    HolderMidRetry,
}

/// One request of a bridged call.
pub struct Flow {
    config: FlowConfig,
    /// What carries over from round to round.
    common: Common,
    phase: Phase,
    commands: VecDeque<Command>,
    /// This request started upstream work that a client who never continues would leave
    /// behind, for its replica's reaper to end: it opened the flow's session (a new call,
    /// or a re-run), or posted the call in a data-layer session.
    started: bool,
    /// The upstream id of the data-layer session's call this retry resumed, which the
    /// replica that posted it may watch: unwatched when the call ends here.
    resumed_data_call: Option<Value>,
    /// The session was initialized ahead of demand and no call has gone out on it yet.
    warm_session: bool,
    /// This request runs a lost call again (a restartable tool): the state that led here
    /// stays claimed once the call goes out.
    rerun: bool,
    /// This request retries a state whose call has yet to go out (deferred, or re-issued
    /// after a URL elicitation): until it does, nothing of the state ran upstream.
    unspent: bool,
    /// When a round still reading ends, at the flow's deadline (`max_flow_seconds`).
    ends_at: Instant,
    /// When this request's flow was made, on its clock (the wall clock's `config.now_ms`),
    /// and the time of the input being handled: a state's expiry counts from when it is
    /// issued, however long the round ran.
    began: Instant,
    clock: Instant,
}

#[derive(Clone, Debug)]
struct Common {
    flow_id: u64,
    started_ms: u64,
    flow_deadline: u64,
    round: u16,
    known: Vec<Known>,
}

/// Where the request stands.
enum Phase {
    /// `OpenSession` sent.
    Opening,
    /// The session is open; its GET stream is opened before the call is posted.
    OpeningSessionStream {
        call: UpstreamCall,
    },
    /// `PostCall` sent; its answer (the response header) is due by `until`. Some servers
    /// send a POST stream's header only with its first event: a message on the session's
    /// stream meanwhile (`early`, at its time) starts the round if the answer has not come
    /// `WITHHELD_AFTER` later, the call's answer then coming when it comes.
    Posting {
        call: UpstreamCall,
        until: Instant,
        early: Option<Box<(Input, Instant)>>,
        /// When the client is next sent a keep-alive comment while the answer is awaited.
        keepalive_at: Option<Instant>,
    },
    /// A retry reopens the call's stream.
    Reopening(Box<Retry>),
    /// The reopened stream settles: events wait until its priming event, or `until`.
    Settling {
        retry: Box<Retry>,
        until: Instant,
    },
    /// An empty resumption is tried again at `until`.
    Backoff {
        retry: Box<Retry>,
        until: Instant,
    },
    /// The retry's answers go up, one `Post` at a time.
    Answering(Box<Retry>),
    /// A round is read.
    Reading(Box<Reading>),
    /// `Watch` sent before the round's questions go to the client.
    Watching(Box<Ended>),
    /// `Hold` sent.
    Holding {
        state: Box<FlowState>,
        questions: Map<String, Value>,
    },
    /// A data-layer session's call failed; its cancellation is posted, and its answer
    /// says whether the session itself ended. The answers to `posts_before`, posts
    /// queued ahead of it (refusals of one batch event), come first and say nothing.
    Cancelling {
        failure: Failure,
        posts_before: usize,
    },
    Done,
}

/// A retry on its way back into its call.
struct Retry {
    call: UpstreamCall,
    pending: Vec<Pending>,
    responses: Map<String, Value>,
    /// The call stream's position to resume from, and the session stream's.
    from: Option<String>,
    session_from: Option<String>,
    /// How many events each stream replays that the round before read: those from the
    /// round's start, on a stream resumed from there.
    read_before: ReadBefore,
    all_answered: bool,
    /// Empty resumptions so far.
    empties: u32,
    /// The session's stream was reopened with the call's.
    session_reopened: bool,
    /// When the call's stream was last asked to reopen (`Phase::Reopening`).
    reopened_at: Option<Instant>,
    /// Events read while the resumed stream settled (replayed on the call's stream, or
    /// on the session's), for the round; and their bytes, against `MAX_SETTLE_BYTES`.
    replayed: Vec<(Stream, Event)>,
    replayed_bytes: usize,
    /// The resumed stream ended while it settled (after replaying something).
    call_ended: bool,
    to_post: VecDeque<(Pending, Value)>,
    answered: Vec<UpstreamId>,
    then: AfterAnswers,
    /// The gateway began draining while the resumed stream settled: the answers go up
    /// first, then the round is handed over as soon as it can be.
    drain_pending: bool,
}

enum AfterAnswers {
    /// Read the next round on the reopened streams.
    Read,
    /// Read on the held streams, asking unanswered questions again.
    ReadHeld { questions: Map<String, Value> },
    /// Post the call again (URL elicitation).
    Reissue,
}

/// A round being read.
struct Reading {
    call: UpstreamCall,
    round: Round,
    /// The call's stream is open (its events come as inputs).
    call_open: bool,
    /// Events read on the call's stream since it was (re)opened.
    call_events: usize,
    /// The call's stream is a resumption, not the call's own POST stream.
    reopened: bool,
    /// The upstream's `retry` hint.
    retry: Duration,
    /// Stream ends in a row without a message in between.
    stream_ends: usize,
    empty_resumptions: u32,
    quiet_until: Option<Instant>,
    reopen_at: Option<Instant>,
    /// A reopen of the call's stream is awaited.
    reopening: bool,
    last_activity: Instant,
    last_message: Instant,
    keepalive_at: Option<Instant>,
    /// A `Post` (a ping's answer, a refusal) is awaited, and what follows it.
    posting: Option<AfterPost>,
    /// Where the round is with its barrier (`Command::Barrier`).
    barrier: Barrier,
    /// What the flow read before the round began (a retry's replay, while its stream
    /// settled) and has yet to take: taken in order, each once no `Post` is awaited.
    replayed: VecDeque<Input>,
    /// A question among `replayed` shows the call asks several at once (every question
    /// of the round before was answered, so the replay holds only what came after it).
    replay_teaches: bool,
    /// The input being taken comes from `replayed`.
    taking_replayed: bool,
    /// How many events each stream has yet to replay that an earlier round read: what
    /// they said went to the client then and was answered then, so only the questions
    /// still pending (`earlier_pending`) count again.
    earlier: ReadBefore,
    earlier_pending: Vec<UpstreamId>,
    /// The gateway began draining before the round could be resumed elsewhere (no event
    /// id seen yet): it is handed over as soon as it can be.
    drain_pending: bool,
}

/// A round's barrier: before a round whose questions the session's GET stream cannot
/// send again ends, the upstream answers a ping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Barrier {
    NotYet,
    Awaited,
    Passed,
}

/// What follows a round's `Post`.
enum AfterPost {
    Read,
    End(Box<RoundEnd>),
}

/// How a round ended.
enum RoundEnd {
    Complete(Value),
    Questions {
        draining: bool,
    },
    Failed(Failure),
    MissingCapability(Value),
    Silent,
    /// The flow reached its deadline (`max_flow_seconds`).
    FlowDeadline,
    /// The replica's grace period ends, and the round could not be handed over.
    ShuttingDown,
    ClientGone,
}

impl RoundEnd {
    /// The upstream broke the protocol or the round's limits: `why`.
    fn broken(why: impl Into<String>) -> RoundEnd {
        RoundEnd::Failed(Failure::new(FailureKind::Broken, why))
    }
}

/// A round that ended, with what it read.
struct Ended {
    reading: Box<Reading>,
    end: RoundEnd,
}

impl Flow {
    /// A new call: started, or deferred when the replica sheds load.
    pub fn new_call(config: FlowConfig, now: Instant) -> Flow {
        let common = Common {
            flow_id: config.flow_id,
            started_ms: config.now_ms,
            flow_deadline: config.now_secs + config.max_flow_seconds,
            round: 0,
            known: Vec::new(),
        };
        let mut flow = Flow::with(config, common, now);
        flow.phase = flow.start(now);
        flow
    }

    /// A retry of `state` with its answers. `held_questions` is the round's questions
    /// from this replica's table, when it holds the flow and took it for the retry.
    pub fn retry(
        config: FlowConfig,
        state: FlowState,
        responses: Map<String, Value>,
        held_questions: Option<Map<String, Value>>,
        now: Instant,
    ) -> Flow {
        let mut flow = Flow::with(config, Common::of(&state), now);
        flow.unspent = matches!(
            state.waiting,
            Waiting::Deferred { .. } | Waiting::Reissue { .. }
        );
        flow.phase = match state.waiting {
            Waiting::Deferred { .. } => flow.start(now),
            Waiting::Resumable {
                call,
                pending,
                positions,
            } => {
                flow.resumed_data_call = call.data_session.then(|| call.id.to_json());
                flow.resume(call, pending, positions, responses, now)
            }
            Waiting::Held { call, pending, .. } => match held_questions {
                Some(questions) => {
                    // Taken from the held table, a data-layer session's call is this
                    // request's to see ended: watched if it goes on waiting resumably.
                    // (A session of the flow's own stays watched from its first round.)
                    flow.started = call.data_session;
                    let then = AfterAnswers::ReadHeld { questions };
                    flow.answer(Retry::new(call, pending, responses, then), now)
                }
                None => {
                    flow.give_up(&call, HOLDER_GONE);
                    flow.lost(Lost::Holder, &pending, &responses, now)
                }
            },
            Waiting::Reissue { call } if declines_every_question(&responses) => {
                flow.unspent = false;
                flow.declined_url_elicitation(&call)
            }
            Waiting::Reissue { call } => {
                let retry = Retry::new(call, Vec::new(), responses, AfterAnswers::Reissue);
                flow.answer(retry, now)
            }
        };
        flow
    }

    /// The user declined (or cancelled) the URL elicitation the server needs before it
    /// runs the call: the call is not issued again, as a legacy client does not retry
    /// one whose URL the user refused (the server would only ask again, and a tool that
    /// acts before it asks would act again). Its session ends with it.
    fn declined_url_elicitation(&mut self, call: &UpstreamCall) -> Phase {
        self.delete_session(call);
        let text = format!(
            "the user declined the URL-mode elicitation upstream group '{}' needs before it runs {} '{}' (its -32042 error); the call was not issued again",
            self.config.group, self.config.method, self.config.target
        );
        self.finish(Ending::Refused(Refusal::internal(
            Class::UpstreamError,
            text,
        )))
    }

    /// A retry whose call is lost before anything is tried (`cause`): a held flow whose
    /// holder is gone (or cannot be reached), or a call on an endpoint that has left the
    /// group. A restartable tool runs again, on an endpoint of the group now.
    pub fn call_lost(
        config: FlowConfig,
        state: FlowState,
        responses: Map<String, Value>,
        cause: Lost,
        now: Instant,
    ) -> Flow {
        let pending = state.waiting.pending().to_vec();
        let mut flow = Flow::with(config, Common::of(&state), now);
        if let Some(call) = state.waiting.call().filter(|_| cause == Lost::Holder) {
            flow.give_up(call, HOLDER_GONE);
        }
        flow.phase = flow.lost(cause, &pending, &responses, now);
        flow
    }

    fn with(config: FlowConfig, common: Common, now: Instant) -> Flow {
        // The flow's deadline, in wall-clock seconds, as an instant on the flow's clock,
        // a margin before the reaper of the replica that opened it ends its session.
        let left = common.flow_deadline.saturating_sub(config.now_secs);
        let ends_at = now + Duration::from_secs(left).saturating_sub(FLOW_DEADLINE_MARGIN);
        Flow {
            ends_at,
            config,
            common,
            phase: Phase::Done,
            commands: VecDeque::new(),
            started: false,
            resumed_data_call: None,
            warm_session: false,
            rerun: false,
            unspent: false,
            began: now,
            clock: now,
        }
    }

    /// The flow's id, for logs.
    pub fn flow_id(&self) -> u64 {
        self.common.flow_id
    }

    /// The next command, if any.
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// Whether the call's answer is awaited.
    pub fn awaits_call(&self) -> bool {
        matches!(self.phase, Phase::Posting { .. })
    }

    /// Whether the call's answer is awaited and the session's stream is read meanwhile,
    /// until it sends a message.
    pub fn is_posting(&self) -> bool {
        matches!(self.phase, Phase::Posting { early: None, .. })
    }

    /// Whether the flow takes upstream events now. The shell feeds them one at a time,
    /// and keeps those the flow does not take (a round that filled up) for a later round.
    pub fn is_reading(&self) -> bool {
        match &self.phase {
            Phase::Reading(r) => r.posting.is_none() && !r.reopening,
            Phase::Settling { .. } => true,
            _ => false,
        }
    }

    /// Whether the request has finished.
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done) && self.commands.is_empty()
    }

    /// When the flow next wants `handle_timeout`.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Settling { until, .. } | Phase::Backoff { until, .. } => Some(*until),
            Phase::Posting {
                until,
                early,
                keepalive_at,
                ..
            } => {
                let withheld_until = early.as_ref().map(|early| early.1 + WITHHELD_AFTER);
                [
                    Some(*until),
                    Some(self.ends_at),
                    withheld_until,
                    *keepalive_at,
                ]
                .into_iter()
                .flatten()
                .min()
            }
            // A retry's streams that do not come back end at the round's silence, or the
            // flow's deadline if sooner.
            Phase::Reopening(retry) => {
                let silent_at = retry.reopened_at.map(|at| at + self.config.silence);
                Some(silent_at.map_or(self.ends_at, |t| t.min(self.ends_at)))
            }
            // So does a round whose call stream, reopened, does not come back; or sooner,
            // its silence (`reading_timeout`).
            Phase::Reading(r) if r.posting.is_none() && r.reopening => {
                Some((r.last_message + self.config.silence).min(self.ends_at))
            }
            Phase::Reading(r) if r.posting.is_none() && !r.reopening => [
                r.quiet_until,
                r.reopen_at,
                r.keepalive_at,
                Some(r.last_message + self.config.silence),
                Some(self.ends_at),
                self.poll_at(r),
            ]
            .into_iter()
            .flatten()
            .min(),
            _ => None,
        }
    }

    /// When a silent resumable call stream is reopened (which recovers events an upstream
    /// stored but did not deliver to a resumed connection). Never in a round that could
    /// not resume: its live stream is all it has.
    fn poll_at(&self, r: &Reading) -> Option<Instant> {
        let resumable = r.call_open && r.round.last_event_id().is_some() && self.resumes(r);
        (r.quiet_until.is_none() && r.reopen_at.is_none() && resumable)
            .then(|| r.last_activity + self.config.poll)
    }

    /// Feeds what happened.
    pub fn handle(&mut self, input: Input, now: Instant) {
        self.clock = self.clock.max(now);
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        self.phase = match (phase, input) {
            (
                Phase::Opening,
                Input::SessionOpened {
                    endpoint,
                    session,
                    version,
                    warm,
                    session_stream,
                },
            ) => {
                let call = self.upstream_call(endpoint, session, version);
                self.session_opened(call, warm, session_stream, now)
            }
            (Phase::Opening, Input::SessionFailed(failure)) => {
                let refusal = self.refusal_before_call(&failure);
                self.finish(Ending::Refused(refusal))
            }
            (Phase::OpeningSessionStream { call }, Input::StreamOpened { .. }) => {
                self.post_call(call, now)
            }
            (Phase::Posting { call, early, .. }, Input::CallPosted(reply)) => {
                self.call_posted(call, reply, early.map(|e| e.0), now)
            }
            (
                Phase::Posting {
                    call,
                    until,
                    early: None,
                    keepalive_at,
                },
                input @ Input::Event { .. },
            ) => {
                let early = Some(Box::new((input, now)));
                Phase::Posting {
                    call,
                    until,
                    early,
                    keepalive_at,
                }
            }
            (Phase::Posting { call, .. }, Input::ClientGone) => {
                let reading = self.reading_for(call, None, false, false, now);
                self.reading(reading, Input::ClientGone, now)
            }
            // A call whose answer has not come cannot be handed over: it ends with the
            // grace period, as a round that cannot be resumed does.
            (Phase::Posting { call, .. }, Input::GraceEnding) => {
                let reading = self.reading_for(call, None, false, false, now);
                self.end_round(reading, RoundEnd::ShuttingDown)
            }
            // Told while a GET of its streams is cut (`Command::Get`).
            (Phase::OpeningSessionStream { call }, Input::ClientGone) => self.cancelled(&call),
            (Phase::Reopening(retry), Input::ClientGone) => self.cancelled(&retry.call),
            (Phase::OpeningSessionStream { call }, Input::GraceEnding) => {
                self.commands.push_back(Command::CloseStreams);
                self.give_up(&call, "the gateway replica is shutting down");
                if self.rerun {
                    // Nothing ran again: the state that led here goes on elsewhere.
                    self.release_claim_shutting_down("before the call went upstream again")
                } else {
                    self.shutting_down("before the call went upstream: issue it again")
                }
            }
            (Phase::Reopening(_), Input::GraceEnding) => {
                // Nothing went up: the same state goes on elsewhere.
                self.commands.push_back(Command::CloseStreams);
                self.release_claim_shutting_down("before the retry's answers went upstream")
            }
            (
                Phase::Reopening(mut retry),
                Input::Reopened {
                    result,
                    call_at,
                    session_resumed,
                },
            ) => {
                // A fresh stream replays nothing: every event on it is new, and a question
                // it sent before, left unanswered, is never asked again.
                let unasked =
                    |p: &Pending| p.asked.on_session && !retry.responses.contains_key(&p.key);
                if !session_resumed {
                    retry.read_before.session = 0;
                }
                if !session_resumed && result.is_ok() && retry.pending.iter().any(unasked) {
                    self.commands.push_back(Command::CloseStreams);
                    self.unanswerable(&retry)
                } else {
                    self.call_reopened(retry, result, call_at.min(now), now)
                }
            }
            (Phase::Reopening(retry), Input::StreamOpened { result, .. }) => {
                self.call_reopened(retry, result, now, now)
            }
            (Phase::Settling { retry, until }, Input::Event { stream, event }) => {
                self.settling_event(retry, until, stream, event, now)
            }
            (Phase::Settling { retry, .. }, Input::StreamEnded(Stream::Call)) => {
                self.settling_ended(retry, now)
            }
            (
                Phase::Settling { retry, .. } | Phase::Backoff { retry, .. },
                Input::StreamBroken { failure, .. },
            ) => {
                self.commands.push_back(Command::CloseStreams);
                self.give_up(&retry.call, "the call's stream failed");
                self.finish(Ending::Refused(self.refusal_for(&failure)))
            }
            (Phase::Posting { call, .. }, input @ Input::StreamBroken { .. }) => {
                let reading = self.reading_for(call, None, false, false, now);
                self.reading(reading, input, now)
            }
            (Phase::Settling { mut retry, until }, Input::Draining) => {
                retry.drain_pending = true;
                Phase::Settling { retry, until }
            }
            (Phase::Settling { retry, .. } | Phase::Backoff { retry, .. }, Input::ClientGone) => {
                self.cancelled(&retry.call)
            }
            (Phase::Answering(retry), Input::Posted(result)) => {
                self.answer_posted(retry, result, now)
            }
            (Phase::Reading(reading), input) => self.reading(reading, input, now),
            (Phase::Watching(ended), Input::Watched(Ok(()))) => self.round_over(*ended),
            (Phase::Watching(ended), Input::Watched(Err(refusal))) => {
                self.overloaded(&ended.reading, refusal)
            }
            (Phase::Holding { state, questions }, Input::Held(held)) => {
                self.held(state, questions, held)
            }
            (
                Phase::Cancelling {
                    failure,
                    posts_before,
                },
                Input::Posted(_),
            ) if posts_before > 0 => Phase::Cancelling {
                failure,
                posts_before: posts_before - 1,
            },
            (Phase::Cancelling { failure, .. }, Input::Posted(cancelled)) => {
                self.cancelled_after_failure(failure, cancelled)
            }
            // An input the phase does not wait for (a stream ending while a post is
            // answered, a draining signal while a session opens) changes nothing.
            (phase, _) => phase,
        };
    }

    /// Feeds the time; due at `poll_timeout`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.clock = self.clock.max(now);
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        self.phase = match phase {
            Phase::Settling { retry, until } if now >= until => {
                self.commands.push_back(Command::Note(Note::Unprimed));
                if self.config.primes.is_none() {
                    self.learn(Learnt::Primes(false));
                }
                self.resumed(*retry, now)
            }
            Phase::Backoff { retry, until } if now >= until => self.reopen_call(retry, now),
            Phase::Posting {
                call,
                early: Some(early),
                ..
            } if now >= early.1 + WITHHELD_AFTER => {
                // The upstream spoke on the session's stream, and the call's answer is
                // still withheld: the round reads on without it.
                let mut reading = self.reading_for(call, None, false, false, now);
                reading.replayed.push_back(early.0);
                self.take_replayed(reading, now)
            }
            Phase::Posting { call, .. } if now >= self.ends_at => {
                let reading = self.reading_for(call, None, false, false, now);
                self.end_round(reading, RoundEnd::FlowDeadline)
            }
            Phase::Reopening(retry) if now >= self.ends_at => self.deadline_reached(&retry.call),
            Phase::Reopening(retry)
                if retry
                    .reopened_at
                    .is_some_and(|at| now >= at + self.config.silence) =>
            {
                self.went_silent(&retry.call)
            }
            Phase::Posting { call, until, .. } if now >= until => self.call_unanswered(call),
            // An upstream that sends the call's answer only with its first event may be
            // silent for long: idle timeouts in front must not cut the client meanwhile.
            Phase::Posting {
                call,
                until,
                early,
                keepalive_at: Some(at),
            } if now >= at => {
                self.commands.push_back(Command::KeepAlive);
                let keepalive_at = self.config.keepalive.map(|k| now + k);
                Phase::Posting {
                    call,
                    until,
                    early,
                    keepalive_at,
                }
            }
            Phase::Reading(reading) => self.reading_timeout(reading, now),
            other => other,
        };
    }

    // ----- a new call -----

    fn start(&mut self, _now: Instant) -> Phase {
        if self.config.shedding {
            let state = self.state(Waiting::Deferred {
                data_session: self.config.data_session,
            });
            return self.finish(Ending::InputRequired {
                state: Box::new(state),
                input_requests: Map::new(),
                shed: true,
            });
        }
        self.common.round = self.common.round.max(1);
        self.commands.push_back(Command::OpenSession);
        Phase::Opening
    }

    /// The call about to go out in a session just opened (its id is given when it is
    /// posted).
    fn upstream_call(
        &self,
        endpoint: SocketAddr,
        session: Option<String>,
        version: Revision,
    ) -> UpstreamCall {
        UpstreamCall {
            endpoint,
            session: session.unwrap_or_default(),
            id: UpstreamId::Number(0),
            data_session: self.config.data_session,
            version,
        }
    }

    fn session_opened(
        &mut self,
        call: UpstreamCall,
        warm: bool,
        session_stream: bool,
        now: Instant,
    ) -> Phase {
        self.started = !self.config.data_session;
        self.warm_session = warm;
        // A warm session's stream was opened with it.
        if session_stream {
            return self.post_call(call, now);
        }
        self.post_call_with_session_stream(call, now)
    }

    /// Posts the call once the session's GET stream is open, where servers send the
    /// questions they do not tie to a request. A data-layer session has no GET stream of
    /// the flow's: calls in it may run at once, and only each call's own stream says which
    /// call a request belongs to.
    fn post_call_with_session_stream(&mut self, call: UpstreamCall, now: Instant) -> Phase {
        if call.data_session {
            return self.post_call(call, now);
        }
        self.commands.push_back(Command::Get(StreamGet::Open {
            stream: Stream::Session,
            after: None,
        }));
        Phase::OpeningSessionStream { call }
    }

    fn post_call(&mut self, mut call: UpstreamCall, now: Instant) -> Phase {
        let id = fresh_call_id();
        call.id = UpstreamId::Number(id);
        self.started |= call.data_session;
        self.commands.push_back(Command::PostCall { id });
        let until = now + self.config.answer_timeout;
        Phase::Posting {
            call,
            until,
            early: None,
            keepalive_at: self.config.keepalive.map(|k| now + k),
        }
    }

    /// The call's POST went unanswered for the answer timeout, and nothing else came.
    fn call_unanswered(&mut self, call: UpstreamCall) -> Phase {
        self.commands.push_back(Command::CloseStreams);
        self.give_up(&call, "the call was not answered in time");
        let why = "did not answer the call in time";
        let failure = Failure::new(FailureKind::Timeout, format!("upstream {why}"));
        self.finish(Ending::Refused(self.refusal_for(&failure)))
    }

    /// The answer to a call whose round began before it (its header was withheld): its
    /// stream opens now, or its one message is read; a failure ends the round.
    fn call_answered_late(
        &mut self,
        mut r: Box<Reading>,
        reply: Result<CallReply, Failure>,
        now: Instant,
    ) -> Phase {
        self.warm_session = false;
        match reply {
            Ok(CallReply::Stream) => {
                r.call_open = true;
                r.last_activity = now;
                Phase::Reading(r)
            }
            Ok(CallReply::Message(message)) => {
                let event = Event::message(None, message.to_string());
                self.on_event(r, Stream::Call, event, now)
            }
            Err(failure) => self.end_round(r, RoundEnd::Failed(failure)),
        }
    }

    /// The call's answer; `early`, what the session's stream sent before it, is read first.
    fn call_posted(
        &mut self,
        call: UpstreamCall,
        reply: Result<CallReply, Failure>,
        early: Option<Input>,
        now: Instant,
    ) -> Phase {
        let warm = std::mem::take(&mut self.warm_session);
        let reply = match reply {
            Ok(reply) => reply,
            Err(failure) if warm && failure.kind.may_be_forgotten_session() => {
                // A session initialized ahead of demand that the upstream forgot, or
                // whose endpoint went away, ran nothing: the call goes out on a session
                // opened now.
                self.commands.push_back(Command::CloseStreams);
                self.commands.push_back(Command::OpenSession);
                return Phase::Opening;
            }
            Err(failure) => {
                self.commands.push_back(Command::CloseStreams);
                if !failure.never_delivered() {
                    self.give_up(&call, "the call's response failed");
                    return self.finish(Ending::Refused(self.refusal_for(&failure)));
                }
                // A session this request opened ends with it; a re-issue's is its
                // state's, which stays good.
                if self.started {
                    self.delete_session(&call);
                }
                let refusal = self.refusal_before_call(&failure);
                return self.finish(Ending::Refused(refusal));
            }
        };
        let call_open = reply == CallReply::Stream;
        let mut reading = self.reading_for(call, None, call_open, false, now);
        reading.replayed.extend(early);
        if let CallReply::Message(message) = reply {
            let event = Event::message(None, message.to_string());
            return self.reading(
                reading,
                Input::Event {
                    stream: Stream::Call,
                    event,
                },
                now,
            );
        }
        reading.last_activity = now;
        self.take_replayed(reading, now)
    }

    // ----- a retry -----

    fn resume(
        &mut self,
        call: UpstreamCall,
        pending: Vec<Pending>,
        positions: Positions,
        responses: Map<String, Value>,
        now: Instant,
    ) -> Phase {
        // Whether the upstream primes, as the replica that sealed the state had learnt,
        // where this one has not: its first retry need not wait to learn it again.
        if let (None, Some(primes)) = (self.config.primes, positions.upstream.primes) {
            self.learn(Learnt::Primes(primes));
        }
        let mut retry = Retry::new(call, pending, responses, AfterAnswers::Read);
        // Each stream that sent an unanswered question is replayed from before the
        // round's first question on it, so the upstream asks it again; a stream that did
        // not continues after its last event.
        let (mut call_unanswered, mut session_unanswered) = (false, false);
        for pending in &retry.pending {
            if !retry.responses.contains_key(&pending.key) {
                match pending.asked.on_session {
                    true => session_unanswered = true,
                    false => call_unanswered = true,
                }
            }
        }
        let session_replays = positions.session_replayable
            && positions.session_from.is_some()
            && self.config.session_replay_scoped;
        if (call_unanswered && positions.round_start.is_none())
            || (session_unanswered && !session_replays)
        {
            return self.unanswerable(&retry);
        }
        retry.from = match call_unanswered {
            true => positions.round_start,
            false => positions.last_event_id,
        };
        retry.read_before = ReadBefore {
            call: if call_unanswered {
                positions.read_before.call
            } else {
                0
            },
            session: if session_replays {
                positions.read_before.session
            } else {
                0
            },
        };
        retry.session_from = positions.session_from;
        self.reopen_call(Box::new(retry), now)
    }

    /// A retry that leaves unanswered a question no resumption sends again: the first
    /// event of its stream this round (a server that sends no priming event, or the
    /// session's GET stream), or one on the GET stream of a group whose event store does
    /// not keep sessions apart (that stream reopens fresh). Resuming would wait for an
    /// answer that never goes up, so nothing is sent upstream and the state stays usable
    /// (its claim released, a data-layer call still watched): the client is told which
    /// answers are missing.
    fn unanswerable(&mut self, retry: &Retry) -> Phase {
        let missing: Vec<String> = retry
            .pending
            .iter()
            .filter(|p| !retry.responses.contains_key(&p.key))
            .map(|p| Value::from(p.key.as_str()).to_string())
            .collect();
        let text = format!(
            "inputResponses has no answer for {}: the upstream sent this round's questions once and cannot send them again; retry with the same requestState and an answer to each of its inputRequests",
            missing.join(", ")
        );
        self.commands.push_back(Command::ReleaseClaim);
        self.resumed_data_call = None;
        let code = crate::protocol::jsonrpc::code::INVALID_PARAMS;
        self.finish(Ending::Refused(Refusal::new(Class::BadRequest, code, text)))
    }

    /// Resumes the call's stream, with the session's GET stream beside it the first time
    /// (a data-layer session's call reads only its own stream).
    fn reopen_call(&mut self, mut retry: Box<Retry>, now: Instant) -> Phase {
        let Some(from) = retry.from.clone() else {
            let failure = Failure::new(
                FailureKind::Broken,
                "the state holds no position to resume the call's stream from",
            );
            return self.unresumable(retry, Err(failure), now);
        };
        let command = if retry.call.data_session || retry.session_reopened {
            Command::Get(StreamGet::Open {
                stream: Stream::Call,
                after: Some(from),
            })
        } else {
            retry.session_reopened = true;
            // Resumed after its sealed position only where the group's store keeps
            // sessions apart; fresh otherwise.
            let session_after = retry
                .session_from
                .clone()
                .filter(|_| self.config.session_replay_scoped);
            Command::Get(StreamGet::Reopen {
                after: from,
                session_after,
            })
        };
        self.commands.push_back(command);
        retry.reopened_at = Some(now);
        Phase::Reopening(retry)
    }

    /// The retry's streams are open: the wait for the call stream's priming event counts
    /// from when that stream answered, so a slow session stream does not add to it.
    fn call_reopened(
        &mut self,
        retry: Box<Retry>,
        result: Result<(), Failure>,
        call_at: Instant,
        now: Instant,
    ) -> Phase {
        if let Err(failure) = result {
            // What the upstream answered, not what befell the connection, or a throttle.
            if failure.refused_for_good() || failure.kind == FailureKind::Broken {
                self.learn(Learnt::ReplayRefused { empty: false });
            } else if failure.kind.unexplained() {
                self.learn(Learnt::ResumptionFailed);
            }
            return self.unresumable(retry, Err(failure), now);
        }
        if self.config.primes == Some(false) {
            return self.resumed(*retry, now);
        }
        let limit = if self.config.primes == Some(true) {
            SETTLE_PRIMED
        } else {
            SETTLE_UNKNOWN
        };
        Phase::Settling {
            retry,
            until: call_at + limit,
        }
    }

    /// An event read while the resumed stream settles: events wait for the round; the
    /// call stream's priming event says it is live again, and the answers may go up.
    fn settling_event(
        &mut self,
        mut retry: Box<Retry>,
        until: Instant,
        stream: Stream,
        event: Event,
        now: Instant,
    ) -> Phase {
        let priming = stream == Stream::Call && event.id.is_some() && event.data.is_empty();
        retry.replayed_bytes += event.data.len() + EVENT_OVERHEAD;
        if retry.replayed_bytes > MAX_SETTLE_BYTES {
            let failure = Failure::new(
                FailureKind::Broken,
                format!("replayed more than {MAX_SETTLE_BYTES} bytes of events while the call's stream resumed"),
            );
            return self.unresumable(retry, Err(failure), now);
        }
        retry.replayed.push((stream, event));
        if !priming {
            return Phase::Settling { retry, until };
        }
        if self.config.primes != Some(true) {
            self.learn(Learnt::Primes(true));
        }
        self.resumed(*retry, now)
    }

    /// The call's stream is back and settled: the answers go up.
    fn resumed(&mut self, retry: Retry, now: Instant) -> Phase {
        self.learn(Learnt::ResumptionWorked);
        self.answer(retry, now)
    }

    /// The resumed stream ended while it settled: empty, the upstream has nothing after
    /// the position (tried again briefly first); after replaying something, the round
    /// follows it from there.
    fn settling_ended(&mut self, mut retry: Box<Retry>, now: Instant) -> Phase {
        if retry
            .replayed
            .iter()
            .any(|(stream, _)| *stream == Stream::Call)
        {
            retry.call_ended = true;
            return self.answer(*retry, now);
        }
        if retry.empties < EMPTY_RETRIES {
            let until = now + EMPTY_BACKOFF * 2u32.pow(retry.empties);
            retry.empties += 1;
            return Phase::Backoff { retry, until };
        }
        self.learn(Learnt::ReplayRefused { empty: true });
        self.unresumable(retry, Ok(()), now)
    }

    /// A retry that cannot get back into its call: `Err` the resumption failed, `Ok` it
    /// came back empty. Nothing was posted, so the same state may be retried.
    fn unresumable(
        &mut self,
        retry: Box<Retry>,
        failed: Result<(), Failure>,
        now: Instant,
    ) -> Phase {
        self.commands.push_back(Command::CloseStreams);
        self.commands.push_back(Command::ReleaseClaim);
        let data_session = retry.call.data_session;
        match failed {
            Err(failure) if failure.is_lost() && !data_session => {
                self.lost(Lost::Upstream, &retry.pending, &retry.responses, now)
            }
            Err(failure) if failure.refused_for_good() => {
                // As an empty resumption: the call waits for answers it will never get.
                self.give_up(
                    &retry.call,
                    "the upstream refused to resume the call's stream",
                );
                if data_session {
                    return self.finish(Ending::Refused(self.refusal_for(&failure)));
                }
                self.lost(Lost::Unresumable, &retry.pending, &retry.responses, now)
            }
            Err(failure) => {
                // It may resume later: a data-layer session's call stays watched, for a
                // retry of the same state or, failing that, the reaper to end it.
                self.resumed_data_call = None;
                self.finish(Ending::Refused(self.refusal_for(&failure)))
            }
            Ok(()) if data_session => {
                self.give_up(&retry.call, "the call's events are gone");
                let failure = Failure::new(
                    FailureKind::Broken,
                    "a Last-Event-ID resumption came back empty: the upstream no longer has the call's events",
                );
                self.finish(Ending::Refused(self.refusal_for(&failure)))
            }
            Ok(()) => {
                // The call waits for answers it will never get: end its session.
                self.give_up(&retry.call, "the call's events are gone");
                self.lost(Lost::Unresumable, &retry.pending, &retry.responses, now)
            }
        }
    }

    /// The client left: a 2026-07-28 client closing its response cancels the request, so
    /// the call ends (`give_up`), before or after a retry's answers went up alike.
    fn cancelled(&mut self, call: &UpstreamCall) -> Phase {
        self.commands.push_back(Command::CloseStreams);
        self.give_up(call, "the client cancelled the request");
        self.finish(Ending::ClientGone)
    }

    /// Posts the retry's answers, in the order of the questions, then goes on. A question
    /// the server cancelled while the client was away (its cancellation replayed while
    /// the resumed stream settled, before its priming event) gets none: a cancelled
    /// request gets no response (2025-11-25). From a server that does not prime, the
    /// answers go up before anything is replayed.
    fn answer(&mut self, mut retry: Retry, now: Instant) -> Phase {
        let cancelled = cancelled_in(&retry.replayed);
        retry.to_post = retry
            .pending
            .iter()
            .filter(|p| !cancelled.contains(&p.upstream_id))
            .filter_map(|p| retry.responses.get(&p.key).map(|a| (p.clone(), a.clone())))
            .collect();
        self.next_answer(Box::new(retry), now)
    }

    fn next_answer(&mut self, retry: Box<Retry>, now: Instant) -> Phase {
        let Some((pending, answer)) = retry.to_post.front() else {
            return self.answered(retry, now);
        };
        let message =
            json!({"jsonrpc": "2.0", "id": pending.upstream_id.to_json(), "result": answer});
        self.commands.push_back(Command::Post(message));
        Phase::Answering(retry)
    }

    fn answer_posted(
        &mut self,
        mut retry: Box<Retry>,
        result: Result<(), Failure>,
        now: Instant,
    ) -> Phase {
        let Some((pending, answer)) = retry.to_post.pop_front() else {
            return self.answered(retry, now);
        };
        if let Err(failure) = result {
            return self.answer_failed(retry, failure, now);
        }
        retry.answered.push(pending.upstream_id.clone());
        if let Some(fingerprint) = pending.fingerprint {
            self.common.known.push(Known {
                fingerprint,
                answer: jsonrpc::text_of(&answer),
                used: true,
            });
        }
        self.next_answer(retry, now)
    }

    fn answer_failed(&mut self, retry: Box<Retry>, failure: Failure, now: Instant) -> Phase {
        let nothing_posted = retry.answered.is_empty();
        let held = matches!(retry.then, AfterAnswers::ReadHeld { .. });
        self.commands.push_back(Command::CloseStreams);
        if held {
            // The held flow ends here: its session with it.
            self.give_up(&retry.call, "an answer could not be delivered");
            if nothing_posted && failure.never_delivered() {
                // Nothing reached the call (a 401 for a token that expired): the same
                // state, sent again, hears that its flow is lost (-32012), not that it
                // is spent.
                self.commands.push_back(Command::ReleaseClaim);
            }
        } else if nothing_posted && failure.never_delivered() {
            // The upstream has no answer of this state's: the same state may be retried,
            // and a data-layer session's call stays watched meanwhile.
            self.commands.push_back(Command::ReleaseClaim);
            self.resumed_data_call = None;
        } else if !failure.is_lost() {
            // An answer may have reached the call, and the client hears that it failed:
            // the call ends upstream too, or a replay of the state on another replica
            // would resume it and post the answers a second time.
            self.give_up(&retry.call, "an answer's delivery failed");
        }
        if nothing_posted && failure.is_lost() && !retry.call.data_session {
            return self.lost(Lost::Upstream, &retry.pending, &retry.responses, now);
        }
        self.finish(Ending::Refused(self.refusal_for(&failure)))
    }

    /// Every answer is up: read the next round, on the reopened or held streams, or post
    /// the call again.
    fn answered(&mut self, retry: Box<Retry>, now: Instant) -> Phase {
        let Retry {
            call,
            pending,
            from,
            all_answered,
            replayed,
            call_ended,
            answered,
            then,
            session_from,
            read_before,
            drain_pending,
            ..
        } = *retry;
        match then {
            AfterAnswers::Reissue => {
                self.common.round += 1;
                self.post_call_with_session_stream(call, now)
            }
            AfterAnswers::ReadHeld { questions } => {
                let mut reading = self.reading_for(call, None, true, false, now);
                reading.drain_pending = drain_pending;
                reading.round.skip(answered.iter().cloned());
                let mut unanswered = 0;
                for p in pending
                    .iter()
                    .filter(|p| !answered.contains(&p.upstream_id))
                {
                    let Some(question) = questions.get(&p.key) else {
                        continue;
                    };
                    if let Err(required) = reading.round.ask_again(p.clone(), question.clone()) {
                        let end = RoundEnd::MissingCapability(required);
                        return self.round_over(Ended { reading, end });
                    }
                    unanswered += 1;
                }
                if unanswered == 0 {
                    self.common.round += 1;
                } else {
                    reading.quiet_until = Some(now + self.config.quiet_window);
                }
                Phase::Reading(reading)
            }
            AfterAnswers::Read => {
                if all_answered {
                    self.common.round += 1;
                }
                let positions = (from, session_from);
                let mut reading = self.reading_for(call, Some(positions), true, true, now);
                reading.drain_pending = drain_pending;
                reading.earlier = read_before;
                reading.earlier_pending = pending.iter().map(|p| p.upstream_id.clone()).collect();
                reading.round.skip(answered);
                reading.replayed = replayed
                    .into_iter()
                    .map(|(stream, event)| Input::Event { stream, event })
                    .chain(call_ended.then_some(Input::StreamEnded(Stream::Call)))
                    .collect();
                reading.replay_teaches = all_answered;
                self.take_replayed(reading, now)
            }
        }
    }

    // ----- a round -----

    fn reading_for(
        &self,
        call: UpstreamCall,
        positions: Option<(Option<String>, Option<String>)>,
        call_open: bool,
        reopened: bool,
        now: Instant,
    ) -> Box<Reading> {
        let (from, session_from) = positions.unwrap_or_default();
        let config = &self.config;
        let mut round = Round::new(
            call.id.clone(),
            config.capabilities.clone(),
            config.relay.clone(),
            from,
        )
        .bounded(config.round_limits)
        .session_from(session_from);
        if config.restartable && !call.data_session {
            round = round.restartable(self.common.known.clone());
        }
        Box::new(Reading {
            call,
            round,
            call_open,
            call_events: 0,
            reopened,
            retry: DEFAULT_RETRY,
            stream_ends: 0,
            empty_resumptions: 0,
            quiet_until: None,
            reopen_at: None,
            reopening: false,
            last_activity: now,
            last_message: now,
            keepalive_at: config.keepalive.map(|k| now + k),
            posting: None,
            barrier: Barrier::NotYet,
            replayed: VecDeque::new(),
            replay_teaches: false,
            taking_replayed: false,
            earlier: ReadBefore::default(),
            earlier_pending: Vec::new(),
            drain_pending: false,
        })
    }

    /// Takes what the round read before it began, in order, until a `Post` is awaited
    /// (the rest follows its answer) or the round ends (the rest is replayed again from
    /// the state's positions); a drain pending then hands the round over.
    fn take_replayed(&mut self, mut r: Box<Reading>, now: Instant) -> Phase {
        while r.posting.is_none() {
            let Some(input) = r.replayed.pop_front() else {
                break;
            };
            r.taking_replayed = true;
            r = match self.reading(r, input, now) {
                Phase::Reading(r) => r,
                ended => return ended,
            };
            r.taking_replayed = false;
        }
        self.read_on(r)
    }

    fn reading(&mut self, mut r: Box<Reading>, input: Input, now: Instant) -> Phase {
        match input {
            Input::Event { stream, event } => self.on_event(r, stream, event, now),
            Input::StreamEnded(Stream::Session) => {
                // The session's stream is optional; without it, questions come on the
                // call's stream only.
                Phase::Reading(r)
            }
            Input::StreamEnded(Stream::Call) => self.call_ended(r, now),
            Input::StreamBroken { failure, .. } => self.end_round(r, RoundEnd::Failed(failure)),
            Input::StreamOpened {
                stream: Stream::Call,
                result,
            } => {
                r.reopening = false;
                match result {
                    Ok(()) => {
                        r.call_open = true;
                        r.call_events = 0;
                        r.reopened = true;
                        r.last_activity = now;
                        Phase::Reading(r)
                    }
                    Err(failure) => self.end_round(r, RoundEnd::Failed(failure)),
                }
            }
            Input::Posted(result) => match (r.posting.take(), result) {
                (Some(AfterPost::End(end)), _) => self.end_round(r, *end),
                (_, Err(failure)) => self.end_round(r, RoundEnd::Failed(failure)),
                (_, Ok(())) if r.round.is_full() => {
                    self.end_round(r, RoundEnd::Questions { draining: false })
                }
                (_, Ok(())) => self.take_replayed(r, now),
            },
            Input::ClientGone => self.end_round(r, RoundEnd::ClientGone),
            Input::BarrierPassed => {
                // What the server queued before the ping's answer is written before it:
                // the round reads what the streams hold, then ends as any round does.
                r.barrier = Barrier::Passed;
                r.quiet_until = Some(now + self.quiet_window(&r));
                Phase::Reading(r)
            }
            Input::CallPosted(reply) => self.call_answered_late(r, reply, now),
            // Only a resumable round can be handed over; others finish here. One that
            // cannot be resumed yet is handed over once it can.
            Input::Draining if self.resumes(&r) => {
                self.end_round(r, RoundEnd::Questions { draining: true })
            }
            Input::Draining => {
                r.drain_pending = true;
                Phase::Reading(r)
            }
            Input::GraceEnding if self.resumes(&r) => {
                self.end_round(r, RoundEnd::Questions { draining: true })
            }
            Input::GraceEnding => self.end_round(r, RoundEnd::ShuttingDown),
            _ => Phase::Reading(r),
        }
    }

    fn on_event(
        &mut self,
        mut r: Box<Reading>,
        stream: Stream,
        event: Event,
        now: Instant,
    ) -> Phase {
        match (stream, &event.id) {
            (Stream::Call, Some(id)) => r.round.saw_call_event(id),
            (Stream::Session, Some(id)) => r.round.saw_session_event(id),
            _ => {}
        }
        let earlier = read_earlier(&mut r.earlier, stream, &event);
        if stream == Stream::Call {
            r.call_events += 1;
            // A resumption that brought an event ends a run of empty ones.
            r.empty_resumptions = 0;
            r.last_activity = now;
            if let Some(ms) = event.retry {
                r.retry = Duration::from_millis(ms).min(MAX_RETRY);
            }
        }
        // A priming event carries no data; an event of another type than `message` (a
        // framework's keep-alive) carries no JSON-RPC message.
        if event.data.is_empty() || !event.is_message() {
            return self.read_on(r);
        }
        r.last_message = now;
        if stream == Stream::Call {
            r.stream_ends = 0;
        }
        let Ok(message) = jsonrpc::from_slice_lenient::<Value>(event.data.as_bytes()) else {
            let why = "the upstream sent an event that is not JSON".to_string();
            return self.end_round(r, RoundEnd::broken(why));
        };
        let asked = r.round.question_count();
        // Requests an earlier round read, other than questions still pending, were
        // answered, refused or cancelled then.
        let message = match earlier {
            true => without_requests_answered(message, &r.earlier_pending),
            false => Some(message),
        };
        let actions = match (stream, message) {
            (_, None) => Vec::new(),
            (Stream::Call, Some(message)) => r.round.on_message(message),
            (Stream::Session, Some(message)) => r.round.on_session_message(message),
        };
        match (stream, &event.id) {
            (_, None) => {}
            (Stream::Call, Some(_)) => r.round.saw_call_message(),
            (Stream::Session, Some(_)) => r.round.saw_session_message(),
        }
        let mut end = None;
        for action in actions {
            match action {
                // Told and answered when an earlier round read it.
                Action::Notify(_) | Action::AnswerUpstream(_) if earlier => {}
                Action::Notify(n) => self.commands.push_back(Command::Notify(n)),
                Action::AnswerUpstream(a) => {
                    self.commands.push_back(Command::Post(a));
                    r.posting = Some(AfterPost::Read);
                }
                Action::Complete(m) => end = Some(RoundEnd::Complete(m)),
                Action::MissingCapability { required, .. } => {
                    end = Some(RoundEnd::MissingCapability(required))
                }
                Action::Fail(why) => end = Some(RoundEnd::broken(why)),
            }
            if end.is_some() {
                break;
            }
        }
        if let Some(end) = end {
            // A refusal posted upstream first (an undeclared capability, an id the
            // gateway cannot carry), then the round ends.
            if r.posting.is_some() {
                r.posting = Some(AfterPost::End(Box::new(end)));
                return Phase::Reading(r);
            }
            return self.end_round(r, end);
        }
        if r.round.question_count() > asked {
            if r.taking_replayed && std::mem::take(&mut r.replay_teaches) {
                // Asked without waiting for the answers of the round before.
                self.learn(Learnt::AsksAtOnce);
            }
            r.quiet_until = Some(now + self.quiet_window(&r));
        } else if r.round.question_count() == 0 {
            // The server cancelled what it had asked: nothing to end the round for.
            r.quiet_until = None;
        }
        if r.round.is_full() && r.posting.is_none() {
            return self.end_round(r, RoundEnd::Questions { draining: false });
        }
        self.read_on(r)
    }

    /// The round reads on after an event, unless the gateway is draining and the round
    /// can now be handed over.
    fn read_on(&mut self, r: Box<Reading>) -> Phase {
        if r.drain_pending && r.posting.is_none() && self.resumes(&r) {
            return self.end_round(r, RoundEnd::Questions { draining: true });
        }
        Phase::Reading(r)
    }

    /// The call's stream ended: a resumption that ended without a single event means the
    /// upstream no longer has the call's events (after `EMPTY_RETRIES` short retries);
    /// otherwise the stream is reopened after the upstream's `retry` hint (SEP-1699
    /// polling).
    fn call_ended(&mut self, mut r: Box<Reading>, now: Instant) -> Phase {
        r.call_open = false;
        if r.reopened && r.call_events == 0 {
            if r.empty_resumptions >= EMPTY_RETRIES {
                self.learn(Learnt::ReplayRefused { empty: true });
                let why = "a Last-Event-ID resumption of the call's stream came back empty: the upstream no longer has the call's events";
                return self.end_round(r, RoundEnd::broken(why));
            }
            r.reopen_at = Some(now + EMPTY_BACKOFF * 2u32.pow(r.empty_resumptions));
            r.empty_resumptions += 1;
            return Phase::Reading(r);
        }
        r.stream_ends += 1;
        if r.stream_ends > MAX_STREAM_ENDS {
            let why = "the upstream kept closing the call's stream".to_string();
            return self.end_round(r, RoundEnd::broken(why));
        }
        if r.round.last_event_id().is_none() {
            let why = "the call's stream ended without a result".to_string();
            return self.end_round(r, RoundEnd::broken(why));
        }
        r.reopen_at = Some(now + r.retry);
        Phase::Reading(r)
    }

    fn reading_timeout(&mut self, mut r: Box<Reading>, now: Instant) -> Phase {
        if r.posting.is_some() || r.barrier == Barrier::Awaited {
            return Phase::Reading(r);
        }
        if r.reopening {
            // The call's stream being reopened (a GET the shell cuts here): only the
            // round's silence and the flow's deadline end it meanwhile.
            if now >= r.last_message + self.config.silence {
                return self.end_round(r, RoundEnd::Silent);
            }
            if now >= self.ends_at {
                return self.end_round(r, RoundEnd::FlowDeadline);
            }
            return Phase::Reading(r);
        }
        if r.quiet_until.is_some_and(|t| now >= t) {
            if self.needs_barrier(&r) {
                r.barrier = Barrier::Awaited;
                r.quiet_until = None;
                let id = fresh_call_id();
                self.commands.push_back(Command::Barrier { id });
                return Phase::Reading(r);
            }
            return self.end_round(r, RoundEnd::Questions { draining: false });
        }
        if now >= r.last_message + self.config.silence {
            return self.end_round(r, RoundEnd::Silent);
        }
        if now >= self.ends_at {
            return self.end_round(r, RoundEnd::FlowDeadline);
        }
        if r.keepalive_at.is_some_and(|t| now >= t) {
            self.commands.push_back(Command::KeepAlive);
            r.keepalive_at = self.config.keepalive.map(|k| now + k);
        }
        let reopen =
            r.reopen_at.is_some_and(|t| now >= t) || self.poll_at(&r).is_some_and(|t| now >= t);
        if reopen {
            let Some(after) = r.round.last_event_id().map(str::to_string) else {
                let why = "the call's stream ended without a result".to_string();
                return self.end_round(r, RoundEnd::broken(why));
            };
            r.reopen_at = None;
            r.reopening = true;
            r.call_open = false;
            self.commands.push_back(Command::Get(StreamGet::Open {
                stream: Stream::Call,
                after: Some(after),
            }));
        }
        Phase::Reading(r)
    }

    /// How long the round waits after a question for more. A held round always waits the
    /// window: its retry reads on without a replay, so a question that missed the round
    /// would not show the call asks several at once.
    fn quiet_window(&self, r: &Reading) -> Duration {
        if self.config.asks_at_once || !self.resumes(r) {
            self.config.quiet_window
        } else {
            Duration::ZERO
        }
    }

    /// Whether the round pings the session before it ends with questions: it will wait
    /// resumable, and a question the session's GET stream sends after the round closed
    /// would be lost, as the retry reopens that stream fresh (the group's store is shared
    /// by sessions, or not known to keep them apart). A data-layer session's call reads
    /// no GET stream, and a session without an id has none.
    fn needs_barrier(&self, r: &Reading) -> bool {
        r.barrier == Barrier::NotYet
            && !r.call.data_session
            && !r.call.session.is_empty()
            && !self.config.session_replay_scoped
            && self.resumes(r)
    }

    /// Whether a round that ends now waits resumable, rather than held on this replica.
    fn resumes(&self, r: &Reading) -> bool {
        match self.config.resume {
            ResumeMode::Resumable => true,
            ResumeMode::Hold => false,
            ResumeMode::Auto => {
                r.round.last_event_id().is_some()
                    && r.round.event_ids_unusable().is_none()
                    && !self.config.replay_refused
            }
        }
    }

    fn end_round(&mut self, r: Box<Reading>, end: RoundEnd) -> Phase {
        let asks = matches!(end, RoundEnd::Questions { .. })
            || matches!(&end, RoundEnd::Complete(m) if is_url_required(m));
        let ended = Ended { reading: r, end };
        // Before the flow waits for its client, the reaper watches what this request
        // started (a resumed flow's, by the replica that started it): the session it
        // opened, or, in a data-layer session, the call waiting for answers. A held call
        // is ended by the held table instead, and a call that ended asking for URLs first
        // has nothing left running.
        let call = &ended.reading.call;
        let watch = if call.data_session {
            let waits = matches!(ended.end, RoundEnd::Questions { .. });
            (waits && self.resumes(&ended.reading)).then(|| Some(call.id.to_json()))
        } else {
            asks.then_some(None)
        };
        if let Some(call_id) = watch.filter(|_| self.started && !call.session.is_empty()) {
            let until = self.common.flow_deadline;
            self.commands.push_back(Command::Watch {
                until,
                call: call_id,
            });
            return Phase::Watching(Box::new(ended));
        }
        self.round_over(ended)
    }

    fn round_over(&mut self, ended: Ended) -> Phase {
        let Ended {
            reading: mut r,
            end,
        } = ended;
        let group = self.config.group.clone();
        match end {
            RoundEnd::Complete(message) if r.round.absorb_url_required(&message) => {
                self.commands.push_back(Command::CloseStreams);
                if !r.round.accepts_url_elicitation() {
                    self.delete_session(&r.call);
                    let data = json!({"requiredCapabilities": {"elicitation": {"url": {}}}});
                    let refusal = Refusal::new(
                        Class::MissingCapability,
                        mcode::MISSING_REQUIRED_CLIENT_CAPABILITY,
                        "the server needs URL-mode elicitation, which this request did not declare",
                    )
                    .with_data(data);
                    return self.finish(Ending::Refused(refusal));
                }
                let input_requests = r.round.input_requests().clone();
                let state = self.state(Waiting::Reissue {
                    call: r.call.clone(),
                });
                self.ask(&r, state, input_requests)
            }
            RoundEnd::Complete(message) => {
                self.commands.push_back(Command::CloseStreams);
                self.delete_session(&r.call);
                let (rounds, started_ms) = (self.common.round, self.common.started_ms);
                self.finish(Ending::Complete {
                    message,
                    rounds,
                    started_ms,
                })
            }
            RoundEnd::Questions { .. }
                if (r.round.last_event_id().is_none()
                    || r.round.event_ids_unusable().is_some())
                    && self.config.resume == ResumeMode::Resumable =>
            {
                self.commands.push_back(Command::CloseStreams);
                self.give_up(&r.call, "the call cannot be resumed");
                let why = match r.round.event_ids_unusable() {
                    Some(unusable) => unusable.why(),
                    None => "its SSE events carry no ids",
                };
                let text = format!("upstream group '{group}' is configured `resume: resumable`, but {why}, so its calls cannot be resumed: configure `resume: auto` or `hold`");
                self.finish(Ending::Refused(Refusal::internal(
                    Class::UpstreamError,
                    text,
                )))
            }
            RoundEnd::Questions { draining } => {
                if draining {
                    self.commands.push_back(Command::Note(Note::HandedOver));
                }
                if let Some(unusable) = r.round.event_ids_unusable() {
                    if !self.config.replay_refused {
                        self.learn(Learnt::EventIdsUnusable(unusable));
                    }
                }
                let resumable = self.resumes(&r);
                self.learn(Learnt::Resumable(resumable));
                let pending = r.round.pending().to_vec();
                if self.config.restartable && !r.call.data_session {
                    self.common.known = r.round.known().to_vec();
                }
                let input_requests = r.round.input_requests().clone();
                if !resumable {
                    return self.hold(r, pending, input_requests);
                }
                let positions = Positions {
                    last_event_id: r.round.last_event_id().map(str::to_string),
                    round_start: r.round.round_start().map(str::to_string),
                    session_from: r.round.session_resume_from().map(str::to_string),
                    session_replayable: r.round.session_replayable(),
                    read_before: r.round.read_before(),
                    upstream: UpstreamFacts {
                        primes: self.config.primes,
                        sessions_kept_apart: self.config.sessions_kept_apart,
                    },
                };
                let state = self.state(Waiting::Resumable {
                    call: r.call.clone(),
                    pending,
                    positions,
                });
                self.commands.push_back(Command::CloseStreams);
                self.ask(&r, state, input_requests)
            }
            RoundEnd::MissingCapability(required) => {
                self.commands.push_back(Command::CloseStreams);
                self.give_up(&r.call, "the client lacks a capability the call needs");
                let data = json!({"requiredCapabilities": required});
                let refusal = Refusal::new(
                    Class::MissingCapability,
                    mcode::MISSING_REQUIRED_CLIENT_CAPABILITY,
                    "the server needs a client capability this request did not declare",
                )
                .with_data(data);
                self.finish(Ending::Refused(refusal))
            }
            RoundEnd::Failed(failure) => {
                self.commands.push_back(Command::CloseStreams);
                // A session the upstream no longer has runs nothing to cancel.
                if failure.kind == FailureKind::Gone {
                    self.delete_session(&r.call);
                    return self.failed_during_call(failure);
                }
                if r.call.data_session {
                    // The call's stream may have ended with its session (deleted by its
                    // client elsewhere): the cancellation goes up before the client is
                    // answered, and a 404 to it says the session ended.
                    let cancel = cancellation_of(&r.call, "the call's stream failed");
                    let posts_before = self
                        .commands
                        .iter()
                        .filter(|c| matches!(c, Command::Post(_)))
                        .count();
                    self.commands.push_back(Command::CancelFirst(cancel));
                    return Phase::Cancelling {
                        failure,
                        posts_before,
                    };
                }
                self.give_up(&r.call, "the call's stream failed");
                self.failed_during_call(failure)
            }
            RoundEnd::Silent => self.went_silent(&r.call),
            RoundEnd::FlowDeadline => self.deadline_reached(&r.call),
            RoundEnd::ShuttingDown => {
                self.commands.push_back(Command::CloseStreams);
                self.give_up(&r.call, "the gateway replica is shutting down");
                let text = format!(
                    "the gateway replica running {} '{}' is shutting down, and the round could not be handed to another replica (the upstream cannot resume it); the upstream call was ended: issue it again",
                    self.config.method, self.config.target
                );
                self.finish(Ending::Refused(Refusal::internal(Class::Overloaded, text)))
            }
            RoundEnd::ClientGone => self.cancelled(&r.call),
        }
    }
}

impl Flow {
    /// Sends the round's questions to the client with `state`, unless the flow is over its
    /// limits (rounds, or a state too large to come back): then the call ends in error.
    fn ask(&mut self, r: &Reading, state: FlowState, input_requests: Map<String, Value>) -> Phase {
        if let Some(refusal) = self.over_limits(&r.round, &state) {
            self.give_up(&r.call, "the call went over the gateway's limits");
            return self.finish(Ending::Refused(refusal));
        }
        self.finish(Ending::InputRequired {
            state: Box::new(state),
            input_requests,
            shed: false,
        })
    }

    fn over_limits(&self, round: &Round, state: &FlowState) -> Option<Refusal> {
        let limits = &self.config.round_limits;
        let text = if round.question_count() > limits.max_questions {
            format!(
                "the server asked {} questions in one round, above the limit of {}",
                round.question_count(),
                limits.max_questions
            )
        } else if self.common.round > self.config.max_rounds {
            format!(
                "the call needed more than {} rounds, the limit",
                self.config.max_rounds
            )
        } else if state.plaintext_len_at_most() > self.config.max_state_plaintext {
            let too_large = state.too_large(self.config.max_state_bytes, self.config.kid_len);
            too_large.to_string()
        } else {
            return None;
        };
        Some(Refusal::internal(Class::OverLimit, text))
    }

    /// Holds the flow on this replica (its upstream cannot resume): checked against the
    /// limits as the state will be, naming the slot.
    fn hold(
        &mut self,
        r: Box<Reading>,
        pending: Vec<Pending>,
        questions: Map<String, Value>,
    ) -> Phase {
        let widest = HeldAt {
            owner: Some(SocketAddr::from(([0xffff; 8], u16::MAX))),
            slot: u64::MAX,
        };
        let state = self.state(Waiting::Held {
            call: r.call.clone(),
            pending,
            at: widest,
        });
        if let Some(refusal) = self.over_limits(&r.round, &state) {
            self.commands.push_back(Command::CloseStreams);
            self.give_up(&r.call, "the call went over the gateway's limits");
            return self.finish(Ending::Refused(refusal));
        }
        self.commands.push_back(Command::Hold {
            questions: questions.clone(),
            expires_at: state.expires_at,
            cancel_on_expiry: r
                .call
                .data_session
                .then(|| cancellation_of(&r.call, NOT_CONTINUED)),
        });
        Phase::Holding {
            state: Box::new(state),
            questions,
        }
    }

    /// The table's answer to `Hold`. A refusal (the table is full, the flow too large) has
    /// had its streams and session ended by the shell.
    fn held(
        &mut self,
        mut state: Box<FlowState>,
        input_requests: Map<String, Value>,
        held: Result<HeldAt, Refusal>,
    ) -> Phase {
        match held {
            Ok(at) => {
                if let Waiting::Held { at: slot, .. } = &mut state.waiting {
                    *slot = at;
                }
                self.finish(Ending::InputRequired {
                    state,
                    input_requests,
                    shed: false,
                })
            }
            Err(refusal) => self.finish(Ending::Refused(refusal)),
        }
    }

    fn overloaded(&mut self, r: &Reading, refusal: Refusal) -> Phase {
        self.commands.push_back(Command::CloseStreams);
        self.give_up(&r.call, "too many flows wait on the gateway");
        self.finish(Ending::Refused(refusal))
    }

    /// The call was lost between rounds (before any answer of this retry reached it): a
    /// `restartable` tool runs again in a new session, its repeated questions answered
    /// from the answers given so far and in this retry; any other call ends with
    /// `FLOW_LOST`, for the client to issue again.
    fn lost(
        &mut self,
        cause: Lost,
        pending: &[Pending],
        responses: &Map<String, Value>,
        now: Instant,
    ) -> Phase {
        let group = self.config.group.clone();
        if !self.config.restartable || self.config.data_session {
            let what = match cause {
                Lost::Upstream => format!("upstream group '{group}' lost this call between rounds (its session is gone, or its endpoint is down or has left the group; a call that an earlier retry of this requestState completed on another replica looks the same)"),
                Lost::Unresumable => format!("upstream group '{group}' no longer has this call's events (a Last-Event-ID resumption was refused or came back empty; the group's later calls are held)"),
                Lost::Holder => format!("the gateway replica holding this call's upstream streams is gone or no longer holds them (upstream group '{group}' cannot resume streams, so its calls are held)"),
                Lost::HolderMidRetry => format!("the gateway replica holding this call's upstream streams stopped answering while it continued this retry (upstream group '{group}' cannot resume streams, so its calls are held), after this retry's answers may have reached the call, which may have run to its end there"),
            };
            let next = match cause {
                Lost::HolderMidRetry => "check whether it ran before issuing it again",
                _ => "issue the call again",
            };
            let text = format!(
                "{what}, and the tool is not marked restartable, so it is not run again: {next}"
            );
            let refusal = Refusal::new(Class::UpstreamError, gcode::FLOW_LOST, text);
            return self.finish(Ending::Refused(refusal));
        }
        for p in pending {
            if let (Some(fingerprint), Some(answer)) = (p.fingerprint, responses.get(&p.key)) {
                self.common.known.push(Known {
                    fingerprint,
                    answer: jsonrpc::text_of(answer),
                    used: true,
                });
            }
        }
        for known in &mut self.common.known {
            known.used = false;
        }
        // The state that led here runs the call again: it stays claimed, or a replay of
        // it on this replica would run the tool a second time.
        self.commands.retain(|c| *c != Command::ReleaseClaim);
        self.rerun = true;
        self.commands.push_back(Command::Note(Note::Restarted));
        self.common.round += 1;
        self.start(now)
    }

    /// The client's error for an upstream failure; in a data-layer session the upstream's
    /// losing the session ends that session.
    /// The call failed upstream during a round: a data-layer session that has ended is
    /// told as such (its client creates another), anything else as the upstream's error.
    fn failed_during_call(&mut self, failure: Failure) -> Phase {
        let refusal = if failure.kind == FailureKind::Gone && self.config.data_session {
            self.refusal_for(&failure)
        } else {
            let (group, why) = (&self.config.group, failure.message);
            let text = format!("upstream group '{group}' failed during the call: {why}");
            Refusal::internal(Class::UpstreamError, text)
        };
        self.finish(Ending::Refused(refusal))
    }

    /// The answer to the cancellation of a data-layer session's call that `failed`: a
    /// session the upstream no longer has is what ended the call.
    fn cancelled_after_failure(
        &mut self,
        failed: Failure,
        cancelled: Result<(), Failure>,
    ) -> Phase {
        match cancelled {
            Err(gone) if gone.kind == FailureKind::Gone => self.failed_during_call(gone),
            _ => self.failed_during_call(failed),
        }
    }

    /// The client's error for a failure before the call reached the upstream. A re-run
    /// then ran nothing: its state's claim is released, so the same retry runs it again.
    fn refusal_before_call(&mut self, failure: &Failure) -> Refusal {
        let mut refusal = self.refusal_for(failure);
        if self.rerun || self.unspent {
            self.commands.push_back(Command::ReleaseClaim);
            let again = match self.rerun {
                true => format!("; the tool was not run again: {SAME_RETRY_AGAIN}"),
                false => format!("; {SAME_RETRY_AGAIN}"),
            };
            refusal.message.push_str(&again);
        }
        refusal
    }

    /// The replica shuts down `when` nothing of the retry reached the upstream: the
    /// state's claim is released, so the same retry goes on at another replica.
    fn release_claim_shutting_down(&mut self, when: &str) -> Phase {
        self.commands.push_back(Command::ReleaseClaim);
        self.shutting_down(&format!("{when}; {SAME_RETRY_AGAIN}"))
    }

    fn refusal_for(&self, failure: &Failure) -> Refusal {
        if failure.kind == FailureKind::Gone && self.config.data_session {
            let text = "Session ended: the upstream no longer has it; call session/create again";
            return Refusal::new(Class::SessionEnded, gcode::SESSION_ENDED, text);
        }
        failure.refusal(&self.config.group)
    }

    fn finish(&mut self, ending: Ending) -> Phase {
        if !matches!(ending, Ending::InputRequired { .. }) {
            if let Some(call) = self.resumed_data_call.take() {
                self.commands.push_back(Command::Unwatch { call });
            }
        }
        self.commands.push_back(Command::Finish(ending));
        Phase::Done
    }

    /// A state of this flow waiting as `waiting`, expiring a round's TTL from now (in
    /// whole seconds, rounded up: never sooner) but never past the flow's deadline.
    fn state(&self, waiting: Waiting) -> FlowState {
        let ran = self.clock.saturating_duration_since(self.began).as_millis() as u64;
        let issued = (self.config.now_ms + ran).div_ceil(1000);
        let expires_at =
            (issued + self.config.request_state_ttl_seconds).min(self.common.flow_deadline);
        FlowState {
            group: self.config.group.clone(),
            flow_id: self.common.flow_id,
            started_ms: self.common.started_ms,
            flow_deadline: self.common.flow_deadline,
            expires_at,
            round: self.common.round,
            known: self.common.known.clone(),
            waiting,
        }
    }

    /// Deletes the session, unless a data-layer session's (which outlives its calls).
    fn delete_session(&mut self, call: &UpstreamCall) {
        if !call.data_session {
            self.commands.push_back(Command::DeleteSession);
        }
    }

    /// The upstream sent nothing for the round's silence: the call ends, and the client is
    /// told which limit.
    fn went_silent(&mut self, call: &UpstreamCall) -> Phase {
        self.commands.push_back(Command::CloseStreams);
        self.give_up(call, "the call was silent for too long");
        let mut text = format!(
            "upstream group '{}' sent nothing for {} s (bridge.round_silence_seconds) while the gateway waited for {} '{}' to answer or ask (round {})",
            self.config.group, self.config.silence_seconds, self.config.method, self.config.target, self.common.round
        );
        if call.data_session {
            text.push_str("; in a data-layer session only the call's own stream is read, so a question the server sends on the session's GET stream instead (not tied to the call) is not delivered: call such a tool outside the session");
        }
        self.finish(Ending::Refused(Refusal::internal(
            Class::UpstreamTimeout,
            text,
        )))
    }

    /// The replica shuts down in the middle of the flow (`when`, and what the client can
    /// do): the client is told.
    fn shutting_down(&mut self, when: &str) -> Phase {
        let text = format!(
            "the gateway replica running {} '{}' is shutting down {when}",
            self.config.method, self.config.target
        );
        self.finish(Ending::Refused(Refusal::internal(Class::Overloaded, text)))
    }

    /// The flow reached its deadline: its call ends (no state it could issue would still
    /// open), and the client is told which limit.
    fn deadline_reached(&mut self, call: &UpstreamCall) -> Phase {
        self.commands.push_back(Command::CloseStreams);
        self.give_up(call, "the flow reached its deadline");
        let text = format!(
            "{} '{}' reached the flow's limit of {} s across its rounds (bridge.max_flow_seconds) in round {}; the upstream call was ended: issue it again",
            self.config.method, self.config.target, self.config.max_flow_seconds, self.common.round
        );
        self.finish(Ending::Refused(Refusal::internal(Class::OverLimit, text)))
    }

    /// Ends a call the flow gives up on while the upstream may still be running it: its
    /// session deleted, or, in a data-layer session, the call cancelled by id as a legacy
    /// client cancels one (closing its stream does not: 2025-11-25, Cancellation), so
    /// that the tool stops instead of waiting on until the server's own timeout.
    fn give_up(&mut self, call: &UpstreamCall, reason: &'static str) {
        if !call.data_session {
            return self.commands.push_back(Command::DeleteSession);
        }
        self.commands
            .push_back(Command::Cancel(cancellation_of(call, reason)));
    }

    fn learn(&mut self, learnt: Learnt) {
        match learnt {
            Learnt::ReplayRefused { .. } | Learnt::EventIdsUnusable(_) => {
                self.config.replay_refused = true
            }
            Learnt::Primes(primes) => self.config.primes = Some(primes),
            Learnt::Resumable(_)
            | Learnt::AsksAtOnce
            | Learnt::ResumptionFailed
            | Learnt::ResumptionWorked => {}
        }
        self.commands.push_back(Command::Learn(learnt));
    }
}

impl Common {
    fn of(state: &FlowState) -> Common {
        Common {
            flow_id: state.flow_id,
            started_ms: state.started_ms,
            flow_deadline: state.flow_deadline,
            round: state.round,
            known: state.known.clone(),
        }
    }
}

impl Retry {
    fn new(
        call: UpstreamCall,
        pending: Vec<Pending>,
        responses: Map<String, Value>,
        then: AfterAnswers,
    ) -> Retry {
        let all_answered = pending.iter().all(|p| responses.contains_key(&p.key));
        Retry {
            call,
            pending,
            responses,
            from: None,
            session_from: None,
            read_before: ReadBefore::default(),
            all_answered,
            drain_pending: false,
            empties: 0,
            session_reopened: false,
            reopened_at: None,
            replayed: Vec::new(),
            replayed_bytes: 0,
            call_ended: false,
            to_post: VecDeque::new(),
            answered: Vec::new(),
            then,
        }
    }
}

/// The ids of the server's requests cancelled in `replayed` (`notifications/cancelled`,
/// alone or in a batch).
fn cancelled_in(replayed: &[(Stream, Event)]) -> Vec<UpstreamId> {
    let cancelled = |m: &Value| {
        (m["method"] == "notifications/cancelled")
            .then(|| UpstreamId::from_json(&m["params"]["requestId"]))
            .flatten()
    };
    // Each event read whole: a server may escape the method's `/` (`\/`), or any letter.
    replayed
        .iter()
        .filter(|(_, e)| e.is_message() && !e.data.is_empty())
        .filter_map(|(_, e)| jsonrpc::from_slice_lenient::<Value>(e.data.as_bytes()).ok())
        .flat_map(|m| match m {
            Value::Array(batch) => batch.iter().filter_map(cancelled).collect(),
            m => cancelled(&m).into_iter().collect::<Vec<_>>(),
        })
        .collect()
}

/// `message` without the requests whose id is none of `pending` (`None` if it was one),
/// a batch's taken out one by one.
fn without_requests_answered(message: Value, pending: &[UpstreamId]) -> Option<Value> {
    let answered = |m: &Value| {
        let id = m.get("method").and(m.get("id"));
        id.is_some_and(|id| !UpstreamId::from_json(id).is_some_and(|id| pending.contains(&id)))
    };
    match message {
        Value::Array(mut batch) => {
            batch.retain(|m| !answered(m));
            Some(Value::Array(batch))
        }
        message if answered(&message) => None,
        message => Some(message),
    }
}

/// Whether an event read on `stream` is one an earlier round read (`left` counts those
/// still to come): a replayed event carries a message and an id; an event without data
/// (a priming event) says the stream is live.
fn read_earlier(left: &mut ReadBefore, stream: Stream, event: &Event) -> bool {
    let left = match stream {
        Stream::Call => &mut left.call,
        Stream::Session => &mut left.session,
    };
    if *left == 0 || event.id.is_none() || !event.is_message() {
        return false;
    }
    if event.data.is_empty() {
        *left = 0;
        return false;
    }
    *left -= 1;
    true
}

/// Why a call whose client never continued it is cancelled: its held entry or its
/// reaper entry expired.
pub const NOT_CONTINUED: &str = "the client did not continue the call in time";

/// The cancellation of `call`, for `reason`.
fn cancellation_of(call: &UpstreamCall, reason: &'static str) -> Cancellation {
    Cancellation {
        request_id: call.id.to_json(),
        reason,
    }
}

/// Whether the call's response is a 2025-11-25 URL-elicitation-required error.
fn is_url_required(message: &Value) -> bool {
    message["error"]["code"].as_i64() == Some(Round::URL_ELICITATION_REQUIRED)
}

/// Whether a retry answers its questions, and declines or cancels every one
/// (`ElicitResult.action`): a retry without answers, or with any other, goes on.
fn declines_every_question(responses: &Map<String, Value>) -> bool {
    !responses.is_empty()
        && responses
            .values()
            .all(|r| matches!(r["action"].as_str(), Some("decline" | "cancel")))
}

/// A fresh id for a call posted upstream (and for each re-issue): random, between 2^32
/// and 2^53, so no two calls share one (SDKs name a call's stream after its id, and
/// stores shared by every session replay by stream), it never looks like a server's own
/// small request counter, and it stays exact in JavaScript.
pub fn fresh_call_id() -> i64 {
    rand::Rng::gen_range(&mut rand::thread_rng(), 1i64 << 32..1i64 << 53)
}

#[cfg(test)]
mod tests;
