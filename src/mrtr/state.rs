//! The `requestState` of a bridged flow: a sealed pointer to the upstream call that is
//! waiting for answers, so that any replica can post them and resume the stream. What a
//! flow waits as is an enum of phases (`Waiting`): deferred before it started, resumable
//! at per-stream positions, held by a replica, or to be re-issued.
//!
//! The payload's layout is versioned by the envelope (`seal::VERSION`, authenticated):
//! this replica seals the current layout and opens the one before too (`v1`, the layout
//! of the release before phases), so states in flight survive a rolling upgrade. After
//! the layout come extensions (`seal`'s rule: ignored by the replicas before them): the
//! revision the call's session negotiated, then, for a round with questions, each question's
//! method and stream (`RoundExtension`).
//!
//! It is sealed with `Purpose::RequestState` together with its binding: a digest of the
//! principal, and a digest of the method, the tool name or resource uri and the
//! arguments. A state presented by someone else, or on another request, is refused, and
//! the logs can say which of the two it was. It expires. Because the binding travels
//! inside the ciphertext rather than as associated data, an operator holding the keys can
//! `inspect` a state without knowing the request it belongs to.

use crate::keys::{KeyRing, Purpose};
use crate::protocol::jsonrpc;
use crate::protocol::revision::Revision;
use crate::seal::{self, same, OpenError};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;

/// Seconds since the Unix epoch: the clock of expiries and deadlines.
pub fn now_secs() -> u64 {
    now_ms() / 1000
}

/// Milliseconds since the Unix epoch: when a flow began, for its duration.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The hard ceiling on a `requestState`'s length, whatever the configured limit
/// (`limits.max_request_state_bytes`, checked first) says.
pub const MAX_STATE_LEN: usize = 64 << 10;

/// A JSON-RPC id the upstream chose for one of its requests (0 is valid).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpstreamId {
    Number(i64),
    Text(String),
}

impl UpstreamId {
    pub fn from_json(id: &Value) -> Option<UpstreamId> {
        match id {
            Value::Number(n) => n.as_i64().map(UpstreamId::Number),
            Value::String(s) => Some(UpstreamId::Text(s.clone())),
            _ => None,
        }
    }

    pub fn to_json(&self) -> Value {
        match self {
            UpstreamId::Number(n) => Value::from(*n),
            UpstreamId::Text(s) => Value::from(s.as_str()),
        }
    }
}

/// A server request waiting for the client's answer under `key`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    pub key: String,
    pub upstream_id: UpstreamId,
    /// For a `restartable` tool: the request's fingerprint, so that its answer can be
    /// given again if the call has to be run again.
    pub fingerprint: Option<u64>,
    /// What the request was and which stream sent it. Sealed after the layout, in the
    /// round's extension; not known in a state sealed by a release before it.
    #[serde(skip)]
    pub asked: Asked,
}

/// A server request's method and the stream it came on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Asked {
    /// Its method, `None` where the state does not say.
    pub kind: Option<QuestionKind>,
    /// It came on the session's GET stream, not the call's.
    pub on_session: bool,
}

/// The methods a server may ask a client through the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuestionKind {
    Elicitation,
    Sampling,
    Roots,
}

impl QuestionKind {
    pub fn of(method: &str) -> Option<QuestionKind> {
        match method {
            "elicitation/create" => Some(QuestionKind::Elicitation),
            "sampling/createMessage" => Some(QuestionKind::Sampling),
            "roots/list" => Some(QuestionKind::Roots),
            _ => None,
        }
    }
}

/// An answer the client gave in a `restartable` tool's flow, kept so that a re-run of the
/// call (after its upstream session was lost) is not asked the same thing twice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Known {
    /// The fingerprint of the server request it answered (`fingerprint`).
    pub fingerprint: u64,
    /// The answer, as JSON text.
    pub answer: String,
    /// Whether the current run of the call has been given it already.
    pub used: bool,
}

/// A server request's identity across runs of a call: its method and canonical params
/// (object keys sorted), without `_meta` and the per-run `elicitationId`.
pub fn fingerprint(method: &str, params: &Value) -> u64 {
    let mut params = params.clone();
    if let Some(p) = params.as_object_mut() {
        p.remove("_meta");
        p.remove("elicitationId");
    }
    let mut h = Sha256::new();
    h.update(b"mrtr-gateway request fingerprint v1\0");
    h.update(method.as_bytes());
    h.update(b"\0");
    h.update(jsonrpc::text_of(&params).as_bytes());
    let digest = h.finalize();
    u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// A bridged flow between two of its client's requests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowState {
    pub group: String,
    /// Random id that stays the same across rounds and replicas, for logs.
    pub flow_id: u64,
    /// When the flow began, in milliseconds since the Unix epoch (its duration metric).
    pub started_ms: u64,
    /// The flow's hard deadline; no round's `expires_at` passes it.
    pub flow_deadline: u64,
    /// Seconds since the Unix epoch after which the state is refused.
    pub expires_at: u64,
    /// The rounds of questions asked so far (0 while deferred).
    pub round: u16,
    /// A `restartable` tool's answers so far, in order; empty for other tools.
    pub known: Vec<Known>,
    pub waiting: Waiting,
}

