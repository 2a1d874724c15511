//! One round of a bridged call, as a state machine: upstream messages in (from the call's
//! POST stream or the session's GET stream), actions out. Server requests become
//! `inputRequests` entries; progress and opted-in log messages go to the client; `ping`
//! and requests the client cannot take are answered upstream; the call's response ends
//! the flow.

use super::modern::LogLevel;
use super::state::{fingerprint, Asked, Known, Pending, QuestionKind, ReadBefore, UpstreamId};
use crate::protocol::jsonrpc::{self, code};
use serde_json::{json, Map, Value};
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

/// A legacy server may name an input key itself with this `_meta` hint on its request.
pub const INPUT_KEY_HINT: &str = "io.modelcontextprotocol/inputKey";
const MAX_KEY_LEN: usize = 64;
/// Longest string id of a server request the gateway carries (in input keys and states).
pub const MAX_SERVER_ID_BYTES: usize = 256;

/// What one round may gather, checked as each question arrives: a round that reaches
/// `max_questions` ends at once, and questions beyond `max_bytes` end the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundLimits {
    /// Most questions in one round; the round ends when it has this many.
    pub max_questions: usize,
    /// Most bytes the round's input requests may take, as JSON.
    pub max_bytes: usize,
}

impl Default for RoundLimits {
    fn default() -> Self {
        RoundLimits {
            max_questions: 16,
            max_bytes: 1 << 20,
        }
    }
}

/// What the shell must do after a message.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Write this notification to the client's SSE response, if it has one.
    Notify(Value),
    /// POST this JSON-RPC response upstream (ping, or a request refused on the client's behalf).
    AnswerUpstream(Value),
    /// The upstream answered the call: the JSON-RPC response (result or error).
    Complete(Value),
    /// The upstream asked for something the client did not declare: fail with -32021.
    MissingCapability { method: String, required: Value },
    /// The upstream sent what the call cannot go on with (a request id the gateway cannot
    /// carry, questions beyond the round's byte limit): end the call with this reason.
    Fail(String),
}

/// The client capability an input request needs, as `ClientCapabilities` JSON.
fn required_capability(method: &str, params: &Value) -> Value {
    match method {
        "elicitation/create" if params["mode"] == "url" => json!({"elicitation": {"url": {}}}),
        "elicitation/create" => json!({"elicitation": {"form": {}}}),
        "sampling/createMessage" if uses_tools(params) => json!({"sampling": {"tools": {}}}),
        "sampling/createMessage" => json!({"sampling": {}}),
        _ => json!({"roots": {}}),
    }
}

/// A member a question must have: its name, the test its value must pass, and what that
/// test asks for, in words.
type Required = (&'static str, fn(&Value) -> bool, &'static str);

/// What a question lacks that its schema requires (2025-11-25), if anything: a client
/// is never asked one it could not show.
fn malformed_question(method: &str, params: &Value) -> Option<String> {
    let required: &[Required] = match method {
        "elicitation/create" if params["mode"] == "url" => &[
            ("message", Value::is_string, "a string"),
            ("url", Value::is_string, "a string"),
        ],
        "elicitation/create" => &[
            ("message", Value::is_string, "a string"),
            ("requestedSchema", Value::is_object, "an object"),
        ],
        "sampling/createMessage" => &[
            ("messages", Value::is_array, "an array"),
            ("maxTokens", Value::is_u64, "a non-negative integer"),
        ],
        _ => &[],
    };
    let (name, _, what) = required
        .iter()
        .find(|(name, holds, _)| !params.get(*name).is_some_and(holds))?;
    Some(format!("{method} needs params.{name}, {what}"))
}

/// A sampling request that offers the model tools (`tools`, `toolChoice`), which only a
/// client declaring `sampling.tools` may be sent (2025-11-25).
fn uses_tools(params: &Value) -> bool {
    ["tools", "toolChoice"]
        .iter()
        .any(|key| params.get(key).is_some_and(|v| !v.is_null()))
}

/// Whether the client declared what `method` with `params` needs: a capability (and a
/// sub-capability) is declared by an object, as the schema types them; `null`, `false`
/// or any other value declares nothing. An `elicitation` that names no mode is form
/// mode's (as before modes existed); one that names modes has form mode only if it
/// names it.
fn declared(capabilities: &Map<String, Value>, method: &str, params: &Value) -> bool {
    let capability = |name: &str| capabilities.get(name).and_then(Value::as_object);
    let sub = |name: &str, key: &str| {
        capability(name).is_some_and(|c| c.get(key).is_some_and(Value::is_object))
    };
    match method {
        "elicitation/create" if params["mode"] == "url" => sub("elicitation", "url"),
        "elicitation/create" => capability("elicitation")
            .is_some_and(|modes| modes.is_empty() || sub("elicitation", "form")),
        "sampling/createMessage" if uses_tools(params) => sub("sampling", "tools"),
        "sampling/createMessage" => capability("sampling").is_some(),
        _ => capability("roots").is_some(),
    }
}

fn short_kind(method: &str) -> &'static str {
    match method {
        "elicitation/create" => "elicitation",
        "sampling/createMessage" => "sampling",
        _ => "roots",
    }
}

/// What the client request a round answers asked to be told while it runs. Each round
/// answers a request of its own (the call, then each retry), and each says this anew.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Relay {
    /// The request's `progressToken`: the call's progress goes to it, under this token;
    /// without one, nowhere.
    pub progress_token: Option<Value>,
    /// The least severe log messages the request wants; none without it.
    pub log_level: Option<LogLevel>,
}

impl Relay {
    /// A log message the request asked for: at or above its level (one whose level is
    /// not a schema name is passed on).
    fn wants_log(&self, message: &Value) -> bool {
        let Some(least) = self.log_level else {
            return false;
        };
        match message["params"]["level"]
            .as_str()
            .and_then(LogLevel::parse)
        {
            Some(level) => level >= least,
            None => true,
        }
    }
}

/// The stream a server message came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// The call's own stream (or its response).
    Call,
    /// The session's GET stream.
    Session,
}