/// What a flow waits as.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Waiting {
    /// Deferred under load shedding: nothing went upstream, and the retry starts the call.
    Deferred { data_session: bool },
    /// The call waits upstream for answers; a retry resumes its streams with
    /// `Last-Event-ID` from `positions`.
    Resumable {
        call: UpstreamCall,
        pending: Vec<Pending>,
        positions: Positions,
    },
    /// The call waits upstream for answers, its streams held open by the replica `at`.
    Held {
        call: UpstreamCall,
        pending: Vec<Pending>,
        at: HeldAt,
    },
    /// The call ended asking the user to visit URLs first: the retry posts it again.
    Reissue { call: UpstreamCall },
}

/// The upstream call a flow runs: where, in which session, under which id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamCall {
    pub endpoint: SocketAddr,
    pub session: String,
    /// The id the gateway gave the call upstream; its response ends the flow.
    pub id: UpstreamId,
    /// The call runs in a data-layer session: it reads only the call's own stream and
    /// never deletes the upstream session.
    pub data_session: bool,
    /// The revision the session negotiated, which its every request names. Sealed after
    /// the layout, as an extension; a state without one (sealed by a release before it)
    /// has the revision the gateway asks for, which those releases spoke.
    #[serde(skip)]
    pub version: Revision,
}

/// Where a resumable flow's streams are resumed from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Positions {
    /// The last event id read on the call's stream.
    pub last_event_id: Option<String>,
    /// The call-stream position before the round's first question, to ask again.
    pub round_start: Option<String>,
    /// The session GET stream's position: before the round's first question on it (so an
    /// unanswered one is asked again), else its last event.
    pub session_from: Option<String>,
    /// `session_from` is before the round's first question on the GET stream, so a
    /// resumption from it sends the stream's questions again (it sent an event before
    /// them). Sealed in the round's extension.
    #[serde(skip)]
    pub session_replayable: bool,
    /// How many of the events a resumption from the round's start replays the round
    /// read. Sealed in an extension of its own, after the round's.
    #[serde(skip)]
    pub read_before: ReadBefore,
    /// What the replica that sealed the state had learnt of the group's upstream. Sealed
    /// in an extension of its own, after `read_before`'s.
    #[serde(skip)]
    pub upstream: UpstreamFacts,
}

/// What a replica learns of a group's upstream by serving it, sealed in each round's
/// state so that the replica taking the retry, when it has not learnt it yet, takes the
/// sealing replica's word rather than learning it again (a wait, a probe) on its first
/// retry. `None` where the sealing replica did not know, or in a state sealed by a release
/// before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamFacts {
    /// Whether its resumed streams are primed once live.
    pub primes: Option<bool>,
    /// Whether its event store keeps sessions apart (a session's GET stream may be
    /// resumed), or is shared by them (it is reopened fresh).
    pub sessions_kept_apart: Option<bool>,
}

/// How many events carrying a message a stream sent from its first question of a round
/// on, to the round's end (none on a stream that asked nothing): a retry resuming the
/// stream from before that question is replayed them first, and what they told the
/// client, or what the gateway answered for them, went out in that round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadBefore {
    pub call: u32,
    pub session: u32,
}

/// A round's extension, sealed after the revision in a state with questions (resumable
/// or held): what its layout does not say of them. A state without it (sealed by a
/// release before it) leaves their kinds unknown and counts every question as the call
/// stream's.
#[derive(Default, Serialize, Deserialize)]
struct RoundExtension {
    /// Each pending question's, in order.
    asked: Vec<Asked>,
    session_replayable: bool,
}

impl Waiting {
    /// The upstream call, once there is one.
    pub fn call(&self) -> Option<&UpstreamCall> {
        match self {
            Waiting::Deferred { .. } => None,
            Waiting::Resumable { call, .. } | Waiting::Held { call, .. } => Some(call),
            Waiting::Reissue { call } => Some(call),
        }
    }

    /// The upstream call, to change what it knows.
    fn call_mut(&mut self) -> Option<&mut UpstreamCall> {
        match self {
            Waiting::Deferred { .. } => None,
            Waiting::Resumable { call, .. } | Waiting::Held { call, .. } => Some(call),
            Waiting::Reissue { call } => Some(call),
        }
    }

    /// The server requests waiting for the client's answers.
    pub fn pending(&self) -> &[Pending] {
        match self {
            Waiting::Resumable { pending, .. } | Waiting::Held { pending, .. } => pending,
            Waiting::Deferred { .. } | Waiting::Reissue { .. } => &[],
        }
    }

    /// Whether the flow runs in a data-layer session.
    pub fn data_session(&self) -> bool {
        match self {
            Waiting::Deferred { data_session } => *data_session,
            other => other.call().is_some_and(|c| c.data_session),
        }
    }
}

/// A held flow's place: the replica keeping its upstream streams open, and the slot of
/// its table holding them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldAt {
    /// The owner's peer address; `None` when it has no peer listener, so only a retry
    /// reaching it directly can continue the flow.
    pub owner: Option<SocketAddr>,
    /// Random, so a slot never names another flow, even after the owner restarts.
    pub slot: u64,
}

/// What a state is bound to: the first half names the principal (a prefix of its
/// digest), the second the request (a digest of method, name or uri, and arguments).
pub fn binding(
    principal: &[u8; 32],
    method: &str,
    target: Option<&str>,
    arguments: Option<&Value>,
) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"mrtr-gateway request binding v2\0");
    for part in [method, target.unwrap_or("")] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    // serde_json keeps object keys sorted, so equal arguments serialize equally.
    let args = arguments.map(jsonrpc::text_of).unwrap_or_default();
    h.update(Sha256::digest(args.as_bytes()));
    let request: [u8; 32] = h.finalize().into();
    let mut bound = [0u8; 32];
    bound[..16].copy_from_slice(&principal[..16]);
    bound[16..].copy_from_slice(&request[..16]);
    bound
}

/// Compares a sealed binding with a request's: the principal half first.
pub fn check_binding(sealed: &[u8; 32], presented: &[u8; 32]) -> Result<(), OpenError> {
    if !same(&sealed[..16], &presented[..16]) {
        return Err(OpenError::Principal);
    }
    if !same(&sealed[16..], &presented[16..]) {
        return Err(OpenError::Binding);
    }
    Ok(())
}

/// A state the gateway will not issue: sealed, it would be longer than the limit it
/// accepts (`limits.max_request_state_bytes`), so its retry would be refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateTooLarge {
    /// Its length sealed.
    pub len: usize,
    pub limit: usize,
    /// What takes most of it, and how many bytes.
    pub largest: (&'static str, usize),
}

impl std::fmt::Display for StateTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, bytes) = self.largest;
        write!(
            f,
            "the call's requestState would be {} bytes, above limits.max_request_state_bytes ({}), \
             the longest the gateway issues or accepts; most of it is {what} ({bytes} bytes)",
            self.len, self.limit
        )
    }
}

impl std::error::Error for StateTooLarge {}

impl FlowState {
    /// Seals the state, unless it would be longer than `limit`: a state the gateway issues
    /// is always one it accepts.
    pub fn seal_within(
        &self,
        ring: &KeyRing,
        binding: &[u8; 32],
        limit: usize,
    ) -> Result<String, StateTooLarge> {
        self.seal_layout_within(ring, binding, limit, false)
    }

    /// `seal_within`, in the previous layout when `previous` (`seal_previous`).
    pub fn seal_layout_within(
        &self,
        ring: &KeyRing,
        binding: &[u8; 32],
        limit: usize,
        previous: bool,
    ) -> Result<String, StateTooLarge> {
        let sealed = if previous {
            self.seal_previous(ring, binding)
        } else {
            self.seal(ring, binding)
        };
        if sealed.len() <= limit {
            return Ok(sealed);
        }
        Err(StateTooLarge {
            len: sealed.len(),
            limit,
            largest: self.largest_part(),
        })
    }

    /// The length of the plaintext sealed for this state (with its binding).
    pub fn plaintext_len(&self) -> usize {
        postcard::to_allocvec(&([0u8; 32], self)).map_or(usize::MAX, |v| self.extended(v).len())
    }

    /// The most plaintext this state takes as the shell seals it: in either layout
    /// (`seal_layout_within`: the previous one is a few bytes larger for some phases),
    /// and with its endpoint's store verdict known (one byte more than not known). A
    /// flow checks its limits against this before it holds or watches its call, so
    /// that the seal cannot fail after.
    pub fn plaintext_len_at_most(&self) -> usize {
        let unknown_verdict = match &self.waiting {
            Waiting::Resumable { positions, .. } => {
                usize::from(positions.upstream.sessions_kept_apart.is_none())
            }
            _ => 0,
        };
        let previous = postcard::to_allocvec(&([0u8; 32], v1::FlowState::from(self)))
            .map_or(usize::MAX, |v| self.extended(v).len());
        self.plaintext_len()
            .max(previous)
            .saturating_add(unknown_verdict)
    }

    /// Why this state is too large for `limit`, sealed under a key id of `kid_len` bytes.
    pub fn too_large(&self, limit: usize, kid_len: usize) -> StateTooLarge {
        StateTooLarge {
            len: seal::sealed_len(kid_len, self.plaintext_len()),
            limit,
            largest: self.largest_part(),
        }
    }

    /// The part of the state whose size the upstream or the client chose that takes most.
    fn largest_part(&self) -> (&'static str, usize) {
        let id_len = |id: &UpstreamId| match id {
            UpstreamId::Number(_) => 8,
            UpstreamId::Text(t) => t.len(),
        };
        let questions = self
            .waiting
            .pending()
            .iter()
            .map(|p| p.key.len() + id_len(&p.upstream_id))
            .sum();
        let event_ids = match &self.waiting {
            Waiting::Resumable { positions: p, .. } => {
                [&p.last_event_id, &p.round_start, &p.session_from]
                    .iter()
                    .filter_map(|id| id.as_ref().map(String::len))
                    .sum()
            }
            _ => 0,
        };
        let session = self.waiting.call().map_or(0, |c| c.session.len());
        let answers = self.known.iter().map(|k| k.answer.len()).sum();
        [
            ("the server's request ids and their input keys", questions),
            ("the upstream's SSE event ids", event_ids),
            ("the upstream session id", session),
            ("the restartable tool's answers so far", answers),
        ]
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .expect("four parts")
    }

    /// Seals the state in the current layout.
    pub fn seal(&self, ring: &KeyRing, binding: &[u8; 32]) -> String {
        let plain = postcard::to_extend(&(binding, self), Vec::with_capacity(256))
            .expect("a flow state always serializes");
        seal::seal(ring, Purpose::RequestState, b"", &self.extended(plain))
    }