/// The state of one round.
#[derive(Debug)]
pub struct Round {
    call_id: UpstreamId,
    capabilities: Map<String, Value>,
    relay: Relay,
    input_requests: Map<String, Value>,
    pending: Vec<Pending>,
    last_event_id: Option<String>,
    /// The event id before the current one, and before this round's first question.
    previous_event_id: Option<String>,
    round_start: Option<String>,
    /// Server requests already answered, to ignore when a stream is replayed.
    answered: Vec<UpstreamId>,
    /// Server requests this round settled without asking the client (cancelled, refused,
    /// answered from a known answer), bounded by `MAX_SETTLED`.
    settled: usize,
    /// A restartable tool's round: questions are fingerprinted, and those a known
    /// answer not yet given in this run matches are answered upstream from it.
    restartable: bool,
    known: Vec<Known>,
    limits: RoundLimits,
    /// Bytes the round's input requests take, as JSON.
    question_bytes: usize,
    /// The session GET stream's last event id, the one before it, and the one before this
    /// round's first question on that stream.
    session_last_event_id: Option<String>,
    session_previous_event_id: Option<String>,
    session_round_start: Option<String>,
    /// Whether the call's stream has asked a question this round.
    call_asked: bool,
    /// Whether the session's GET stream has asked a question this round.
    session_asked: bool,
    /// Events carrying a message read on each stream since its first question.
    read_since_asked: ReadBefore,
    /// Digests of the event ids seen on either stream this round (the first
    /// `MAX_IDS_COMPARED`), and why the ids cannot resume the call, once one showed it.
    seen_ids: Vec<u64>,
    ids_unusable: Option<UnusableIds>,
}

/// Why a round's event ids cannot resume its call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnusableIds {
    /// One came twice, on one stream or on both: it names no one event.
    Repeated,
    /// One cannot be sent back as a `Last-Event-ID` header: it holds a control
    /// character, or white space at an end (which HTTP strips), or is empty.
    NotAHeader,
}

impl UnusableIds {
    /// What the upstream did, for a client's error or the log.
    pub fn why(self) -> &'static str {
        match self {
            UnusableIds::Repeated => "it sent the same SSE event id twice in one round",
            UnusableIds::NotAHeader => {
                "it sent an SSE event id that cannot be sent back as a Last-Event-ID header (empty, a control character, or white space at an end)"
            }
        }
    }
}

/// Whether `id` goes back to the upstream as it came, as a `Last-Event-ID` value.
fn is_header_value(id: &str) -> bool {
    let bytes = id.as_bytes();
    let ends = [bytes.first(), bytes.last()];
    !bytes.is_empty()
        && bytes.iter().all(|&b| b >= 0x20 && b != 0x7f)
        && !ends.into_iter().flatten().any(|&b| b == b' ')
}

/// How many event ids a round remembers to tell whether one comes twice.
const MAX_IDS_COMPARED: usize = 128;

/// The most server requests one round settles without asking the client (each cancelled,
/// refused or answered from a known answer is remembered, so that a replay does not ask
/// it): a server past it, sending request after request that never reaches the client
/// and so never fills the round, fails the round.
const MAX_SETTLED: usize = 1024;

impl Round {
    pub fn new(
        call_id: UpstreamId,
        capabilities: Map<String, Value>,
        relay: Relay,
        last_event_id: Option<String>,
    ) -> Round {
        Round {
            call_id,
            capabilities,
            relay,
            input_requests: Map::new(),
            pending: Vec::new(),
            previous_event_id: last_event_id.clone(),
            round_start: None,
            last_event_id,
            answered: Vec::new(),
            settled: 0,
            restartable: false,
            known: Vec::new(),
            limits: RoundLimits::default(),
            question_bytes: 0,
            session_last_event_id: None,
            session_previous_event_id: None,
            session_round_start: None,
            call_asked: false,
            session_asked: false,
            read_since_asked: ReadBefore::default(),
            seen_ids: Vec::new(),
            ids_unusable: None,
        }
    }

    /// Starts the session GET stream's position at `id` (a resumed round's).
    pub fn session_from(mut self, id: Option<String>) -> Round {
        self.session_previous_event_id = id.clone();
        self.session_last_event_id = id;
        self
    }

    /// Records the id of an event read on the session's GET stream.
    pub fn saw_session_event(&mut self, id: &str) {
        self.note_id(id);
        self.session_previous_event_id = self.session_last_event_id.replace(id.to_string());
    }

    /// Where a retry resumes the session's GET stream: before this round's first question
    /// on it, so that a question left unanswered is sent again, else after its last event.
    pub fn session_resume_from(&self) -> Option<&str> {
        self.session_round_start
            .as_deref()
            .or(self.session_last_event_id.as_deref())
    }

    /// Feeds one message read on the session's GET stream (after `saw_session_event`).
    pub fn on_session_message(&mut self, message: Value) -> Vec<Action> {
        self.on_message_from(message, Origin::Session)
    }

    /// Whether resuming the session's GET stream from `session_resume_from` sends its
    /// questions of this round again: it sent an event before the first.
    pub fn session_replayable(&self) -> bool {
        self.session_round_start.is_some()
    }

    /// Bounds this round by `limits` rather than the defaults.
    pub fn bounded(mut self, limits: RoundLimits) -> Round {
        self.limits = limits;
        self
    }

    /// Whether the round holds as many questions as it may: it ends now, and what the
    /// upstream sends next belongs to the next round.
    pub fn is_full(&self) -> bool {
        self.input_requests.len() >= self.limits.max_questions
    }

    /// Makes this a restartable tool's round, with the answers known so far.
    pub fn restartable(mut self, known: Vec<Known>) -> Round {
        self.restartable = true;
        self.known = known;
        self
    }

    /// The known answers, with those given in this run marked used.
    pub fn known(&self) -> &[Known] {
        &self.known
    }

    /// Ignores these server requests if a replayed stream sends them again.
    pub fn skip(&mut self, answered: impl IntoIterator<Item = UpstreamId>) {
        self.answered.extend(answered);
    }

    /// Records the id of an event read on the call's own stream (including priming events).
    pub fn saw_call_event(&mut self, id: &str) {
        self.note_id(id);
        self.previous_event_id = self.last_event_id.replace(id.to_string());
    }

    /// Counts an event carrying a message, with an id, read on the call's stream (after
    /// the message, if any, was fed): from the stream's first question on.
    pub fn saw_call_message(&mut self) {
        if self.call_asked {
            self.read_since_asked.call = self.read_since_asked.call.saturating_add(1);
        }
    }

    /// As `saw_call_message`, on the session's GET stream.
    pub fn saw_session_message(&mut self) {
        if self.session_asked {
            self.read_since_asked.session = self.read_since_asked.session.saturating_add(1);
        }
    }

    /// How many events carrying a message each stream sent from its first question of
    /// the round on: what a resumption from `round_start` (or the GET stream's) replays
    /// that this round read.
    pub fn read_before(&self) -> ReadBefore {
        self.read_since_asked
    }

    /// The call-stream position just before this round's first question: replaying from
    /// here asks every question of the round again.
    pub fn round_start(&self) -> Option<&str> {
        self.round_start.as_deref()
    }

    pub fn last_event_id(&self) -> Option<&str> {
        self.last_event_id.as_deref()
    }

    /// Records an event id of either stream (bounded), and whether it came before.
    fn note_id(&mut self, id: &str) {
        let digest = BuildHasherDefault::<DefaultHasher>::default().hash_one(id);
        if !is_header_value(id) {
            self.ids_unusable.get_or_insert(UnusableIds::NotAHeader);
        }
        if self.seen_ids.contains(&digest) {
            self.ids_unusable.get_or_insert(UnusableIds::Repeated);
        }
        if self.seen_ids.len() < MAX_IDS_COMPARED {
            self.seen_ids.push(digest);
        }
    }

    /// Why this round's event ids cannot resume its call, if one showed it. An id that
    /// came twice, on one stream or on both, names no one event: a `Last-Event-ID`
    /// resumption by it may replay another stream, or events already answered, and the
    /// call's result may never be seen (rmcp, the Rust SDK, opens every stream with an
    /// event whose id is `0`, numbers the GET stream's messages from `0` too, and
    /// resolves `0` to the GET stream). One that is no header value cannot be sent back.
    pub fn event_ids_unusable(&self) -> Option<UnusableIds> {
        self.ids_unusable
    }

    pub fn has_questions(&self) -> bool {
        !self.pending.is_empty()
    }

    /// How many input requests this round's `InputRequiredResult` carries.
    pub fn question_count(&self) -> usize {
        self.input_requests.len()
    }

    pub fn pending(&self) -> &[Pending] {
        &self.pending
    }

    /// This round's input requests by key, as the client gets them.
    pub fn input_requests(&self) -> &Map<String, Value> {
        &self.input_requests
    }

    /// Asks again a question of an earlier round that the client left unanswered: the
    /// upstream still waits for it and will not send it again (a held flow's stream is
    /// read on, not replayed). A retry declares its capabilities anew: one that no longer
    /// declares what the question needs is not asked it, and hears which capability
    /// (`Err`, as `requiredCapabilities`), as a question arriving now would.
    pub fn ask_again(&mut self, pending: Pending, request: Value) -> Result<(), Value> {
        let method = request["method"].as_str().unwrap_or_default();
        let params = &request["params"];
        if !declared(&self.capabilities, method, params) {
            return Err(required_capability(method, params));
        }
        if self
            .pending
            .iter()
            .any(|p| p.upstream_id == pending.upstream_id)
        {
            return Ok(());
        }
        self.input_requests.insert(pending.key.clone(), request);
        self.pending.push(pending);
        Ok(())
    }

    /// Feeds one upstream JSON-RPC message read on the call's stream (after
    /// `saw_call_event`), or the call's response.
    pub fn on_message(&mut self, message: Value) -> Vec<Action> {
        self.on_message_from(message, Origin::Call)
    }

    fn on_message_from(&mut self, message: Value, origin: Origin) -> Vec<Action> {
        // A batch (2025-03-26 let servers send one): each message in turn.
        let message = match message {
            Value::Array(batch) => {
                let mut actions = Vec::new();
                for message in batch.into_iter().filter(|m| !m.is_array()) {
                    actions.extend(self.on_message_from(message, origin));
                }
                return actions;
            }
            message => message,
        };
        let method = message
            .get("method")
            .and_then(Value::as_str)
            .map(str::to_string);
        match (method, message.get("id").cloned()) {
            (Some(method), Some(id)) => self.on_request(
                &method,
                id,
                message.get("params").cloned().unwrap_or(json!({})),
                origin,
            ),
            (Some(method), None) => self.on_notification(&method, message),
            (None, Some(id)) if UpstreamId::from_json(&id).as_ref() == Some(&self.call_id) => {
                vec![Action::Complete(message)]
            }
            _ => Vec::new(),
        }
    }

    /// Records a question about to join `pending`: the first on each stream fixes the
    /// position a retry replays that stream from to ask the round's questions again.
    fn mark_round_start(&mut self, origin: Origin) {
        match origin {
            Origin::Call if !self.call_asked => {
                self.call_asked = true;
                self.round_start = self.previous_event_id.clone();
            }
            Origin::Call => {}
            Origin::Session if !self.session_asked => {
                self.session_asked = true;
                self.session_round_start = self.session_previous_event_id.clone();
            }
            Origin::Session => {}
        }
    }

    fn on_notification(&mut self, method: &str, message: Value) -> Vec<Action> {
        match method {
            "notifications/progress" => self.on_progress(message),
            "notifications/cancelled" => self.on_cancelled(&message).into_iter().collect(),
            "notifications/message" if self.relay.wants_log(&message) => {
                vec![Action::Notify(message)]
            }
            _ => Vec::new(),
        }
    }

    /// The server cancelled a request of its own: a question of the round still to be
    /// asked is not asked, and never answered (2025-11-25: a cancelled request gets no
    /// response); the same request replayed later is not asked again.
    fn on_cancelled(&mut self, message: &Value) -> Option<Action> {
        let cancelled = message["params"].get("requestId");
        let id = cancelled.and_then(UpstreamId::from_json)?;
        let at = self.pending.iter().position(|p| p.upstream_id == id)?;
        let question = self.pending.remove(at);
        if let Some(request) = self.input_requests.remove(&question.key) {
            let bytes = question.key.len() + jsonrpc::text_len(&request);
            self.question_bytes = self.question_bytes.saturating_sub(bytes);
        }
        self.settle(id)
    }

    /// Remembers a server request settled without asking the client; past `MAX_SETTLED`
    /// in the round, the round fails.
    fn settle(&mut self, id: UpstreamId) -> Option<Action> {
        self.answered.push(id);
        self.settled += 1;
        (self.settled > MAX_SETTLED).then(|| {
            Action::Fail(format!(
                "the server sent more than {MAX_SETTLED} requests in one round that were cancelled or refused without reaching the client"
            ))
        })
    }

    /// The call's progress (the call went up with its own id as the progress token, so
    /// that every round can ask for it) goes to the client under this round's token.
    /// Progress on any other token is not the call's.
    fn on_progress(&self, mut message: Value) -> Vec<Action> {
        let Some(token) = &self.relay.progress_token else {
            return Vec::new();
        };
        let Some(theirs) = message["params"].get_mut("progressToken") else {
            return Vec::new();
        };
        if UpstreamId::from_json(theirs).as_ref() != Some(&self.call_id) {
            return Vec::new();
        }
        *theirs = token.clone();
        vec![Action::Notify(message)]
    }