    /// `plain`, a sealed layout of the state, followed by its extensions: the call's
    /// session revision, when there is a call; then, for a round with questions, what
    /// they were and where they came from, how many events a resumption from the
    /// round's start replays that it read, and what this replica knew of the upstream.
    fn extended(&self, plain: Vec<u8>) -> Vec<u8> {
        let serialized = "an extension always serializes";
        let Some(call) = self.waiting.call() else {
            return plain;
        };
        let plain = postcard::to_extend(&call.version, plain).expect(serialized);
        let (pending, session_replayable, read_before, facts) = match &self.waiting {
            Waiting::Resumable {
                pending, positions, ..
            } => (
                pending,
                positions.session_replayable,
                positions.read_before,
                positions.upstream,
            ),
            // Held rounds write them as nothing, so that what follows, in a later
            // release, is found in one place whatever the phase.
            Waiting::Held { pending, .. } => (
                pending,
                false,
                ReadBefore::default(),
                UpstreamFacts::default(),
            ),
            Waiting::Deferred { .. } | Waiting::Reissue { .. } => return plain,
        };
        let round = RoundExtension {
            asked: pending.iter().map(|p| p.asked).collect(),
            session_replayable,
        };
        let plain = postcard::to_extend(&round, plain).expect(serialized);
        let plain = postcard::to_extend(&read_before, plain).expect(serialized);
        postcard::to_extend(&facts, plain).expect(serialized)
    }

    /// Sets what the extensions after a sealed layout (`rest`) say, where there are some.
    fn extend_from(&mut self, rest: &[u8]) -> Result<(), OpenError> {
        let (version, rest) = seal::next_extension::<Revision>(rest)?;
        if let (Some(version), Some(call)) = (version, self.waiting.call_mut()) {
            call.version = version;
        }
        let (pending, positions) = match &mut self.waiting {
            Waiting::Resumable {
                pending, positions, ..
            } => (pending, Some(positions)),
            Waiting::Held { pending, .. } => (pending, None),
            Waiting::Deferred { .. } | Waiting::Reissue { .. } => return Ok(()),
        };
        let (round, rest) = seal::next_extension::<RoundExtension>(rest)?;
        let round = round.unwrap_or_default();
        for (pending, asked) in pending.iter_mut().zip(round.asked) {
            pending.asked = asked;
        }
        // Written for held rounds too (as nothing), so that what follows it, in a later
        // release, is found in one place whatever the phase.
        let (read_before, rest) = seal::next_extension::<ReadBefore>(rest)?;
        let facts = seal::extension::<UpstreamFacts>(rest)?.unwrap_or_default();
        if let Some(positions) = positions {
            positions.session_replayable = round.session_replayable;
            positions.read_before = read_before.unwrap_or_default();
            positions.upstream = facts;
        }
        Ok(())
    }

    /// Seals the state in the previous layout (`v1`), which replicas of the release before
    /// open: for the first phase of a rolling upgrade. The session stream's position is
    /// lost (the retry reopens that stream fresh).
    pub fn seal_previous(&self, ring: &KeyRing, binding: &[u8; 32]) -> String {
        let old = v1::FlowState::from(self);
        let plain = postcard::to_extend(&(binding, &old), Vec::with_capacity(256))
            .expect("a flow state always serializes");
        seal::seal_version(
            ring,
            Purpose::RequestState,
            seal::OLDEST_VERSION,
            b"",
            &self.extended(plain),
        )
    }

    /// Opens a state presented with `binding`; `now` is seconds since the Unix epoch.
    pub fn open(
        ring: &KeyRing,
        binding: &[u8; 32],
        text: &str,
        now: u64,
    ) -> Result<FlowState, OpenError> {
        let (bound, state) = FlowState::open_unbound(ring, text)?;
        check_binding(&bound, binding)?;
        if now >= state.expires_at {
            return Err(OpenError::Expired);
        }
        Ok(state)
    }

    /// Opens a state without checking its binding or expiry (for `inspect`); returns the
    /// binding it was sealed with. States sealed in the previous layout open as well.
    pub fn open_unbound(ring: &KeyRing, text: &str) -> Result<([u8; 32], FlowState), OpenError> {
        let (version, plain) =
            seal::open_version(ring, Purpose::RequestState, b"", text, MAX_STATE_LEN)?;
        let bad = |_| OpenError::BadPayload;
        let (bound, mut state, rest) = if version == seal::VERSION {
            let ((bound, state), rest) = postcard::take_from_bytes(&plain).map_err(bad)?;
            (bound, state, rest)
        } else {
            let ((bound, old), rest): (([u8; 32], v1::FlowState), _) =
                postcard::take_from_bytes(&plain).map_err(bad)?;
            (bound, FlowState::from(old), rest)
        };
        state.extend_from(rest)?;
        Ok((bound, state))
    }
}

/// The layout of the release before phases (sealed as format version 1), frozen: what
/// replicas of that release sealed, and what they open.
pub mod v1 {
    use super::{HeldAt, Known, Pending, Positions, UpstreamCall, UpstreamId, Waiting};
    use crate::protocol::revision::Revision;
    use serde::{Deserialize, Serialize};
    use std::net::SocketAddr;

    /// `round` of a deferred state.
    const DEFERRED: u16 = 0;

    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct FlowState {
        pub group: String,
        pub endpoint: SocketAddr,
        pub upstream_session: String,
        pub call_id: UpstreamId,
        pub pending: Vec<Pending>,
        pub last_event_id: Option<String>,
        pub round_start: Option<String>,
        pub round: u16,
        pub expires_at: u64,
        pub flow_deadline: u64,
        pub started_ms: u64,
        pub reissue: bool,
        pub data_session: bool,
        pub known: Vec<Known>,
        pub flow_id: u64,
        pub held: Option<HeldAt>,
        /// The session GET stream's position. Read and left: a state opened here
        /// reopens that stream fresh (`seal_previous`'s states carry none).
        pub session_event_id: Option<String>,
    }