    fn on_request(
        &mut self,
        method: &str,
        id: Value,
        mut params: Value,
        origin: Origin,
    ) -> Vec<Action> {
        let refuse = |code: i64, text: &str| {
            Action::AnswerUpstream(
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": text}}),
            )
        };
        match method {
            "ping" => {
                return vec![Action::AnswerUpstream(
                    json!({"jsonrpc": "2.0", "id": id, "result": {}}),
                )]
            }
            "elicitation/create" | "sampling/createMessage" | "roots/list" => {}
            _ => {
                return vec![refuse(
                    -32601,
                    "the client cannot take this request through the gateway",
                )]
            }
        }
        let upstream_id = match carried_id(&id) {
            Ok(upstream_id) => upstream_id,
            Err(why) => {
                let reason = format!("the server sent {method} with {why}");
                return vec![refuse(code::INVALID_REQUEST, &reason), Action::Fail(reason)];
            }
        };
        if self.answered.contains(&upstream_id) {
            return Vec::new();
        }
        if let Some(asked) = self.pending.iter().find(|p| p.upstream_id == upstream_id) {
            // The same request delivered again (a replay, or both streams) is ignored; a
            // different one under an id still unanswered could not be answered apart.
            if self.is_asked_as(&asked.key, method, &params) {
                return Vec::new();
            }
            let reason = format!(
                "the server sent {method} with id {id} while its request of that id was unanswered"
            );
            return vec![refuse(code::INVALID_REQUEST, &reason), Action::Fail(reason)];
        }
        if !declared(&self.capabilities, method, &params) {
            return vec![
                refuse(-32601, "the client did not declare this capability"),
                Action::MissingCapability {
                    method: method.to_string(),
                    required: required_capability(method, &params),
                },
            ];
        }
        if let Some(problem) = malformed_question(method, &params) {
            // Refused as the client would refuse it, once; the tool may go on without.
            let refused = refuse(code::INVALID_PARAMS, &problem);
            return [Some(refused), self.settle(upstream_id)]
                .into_iter()
                .flatten()
                .collect();
        }
        let fingerprint = self.restartable.then(|| fingerprint(method, &params));
        if let Some(answer) = fingerprint.and_then(|fp| self.known_answer(fp)) {
            let answer = json!({"jsonrpc": "2.0", "id": id, "result": answer});
            let answered = Action::AnswerUpstream(answer);
            return [Some(answered), self.settle(upstream_id)]
                .into_iter()
                .flatten()
                .collect();
        }
        let key = self.key_for(method, &upstream_id, &mut params);
        strip_legacy_fields(&mut params);
        let request = json!({"method": method, "params": params});
        let bytes = key.len() + jsonrpc::text_len(&request);
        if self.question_bytes + bytes > self.limits.max_bytes {
            return vec![Action::Fail(format!(
                "the server's questions in one round take more than {} bytes, the limit (limits.max_input_requests_bytes)",
                self.limits.max_bytes
            ))];
        }
        self.question_bytes += bytes;
        self.input_requests.insert(key.clone(), request);
        self.mark_round_start(origin);
        self.pending.push(Pending {
            key,
            upstream_id,
            fingerprint,
            asked: Asked {
                kind: QuestionKind::of(method),
                on_session: origin == Origin::Session,
            },
        });
        Vec::new()
    }

    /// Whether the request asked under `key` is `method` with `params`, told as a
    /// restartable tool's questions are (`_meta` and the per-run `elicitationId` aside);
    /// one no longer in the round's requests is taken to be.
    fn is_asked_as(&self, key: &str, method: &str, params: &Value) -> bool {
        let Some(asked) = self.input_requests.get(key) else {
            return true;
        };
        let mut params = params.clone();
        strip_legacy_fields(&mut params);
        let asked_method = asked["method"].as_str().unwrap_or_default();
        fingerprint(asked_method, &asked["params"]) == fingerprint(method, &params)
    }

    /// The first known answer to a request with this fingerprint not yet given in this
    /// run, marked given.
    fn known_answer(&mut self, fingerprint: u64) -> Option<Value> {
        let known = self
            .known
            .iter_mut()
            .find(|k| !k.used && k.fingerprint == fingerprint)?;
        let answer = serde_json::from_str(&known.answer).ok()?;
        known.used = true;
        Some(answer)
    }

    /// The hint the server gave, when usable and unique; else `KIND_ID`. Unique within the
    /// round: a key already taken (ids `7` and `"7"`, or a hint `elicitation_7` next to id
    /// 7) gets the first free suffix `_2`, `_3`, …, so no question hides another.
    fn key_for(&self, method: &str, id: &UpstreamId, params: &mut Value) -> String {
        let hint = params
            .get_mut("_meta")
            .and_then(Value::as_object_mut)
            .and_then(|meta| meta.remove(INPUT_KEY_HINT))
            .and_then(|v| v.as_str().map(str::to_string))
            .filter(|k| {
                !k.is_empty() && k.len() <= MAX_KEY_LEN && !self.input_requests.contains_key(k)
            });
        let key = hint.unwrap_or_else(|| match id {
            UpstreamId::Number(n) => format!("{}_{n}", short_kind(method)),
            UpstreamId::Text(t) => format!("{}_{t}", short_kind(method)),
        });
        if !self.input_requests.contains_key(&key) {
            return key;
        }
        (2..)
            .map(|n| format!("{key}_{n}"))
            .find(|k| !self.input_requests.contains_key(k))
            .expect("a round holds finitely many keys")
    }

    /// The 2025-11-25 error a server answers when the user must first visit URLs.
    pub const URL_ELICITATION_REQUIRED: i64 = -32042;

    /// Takes a 2025-11-25 URL-elicitation-required error (-32042) ending the call as
    /// URL-mode input requests (`url_0`, `url_1`, …), which 2026-07-28 asks for instead.
    /// Nothing is pending upstream: the call ended, and the retry re-issues it. Returns
    /// false when `response` is not such an error, or names no usable elicitation.
    pub fn absorb_url_required(&mut self, response: &Value) -> bool {
        let error = &response["error"];
        if error["code"].as_i64() != Some(Self::URL_ELICITATION_REQUIRED) {
            return false;
        }
        let Some(elicitations) = error["data"]["elicitations"].as_array() else {
            return false;
        };
        let mut absorbed = false;
        for (i, e) in elicitations.iter().enumerate() {
            let (Some(url), Some(message)) = (e["url"].as_str(), e["message"].as_str()) else {
                continue;
            };
            let params = json!({"mode": "url", "url": url, "message": message});
            self.input_requests.insert(
                format!("url_{i}"),
                json!({"method": "elicitation/create", "params": params}),
            );
            absorbed = true;
        }
        absorbed
    }

    /// Whether the client declared URL-mode elicitation.
    pub fn accepts_url_elicitation(&self) -> bool {
        declared(
            &self.capabilities,
            "elicitation/create",
            &json!({"mode": "url"}),
        )
    }

    /// The `InputRequiredResult` for the questions gathered so far; with none (a round
    /// handed over while draining) it carries only the state, which the client retries.
    pub fn input_required(&self, request_state: String) -> Value {
        let mut result = json!({"resultType": "input_required", "requestState": request_state});
        if !self.input_requests.is_empty() {
            result["inputRequests"] = json!(self.input_requests);
        }
        result
    }
}