    impl From<FlowState> for super::FlowState {
        fn from(old: FlowState) -> super::FlowState {
            let call = UpstreamCall {
                endpoint: old.endpoint,
                session: old.upstream_session,
                id: old.call_id,
                data_session: old.data_session,
                version: Revision::default(),
            };
            let waiting = match (old.round, old.reissue, old.held) {
                (DEFERRED, ..) => Waiting::Deferred {
                    data_session: old.data_session,
                },
                (_, true, _) => Waiting::Reissue { call },
                (_, _, Some(at)) => Waiting::Held {
                    call,
                    pending: old.pending,
                    at,
                },
                _ => Waiting::Resumable {
                    call,
                    pending: old.pending,
                    positions: Positions {
                        last_event_id: old.last_event_id,
                        round_start: old.round_start,
                        ..Positions::default()
                    },
                },
            };
            super::FlowState {
                group: old.group,
                flow_id: old.flow_id,
                started_ms: old.started_ms,
                flow_deadline: old.flow_deadline,
                expires_at: old.expires_at,
                round: old.round,
                known: old.known,
                waiting,
            }
        }
    }

    impl From<&super::FlowState> for FlowState {
        fn from(new: &super::FlowState) -> FlowState {
            let unstarted = UpstreamCall {
                endpoint: SocketAddr::from(([0, 0, 0, 0], 0)),
                session: String::new(),
                id: UpstreamId::Number(0),
                data_session: new.waiting.data_session(),
                version: Revision::default(),
            };
            let call = new.waiting.call().cloned().unwrap_or(unstarted);
            let (last_event_id, round_start) = match &new.waiting {
                Waiting::Resumable { positions, .. } => (
                    positions.last_event_id.clone(),
                    positions.round_start.clone(),
                ),
                _ => (None, None),
            };
            let held = match &new.waiting {
                Waiting::Held { at, .. } => Some(*at),
                _ => None,
            };
            FlowState {
                group: new.group.clone(),
                endpoint: call.endpoint,
                upstream_session: call.session,
                call_id: call.id,
                pending: new.waiting.pending().to_vec(),
                last_event_id,
                round_start,
                // A deferred call is one of round `DEFERRED` there, whatever its rounds
                // before (a restartable tool run again, then deferred).
                round: match new.waiting {
                    Waiting::Deferred { .. } => DEFERRED,
                    _ => new.round,
                },
                expires_at: new.expires_at,
                flow_deadline: new.flow_deadline,
                started_ms: new.started_ms,
                reissue: matches!(new.waiting, Waiting::Reissue { .. }),
                data_session: call.data_session,
                known: new.known.clone(),
                flow_id: new.flow_id,
                held,
                session_event_id: None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ring() -> KeyRing {
        KeyRing::parse("k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap()
    }

    fn one_elicitation() -> FlowState {
        FlowState {
            group: "default".into(),
            flow_id: 0x1234_5678_9abc_def0,
            started_ms: 2_000_000_000_000,
            flow_deadline: 2_000_000_600,
            expires_at: 2_000_000_000,
            round: 1,
            known: Vec::new(),
            waiting: Waiting::Resumable {
                call: UpstreamCall {
                    endpoint: "10.0.0.7:3001".parse().unwrap(),
                    session: "5b0c3a1e-4d2f-4f8e-9c1a-7f6e5d4c3b2a".into(),
                    id: UpstreamId::Number(1),
                    data_session: false,
                    version: Revision::default(),
                },
                pending: vec![Pending {
                    key: "elicitation_0".into(),
                    upstream_id: UpstreamId::Number(0),
                    fingerprint: None,
                    asked: Asked::default(),
                }],
                positions: Positions {
                    last_event_id: Some("7a655773-cec9-4f18-9782-81d58bb08a83_3".into()),
                    round_start: Some("7a655773-cec9-4f18-9782-81d58bb08a83_2".into()),
                    ..Positions::default()
                },
            },
        }
    }

    #[test]
    fn a_one_elicitation_state_is_small_and_round_trips() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let sealed = one_elicitation().seal(&ring(), &b);
        println!("a one-elicitation requestState is {} bytes", sealed.len());
        assert!(sealed.len() <= 400, "state is {} bytes", sealed.len());
        assert_eq!(
            FlowState::open(&ring(), &b, &sealed, 1_900_000_000).unwrap(),
            one_elicitation()
        );
    }

    #[test]
    fn it_is_bound_to_principal_request_and_time() {
        let args = json!({"city": "Lisbon", "nights": 3});
        let b = binding(&[1; 32], "tools/call", Some("plan"), Some(&args));
        let sealed = one_elicitation().seal(&ring(), &b);
        let now = 1_900_000_000;
        let other = [
            binding(&[2; 32], "tools/call", Some("plan"), Some(&args)),
            binding(&[1; 32], "prompts/get", Some("plan"), Some(&args)),
            binding(&[1; 32], "tools/call", Some("other"), Some(&args)),
            binding(
                &[1; 32],
                "tools/call",
                Some("plan"),
                Some(&json!({"city": "Porto", "nights": 3})),
            ),
        ];
        let reasons = [
            OpenError::Principal,
            OpenError::Binding,
            OpenError::Binding,
            OpenError::Binding,
        ];
        for (b, reason) in other.iter().zip(reasons) {
            assert_eq!(FlowState::open(&ring(), b, &sealed, now), Err(reason));
        }
        assert_eq!(
            FlowState::open(&ring(), &b, &sealed, 2_000_000_000),
            Err(OpenError::Expired)
        );
        let reordered =
            serde_json::from_str::<Value>(r#"{"nights": 3, "city": "Lisbon"}"#).unwrap();
        assert_eq!(
            b,
            binding(&[1; 32], "tools/call", Some("plan"), Some(&reordered))
        );
    }

    #[test]
    fn a_session_token_never_opens_as_a_state() {
        use crate::protocol::session_token::SessionToken;
        let b = binding(&[1; 32], "tools/call", Some("x"), None);
        let token = SessionToken {
            group: "default".into(),
            endpoint: "10.0.0.7:3001".parse().unwrap(),
            upstream_session: "s".into(),
            issued_at: 0,
        }
        .seal(&ring(), &b);
        assert_eq!(
            FlowState::open(&ring(), &b, &token, 0),
            Err(OpenError::Rejected)
        );
    }

    #[test]
    fn a_state_over_the_limit_is_not_issued_and_says_what_made_it_large() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let mut state = one_elicitation();
        let fits = state
            .seal_within(&ring(), &b, 400)
            .expect("a small state fits");
        assert!(FlowState::open(&ring(), &b, &fits, 1_900_000_000).is_ok());
        if let Waiting::Resumable { positions, .. } = &mut state.waiting {
            positions.last_event_id = Some("e".repeat(6000));
        }
        let refused = state.seal_within(&ring(), &b, 4096).unwrap_err();
        assert!(refused.len > 4096, "{refused}");
        assert_eq!(refused.largest.0, "the upstream's SSE event ids");
        assert!(refused
            .to_string()
            .contains("max_request_state_bytes (4096)"));
        let mut restartable = one_elicitation();
        restartable.known.push(Known {
            fingerprint: 1,
            answer: json!({"action": "accept", "content": {"name": "n".repeat(3000)}}).to_string(),
            used: true,
        });
        let refused = restartable.seal_within(&ring(), &b, 4096).unwrap_err();
        assert_eq!(refused.largest.0, "the restartable tool's answers so far");
    }

    #[test]
    fn a_state_sealed_by_the_previous_release_opens_as_its_phase() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let mut phases = vec![one_elicitation()];
        let call = one_elicitation().waiting.call().cloned().unwrap();
        let pending = one_elicitation().waiting.pending().to_vec();
        let at = HeldAt {
            owner: Some("10.0.0.9:9091".parse().unwrap()),
            slot: 77,
        };
        for waiting in [
            Waiting::Held {
                call: call.clone(),
                pending,
                at,
            },
            Waiting::Reissue { call },
        ] {
            phases.push(FlowState {
                round: 2,
                waiting,
                ..one_elicitation()
            });
        }
        phases.push(FlowState {
            round: 0,
            waiting: Waiting::Deferred { data_session: true },
            ..one_elicitation()
        });
        for state in phases {
            let old = state.seal_previous(&ring(), &b);
            let opened = FlowState::open(&ring(), &b, &old, 1_900_000_000).unwrap();
            assert_eq!(opened, state, "the previous layout keeps every phase");
            // What the previous release itself sealed: its own struct, format version 1.
            let plain = postcard::to_allocvec(&(&b, v1::FlowState::from(&state))).unwrap();
            let theirs = sealed_as_the_release_before(&plain);
            assert_eq!(
                FlowState::open(&ring(), &b, &theirs, 1_900_000_000).unwrap(),
                state
            );
        }
        // The session stream's position is what the previous layout cannot carry.
        let mut with_session = one_elicitation();
        if let Waiting::Resumable { positions, .. } = &mut with_session.waiting {
            positions.session_from = Some("g-1".into());
        }
        let old = with_session.seal_previous(&ring(), &b);
        assert_eq!(
            FlowState::open(&ring(), &b, &old, 1_900_000_000).unwrap(),
            one_elicitation()
        );
    }

    /// `plain` sealed as the release before sealed its states: format version 1.
    fn sealed_as_the_release_before(plain: &[u8]) -> String {
        seal::seal_version(
            &ring(),
            Purpose::RequestState,
            seal::OLDEST_VERSION,
            b"",
            plain,
        )
    }

    /// The layout the release before phases sealed, field for field as it was
    /// (`git show 5584835^:src/mrtr/state.rs`), its session GET stream's position last.
    #[derive(Serialize)]
    struct Released {
        group: String,
        endpoint: SocketAddr,
        upstream_session: String,
        call_id: UpstreamId,
        pending: Vec<Pending>,
        last_event_id: Option<String>,
        round_start: Option<String>,
        round: u16,
        expires_at: u64,
        flow_deadline: u64,
        started_ms: u64,
        reissue: bool,
        data_session: bool,
        known: Vec<Known>,
        flow_id: u64,
        held: Option<HeldAt>,
        session_event_id: Option<String>,
    }

    /// A state that release sealed opens here, with or without its GET stream's position
    /// (which is dropped: the stream reopens fresh), as the same phase and revision; and
    /// what this release seals in the previous layout reads there as that layout.
    #[test]
    fn a_state_the_release_before_sealed_opens_whatever_its_get_stream_position() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let state = one_elicitation();
        let Waiting::Resumable {
            call,
            pending,
            positions,
        } = &state.waiting
        else {
            unreachable!("one_elicitation waits resumable");
        };
        for session_event_id in [None, Some("s1-g4".to_string())] {
            let released = Released {
                group: state.group.clone(),
                endpoint: call.endpoint,
                upstream_session: call.session.clone(),
                call_id: call.id.clone(),
                pending: pending.clone(),
                last_event_id: positions.last_event_id.clone(),
                round_start: positions.round_start.clone(),
                round: state.round,
                expires_at: state.expires_at,
                flow_deadline: state.flow_deadline,
                started_ms: state.started_ms,
                reissue: false,
                data_session: false,
                known: Vec::new(),
                flow_id: state.flow_id,
                held: None,
                session_event_id,
            };
            let plain = postcard::to_allocvec(&(&b, &released)).unwrap();
            let theirs = sealed_as_the_release_before(&plain);
            let opened = FlowState::open(&ring(), &b, &theirs, 1_900_000_000);
            assert_eq!(opened, Ok(state.clone()), "{:?}", released.session_event_id);
        }
        let ours = state.seal_previous(&ring(), &b);
        let (version, plain) =
            seal::open_version(&ring(), Purpose::RequestState, b"", &ours, MAX_STATE_LEN).unwrap();
        assert_eq!(version, seal::OLDEST_VERSION);
        let (_, read): ([u8; 32], v1::FlowState) = postcard::from_bytes(&plain).unwrap();
        assert_eq!(
            read.session_event_id, None,
            "its extensions are not read as the position"
        );
        // A call deferred after rounds (a restartable tool run again) is a deferred call
        // there, not a resumable one with an invented upstream call.
        let deferred = FlowState {
            round: 2,
            waiting: Waiting::Deferred {
                data_session: false,
            },
            ..one_elicitation()
        };
        let sealed = deferred.seal_previous(&ring(), &b);
        let opened = FlowState::open(&ring(), &b, &sealed, 1_900_000_000).unwrap();
        assert!(matches!(
            opened.waiting,
            Waiting::Deferred {
                data_session: false
            }
        ));
    }