/// The id of a server request as the gateway carries it: an integer in i64 or a string
/// of at most `MAX_SERVER_ID_BYTES`; `Err` says what else it was.
fn carried_id(id: &Value) -> Result<UpstreamId, String> {
    match UpstreamId::from_json(id) {
        Some(UpstreamId::Text(t)) if t.len() > MAX_SERVER_ID_BYTES => Err(format!(
            "a request id of {} bytes, above the {MAX_SERVER_ID_BYTES} the gateway carries",
            t.len()
        )),
        Some(carried) => Ok(carried),
        None => {
            let mut shown = id.to_string();
            if shown.len() > 40 {
                shown.truncate(shown.floor_char_boundary(40));
                shown.push('…');
            }
            Err(format!(
                "the request id {shown}, which is neither an integer (i64) nor a string"
            ))
        }
    }
}

/// Removes what a 2026-07-28 input request may not carry: the legacy progress token and an
/// empty `_meta`, the task augmentation, and a URL elicitation's `elicitationId`.
fn strip_legacy_fields(params: &mut Value) {
    let Some(p) = params.as_object_mut() else {
        return;
    };
    p.remove("task");
    p.remove("elicitationId");
    if let Some(meta) = p.get_mut("_meta").and_then(Value::as_object_mut) {
        meta.remove("progressToken");
        if meta.is_empty() {
            p.remove("_meta");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn round(capabilities: Value) -> Round {
        Round::new(
            UpstreamId::Number(1),
            caps(capabilities),
            Relay::default(),
            None,
        )
    }

    fn elicit(id: i64, extra_meta: Value) -> Value {
        json!({"jsonrpc": "2.0", "id": id, "method": "elicitation/create",
               "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}, "_meta": extra_meta}})
    }

    #[test]
    fn a_restartable_round_answers_a_known_question_once_and_asks_the_rest() {
        let asked = elicit(4, json!({}));
        let fp = fingerprint("elicitation/create", &asked["params"]);
        let known = vec![Known {
            fingerprint: fp,
            answer: json!({"action": "accept", "content": {"name": "Ada"}}).to_string(),
            used: false,
        }];
        let mut r = round(json!({"elicitation": {}})).restartable(known);
        // Another run's request id and `_meta` do not change the fingerprint.
        let actions = r.on_message(elicit(7, json!({"progressToken": 9})));
        assert_eq!(
            actions,
            vec![Action::AnswerUpstream(
                json!({"jsonrpc": "2.0", "id": 7, "result": {"action": "accept", "content": {"name": "Ada"}}})
            )]
        );
        assert!(r.known()[0].used);
        // The same question again is new: it goes to the client, fingerprinted.
        assert!(r.on_message(elicit(8, json!({}))).is_empty());
        assert_eq!(r.pending()[0].fingerprint, Some(fp));
        // A round of a tool that is not restartable fingerprints nothing.
        let mut plain = round(json!({"elicitation": {}}));
        plain.on_message(elicit(1, json!({})));
        assert_eq!(plain.pending()[0].fingerprint, None);
    }

    #[test]
    fn server_requests_become_input_requests_with_stable_keys() {
        let mut r = round(json!({"elicitation": {}, "sampling": {}, "roots": {}}));
        assert!(r
            .on_message(elicit(0, json!({"progressToken": 3})))
            .is_empty());
        let sampling = json!({"jsonrpc": "2.0", "id": "s-1", "method": "sampling/createMessage", "params": {"messages": [], "maxTokens": 5}});
        assert!(r.on_message(sampling).is_empty());
        assert!(r
            .on_message(json!({"jsonrpc": "2.0", "id": 2, "method": "roots/list"}))
            .is_empty());
        let result = r.input_required("STATE".into());
        let requests = result["inputRequests"].as_object().unwrap();
        assert_eq!(
            requests.keys().collect::<Vec<_>>(),
            ["elicitation_0", "roots_2", "sampling_s-1"]
        );
        assert_eq!(
            requests["elicitation_0"]["params"],
            json!({"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}})
        );
        assert!(
            requests["elicitation_0"].get("jsonrpc").is_none()
                && requests["elicitation_0"].get("id").is_none()
        );
        assert_eq!(result["resultType"], "input_required");
        assert_eq!(result["requestState"], "STATE");
        assert_eq!(r.pending()[1].upstream_id, UpstreamId::Text("s-1".into()));
    }

    #[test]
    fn a_round_without_questions_yields_a_state_only_result() {
        let r = round(json!({"elicitation": {}}));
        assert_eq!(
            r.input_required("s".into()),
            json!({"resultType": "input_required", "requestState": "s"})
        );
    }

    #[test]
    fn a_key_hint_names_the_input_and_is_stripped() {
        let mut r = round(json!({"elicitation": {}}));
        r.on_message(elicit(4, json!({INPUT_KEY_HINT: "user_name"})));
        r.on_message(elicit(5, json!({INPUT_KEY_HINT: "user_name"})));
        let result = r.input_required(String::new());
        let requests = result["inputRequests"].as_object().unwrap();
        assert_eq!(
            requests.keys().collect::<Vec<_>>(),
            ["elicitation_5", "user_name"],
            "a duplicate hint falls back"
        );
        assert!(requests["user_name"]["params"].get("_meta").is_none());
    }

    #[test]
    fn ping_undeclared_and_unknown_requests_are_answered_upstream() {
        let mut r = round(json!({"sampling": {}}));
        let ping = r.on_message(json!({"jsonrpc": "2.0", "id": 9, "method": "ping"}));
        assert_eq!(
            ping,
            vec![Action::AnswerUpstream(
                json!({"jsonrpc": "2.0", "id": 9, "result": {}})
            )]
        );
        let actions = r.on_message(elicit(1, json!({})));
        assert!(matches!(&actions[0], Action::AnswerUpstream(a) if a["error"]["code"] == -32601));
        assert_eq!(
            actions[1],
            Action::MissingCapability {
                method: "elicitation/create".into(),
                required: json!({"elicitation": {"form": {}}})
            }
        );
        let url = json!({"jsonrpc": "2.0", "id": 2, "method": "elicitation/create", "params": {"mode": "url", "url": "https://x", "message": "m", "elicitationId": "e"}});
        let mut form_only = round(json!({"elicitation": {}}));
        assert!(
            matches!(&form_only.on_message(url)[1], Action::MissingCapability { required, .. } if required == &json!({"elicitation": {"url": {}}}))
        );
        let custom = r
            .on_message(json!({"jsonrpc": "2.0", "id": 3, "method": "tasks/result", "params": {}}));
        assert!(matches!(&custom[..], [Action::AnswerUpstream(a)] if a["error"]["code"] == -32601));
        assert!(!r.has_questions());
    }

    /// Form mode needs `elicitation` naming no mode or naming `form`; a sampling request
    /// offering tools needs `sampling.tools` (2025-11-25).
    #[test]
    fn sub_capabilities_are_checked_where_the_request_needs_them() {
        let missing = |caps: Value, message: Value| {
            let actions = round(caps).on_message(message);
            actions.iter().find_map(|a| match a {
                Action::MissingCapability { required, .. } => Some(required.clone()),
                _ => None,
            })
        };
        let form = elicit(1, json!({}));
        assert_eq!(missing(json!({"elicitation": {}}), form.clone()), None);
        assert_eq!(
            missing(json!({"elicitation": {"form": {}}}), form.clone()),
            None
        );
        assert_eq!(
            missing(json!({"elicitation": {"url": {}}}), form),
            Some(json!({"elicitation": {"form": {}}}))
        );
        let sample = |params: Value| json!({"jsonrpc": "2.0", "id": 2, "method": "sampling/createMessage", "params": params});
        let plain = sample(json!({"messages": [], "maxTokens": 10}));
        let tools = sample(json!({"messages": [], "maxTokens": 10, "tools": [{"name": "t"}]}));
        let choice =
            sample(json!({"messages": [], "maxTokens": 10, "toolChoice": {"mode": "auto"}}));
        assert_eq!(missing(json!({"sampling": {}}), plain), None);
        for offered in [tools.clone(), choice] {
            assert_eq!(
                missing(json!({"sampling": {}}), offered),
                Some(json!({"sampling": {"tools": {}}}))
            );
        }
        assert_eq!(missing(json!({"sampling": {"tools": {}}}), tools), None);
        // Declared by an object only: null or false declares nothing.
        let form = elicit(1, json!({}));
        for nothing in [
            json!({"elicitation": null}),
            json!({"elicitation": false}),
            json!({"elicitation": {"form": null}}),
        ] {
            assert!(
                missing(nothing.clone(), form.clone()).is_some(),
                "{nothing}"
            );
        }
        assert!(missing(json!({"sampling": null}), plain_sample()).is_some());
        assert!(missing(json!({"sampling": false}), plain_sample()).is_some());
    }

    fn plain_sample() -> Value {
        json!({"jsonrpc": "2.0", "id": 2, "method": "sampling/createMessage",
            "params": {"messages": [], "maxTokens": 10}})
    }

    /// A 2025-03-26 server may send a batch: its questions are asked and its answer taken
    /// as if sent one by one (a batch within a batch is not JSON-RPC, and is ignored).
    #[test]
    fn a_batch_from_the_server_is_read_message_by_message() {
        let mut r = round(json!({"elicitation": {}}));
        let batch = json!([
            elicit(1, json!({})),
            elicit(2, json!({})),
            [elicit(3, json!({}))]
        ]);
        assert!(r.on_message(batch).is_empty());
        assert_eq!(r.question_count(), 2);
        let log = json!({"jsonrpc": "2.0", "method": "notifications/message",
            "params": {"level": "info", "data": "x"}});
        let done = json!({"jsonrpc": "2.0", "id": 1, "result": {"content": []}});
        let actions = round(json!({})).on_message(json!([log, done.clone()]));
        assert_eq!(actions, [Action::Complete(done)]);
    }

    /// A question its schema would refuse is refused upstream (-32602 naming what it
    /// lacks) and not asked: the client could not show it.
    #[test]
    fn a_malformed_question_is_refused_upstream_not_asked() {
        let caps = json!({"elicitation": {"form": {}, "url": {}}, "sampling": {}});
        let ask = |method: &str, params: Value| {
            let mut r = round(caps.clone());
            let message = json!({"jsonrpc": "2.0", "id": 4, "method": method, "params": params});
            (r.on_message(message), r.question_count())
        };
        for (method, params, lacks) in [
            ("elicitation/create", json!({}), "params.message"),
            (
                "elicitation/create",
                json!({"message": "m"}),
                "params.requestedSchema",
            ),
            (
                "elicitation/create",
                json!({"mode": "url", "message": "m"}),
                "params.url",
            ),
            (
                "sampling/createMessage",
                json!({"messages": []}),
                "params.maxTokens",
            ),
            (
                "sampling/createMessage",
                json!({"maxTokens": 5}),
                "params.messages",
            ),
        ] {
            let (actions, asked) = ask(method, params);
            assert_eq!(asked, 0, "{method}: asked");
            let [Action::AnswerUpstream(refusal)] = &actions[..] else {
                panic!("{method}: {actions:?}");
            };
            assert_eq!(refusal["error"]["code"], -32602);
            let text = refusal["error"]["message"].as_str().unwrap_or_default();
            assert!(text.contains(lacks), "{text}");
        }
        let sampling = json!({"messages": [], "maxTokens": 5});
        assert_eq!(ask("sampling/createMessage", sampling), (vec![], 1));
        assert_eq!(
            ask("roots/list", json!({})).1,
            0,
            "roots: not declared here"
        );
    }

    #[test]
    fn a_question_the_server_cancels_is_not_asked_nor_asked_again() {
        let mut r = round(json!({"elicitation": {}}));
        let cancel = |id: i64| {
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": id, "reason": "no longer needed"}})
        };
        assert!(r.on_message(elicit(1, json!({}))).is_empty());
        assert!(r.on_message(cancel(1)).is_empty());
        assert!(r.on_message(elicit(2, json!({}))).is_empty());
        assert!(
            r.on_message(cancel(99)).is_empty(),
            "not a question of the round"
        );
        assert_eq!(r.question_count(), 1);
        let ids: Vec<_> = r.pending().iter().map(|p| p.upstream_id.clone()).collect();
        assert_eq!(ids, [UpstreamId::Number(2)]);
        assert!(r.on_message(elicit(1, json!({}))).is_empty(), "replayed");
        assert_eq!(
            r.question_count(),
            1,
            "a cancelled request is not asked again"
        );
    }

    /// A server that asks and cancels, request after request, never fills the round nor
    /// lets it end quiet: past `MAX_SETTLED` such requests the round fails, rather than
    /// remembering each until the flow's deadline.
    #[test]
    fn a_server_cancelling_request_after_request_fails_the_round() {
        let mut r = round(json!({"elicitation": {}}));
        let cancel = |id: usize| {
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": id}})
        };
        for id in 1..=MAX_SETTLED {
            assert!(r.on_message(elicit(id as i64, json!({}))).is_empty());
            assert!(r.on_message(cancel(id)).is_empty(), "{id}");
        }
        assert!(r.on_message(elicit(0, json!({}))).is_empty());
        let failed = r.on_message(cancel(0));
        assert!(
            matches!(&failed[..], [Action::Fail(why)] if why.contains("cancelled or refused")),
            "{failed:?}"
        );
    }

    fn relaying(relay: Relay) -> Round {
        Round::new(UpstreamId::Number(1), Map::new(), relay, None)
    }

    #[test]
    fn progress_goes_to_the_rounds_own_token() {
        let progress = |token: Value| json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": token, "progress": 2, "total": 3}});
        let mut r = relaying(Relay {
            progress_token: Some(json!("retry-7")),
            ..Relay::default()
        });
        assert_eq!(
            r.on_message(progress(json!(1))),
            vec![Action::Notify(progress(json!("retry-7")))],
            "the call's progress (its id is its token upstream), under this round's token"
        );
        assert!(
            r.on_message(progress(json!("first-token"))).is_empty(),
            "progress on another token is not the call's"
        );
        assert!(r.on_message(progress(json!(2))).is_empty());
        let tokenless = json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}});
        assert!(r.on_message(tokenless).is_empty());
    }

    #[test]
    fn logs_at_or_above_the_requested_level() {
        let log = |level: &str| json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": level, "data": "x"}});
        let mut r = relaying(Relay {
            log_level: Some(LogLevel::Warning),
            ..Relay::default()
        });
        for below in ["debug", "info", "notice"] {
            assert!(
                r.on_message(log(below)).is_empty(),
                "{below} is below warning"
            );
        }
        for at_or_above in [
            "warning",
            "error",
            "critical",
            "alert",
            "emergency",
            "verbose",
        ] {
            assert_eq!(
                r.on_message(log(at_or_above)),
                vec![Action::Notify(log(at_or_above))],
                "{at_or_above}: at or above warning, or not a level to judge"
            );
        }
    }

    #[test]
    fn notifications_and_the_final_response() {
        let mut quiet = round(json!({}));
        let progress = |token: Value| json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": token, "progress": 1}});
        assert!(
            quiet.on_message(progress(json!(1))).is_empty(),
            "progress needs the request's own token"
        );
        let log = json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "x"}});
        assert!(
            quiet.on_message(log.clone()).is_empty(),
            "logs need the logLevel opt-in"
        );
        let mut verbose = relaying(Relay {
            log_level: Some(LogLevel::Info),
            ..Relay::default()
        });
        assert_eq!(verbose.on_message(log.clone()), vec![Action::Notify(log)]);
        assert!(quiet
            .on_message(json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}))
            .is_empty());
        let other = json!({"jsonrpc": "2.0", "id": 7, "result": {}});
        assert!(
            quiet.on_message(other).is_empty(),
            "only the call's own response completes it"
        );
        let done = json!({"jsonrpc": "2.0", "id": 1, "result": {"content": []}});
        assert_eq!(quiet.on_message(done.clone()), vec![Action::Complete(done)]);
    }

    #[test]
    fn a_replayed_round_asks_only_what_was_not_answered() {
        let mut first = round(json!({"elicitation": {}}));
        first.saw_call_event("s-0");
        first.saw_call_event("s-1");
        first.on_message(elicit(0, json!({})));
        first.saw_call_event("s-2");
        first.on_message(elicit(1, json!({})));
        assert_eq!(
            first.round_start(),
            Some("s-0"),
            "the position before the first question"
        );
        let mut replay = round(json!({"elicitation": {}}));
        replay.skip([UpstreamId::Number(0)]);
        replay.on_message(elicit(0, json!({})));
        replay.on_message(elicit(1, json!({})));
        replay.on_message(elicit(1, json!({})));
        let result = replay.input_required(String::new());
        assert_eq!(
            result["inputRequests"]
                .as_object()
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            ["elicitation_1"]
        );
    }

    #[test]
    fn a_url_elicitation_required_error_becomes_url_input_requests() {
        let mut r = round(json!({"elicitation": {"url": {}}}));
        assert!(r.accepts_url_elicitation());
        let error = json!({"jsonrpc": "2.0", "id": 1, "error": {"code": -32042, "message": "needs auth", "data": {"elicitations": [
            {"mode": "url", "elicitationId": "e1", "url": "https://example.com/a", "message": "Open A"},
            {"mode": "url", "url": "https://example.com/b"}]}}});
        assert!(r.absorb_url_required(&error));
        let result = r.input_required("S".into());
        assert_eq!(
            result["inputRequests"],
            json!({"url_0": {"method": "elicitation/create", "params": {"mode": "url", "url": "https://example.com/a", "message": "Open A"}}})
        );
        assert!(!r.has_questions(), "nothing waits upstream");
        let other = json!({"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "x"}});
        assert!(!round(json!({})).absorb_url_required(&other));
        assert!(!round(json!({"elicitation": {}})).accepts_url_elicitation());
    }

    #[test]
    fn url_elicitations_lose_their_legacy_id() {
        let mut r = round(json!({"elicitation": {"url": {}}}));
        r.on_message(json!({"jsonrpc": "2.0", "id": 2, "method": "elicitation/create", "params": {"mode": "url", "url": "https://x", "message": "m", "elicitationId": "e"}}));
        let result = r.input_required(String::new());
        assert_eq!(
            result["inputRequests"]["elicitation_2"]["params"],
            json!({"mode": "url", "url": "https://x", "message": "m"})
        );
    }

    #[test]
    fn colliding_ids_and_hints_get_distinct_keys() {
        let mut r = round(json!({"elicitation": {}}));
        r.on_message(elicit(7, json!({})));
        let text_seven = json!({"jsonrpc": "2.0", "id": "7", "method": "elicitation/create",
            "params": {"mode": "form", "message": "Other?", "requestedSchema": {"type": "object"}}});
        r.on_message(text_seven);
        r.on_message(elicit(8, json!({INPUT_KEY_HINT: "elicitation_7"})));
        let keys: Vec<&String> = r.pending().iter().map(|p| &p.key).collect();
        assert_eq!(keys, ["elicitation_7", "elicitation_7_2", "elicitation_8"]);
        assert_eq!(r.question_count(), 3, "every question reaches the client");
        let ids: Vec<&UpstreamId> = r.pending().iter().map(|p| &p.upstream_id).collect();
        assert_eq!(
            ids,
            [
                &UpstreamId::Number(7),
                &UpstreamId::Text("7".into()),
                &UpstreamId::Number(8)
            ],
            "each key answers its own request"
        );
        // A hint naming the key another request's id would get, before that request.
        let mut hinted_first = round(json!({"elicitation": {}}));
        hinted_first.on_message(elicit(8, json!({INPUT_KEY_HINT: "elicitation_7"})));
        hinted_first.on_message(elicit(7, json!({})));
        let keys: Vec<&String> = hinted_first.pending().iter().map(|p| &p.key).collect();
        assert_eq!(keys, ["elicitation_7", "elicitation_7_2"]);
    }

    #[test]
    fn request_ids_the_gateway_cannot_carry_are_refused_and_end_the_call() {
        let long = json!("x".repeat(MAX_SERVER_ID_BYTES + 1));
        for id in [
            json!(u64::MAX),
            json!(1.5),
            Value::Null,
            json!({"a": 1}),
            json!([1]),
            long,
        ] {
            let mut r = round(json!({"elicitation": {}}));
            let message = json!({"jsonrpc": "2.0", "id": id, "method": "elicitation/create",
                "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}});
            let actions = r.on_message(message);
            assert!(
                matches!(&actions[..], [Action::AnswerUpstream(a), Action::Fail(why)]
                    if a["id"] == id && a["error"]["code"] == -32600 && why.contains("elicitation/create")),
                "{id}: {actions:?}"
            );
            assert!(!r.has_questions(), "{id}");
        }
    }

    #[test]
    fn a_round_is_full_at_its_question_limit_and_bounded_in_bytes() {
        let limits = RoundLimits {
            max_questions: 2,
            max_bytes: 400,
        };
        let mut r = round(json!({"elicitation": {}})).bounded(limits);
        r.on_message(elicit(1, json!({})));
        assert!(!r.is_full());
        r.on_message(elicit(2, json!({})));
        assert!(r.is_full(), "the round ends as its limit is reached");

        let mut big = round(json!({"elicitation": {}})).bounded(limits);
        assert!(big.on_message(elicit(1, json!({}))).is_empty());
        let huge = json!({"jsonrpc": "2.0", "id": 2, "method": "elicitation/create",
            "params": {"mode": "form", "message": "x".repeat(400), "requestedSchema": {"type": "object"}}});
        let actions = big.on_message(huge);
        assert!(
            matches!(&actions[..], [Action::Fail(why)] if why.contains("400 bytes")),
            "{actions:?}"
        );
        assert_eq!(
            big.question_count(),
            1,
            "the question over the limit is not kept"
        );
    }

    #[test]
    fn a_request_again_under_an_unanswered_id_is_ignored_and_another_fails_the_round() {
        let mut r = round(json!({"elicitation": {}}));
        assert!(r
            .on_message(elicit(5, json!({"progressToken": 1})))
            .is_empty());
        assert_eq!(r.question_count(), 1);
        let again = r.on_message(elicit(5, json!({"progressToken": 2})));
        assert!(again.is_empty(), "the same request again: {again:?}");
        assert_eq!(r.question_count(), 1);
        let mut other = elicit(5, json!({}));
        other["params"]["message"] = json!("Age?");
        let actions = r.on_message(other);
        let refused =
            matches!(&actions[0], Action::AnswerUpstream(m) if m["error"]["code"] == -32600);
        let failed = matches!(&actions[1], Action::Fail(why) if why.contains("id 5 while"));
        assert!(refused && failed, "{actions:?}");
    }

    #[test]
    fn a_round_tells_when_an_event_id_cannot_be_sent_back() {
        for id in ["a\u{1}b", "a\tb", "", " a", "a ", "a\u{7f}"] {
            let mut r = round(json!({}));
            r.saw_call_event("c-0");
            r.saw_session_event(id);
            let unusable = r.event_ids_unusable();
            assert_eq!(unusable, Some(UnusableIds::NotAHeader), "{id:?}");
        }
        for id in ["a b", "0/0", "é-1", "~!"] {
            let mut r = round(json!({}));
            r.saw_call_event(id);
            assert_eq!(r.event_ids_unusable(), None, "{id:?}");
        }
    }

    #[test]
    fn a_round_tells_when_an_event_id_comes_twice() {
        let mut r = round(json!({}));
        r.saw_session_event("g-0");
        r.saw_call_event("c-0");
        r.saw_session_event("g-1");
        assert_eq!(r.event_ids_unusable(), None, "distinct ids");
        r.saw_call_event("g-0");
        assert_eq!(
            r.event_ids_unusable(),
            Some(UnusableIds::Repeated),
            "the call's stream repeats a GET-stream id"
        );

        let mut one_stream = round(json!({}));
        one_stream.saw_session_event("0");
        one_stream.saw_session_event("0");
        assert_eq!(one_stream.event_ids_unusable(), Some(UnusableIds::Repeated));

        let mut many = round(json!({}));
        for n in 0..MAX_IDS_COMPARED + 10 {
            many.saw_call_event(&format!("c-{n}"));
        }
        assert_eq!(many.seen_ids.len(), MAX_IDS_COMPARED, "bounded");
        assert_eq!(many.event_ids_unusable(), None);
        many.saw_session_event("c-3");
        assert_eq!(many.event_ids_unusable(), Some(UnusableIds::Repeated));
    }

    #[test]
    fn a_round_knows_where_to_resume_the_session_stream() {
        let mut r = round(json!({"elicitation": {}})).session_from(Some("g-1".into()));
        assert_eq!(r.session_resume_from(), Some("g-1"));
        r.saw_session_event("g-2");
        assert!(r
            .on_session_message(json!({"jsonrpc": "2.0", "method": "notifications/message"}))
            .is_empty());
        assert_eq!(r.session_resume_from(), Some("g-2"), "after its last event");
        r.saw_session_event("g-3");
        r.on_session_message(elicit(4, json!({})));
        r.saw_session_event("g-4");
        r.on_session_message(elicit(5, json!({})));
        assert_eq!(
            r.session_resume_from(),
            Some("g-2"),
            "before the round's first question on it, so an unanswered one comes again"
        );
        assert!(r.session_replayable());
        let on_session = r.pending().iter().map(|p| p.asked.on_session);
        assert_eq!(on_session.collect::<Vec<_>>(), [true, true]);
    }

    #[test]
    fn each_stream_starts_its_round_at_its_own_first_question() {
        let mut r = round(json!({"elicitation": {}}));
        r.saw_call_event("c-1");
        r.saw_session_event("g-1");
        r.on_session_message(elicit(4, json!({})));
        r.saw_call_event("c-2");
        r.saw_call_event("c-3");
        r.on_message(elicit(5, json!({})));
        assert_eq!(
            r.round_start(),
            Some("c-2"),
            "the call's, not the GET stream's"
        );
        assert!(
            !r.session_replayable(),
            "the GET stream's first event: no position before it"
        );
        let asked: Vec<_> = r.pending().iter().map(|p| p.asked).collect();
        let elicitation = Some(QuestionKind::Elicitation);
        assert_eq!(
            asked,
            [(elicitation, true), (elicitation, false)]
                .map(|(kind, on_session)| Asked { kind, on_session })
        );
        assert_eq!(r.session_resume_from(), Some("g-1"), "after it");
    }
}