    /// What a flow checks its limits against bounds every plaintext the shell may seal
    /// for the state: either layout, with the endpoint's verdict known.
    #[test]
    fn the_most_a_state_takes_bounds_both_layouts_and_a_known_verdict() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let held = FlowState {
            waiting: Waiting::Held {
                call: one_elicitation().waiting.call().unwrap().clone(),
                pending: one_elicitation().waiting.pending().to_vec(),
                at: HeldAt {
                    owner: None,
                    slot: 7,
                },
            },
            ..one_elicitation()
        };
        for state in [one_elicitation(), held] {
            let mut known = state.clone();
            if let Waiting::Resumable { positions, .. } = &mut known.waiting {
                positions.upstream.sessions_kept_apart = Some(true);
            }
            let plaintext = |sealed: &str| {
                let opened =
                    seal::open_version(&ring(), Purpose::RequestState, b"", sealed, MAX_STATE_LEN);
                opened.unwrap().1.len()
            };
            let most = state.plaintext_len_at_most();
            let (now, before) = (known.seal(&ring(), &b), known.seal_previous(&ring(), &b));
            assert!(state.plaintext_len() < plaintext(&now).max(plaintext(&before)));
            for sealed in [now, before] {
                assert!(
                    plaintext(&sealed) <= most,
                    "{} > {most}",
                    plaintext(&sealed)
                );
            }
        }
    }

    /// A state whose session negotiated an older revision than the one asked for.
    fn on_an_older_revision() -> FlowState {
        let mut state = one_elicitation();
        if let Waiting::Resumable { call, .. } = &mut state.waiting {
            call.version = Revision::parse("2025-06-18").unwrap();
        }
        state
    }

    #[test]
    fn the_sessions_revision_travels_after_either_layout() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let state = on_an_older_revision();
        for sealed in [state.seal(&ring(), &b), state.seal_previous(&ring(), &b)] {
            assert_eq!(
                FlowState::open(&ring(), &b, &sealed, 1_900_000_000).unwrap(),
                state
            );
        }
        // Twelve bytes more than without the extensions: the revision's four, the round's
        // (one question, its kind and stream, two; a flag; a length), two counts, and
        // the upstream's two facts (not known: one byte each).
        let without = postcard::to_allocvec(&([0u8; 32], &state)).unwrap().len();
        assert_eq!(state.plaintext_len(), without + 12);
    }

    #[test]
    fn what_was_learnt_of_the_upstream_travels_last_and_a_state_without_it_says_nothing() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let known = [None, Some(false), Some(true)];
        for (primes, sessions_kept_apart) in known.into_iter().zip(known.into_iter().rev()) {
            let mut state = on_an_older_revision();
            if let Waiting::Resumable { positions, .. } = &mut state.waiting {
                positions.read_before = ReadBefore {
                    call: 1,
                    session: 0,
                };
                positions.upstream = UpstreamFacts {
                    primes,
                    sessions_kept_apart,
                };
            }
            let sealed = state.seal(&ring(), &b);
            assert_eq!(
                FlowState::open(&ring(), &b, &sealed, 1_900_000_000).unwrap(),
                state
            );
            // The release before reads what it knows and leaves the facts.
            let plain =
                seal::open(&ring(), Purpose::RequestState, b"", &sealed, usize::MAX).unwrap();
            let (_, rest): (([u8; 32], FlowState), _) = postcard::take_from_bytes(&plain).unwrap();
            let (_, rest) = seal::next_extension::<Revision>(rest).unwrap();
            let (_, rest) = seal::next_extension::<RoundExtension>(rest).unwrap();
            let read_before = seal::extension::<ReadBefore>(rest).unwrap();
            assert_eq!(
                read_before,
                Some(ReadBefore {
                    call: 1,
                    session: 0
                })
            );
        }
        // A state of that release (everything up to the counts) opens knowing nothing.
        let mut state = on_an_older_revision();
        if let Waiting::Resumable { positions, .. } = &mut state.waiting {
            positions.read_before = ReadBefore {
                call: 1,
                session: 0,
            };
        }
        let round = RoundExtension {
            asked: vec![state.waiting.pending()[0].asked],
            session_replayable: false,
        };
        let plain = postcard::to_allocvec(&(&b, &state)).unwrap();
        let plain = postcard::to_extend(&state.waiting.call().unwrap().version, plain).unwrap();
        let plain = postcard::to_extend(&round, plain).unwrap();
        let plain = postcard::to_extend(
            &ReadBefore {
                call: 1,
                session: 0,
            },
            plain,
        )
        .unwrap();
        let theirs = seal::seal(&ring(), Purpose::RequestState, b"", &plain);
        let opened = FlowState::open(&ring(), &b, &theirs, 1_900_000_000).unwrap();
        assert_eq!(opened, state);
        let Waiting::Resumable { positions, .. } = &opened.waiting else {
            panic!("{opened:?}");
        };
        assert_eq!(positions.upstream, UpstreamFacts::default());
        assert_eq!(positions.read_before.call, 1);
    }

    #[test]
    fn what_a_rounds_questions_were_travels_after_the_revision() {
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let mut state = on_an_older_revision();
        if let Waiting::Resumable {
            positions, pending, ..
        } = &mut state.waiting
        {
            positions.session_from = Some("g-1".into());
            positions.session_replayable = true;
            pending[0].asked = Asked {
                kind: Some(QuestionKind::Sampling),
                on_session: true,
            };
        }
        let sealed = state.seal(&ring(), &b);
        assert_eq!(
            FlowState::open(&ring(), &b, &sealed, 1_900_000_000).unwrap(),
            state
        );
        // How many events a resumption replays that the round read follows; a release
        // before it reads the state as it did (the rest left).
        if let Waiting::Resumable { positions, .. } = &mut state.waiting {
            positions.read_before = ReadBefore {
                call: 2,
                session: 300,
            };
        }
        let sealed = state.seal(&ring(), &b);
        assert_eq!(
            FlowState::open(&ring(), &b, &sealed, 1_900_000_000).unwrap(),
            state
        );
        // As the release before reads it: the layout, the revision, the round's
        // extension, and the rest left.
        let plain = seal::open(&ring(), Purpose::RequestState, b"", &sealed, usize::MAX).unwrap();
        let ((_, layout), rest): (([u8; 32], FlowState), _) =
            postcard::take_from_bytes(&plain).unwrap();
        let (revision, rest) = seal::next_extension::<Revision>(rest).unwrap();
        let round = seal::extension::<RoundExtension>(rest).unwrap().unwrap();
        assert_eq!(revision, state.waiting.call().map(|c| c.version));
        assert_eq!(round.asked, [state.waiting.pending()[0].asked]);
        assert!(round.session_replayable);
        assert_eq!(layout.flow_id, state.flow_id);
        // A release that seals the revision alone: its states say nothing of the kinds,
        // and count every question as the call stream's.
        let plain = postcard::to_allocvec(&(&b, &state)).unwrap();
        let revision_only = postcard::to_extend(&Revision::parse("2025-06-18").unwrap(), plain);
        let theirs = seal::seal(&ring(), Purpose::RequestState, b"", &revision_only.unwrap());
        let opened = FlowState::open(&ring(), &b, &theirs, 1_900_000_000).unwrap();
        let Waiting::Resumable {
            positions, pending, ..
        } = &opened.waiting
        else {
            panic!("{opened:?}");
        };
        assert_eq!(pending[0].asked, Asked::default());
        assert!(!positions.session_replayable);
        assert_eq!(positions.session_from.as_deref(), Some("g-1"));
    }

    #[test]
    fn a_state_sealed_without_the_revision_opens_with_the_one_asked_for() {
        // What a release before the extension sealed: the layout alone. Replicas of that
        // release read what this one seals the same way: the layout, the rest left.
        let b = binding(&[1; 32], "tools/call", Some("ask_name"), Some(&json!({})));
        let state = on_an_older_revision();
        let plain = postcard::to_allocvec(&(&b, &state)).unwrap();
        let theirs = seal::seal(&ring(), Purpose::RequestState, b"", &plain);
        let opened = FlowState::open(&ring(), &b, &theirs, 1_900_000_000).unwrap();
        assert_eq!(opened, one_elicitation());
        let ours = seal::open(
            &ring(),
            Purpose::RequestState,
            b"",
            &state.seal(&ring(), &b),
            4096,
        );
        let (_, read): ([u8; 32], FlowState) = postcard::from_bytes(&ours.unwrap()).unwrap();
        assert_eq!(read, one_elicitation(), "the layout reads alone");
    }
}
