//! The flow driven without sockets: a scripted upstream answers each command, a virtual
//! clock advances to each timeout, and the tests walk every transition and the sequences
//! real servers produce (questions on the GET stream between rounds, an empty resumption,
//! a result between the replay and the live stream, a flood of questions).

use super::*;

const ENDPOINT: &str = "10.0.0.7:3001";

fn config() -> FlowConfig {
    let mut capabilities = Map::new();
    capabilities.insert("elicitation".into(), json!({}));
    FlowConfig {
        group: "g".into(),
        method: "tools/call".into(),
        target: "ask".into(),
        capabilities,
        relay: Default::default(),
        restartable: false,
        data_session: false,
        round_limits: RoundLimits::default(),
        max_rounds: 32,
        max_state_plaintext: 3000,
        max_state_bytes: 4096,
        kid_len: 2,
        quiet_window: Duration::from_millis(10),
        asks_at_once: true,
        poll: Duration::from_secs(2),
        answer_timeout: Duration::from_secs(60),
        silence: Duration::from_secs(45),
        silence_seconds: 45,
        keepalive: None,
        request_state_ttl_seconds: 600,
        max_flow_seconds: 1800,
        resume: ResumeMode::Auto,
        replay_refused: false,
        primes: Some(true),
        session_replay_scoped: true,
        sessions_kept_apart: Some(true),
        shedding: false,
        now_secs: 1_000_000,
        now_ms: 1_000_000_000,
        flow_id: 7,
    }
}

/// How the scripted upstream answers the commands that wait for an answer.
struct Upstream {
    session: Option<String>,
    /// The revision the sessions negotiate.
    version: Revision,
    /// The call's POST is not answered (its header withheld) until the test says so.
    answer_withheld: bool,
    /// How `OpenSession` fails, if it does.
    open_failure: Option<Failure>,
    /// Whether each `OpenSession` in turn hands a warm session (then a fresh one).
    warm: VecDeque<bool>,
    /// Whether the sessions come with their GET stream open.
    session_stream: bool,
    /// How the call's posts fail, in turn (then `call_reply`).
    call_failures: VecDeque<Failure>,
    /// Answers to `StreamGet::Open { Call }` and `StreamGet::Reopen`, in turn (then `Ok`).
    call_opens: VecDeque<Result<(), Failure>>,
    /// `StreamGet::Reopen` and `StreamGet::Open { Call }` are not answered (their GETs hang) until the
    /// test says so.
    reopen_withheld: bool,
    /// `StreamGet::Open { Session }` is not answered (its GET hangs).
    session_stream_withheld: bool,
    /// The call's reply, given the id it was posted under.
    call_reply: fn(i64) -> CallReply,
    /// Answers to `Post`, in turn (then `Ok`).
    posts: VecDeque<Result<(), Failure>>,
    watched: bool,
    held: Result<HeldAt, Refusal>,
    /// How much later than the call's resumed stream the session's stream was done.
    session_stream_lag: Duration,
    /// Whether a `Barrier` ping is answered at once (else the test answers it).
    barrier_answered: bool,
    /// Whether a retry's session stream resumes after its position (else it is fresh:
    /// the upstream refused the position).
    session_resumes: bool,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            session: Some("s1".into()),
            version: Revision::REQUESTED,
            answer_withheld: false,
            open_failure: None,
            warm: VecDeque::new(),
            session_stream: false,
            call_failures: VecDeque::new(),
            call_opens: VecDeque::new(),
            reopen_withheld: false,
            session_stream_withheld: false,
            call_reply: |_| CallReply::Stream,
            posts: VecDeque::new(),
            watched: true,
            held: Ok(HeldAt {
                owner: Some("10.0.0.1:9091".parse().unwrap()),
                slot: 42,
            }),
            session_stream_lag: Duration::ZERO,
            barrier_answered: true,
            session_resumes: true,
        }
    }
}

impl Upstream {
    fn answer(&mut self, command: &Command, now: Instant) -> Option<Input> {
        match command {
            Command::OpenSession => Some(match self.open_failure.clone() {
                Some(failure) => Input::SessionFailed(failure),
                None => Input::SessionOpened {
                    endpoint: ENDPOINT.parse().unwrap(),
                    session: self.session.clone(),
                    version: self.version,
                    warm: self.warm.pop_front().unwrap_or(false),
                    session_stream: self.session_stream,
                },
            }),
            Command::Get(StreamGet::Open {
                stream: Stream::Call,
                ..
            }) if self.reopen_withheld => None,
            Command::Get(StreamGet::Open {
                stream: Stream::Session,
                ..
            }) if self.session_stream_withheld => None,
            Command::Get(StreamGet::Open { stream, .. }) => {
                let result = match stream {
                    Stream::Call => self.call_opens.pop_front().unwrap_or(Ok(())),
                    Stream::Session => Ok(()),
                };
                Some(Input::StreamOpened {
                    stream: *stream,
                    result,
                })
            }
            Command::Get(StreamGet::Reopen { .. }) if self.reopen_withheld => None,
            Command::Get(StreamGet::Reopen { .. }) => Some(Input::Reopened {
                result: self.call_opens.pop_front().unwrap_or(Ok(())),
                call_at: now.checked_sub(self.session_stream_lag).unwrap_or(now),
                session_resumed: self.session_resumes,
            }),
            Command::PostCall { .. } if self.answer_withheld => None,
            Command::PostCall { id } => {
                Some(Input::CallPosted(match self.call_failures.pop_front() {
                    Some(failure) => Err(failure),
                    None => Ok((self.call_reply)(*id)),
                }))
            }
            Command::Post(_) | Command::CancelFirst(_) => {
                Some(Input::Posted(self.posts.pop_front().unwrap_or(Ok(()))))
            }
            Command::Watch { .. } => Some(Input::Watched(match self.watched {
                true => Ok(()),
                false => Err(Refusal::internal(Class::Overloaded, "the table is full")),
            })),
            Command::Hold { .. } => Some(Input::Held(self.held.clone())),
            Command::Barrier { .. } if self.barrier_answered => Some(Input::BarrierPassed),
            _ => None,
        }
    }
}

/// A flow, its upstream, a virtual clock and every command the flow gave.
struct Harness {
    flow: Flow,
    upstream: Upstream,
    now: Instant,
    log: Vec<Command>,
    ending: Option<Ending>,
}

impl Harness {
    fn new_call(config: FlowConfig, upstream: Upstream) -> Harness {
        let now = Instant::now();
        let mut h = Harness {
            flow: Flow::new_call(config, now),
            upstream,
            now,
            log: Vec::new(),
            ending: None,
        };
        h.settle();
        h
    }

    fn retry(
        config: FlowConfig,
        upstream: Upstream,
        state: FlowState,
        responses: Value,
        held: Option<Map<String, Value>>,
    ) -> Harness {
        let now = Instant::now();
        let responses = responses.as_object().cloned().unwrap_or_default();
        let mut h = Harness {
            flow: Flow::retry(config, state, responses, held, now),
            upstream,
            now,
            log: Vec::new(),
            ending: None,
        };
        h.settle();
        h
    }

    /// Carries out commands until the flow waits for the upstream, the client or time.
    fn settle(&mut self) {
        while let Some(command) = self.flow.poll_command() {
            if let Command::Finish(ending) = &command {
                assert!(self.ending.is_none(), "a flow finishes once");
                self.ending = Some(ending.clone());
            }
            let answer = self.upstream.answer(&command, self.now);
            self.log.push(command);
            if let Some(input) = answer {
                self.flow.handle(input, self.now);
            }
        }
    }

    fn feed(&mut self, input: Input) {
        self.flow.handle(input, self.now);
        self.settle();
    }

    fn event(&mut self, stream: Stream, id: Option<&str>, data: &Value) {
        assert!(self.flow.is_reading(), "the flow takes no events now");
        let text = match data {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        self.feed(Input::Event {
            stream,
            event: Event::message(id.map(str::to_string), text),
        });
    }

    /// Advances the clock by `by`, firing each timeout the flow asks for on the way.
    fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        while let Some(at) = self.flow.poll_timeout().filter(|at| *at <= until) {
            self.now = at.max(self.now);
            self.flow.handle_timeout(self.now);
            self.settle();
        }
        self.now = until;
    }

    /// Ends the call's stream, then advances the clock a millisecond at a time until the
    /// flow opens it again (how long that took) or finishes (`None`).
    fn end_call_stream_and_await_reopen(&mut self) -> Option<Duration> {
        let opens = |h: &Harness| {
            let call_stream = |c: &&Command| {
                matches!(
                    c,
                    Command::Get(StreamGet::Reopen { .. })
                        | Command::Get(StreamGet::Open {
                            stream: Stream::Call,
                            ..
                        })
                )
            };
            h.log.iter().filter(call_stream).count()
        };
        let before = opens(self);
        self.feed(Input::StreamEnded(Stream::Call));
        let mut waited = Duration::ZERO;
        while waited < Duration::from_secs(10) {
            if self.ending.is_some() {
                return None;
            }
            if opens(self) > before {
                return Some(waited);
            }
            self.advance(Duration::from_millis(1));
            waited += Duration::from_millis(1);
        }
        panic!("neither reopened nor finished: {:?}", self.log);
    }

    fn ending(&self) -> &Ending {
        self.ending.as_ref().expect("the flow finished")
    }

    fn posted(&self) -> Vec<Value> {
        self.log
            .iter()
            .filter_map(|c| match c {
                Command::Post(v) => Some(v.clone()),
                _ => None,
            })
            .collect()
    }

    fn position(&self, pick: impl Fn(&Command) -> bool) -> Option<usize> {
        self.log.iter().position(pick)
    }

    fn call_id(&self) -> i64 {
        self.log
            .iter()
            .rev()
            .find_map(|c| match c {
                Command::PostCall { id } => Some(*id),
                _ => None,
            })
            .expect("a call was posted")
    }

    fn state(&self) -> FlowState {
        match self.ending() {
            Ending::InputRequired { state, .. } => (**state).clone(),
            other => panic!("no state: {other:?}"),
        }
    }

    fn refusal(&self) -> &Refusal {
        match self.ending() {
            Ending::Refused(r) => r,
            other => panic!("not refused: {other:?}"),
        }
    }
}

fn question(id: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "elicitation/create",
           "params": {"mode": "form", "message": message, "requestedSchema": {"type": "object"}}})
}

fn result(id: i64, text: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": {"content": [{"type": "text", "text": text}]}})
}

fn accept(name: &str) -> Value {
    json!({"action": "accept", "content": {"name": name}})
}

/// Whether a command opens `stream` after `after`: alone, or in a retry's `Reopen`.
fn is_open(stream: Stream, after: Option<&str>) -> impl Fn(&Command) -> bool + '_ {
    move |c| match c {
        Command::Get(StreamGet::Open {
            stream: s,
            after: a,
        }) => *s == stream && a.as_deref() == after,
        Command::Get(StreamGet::Reopen {
            after: a,
            session_after,
        }) => match stream {
            Stream::Call => Some(a.as_str()) == after,
            Stream::Session => session_after.as_deref() == after,
        },
        _ => false,
    }
}

/// A first round that asked two questions (ids 0 and 1) on the call's stream, events `c2`
/// and `c3`.
fn two_questions_round() -> Harness {
    let mut h = Harness::new_call(config(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
    h.event(Stream::Call, Some("c3"), &question(1, "Size?"));
    h.advance(Duration::from_millis(10));
    h
}

/// A first round (`with_logs`) that asked a question (id 0) on the call's stream, event
/// `c2`, and one (id 1) on the session's GET stream between a log message and a ping:
/// `g1` log "hello", `g2` question, `g3` log "first", `g4` ping (id 9).
fn get_stream_round() -> Harness {
    let mut h = Harness::new_call(with_logs(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
    h.event(Stream::Session, Some("g1"), &log("hello"));
    h.event(Stream::Session, Some("g2"), &question(1, "Size?"));
    h.event(Stream::Session, Some("g3"), &log("first"));
    h.event(Stream::Session, Some("g4"), &ping(9));
    h.advance(Duration::from_millis(10));
    assert_eq!(notified(&h), [json!("hello"), json!("first")]);
    h
}

/// A first round that asked one question (id 0) on the call's stream, event `c2`.
fn first_round() -> Harness {
    first_round_knowing(config().primes)
}

/// `first_round`, on a replica that knows `primes` of whether the upstream primes.
fn first_round_knowing(primes: Option<bool>) -> Harness {
    let config = FlowConfig { primes, ..config() };
    let mut h = Harness::new_call(config, Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    h.advance(Duration::from_millis(10));
    h
}

#[test]
fn a_new_call_opens_the_session_stream_before_posting_and_asks_after_the_quiet_window() {
    let h = first_round();
    let open_session = h.position(|c| matches!(c, Command::OpenSession)).unwrap();
    let get = h.position(is_open(Stream::Session, None)).unwrap();
    let post = h
        .position(|c| matches!(c, Command::PostCall { .. }))
        .unwrap();
    assert!(open_session < get && get < post, "{:?}", h.log);
    let watch = h
        .position(|c| matches!(c, Command::Watch { call: None, .. }))
        .unwrap();
    let close = h.position(|c| matches!(c, Command::CloseStreams)).unwrap();
    assert!(watch < close, "the reaper watches before the flow waits");
    let Ending::InputRequired {
        state,
        input_requests,
        shed,
    } = h.ending()
    else {
        panic!("{:?}", h.ending());
    };
    assert!(!shed);
    assert_eq!(input_requests.keys().collect::<Vec<_>>(), ["elicitation_0"]);
    let Waiting::Resumable {
        call,
        pending,
        positions,
    } = &state.waiting
    else {
        panic!("{state:?}");
    };
    assert_eq!(call.session, "s1");
    assert_eq!(call.id, UpstreamId::Number(h.call_id()));
    assert_eq!(pending[0].upstream_id, UpstreamId::Number(0));
    assert_eq!(positions.last_event_id.as_deref(), Some("c2"));
    assert_eq!(positions.round_start.as_deref(), Some("c1"));
    assert_eq!(state.round, 1);
    // Issued 10 ms into the flow: the TTL counts from the next whole second.
    assert_eq!(state.expires_at, 1_000_601);
    assert!(!h.log.contains(&Command::DeleteSession));
}

/// A round that runs longer than the TTL before its question comes still issues a state
/// good for the whole TTL: its expiry counts from when it is issued, not from the request.
#[test]
fn a_state_is_good_for_its_ttl_from_when_it_is_issued() {
    let mut config = config();
    config.request_state_ttl_seconds = 5;
    let mut h = Harness::new_call(config, Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.advance(Duration::from_millis(7_250));
    h.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired { state, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    // Issued 7.26 s after the request came (at 1,000,000 s): good until 5 s after 1,000,008.
    assert_eq!(state.expires_at, 1_000_013);
}

#[test]
fn every_round_names_the_revision_the_session_negotiated() {
    let older = Revision::parse("2025-06-18").unwrap();
    let upstream = Upstream {
        version: older,
        ..Upstream::default()
    };
    let mut first = Harness::new_call(config(), upstream);
    first.event(Stream::Call, Some("c1"), &json!(""));
    first.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    first.advance(Duration::from_millis(10));
    let version = |h: &Harness| h.state().waiting.call().map(|c| c.version);
    assert_eq!(version(&first), Some(older));
    // The retry's round asks again: its state still names the session's revision.
    let mut second = answered(&first, "Ada");
    second.event(Stream::Call, Some("c3"), &json!(""));
    second.event(Stream::Call, Some("c4"), &question(1, "Age?"));
    second.advance(Duration::from_millis(10));
    assert_eq!(version(&second), Some(older));
}

#[test]
fn a_call_that_completes_at_once_ends_with_its_own_response_only() {
    let mut h = Harness::new_call(config(), Upstream::default());
    let id = h.call_id();
    h.event(Stream::Call, Some("c1"), &result(id + 1, "not mine"));
    assert!(
        h.ending.is_none(),
        "another call's response completes nothing"
    );
    h.event(Stream::Call, Some("c2"), &result(id, "mine"));
    let Ending::Complete {
        message, rounds, ..
    } = h.ending()
    else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(message["result"]["content"][0]["text"], "mine");
    assert_eq!(*rounds, 1);
    assert!(h.log.contains(&Command::DeleteSession));
    assert!(!h.log.iter().any(|c| matches!(c, Command::Watch { .. })));
}

#[test]
fn a_warm_session_the_upstream_forgot_is_replaced_and_the_call_goes_out_once() {
    for lost in [
        Failure::new(FailureKind::Gone, "no longer has the session"),
        Failure::new(FailureKind::Unreachable, "cannot connect"),
        // How server-everything, and servers built on the TypeScript SDK's examples,
        // answer a session they do not know.
        Failure::new(FailureKind::Refused(400), "No valid session ID provided"),
    ] {
        let upstream = Upstream {
            warm: VecDeque::from([true]),
            call_failures: VecDeque::from([lost.clone()]),
            call_reply: |id| CallReply::Message(result(id, "on a fresh session")),
            ..Upstream::default()
        };
        let h = Harness::new_call(config(), upstream);
        let Ending::Complete { message, .. } = h.ending() else {
            panic!("{lost:?}: {:?}", h.ending());
        };
        assert_eq!(
            message["result"]["content"][0]["text"],
            "on a fresh session"
        );
        let opens = h.log.iter().filter(|c| **c == Command::OpenSession).count();
        assert_eq!(opens, 2, "{lost:?}: the warm session, then a fresh one");
        let posts = h
            .log
            .iter()
            .filter(|c| matches!(c, Command::PostCall { .. }))
            .count();
        assert_eq!(posts, 2, "{lost:?}: the call ran on neither before");
    }
}

#[test]
fn a_session_that_comes_with_its_stream_open_posts_the_call_at_once() {
    let opening = |session_stream| {
        let upstream = Upstream {
            warm: VecDeque::from([true]),
            session_stream,
            call_reply: |id| CallReply::Message(result(id, "done")),
            ..Upstream::default()
        };
        let h = Harness::new_call(config(), upstream);
        assert!(
            matches!(h.ending(), Ending::Complete { .. }),
            "{:?}",
            h.ending()
        );
        h.log
            .iter()
            .take_while(|c| !matches!(c, Command::PostCall { .. }))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(opening(true), [Command::OpenSession]);
    let session_stream = Command::Get(StreamGet::Open {
        stream: Stream::Session,
        after: None,
    });
    assert_eq!(opening(false), [Command::OpenSession, session_stream]);
}

#[test]
fn only_a_warm_session_is_replaced_and_only_when_it_ran_nothing() {
    let gone = || Failure::new(FailureKind::Gone, "no longer has the session");
    // A session opened for the call that is gone at once: the call fails.
    let upstream = Upstream {
        call_failures: VecDeque::from([gone()]),
        ..Upstream::default()
    };
    let h = Harness::new_call(config(), upstream);
    assert_eq!(h.refusal().class, Class::UpstreamError, "{:?}", h.refusal());
    assert_eq!(
        h.log.iter().filter(|c| **c == Command::OpenSession).count(),
        1
    );
    // A warm session that refuses the call otherwise: the refusal stands.
    let upstream = Upstream {
        warm: VecDeque::from([true]),
        call_failures: VecDeque::from([Failure::new(FailureKind::Refused(500), "refused")]),
        ..Upstream::default()
    };
    let h = Harness::new_call(config(), upstream);
    assert_eq!(h.refusal().class, Class::UpstreamError, "{:?}", h.refusal());
    let opens = h.log.iter().filter(|c| **c == Command::OpenSession).count();
    assert_eq!(opens, 1);
    // The replacement is not itself replaced.
    let upstream = Upstream {
        warm: VecDeque::from([true]),
        call_failures: VecDeque::from([gone(), gone()]),
        ..Upstream::default()
    };
    let h = Harness::new_call(config(), upstream);
    let opens = h.log.iter().filter(|c| **c == Command::OpenSession).count();
    assert_eq!(opens, 2);
    assert!(matches!(h.ending(), Ending::Refused(_)));
}

#[test]
fn a_json_answer_to_the_call_completes_it() {
    let upstream = Upstream {
        call_reply: |id| CallReply::Message(result(id, "at once")),
        ..Upstream::default()
    };
    let h = Harness::new_call(config(), upstream);
    let Ending::Complete { message, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(message["result"]["content"][0]["text"], "at once");
    // A JSON reply that is not the call's answer completes nothing: the silence limit ends it.
    let upstream = Upstream {
        call_reply: |_| {
            CallReply::Message(json!({"jsonrpc": "2.0", "method": "notifications/message"}))
        },
        ..Upstream::default()
    };
    let mut h = Harness::new_call(config(), upstream);
    h.advance(Duration::from_secs(45));
    assert_eq!(h.refusal().class, Class::UpstreamTimeout);
}

#[test]
fn a_shedding_replica_defers_a_new_call_and_its_retry_starts_it() {
    let mut shed = config();
    shed.shedding = true;
    let h = Harness::new_call(shed, Upstream::default());
    let Ending::InputRequired {
        state,
        input_requests,
        shed: true,
    } = h.ending()
    else {
        panic!("{:?}", h.ending());
    };
    assert!(input_requests.is_empty());
    assert_eq!(
        state.waiting,
        Waiting::Deferred {
            data_session: false
        }
    );
    assert!(
        !h.log.contains(&Command::OpenSession),
        "nothing went upstream"
    );
    let retry = Harness::retry(
        config(),
        Upstream::default(),
        (**state).clone(),
        json!({}),
        None,
    );
    assert!(retry.log.contains(&Command::OpenSession));
    assert!(retry
        .log
        .iter()
        .any(|c| matches!(c, Command::PostCall { .. })));
}

/// A retry of `first`'s state that accepts its question with `name`.
fn answered(first: &Harness, name: &str) -> Harness {
    let responses = json!({"elicitation_0": accept(name)});
    retry_of(first, config(), Upstream::default(), responses)
}

/// A retry of `first_round`'s state with `responses`.
fn retry_of(first: &Harness, config: FlowConfig, upstream: Upstream, responses: Value) -> Harness {
    Harness::retry(config, upstream, first.state(), responses, None)
}

#[test]
fn a_retry_reopens_and_settles_the_streams_before_it_posts_the_answers() {
    let first = first_round();
    let id = first.call_id();
    let mut h = answered(&first, "Ada");
    // Both streams are reopened at once, before anything else.
    let reopen = Command::Get(StreamGet::Reopen {
        after: "c2".into(),
        session_after: None,
    });
    assert_eq!(h.log, [reopen]);
    assert!(h.posted().is_empty(), "no answer before the stream is live");
    assert!(h.flow.is_reading(), "settling: replayed events are read");
    // The session stream's own priming event does not make the call's stream live.
    h.event(Stream::Session, Some("g1"), &json!(""));
    assert!(
        h.posted().is_empty(),
        "no answer before the call's stream is live"
    );
    h.event(Stream::Call, Some("c3"), &json!(""));
    assert_eq!(
        h.posted()[0],
        json!({"jsonrpc": "2.0", "id": 0, "result": accept("Ada")})
    );
    h.event(Stream::Call, Some("c4"), &result(id, "Hello, Ada!"));
    let Ending::Complete { rounds, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(*rounds, 2);
}

#[test]
fn a_question_on_the_session_stream_while_the_call_settles_is_asked_after_the_answers() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    // Pushed on the GET stream before the answers went up; then the call's stream is live.
    h.event(Stream::Session, Some("g1"), &question(1, "Nights?"));
    h.event(Stream::Call, Some("c3"), &json!(""));
    assert_eq!(
        h.posted().len(),
        1,
        "the answer goes up once the call's stream is live"
    );
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired { input_requests, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(input_requests.keys().collect::<Vec<_>>(), ["elicitation_1"]);
    let state = h.state();
    let Waiting::Resumable { positions, .. } = &state.waiting else {
        panic!("{state:?}");
    };
    assert_eq!(positions.last_event_id.as_deref(), Some("c3"));
}

#[test]
fn a_round_waits_the_quiet_window_only_for_a_call_that_asks_at_once_or_a_held_round() {
    let round_after = |asks_at_once: bool, resume: ResumeMode, after: Duration| {
        let mut config = config();
        (config.asks_at_once, config.resume) = (asks_at_once, resume);
        let mut h = Harness::new_call(config, Upstream::default());
        h.event(Stream::Call, Some("c1"), &question(0, "Name?"));
        h.advance(after);
        h.ending.is_some() || h.log.iter().any(|c| matches!(c, Command::Hold { .. }))
    };
    // Nothing more to read now: the round ends at once.
    assert!(round_after(false, ResumeMode::Auto, Duration::ZERO));
    // A call known to ask at once, and a round that will be held, wait the window.
    assert!(!round_after(
        true,
        ResumeMode::Auto,
        Duration::from_millis(9)
    ));
    assert!(round_after(
        true,
        ResumeMode::Auto,
        Duration::from_millis(10)
    ));
    assert!(!round_after(
        false,
        ResumeMode::Hold,
        Duration::from_millis(9)
    ));
    assert!(round_after(
        false,
        ResumeMode::Hold,
        Duration::from_millis(10)
    ));
}

#[test]
fn a_question_sent_before_the_answers_went_up_shows_the_call_asks_at_once() {
    let first = first_round();
    let asks_at_once = |h: &Harness| h.log.contains(&Command::Learn(Learnt::AsksAtOnce));
    // The second of two questions asked at once missed the first round: it is replayed
    // while the resumed stream settles, before the answer goes up.
    let mut h = answered(&first, "Ada");
    h.event(Stream::Call, Some("c3"), &question(1, "Nights?"));
    h.event(Stream::Call, Some("c4"), &json!(""));
    assert!(asks_at_once(&h), "{:?}", h.log);
    // A question the answers caused (after the stream is live) says nothing of the kind.
    let mut h = answered(&first, "Ada");
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Call, Some("c4"), &question(1, "Nights?"));
    h.advance(Duration::from_millis(10));
    assert!(!asks_at_once(&h), "{:?}", h.log);
    // Nor does a question of the round before replayed because it went unanswered.
    let mut h = retry_of(&first, config(), Upstream::default(), json!({}));
    h.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.advance(Duration::from_millis(10));
    assert!(!asks_at_once(&h), "{:?}", h.log);
}

#[test]
fn a_question_replayed_after_a_ping_is_asked_once_the_ping_is_answered() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    // Replayed while the stream settles: a ping, then a question.
    let ping = json!({"jsonrpc": "2.0", "id": 9, "method": "ping"});
    h.event(Stream::Call, Some("c3"), &ping);
    h.event(Stream::Call, Some("c4"), &question(1, "Nights?"));
    h.event(Stream::Call, Some("c5"), &json!(""));
    let posted = h.posted();
    assert_eq!(posted.len(), 2, "the answer, then the ping's: {posted:?}");
    assert_eq!(posted[1], json!({"jsonrpc": "2.0", "id": 9, "result": {}}));
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired { input_requests, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(input_requests.keys().collect::<Vec<_>>(), ["elicitation_1"]);
}

/// A question the server cancelled after the round ended (its client took too long, say)
/// is not answered when the retry comes: the cancellation is replayed before the answers
/// go up. The other answers go up, and the call goes on.
#[test]
fn a_question_cancelled_while_the_client_was_away_is_not_answered() {
    let first = two_questions_round();
    let id = first.call_id();
    let cancelled = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                           "params": {"requestId": 0, "reason": "timed out"}});
    // As PHP's `json_encode` writes it by default.
    let escaped =
        r#"{"jsonrpc":"2.0","method":"notifications\/cancelled","params":{"requestId":0}}"#;
    for cancellation in [cancelled, json!(escaped)] {
        let both = json!({"elicitation_0": accept("red"), "elicitation_1": accept("L")});
        let mut h = retry_of(&first, config(), Upstream::default(), both);
        h.event(Stream::Call, Some("c4"), &cancellation);
        h.event(Stream::Call, Some("c5"), &json!(""));
        let posted = h.posted();
        assert_eq!(posted.len(), 1, "the other answer only: {posted:?}");
        assert_eq!(posted[0]["id"], 1);
        h.event(Stream::Call, Some("c6"), &result(id, "done"));
        assert!(
            matches!(h.ending(), Ending::Complete { .. }),
            "{:?}",
            h.ending()
        );
    }
}

#[test]
fn a_result_replayed_before_the_priming_event_is_read_once_the_answers_are_up() {
    let first = first_round();
    let id = first.call_id();
    let mut h = answered(&first, "Ada");
    // The server replays the question again (already answered: skipped), then primes.
    h.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Call, Some("c4"), &result(id, "done"));
    assert!(
        matches!(h.ending(), Ending::Complete { .. }),
        "{:?}",
        h.ending()
    );
    assert_eq!(h.posted().len(), 1, "the answer went up once");
}

#[test]
fn an_unknown_upstream_teaches_whether_it_primes() {
    let first = first_round_knowing(None);
    let mut unknown = config();
    unknown.primes = None;
    let mut h = retry_of(
        &first,
        unknown,
        Upstream::default(),
        json!({"elicitation_0": accept("Ada")}),
    );
    assert!(h.posted().is_empty());
    h.advance(Duration::from_millis(299));
    assert!(h.posted().is_empty());
    h.advance(Duration::from_millis(1));
    assert!(h.log.contains(&Command::Learn(Learnt::Primes(false))));
    assert!(h.log.contains(&Command::Note(Note::Unprimed)));
    assert_eq!(h.posted().len(), 1, "the answers go up after the wait");
    let mut known_not = config();
    known_not.primes = Some(false);
    let h = retry_of(
        &first,
        known_not,
        Upstream::default(),
        json!({"elicitation_0": accept("Ada")}),
    );
    assert_eq!(
        h.posted().len(),
        1,
        "no wait for an upstream known not to prime"
    );
}

#[test]
fn a_replica_that_does_not_know_whether_the_upstream_primes_takes_the_states_word() {
    let responses = || json!({"elicitation_0": accept("Ada")});
    let unknown = FlowConfig {
        primes: None,
        ..config()
    };
    // Sealed where the upstream was known not to prime: the answers go up at once, and
    // the replica knows it from then on.
    let first = first_round_knowing(Some(false));
    let Waiting::Resumable { positions, .. } = &first.state().waiting else {
        panic!("{:?}", first.state());
    };
    assert_eq!(positions.upstream.primes, Some(false));
    assert_eq!(positions.upstream.sessions_kept_apart, Some(true));
    let h = retry_of(&first, unknown.clone(), Upstream::default(), responses());
    assert_eq!(h.log[0], Command::Learn(Learnt::Primes(false)));
    assert_eq!(h.posted().len(), 1, "no wait to learn it again");
    assert!(!h.log.contains(&Command::Note(Note::Unprimed)));
    // Sealed where it was known to prime: the answers wait for the priming event, past
    // the wait a replica that knows nothing gives it.
    let first = first_round_knowing(Some(true));
    let mut h = retry_of(&first, unknown.clone(), Upstream::default(), responses());
    assert_eq!(h.log[0], Command::Learn(Learnt::Primes(true)));
    h.advance(Duration::from_millis(1_000));
    assert!(h.posted().is_empty(), "waiting for the priming event");
    h.event(Stream::Call, Some("c3"), &json!(""));
    assert_eq!(h.posted().len(), 1);
    // A replica that knows keeps what it knows.
    let first = first_round_knowing(Some(true));
    let known_not = FlowConfig {
        primes: Some(false),
        ..config()
    };
    let h = retry_of(&first, known_not, Upstream::default(), responses());
    assert!(!h
        .log
        .iter()
        .any(|c| matches!(c, Command::Learn(Learnt::Primes(_)))));
    assert_eq!(h.posted().len(), 1);
}

#[test]
fn the_wait_for_priming_counts_from_the_call_streams_resumption() {
    // A server that keeps a closed GET stream makes the session's stream take its retries
    // (up to 140 ms) after the call's stream is back; that time is part of the wait.
    let first = first_round_knowing(None);
    let mut unknown = config();
    unknown.primes = None;
    let upstream = Upstream {
        session_stream_lag: Duration::from_millis(200),
        ..Upstream::default()
    };
    let mut h = retry_of(
        &first,
        unknown,
        upstream,
        json!({"elicitation_0": accept("Ada")}),
    );
    h.advance(Duration::from_millis(99));
    assert!(
        h.posted().is_empty(),
        "still within the call stream's 300 ms"
    );
    h.advance(Duration::from_millis(1));
    assert!(h.log.contains(&Command::Learn(Learnt::Primes(false))));
    assert_eq!(
        h.posted().len(),
        1,
        "300 ms after the call's stream, not 500"
    );
}

#[test]
fn a_question_left_unanswered_is_replayed_from_the_rounds_start() {
    let first = two_questions_round();
    let mut h = answered(&first, "red");
    assert!(
        h.log.iter().any(is_open(Stream::Call, Some("c1"))),
        "from the round's start"
    );
    h.event(Stream::Call, Some("c9"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
    h.event(Stream::Call, Some("c3"), &question(1, "Size?"));
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired {
        input_requests,
        state,
        ..
    } = h.ending()
    else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(
        input_requests.keys().collect::<Vec<_>>(),
        ["elicitation_1"],
        "only the unanswered one"
    );
    assert_eq!(state.round, 1, "the round is not over");
}

/// A config whose requests ask for every log message.
fn with_logs() -> FlowConfig {
    let mut with_logs = config();
    with_logs.relay.log_level = Some(crate::mrtr::modern::LogLevel::Debug);
    with_logs
}

fn log(text: &str) -> Value {
    json!({"jsonrpc": "2.0", "method": "notifications/message",
           "params": {"level": "info", "data": text}})
}

fn ping(id: i64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "ping"})
}

/// The data of each log message told the client.
fn notified(h: &Harness) -> Vec<Value> {
    h.log
        .iter()
        .filter_map(|c| match c {
            Command::Notify(n) => Some(n["params"]["data"].clone()),
            _ => None,
        })
        .collect()
}

/// The answers to pings posted upstream.
fn pongs(h: &Harness) -> usize {
    h.posted()
        .iter()
        .filter(|p| p["result"] == json!({}))
        .count()
}

/// A retry that leaves a question unanswered replays the call's stream from before the
/// round's first question: what the round told the client (a log message) and what the
/// gateway answered for it (a ping) went out then, and only the question counts again.
/// What the stream sends after the replay is the round's own.
#[test]
fn a_partial_retry_neither_tells_nor_answers_again_what_the_round_before_read() {
    let with_logs = with_logs();
    let ping = ping(9);
    // After the replay: the live log alone is told, the one answer alone goes up, and
    // the unanswered question is asked again.
    let after_the_replay = |h: &mut Harness, answered: i64, asked: &str| {
        h.advance(Duration::from_millis(10));
        assert_eq!(
            notified(h),
            [json!("second")],
            "the replayed log is not told again"
        );
        let posted = h.posted();
        assert_eq!(
            posted.len(),
            1,
            "the answer only, no second pong: {posted:?}"
        );
        assert_eq!(posted[0]["id"], answered);
        let Ending::InputRequired { input_requests, .. } = h.ending() else {
            panic!("{:?}", h.ending());
        };
        assert_eq!(input_requests.keys().collect::<Vec<_>>(), [asked]);
    };
    let mut h = Harness::new_call(with_logs.clone(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
    h.event(Stream::Call, Some("c3"), &log("first"));
    h.event(Stream::Call, Some("c4"), &ping);
    h.event(Stream::Call, Some("c5"), &question(1, "Size?"));
    h.advance(Duration::from_millis(10));
    assert_eq!(notified(&h), [json!("first")]);
    assert_eq!(
        h.posted(),
        [json!({"jsonrpc": "2.0", "id": 9, "result": {}})]
    );
    let first = h;

    let partial = json!({"elicitation_1": accept("L")});
    let mut h = retry_of(&first, with_logs.clone(), Upstream::default(), partial);
    assert!(h.log.iter().any(is_open(Stream::Call, Some("c1"))));
    for (id, message) in [
        ("c2", question(0, "Color?")),
        ("c3", log("first")),
        ("c4", ping.clone()),
        ("c5", question(1, "Size?")),
    ] {
        h.event(Stream::Call, Some(id), &message);
    }
    h.event(Stream::Call, Some("c6"), &json!(""));
    h.event(Stream::Call, Some("c7"), &log("second"));
    after_the_replay(&mut h, 1, "elicitation_0");

    // The same on the session's GET stream, resumed from before its question.
    let first = get_stream_round();
    let partial = json!({"elicitation_0": accept("red")});
    let mut h = retry_of(&first, with_logs, Upstream::default(), partial);
    assert!(h.log.iter().any(is_open(Stream::Session, Some("g1"))));
    for (id, message) in [
        ("g2", question(1, "Size?")),
        ("g3", log("first")),
        ("g4", ping.clone()),
    ] {
        h.event(Stream::Session, Some(id), &message);
    }
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Session, Some("g5"), &log("second"));
    after_the_replay(&mut h, 0, "elicitation_1");
}

/// A retry that answers every question still resumes the GET stream from before its
/// question (the store keeps sessions apart): what the stream replays that the round read
/// is not told or answered again.
#[test]
fn a_full_retry_neither_tells_nor_answers_again_what_the_get_stream_replays() {
    let first = get_stream_round();
    let both = json!({"elicitation_0": accept("red"), "elicitation_1": accept("L")});
    let mut h = retry_of(&first, with_logs(), Upstream::default(), both);
    assert!(h.log.iter().any(is_open(Stream::Session, Some("g1"))));
    h.event(Stream::Session, Some("g2"), &question(1, "Size?"));
    h.event(Stream::Session, Some("g3"), &log("first"));
    h.event(Stream::Session, Some("g4"), &ping(9));
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Session, Some("g5"), &log("second"));
    h.advance(Duration::from_millis(1));
    assert_eq!(notified(&h), [json!("second")]);
    assert_eq!(pongs(&h), 0, "the replayed ping is not answered again");
    assert_eq!(h.posted().len(), 2, "the two answers");
}

/// A retry whose GET stream the upstream would not resume (its store forgot the
/// position) gets a fresh one, which replays nothing: every event on it is new, told and
/// answered, and its question asked.
#[test]
fn a_fresh_get_stream_in_place_of_a_resumed_one_is_read_as_new() {
    let first = get_stream_round();
    let both = json!({"elicitation_0": accept("red"), "elicitation_1": accept("L")});
    let fresh = Upstream {
        session_resumes: false,
        ..Upstream::default()
    };
    let mut h = retry_of(&first, with_logs(), fresh, both);
    assert!(h.log.iter().any(is_open(Stream::Session, Some("g1"))));
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Session, Some("x1"), &log("live"));
    h.event(Stream::Session, Some("x2"), &ping(10));
    h.event(Stream::Session, Some("x3"), &question(11, "Shape?"));
    h.advance(Duration::from_millis(10));
    assert_eq!(notified(&h), [json!("live")]);
    assert_eq!(pongs(&h), 1);
    let Ending::InputRequired { input_requests, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(
        input_requests.keys().collect::<Vec<_>>(),
        ["elicitation_11"]
    );
}

/// A retry that leaves a GET-stream question unanswered counts on the stream's replay
/// to ask it again; when the upstream reopens the stream fresh instead, nothing will:
/// no answer goes up, the state stays good, and the client is told which answer it
/// lacks.
#[test]
fn a_get_stream_question_left_unanswered_is_not_lost_when_the_stream_reopens_fresh() {
    let first = get_stream_round();
    let only_call = json!({"elicitation_0": accept("red")});
    let fresh = Upstream {
        session_resumes: false,
        ..Upstream::default()
    };
    let h = retry_of(&first, with_logs(), fresh, only_call);
    assert!(h.posted().is_empty(), "{:?}", h.log);
    assert!(h.log.contains(&Command::ReleaseClaim));
    let refusal = h.refusal();
    assert!(refusal.message.contains("\"elicitation_1\""), "{refusal}");
}

/// Two partial retries: the question the first answered lies after the round's start,
/// and the second replays from there. It is not asked again, nor answered twice: in the
/// replay, only the questions still pending count.
#[test]
fn a_question_an_earlier_retry_answered_is_not_asked_again() {
    // Alone, and in a batch (2025-03-26 let servers send one).
    for batched in [false, true] {
        let size = match batched {
            true => json!([question(1, "Size?")]),
            false => question(1, "Size?"),
        };
        let mut h = Harness::new_call(config(), Upstream::default());
        h.event(Stream::Call, Some("c1"), &json!(""));
        h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
        h.event(Stream::Call, Some("c3"), &size);
        h.advance(Duration::from_millis(10));
        let first = h;
        let only_1 = json!({"elicitation_1": accept("L")});
        let mut h = retry_of(&first, config(), Upstream::default(), only_1);
        h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
        h.event(Stream::Call, Some("c3"), &size);
        h.event(Stream::Call, Some("c4"), &json!(""));
        assert_eq!(h.posted().len(), 1);
        h.event(Stream::Call, Some("c5"), &question(2, "Shape?"));
        h.advance(Duration::from_millis(10));
        let second = h;
        let only_2 = json!({"elicitation_2": accept("round")});
        let mut h = retry_of(&second, config(), Upstream::default(), only_2);
        assert!(h.log.iter().any(is_open(Stream::Call, Some("c1"))));
        h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
        h.event(Stream::Call, Some("c3"), &size);
        h.event(Stream::Call, Some("c5"), &question(2, "Shape?"));
        h.event(Stream::Call, Some("c6"), &json!(""));
        h.advance(Duration::from_millis(10));
        let Ending::InputRequired { input_requests, .. } = h.ending() else {
            panic!("{:?}", h.ending());
        };
        let asked: Vec<_> = input_requests.keys().collect();
        assert_eq!(asked, ["elicitation_0"], "batched: {batched}");
        assert_eq!(h.posted().len(), 1, "the second retry's answer only");
    }
}

/// A round that ends on a priming event (the Python SDK stores one with no message, and
/// never replays it): the replay holds only the events that carried a message, and what
/// the server sent after them while the client was away is told and answered.
#[test]
fn what_a_server_sent_while_the_client_was_away_is_told_after_the_replay() {
    let first = two_questions_round();
    let only_0 = json!({"elicitation_0": accept("red")});
    let mut h = retry_of(&first, with_logs(), Upstream::default(), only_0);
    h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
    h.event(Stream::Call, Some("c3"), &question(1, "Size?"));
    h.event(Stream::Call, Some("c4"), &json!(""));
    assert_eq!(h.posted().len(), 1);
    h.event(Stream::Session, Some("g1"), &log("on get"));
    h.event(Stream::Session, Some("g2"), &question(2, "Shape?"));
    h.advance(Duration::from_millis(10));
    let second = h;
    let only_2 = json!({"elicitation_2": accept("round")});
    let mut h = retry_of(&second, with_logs(), Upstream::default(), only_2);
    assert!(h.log.iter().any(is_open(Stream::Call, Some("c2"))));
    h.event(Stream::Call, Some("c3"), &question(1, "Size?"));
    h.event(Stream::Call, Some("c5"), &log("while away"));
    h.event(Stream::Call, Some("c6"), &ping(9));
    h.event(Stream::Call, Some("c7"), &json!(""));
    h.advance(Duration::from_millis(1));
    assert_eq!(notified(&h), [json!("while away")]);
    assert_eq!(pongs(&h), 1, "the new ping is answered");
}

/// A server that sends no priming event puts the round's first question first on the
/// call's stream: no position replays it. A retry that leaves it unanswered is told so at
/// once, nothing goes upstream, and the same state with the answer goes on.
#[test]
fn an_unanswered_question_that_opened_the_call_stream_is_named_and_the_state_kept() {
    let mut h = Harness::new_call(config(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &question(0, "Color?"));
    h.event(Stream::Call, Some("c2"), &question(1, "Size?"));
    h.advance(Duration::from_millis(10));
    let first = h;
    let partial = json!({"elicitation_1": accept("L")});
    let h = retry_of(&first, config(), Upstream::default(), partial);
    let refusal = h.refusal();
    assert_eq!(refusal.code, -32602);
    assert!(
        refusal.message.contains("\"elicitation_0\"")
            && !refusal.message.contains("elicitation_1\""),
        "names the missing answer only: {}",
        refusal.message
    );
    assert!(
        h.log.contains(&Command::ReleaseClaim),
        "the state stays usable"
    );
    assert!(
        !h.log.iter().any(|c| matches!(
            c,
            Command::Get(StreamGet::Reopen { .. }) | Command::Get(StreamGet::Open { .. })
        )),
        "nothing upstream: {:?}",
        h.log
    );
    let both = json!({"elicitation_0": accept("red"), "elicitation_1": accept("L")});
    let h = retry_of(&first, config(), Upstream::default(), both);
    assert!(
        h.log.contains(&Command::Get(StreamGet::Reopen {
            after: "c2".into(),
            session_after: None,
        })),
        "every answer given: after the last event, {:?}",
        h.log
    );
}

/// A question the session's GET stream sent is asked again only by resuming that stream
/// from before it: where the stream sent an event before it this round and the group's
/// store keeps sessions apart. There the call's stream, whose question was answered, goes
/// on after its last event; elsewhere a retry that leaves it unanswered is told so at
/// once and nothing goes upstream (it was resumed after the question, or fresh, and the
/// upstream waited for an answer that never came).
#[test]
fn an_unanswered_question_from_the_get_stream_is_replayed_only_where_it_can_be() {
    let log = json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {}});
    let round = |get_event_first: bool| {
        let mut h = Harness::new_call(config(), Upstream::default());
        h.event(Stream::Call, Some("c1"), &json!(""));
        h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
        if get_event_first {
            h.event(Stream::Session, Some("g1"), &log);
        }
        h.event(Stream::Session, Some("g2"), &question(1, "Size?"));
        h.advance(Duration::from_millis(10));
        h
    };
    let partial = json!({"elicitation_0": accept("red")});
    let refused = |h: &Harness| {
        h.refusal().code == -32602
            && h.refusal().message.contains("\"elicitation_1\"")
            && h.log.contains(&Command::ReleaseClaim)
            && !h.log.iter().any(|c| {
                matches!(
                    c,
                    Command::Get(StreamGet::Reopen { .. }) | Command::Get(StreamGet::Open { .. })
                )
            })
    };

    let first = round(true);
    let h = retry_of(&first, config(), Upstream::default(), partial.clone());
    let replayed = Command::Get(StreamGet::Reopen {
        after: "c2".into(),
        session_after: Some("g1".into()),
    });
    assert!(h.log.contains(&replayed), "{:?}", h.log);
    let mut shared = config();
    shared.session_replay_scoped = false;
    let h = retry_of(&first, shared, Upstream::default(), partial.clone());
    assert!(
        refused(&h),
        "a shared store's GET stream reopens fresh: {:?}",
        h.log
    );

    let first = round(false);
    let h = retry_of(&first, config(), Upstream::default(), partial);
    assert!(refused(&h), "the stream's first event: {:?}", h.log);
}

/// A stream that sends an event over the size limit would send it again to every
/// resumption: the call ends at once with the failure, its session deleted, and nothing is
/// learnt of the group's resumptions, whether the round was being read or a retry's
/// resumed stream was settling.
#[test]
fn an_event_over_the_limit_ends_the_call_without_a_resumption() {
    let broken = |stream| Input::StreamBroken {
        stream,
        failure: Failure::new(FailureKind::Broken, "an SSE event exceeds 4194304 bytes"),
    };
    let assert_ended = |h: &Harness| {
        assert!(
            h.refusal().message.contains("exceeds 4194304 bytes"),
            "{:?}",
            h.refusal()
        );
        assert!(h.log.contains(&Command::DeleteSession), "{:?}", h.log);
        let resumed = h.log.iter().any(|c| {
            matches!(
                c,
                Command::Learn(_)
                    | Command::Get(StreamGet::Open {
                        stream: Stream::Call,
                        ..
                    })
            )
        });
        assert!(!resumed, "{:?}", h.log);
    };
    let mut h = Harness::new_call(config(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.feed(broken(Stream::Call));
    assert_ended(&h);

    let mut h = Harness::new_call(config(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.feed(broken(Stream::Session));
    assert_ended(&h);

    let first = first_round();
    let mut settling = answered(&first, "Ada");
    let reopened = settling.log.len();
    settling.feed(broken(Stream::Call));
    assert!(settling.posted().is_empty(), "no answer went up");
    settling.log.drain(..reopened);
    assert_ended(&settling);
}

/// An upstream that has not yet let go of the call stream's previous connection answers a
/// resumption with an empty stream; a retry that follows its round at once (an automated
/// client, or loopback) meets that nearly every time. The flow tries again within a few
/// milliseconds, doubling, and gives the call up only after as long as before (300 ms).
#[test]
fn an_empty_resumption_is_tried_again_within_milliseconds_and_given_up_after_300() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    let (mut waits, mut patience) = (Vec::new(), Duration::ZERO);
    for _ in 0..=EMPTY_RETRIES {
        let Some(waited) = h.end_call_stream_and_await_reopen() else {
            break;
        };
        waits.push(waited);
        patience += waited;
    }
    let given_up = h
        .log
        .contains(&Command::Learn(Learnt::ReplayRefused { empty: true }));
    assert!(given_up, "never gave up: {waits:?}");
    assert!(waits[0] <= Duration::from_millis(5), "{waits:?}");
    assert!(patience >= Duration::from_millis(300), "{waits:?}");
}

#[test]
fn an_empty_resumption_is_tried_again_then_loses_the_call_and_holds_the_group() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    for _ in 0..=EMPTY_RETRIES {
        h.feed(Input::StreamEnded(Stream::Call));
        h.advance(Duration::from_millis(400));
    }
    let reopens = h
        .log
        .iter()
        .filter(|c| is_open(Stream::Call, Some("c2"))(c))
        .count();
    assert_eq!(reopens, 1 + EMPTY_RETRIES as usize);
    assert!(h
        .log
        .contains(&Command::Learn(Learnt::ReplayRefused { empty: true })));
    assert!(h.log.contains(&Command::ReleaseClaim), "nothing was posted");
    assert!(h.log.contains(&Command::DeleteSession));
    assert!(h.posted().is_empty());
    let refusal = h.refusal();
    assert_eq!(refusal.code, gcode::FLOW_LOST);
    assert!(
        refusal.message.contains("no longer has this call's events"),
        "{refusal}"
    );
}

#[test]
fn a_resumption_that_ends_after_replaying_something_is_followed() {
    let first = first_round();
    let id = first.call_id();
    let mut h = answered(&first, "Ada");
    h.event(Stream::Call, Some("c3"), &json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 1}}));
    h.feed(Input::StreamEnded(Stream::Call));
    assert_eq!(h.posted().len(), 1, "the answers went up");
    h.advance(DEFAULT_RETRY);
    assert!(
        h.log
            .iter()
            .filter(|c| is_open(Stream::Call, Some("c3"))(c))
            .count()
            == 1,
        "{:?}",
        h.log
    );
    h.event(Stream::Call, Some("c5"), &result(id, "done"));
    assert!(matches!(h.ending(), Ending::Complete { .. }));
}

#[test]
fn a_refused_resumption_loses_the_call_ends_its_session_and_teaches_the_group() {
    let first = first_round();
    let failed = |kind: FailureKind| {
        let mut upstream = Upstream::default();
        let failure = Failure::new(kind, "refused");
        upstream.call_opens.push_back(Err(failure));
        retry_of(
            &first,
            config(),
            upstream,
            json!({"elicitation_0": accept("Ada")}),
        )
    };
    let refused = |status| failed(FailureKind::Refused(status));
    let teaches = |h: &Harness| {
        h.log
            .contains(&Command::Learn(Learnt::ReplayRefused { empty: false }))
    };
    let h = refused(400);
    assert!(teaches(&h));
    assert!(h.log.contains(&Command::ReleaseClaim));
    assert!(
        h.log.contains(&Command::DeleteSession),
        "the call ends upstream"
    );
    assert!(h.posted().is_empty());
    let refusal = h.refusal();
    assert_eq!(refusal.code, gcode::FLOW_LOST);
    assert!(refusal.message.contains("was refused"), "{refusal}");
    // A refusal that may pass later (a throttle, a conflict, a server error), one the
    // retry's own size earned (its headers, its URL), or a connection cut under the
    // resumption (an upstream restarting), leaves the state good, and teaches nothing of
    // the group's resumptions.
    let size_earned = [refused(413), refused(414), refused(431)];
    let for_now = [refused(429), refused(503), failed(FailureKind::Cut)];
    for h in size_earned.into_iter().chain(for_now) {
        assert!(h.log.contains(&Command::ReleaseClaim));
        assert!(!h.log.contains(&Command::DeleteSession));
        assert_eq!(h.refusal().class, Class::UpstreamError);
        assert!(!teaches(&h), "{:?}", h.log);
    }
    // An answer against the protocol does.
    assert!(teaches(&failed(FailureKind::Broken)));
}

/// A data-layer session's call whose resumption is refused for good, or comes back
/// empty, can never be continued: it is cancelled (its session outlives the flow, and
/// the call would wait in it for answers). One whose resumption failed for now keeps the
/// state good and stays watched by the reaper, for a retry of the same state or, failing
/// that, the reaper to end it.
#[test]
fn a_data_session_call_that_cannot_be_resumed_is_cancelled_one_that_may_later_stays_watched() {
    let mut first = Harness::new_call(in_data_session(), Upstream::default());
    first.event(Stream::Call, Some("c1"), &json!(""));
    first.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    first.advance(Duration::from_millis(10));
    let id = first.call_id();
    let reopened = |opened: Result<(), Failure>, then_ends: bool| {
        let mut upstream = Upstream::default();
        upstream.call_opens.push_back(opened);
        let responses = json!({"elicitation_0": accept("Ada")});
        let mut h = retry_of(&first, in_data_session(), upstream, responses);
        if then_ends {
            // Each resumed stream ends with nothing in it, as soon as it opens.
            for _ in 0..16 {
                if h.end_call_stream_and_await_reopen().is_none() {
                    break;
                }
            }
        }
        h
    };
    let unwatched = |h: &Harness| h.log.iter().any(|c| matches!(c, Command::Unwatch { .. }));
    let refused = reopened(Err(Failure::new(FailureKind::Refused(400), "no")), false);
    let empty = reopened(Ok(()), true);
    for h in [&refused, &empty] {
        let cancelled = cancellations(h);
        assert_eq!(cancelled.len(), 1, "{:?}", h.log);
        assert_eq!(cancelled[0]["params"]["requestId"], id);
        assert!(h.ending.is_some());
    }
    let for_now = reopened(Err(Failure::new(FailureKind::Refused(503), "busy")), false);
    assert!(cancellations(&for_now).is_empty(), "{:?}", for_now.log);
    assert!(for_now.log.contains(&Command::ReleaseClaim));
    assert!(!unwatched(&for_now), "{:?}", for_now.log);
}

/// Empty resumptions end a round only in a run: a long round whose reopened streams now
/// and then come back empty (a server that has yet to let go of the previous
/// connection), between ones that bring events, goes on.
#[test]
fn only_a_run_of_empty_resumptions_ends_a_round() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    for run in 0..3 {
        for _ in 0..4 {
            assert!(h.end_call_stream_and_await_reopen().is_some());
        }
        h.event(Stream::Call, Some(&format!("p{run}")), &json!(""));
        assert!(h.end_call_stream_and_await_reopen().is_some());
    }
    assert!(h.ending.is_none(), "{:?}", h.ending);
}

/// A resumption cut, or failing with a server error or no answer in time, is counted for
/// the shell to learn from a run of them; one that comes back and settles is told too,
/// ending the run. A throttle counts as neither, nor does a stream that ends while it
/// settles.
#[test]
fn resumptions_failing_without_an_answer_are_told_and_so_are_those_that_work() {
    let first = first_round();
    let learnt = |h: &Harness| -> Vec<Learnt> {
        let learnt = h.log.iter().filter_map(|c| match c {
            Command::Learn(l) => Some(*l),
            _ => None,
        });
        learnt.collect()
    };
    let reopened = |kind: Option<FailureKind>| {
        let mut upstream = Upstream::default();
        if let Some(kind) = kind {
            let failed = Err(Failure::new(kind, "failed"));
            upstream.call_opens.push_back(failed);
        }
        retry_of(
            &first,
            config(),
            upstream,
            json!({"elicitation_0": accept("Ada")}),
        )
    };
    for kind in [
        FailureKind::Cut,
        FailureKind::Timeout,
        FailureKind::Refused(500),
        FailureKind::Refused(503),
    ] {
        let h = reopened(Some(kind));
        assert_eq!(learnt(&h), [Learnt::ResumptionFailed], "{kind:?}");
    }
    assert_eq!(learnt(&reopened(Some(FailureKind::Refused(429)))), []);
    // Back, but not yet settled: nothing; its priming event says it worked.
    let mut h = reopened(None);
    assert_eq!(learnt(&h), []);
    h.event(Stream::Call, Some("c3"), &json!(""));
    assert_eq!(learnt(&h), [Learnt::ResumptionWorked]);
    // Back, then ended before it settled (the call's end replayed, or a cut): neither.
    let mut h = reopened(None);
    h.event(Stream::Call, Some("c3"), &log("replayed"));
    h.feed(Input::StreamEnded(Stream::Call));
    assert_eq!(learnt(&h), []);
}

fn challenge() -> Option<String> {
    Some(r#"Bearer error="invalid_token", resource_metadata="http://10.0.0.7:3001/.well-known/oauth-protected-resource/mcp""#.into())
}

#[test]
fn an_upstream_that_denies_a_new_call_passes_its_challenge_to_the_client() {
    let upstream = Upstream {
        open_failure: Some(Failure::denied(
            401,
            challenge(),
            "requires authorization (HTTP 401)",
        )),
        ..Upstream::default()
    };
    let h = Harness::new_call(config(), upstream);
    let refusal = h.refusal();
    assert_eq!(refusal.class, Class::Unauthorized);
    assert_eq!(refusal.class.status(), 401);
    assert_eq!(refusal.challenge, challenge());
    assert!(refusal
        .message
        .contains("upstream group 'g' requires authorization"));
    assert!(!h.log.iter().any(|c| matches!(c, Command::PostCall { .. })));
}

#[test]
fn a_denied_retry_keeps_its_call_for_an_authenticated_retry_of_the_same_state() {
    let first = first_round();
    let mut upstream = Upstream::default();
    upstream.call_opens.push_back(Err(Failure::denied(
        401,
        challenge(),
        "requires authorization (HTTP 401)",
    )));
    let h = retry_of(
        &first,
        config(),
        upstream,
        json!({"elicitation_0": accept("Ada")}),
    );
    assert!(
        h.log.contains(&Command::ReleaseClaim),
        "the same state may come again"
    );
    assert!(
        !h.log.iter().any(|c| matches!(c, Command::Learn(_))),
        "a denial says nothing of the group's resumptions: {:?}",
        h.log
    );
    assert!(
        !h.log.contains(&Command::DeleteSession),
        "the call waits for the authenticated retry"
    );
    assert!(h.posted().is_empty(), "no answer went up");
    assert_eq!(h.refusal().class, Class::Unauthorized);
    assert_eq!(h.refusal().challenge, challenge());
    // The authenticated retry of the same state completes the call.
    let mut again = answered(&first, "Ada");
    again.event(Stream::Call, Some("c3"), &json!(""));
    assert_eq!(again.posted().len(), 1, "the answer goes up now");
    again.event(
        Stream::Call,
        Some("c4"),
        &result(first.call_id(), "Hello, Ada"),
    );
    assert!(matches!(again.ending(), Ending::Complete { .. }));
}

/// The first round of a restartable tool's call: it asked "Where?" and ended.
fn restartable_first_round() -> (FlowConfig, Harness) {
    let mut restartable = config();
    restartable.restartable = true;
    let mut first = Harness::new_call(restartable.clone(), Upstream::default());
    first.event(Stream::Call, Some("c1"), &question(0, "Where?"));
    first.advance(Duration::from_millis(10));
    (restartable, first)
}

#[test]
fn a_lost_call_of_a_restartable_tool_runs_again_asking_only_what_is_new() {
    let (restartable, first) = restartable_first_round();
    let mut upstream = Upstream::default();
    upstream.call_opens.push_back(Err(Failure::new(
        FailureKind::Gone,
        "the upstream session is gone (HTTP 404)",
    )));
    let mut h = retry_of(
        &first,
        restartable,
        upstream,
        json!({"elicitation_0": accept("Lisbon")}),
    );
    assert!(h.log.contains(&Command::Note(Note::Restarted)));
    assert!(
        !h.log.contains(&Command::ReleaseClaim),
        "the state that ran the call again stays spent: replayed, it would run it again"
    );
    assert!(h.log.contains(&Command::OpenSession), "a new session");
    // The re-run asks the first question again (answered from the state), then a new one.
    h.event(Stream::Call, Some("r1"), &question(0, "Where?"));
    assert_eq!(h.posted().last().unwrap()["result"], accept("Lisbon"));
    h.event(Stream::Call, Some("r2"), &question(1, "Nights?"));
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired {
        input_requests,
        state,
        ..
    } = h.ending()
    else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(input_requests.keys().collect::<Vec<_>>(), ["elicitation_1"]);
    assert!(
        h.log.iter().any(|c| matches!(c, Command::Watch { .. })),
        "the re-run's session is watched"
    );
    assert_eq!(state.round, 2);
}

/// A re-run that never reached the upstream (its session could not be opened, or its
/// call was not delivered) ran nothing: the state that led to it stays good, so the same
/// retry runs the call again once the upstream is back.
#[test]
fn a_rerun_that_never_reached_the_upstream_leaves_its_state_good() {
    let (restartable, first) = restartable_first_round();
    let refused = || Failure::new(FailureKind::Unreachable, "is unreachable");
    let not_sent = || Failure::new(FailureKind::NotSent, "no connection could be opened");
    let lost = || Err(Failure::new(FailureKind::Gone, "the session is gone"));
    let cases = [
        (
            "the session",
            Upstream {
                open_failure: Some(refused()),
                ..Upstream::default()
            },
        ),
        (
            "the call",
            Upstream {
                call_failures: VecDeque::from([not_sent()]),
                ..Upstream::default()
            },
        ),
    ];
    for (what, mut upstream) in cases {
        upstream.call_opens.push_back(lost());
        let responses = json!({"elicitation_0": accept("Lisbon")});
        let h = retry_of(&first, restartable.clone(), upstream, responses);
        assert!(h.log.contains(&Command::Note(Note::Restarted)), "{what}");
        assert!(
            h.log.contains(&Command::ReleaseClaim),
            "{what}: {:?}",
            h.log
        );
        let message = &h.refusal().message;
        assert!(
            message.contains("its requestState is still good"),
            "{what}: {message}"
        );
    }
    // The replica shutting down while the re-run's session stream opens: nothing ran.
    let mut upstream = Upstream {
        session_stream_withheld: true,
        ..Upstream::default()
    };
    upstream.call_opens.push_back(lost());
    let responses = json!({"elicitation_0": accept("Lisbon")});
    let mut h = retry_of(&first, restartable, upstream, responses);
    h.feed(Input::GraceEnding);
    assert!(h.log.contains(&Command::ReleaseClaim), "{:?}", h.log);
    let message = &h.refusal().message;
    assert!(
        message.contains("its requestState is still good"),
        "{message}"
    );
    assert!(!h.log.iter().any(|c| matches!(c, Command::PostCall { .. })));
}

#[test]
fn a_lost_call_of_any_other_tool_ends_with_flow_lost() {
    let first = first_round();
    let mut upstream = Upstream::default();
    upstream.call_opens.push_back(Err(Failure::new(
        FailureKind::Unreachable,
        "cannot connect",
    )));
    let h = retry_of(
        &first,
        config(),
        upstream,
        json!({"elicitation_0": accept("Ada")}),
    );
    assert_eq!(h.refusal().code, gcode::FLOW_LOST);
    assert!(!h.log.contains(&Command::OpenSession), "nothing runs twice");
}

/// A first round without event ids: the upstream cannot resume, so the flow is held.
fn held_round() -> Harness {
    let mut h = Harness::new_call(config(), Upstream::default());
    h.event(Stream::Call, None, &question(0, "Name?"));
    h.event(Stream::Call, None, &question(1, "Age?"));
    h.advance(Duration::from_millis(10));
    h
}

#[test]
fn a_round_without_event_ids_is_held_and_its_retry_reads_on_the_held_streams() {
    let first = held_round();
    assert!(first
        .log
        .contains(&Command::Learn(Learnt::Resumable(false))));
    let hold = first
        .position(|c| matches!(c, Command::Hold { .. }))
        .unwrap();
    assert!(
        !first.log[hold..].contains(&Command::CloseStreams),
        "held streams stay open"
    );
    let state = first.state();
    let Waiting::Held { at, .. } = &state.waiting else {
        panic!("{state:?}");
    };
    assert_eq!(at.slot, 42);
    let id = first.call_id();
    let Ending::InputRequired { input_requests, .. } = first.ending() else {
        unreachable!()
    };
    // Only the first question is answered: the second is asked again after the window.
    let mut h = Harness::retry(
        config(),
        Upstream::default(),
        state,
        json!({"elicitation_0": accept("Ada")}),
        Some(input_requests.clone()),
    );
    assert!(
        !h.log
            .iter()
            .any(|c| matches!(c, Command::Get(StreamGet::Open { .. }))),
        "nothing reopened"
    );
    assert_eq!(h.posted().len(), 1);
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired { input_requests, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(input_requests.keys().collect::<Vec<_>>(), ["elicitation_1"]);
    let _ = id;
}

/// A held retry that no longer declares elicitation is not asked the earlier round's
/// unanswered question again (a server must not infer capabilities from earlier
/// requests): it hears -32021 naming the capability, and the call ends upstream.
#[test]
fn a_held_retry_that_drops_a_capability_is_not_asked_again_what_needs_it() {
    let first = held_round();
    let Ending::InputRequired { input_requests, .. } = first.ending() else {
        unreachable!()
    };
    let mut without = config();
    without.capabilities.clear();
    let h = Harness::retry(
        without,
        Upstream::default(),
        first.state(),
        json!({"elicitation_0": accept("Ada")}),
        Some(input_requests.clone()),
    );
    let refusal = h.refusal();
    assert_eq!(refusal.code, mcode::MISSING_REQUIRED_CLIENT_CAPABILITY);
    assert_eq!(
        refusal.data,
        Some(json!({"requiredCapabilities": {"elicitation": {"form": {}}}}))
    );
    assert!(h.log.contains(&Command::DeleteSession), "{:?}", h.log);
}

/// rmcp 0.16's shape: every stream opens with an event whose id is `0`, and the question
/// comes on the session's GET stream, also as `0`. (rmcp 1 and 2 number the call's
/// stream `0/N`; the GET stream still repeats `0`.)
fn round_with_ids_on_both_streams_alike(config: FlowConfig) -> Harness {
    let mut h = Harness::new_call(config, Upstream::default());
    h.event(Stream::Session, Some("0"), &json!(""));
    h.event(Stream::Call, Some("0"), &json!(""));
    h.event(Stream::Session, Some("0"), &question(0, "Name?"));
    h.advance(Duration::from_millis(10));
    h
}

#[test]
fn a_round_that_sees_an_event_id_twice_is_held_and_teaches_the_group() {
    let h = round_with_ids_on_both_streams_alike(config());
    assert!(h.log.contains(&Command::Learn(Learnt::EventIdsUnusable(
        UnusableIds::Repeated
    ))));
    assert!(h.log.contains(&Command::Learn(Learnt::Resumable(false))));
    assert!(h.log.iter().any(|c| matches!(c, Command::Hold { .. })));
    assert!(
        matches!(h.state().waiting, Waiting::Held { .. }),
        "{:?}",
        h.state()
    );
    // rmcp 2: the call's stream has ids of its own, the GET stream repeats `0`.
    let mut later = Harness::new_call(config(), Upstream::default());
    later.event(Stream::Session, Some("0"), &json!(""));
    later.event(Stream::Call, Some("0/0"), &json!(""));
    later.event(Stream::Session, Some("0"), &question(0, "Where?"));
    later.advance(Duration::from_millis(10));
    assert!(matches!(later.state().waiting, Waiting::Held { .. }));
    // Ids that differ keep the round resumable.
    let mut unique = Harness::new_call(config(), Upstream::default());
    unique.event(Stream::Session, Some("g0"), &json!(""));
    unique.event(Stream::Call, Some("c0"), &json!(""));
    unique.event(Stream::Session, Some("g1"), &question(0, "Name?"));
    unique.advance(Duration::from_millis(10));
    assert!(matches!(unique.state().waiting, Waiting::Resumable { .. }));
    assert!(!unique
        .log
        .contains(&Command::Learn(Learnt::EventIdsUnusable(
            UnusableIds::Repeated
        ))));
}

#[test]
fn a_group_forced_resumable_whose_event_ids_repeat_gets_a_clear_error() {
    let mut forced = config();
    forced.resume = ResumeMode::Resumable;
    let h = round_with_ids_on_both_streams_alike(forced);
    let refusal = h.refusal();
    assert!(
        refusal.message.contains("the same SSE event id twice"),
        "{refusal:?}"
    );
    assert!(h.log.contains(&Command::DeleteSession));
}

/// A call-stream event id no `Last-Event-ID` header can carry (a control character in
/// it): the round is held, the group learns its ids cannot resume, and a group forced
/// resumable is told why.
#[test]
fn a_round_whose_event_id_cannot_be_sent_back_is_held() {
    let round = |config: FlowConfig| {
        let mut h = Harness::new_call(config, Upstream::default());
        h.event(Stream::Call, Some("c\u{1}0"), &json!(""));
        h.event(Stream::Call, Some("c\u{1}1"), &question(0, "Name?"));
        h.advance(Duration::from_millis(10));
        h
    };
    let h = round(config());
    let learnt = Learnt::EventIdsUnusable(UnusableIds::NotAHeader);
    assert!(h.log.contains(&Command::Learn(learnt)), "{:?}", h.log);
    assert!(matches!(h.state().waiting, Waiting::Held { .. }));
    let mut forced = config();
    forced.resume = ResumeMode::Resumable;
    let refusal = round(forced).refusal().clone();
    assert!(
        refusal.message.contains("Last-Event-ID header"),
        "{refusal:?}"
    );
}

/// A held round's retry whose first answer the upstream refuses (401: the caller's token
/// expired): the client hears the challenge; the held flow ends, and since nothing
/// reached the call its state is not spent: sent again once re-authorized, it hears the
/// flow is lost (-32012, issue the call again), not that its state is invalid.
#[test]
fn a_held_retry_denied_before_any_answer_went_up_leaves_its_state_unspent() {
    let first = held_round();
    let Ending::InputRequired { input_requests, .. } = first.ending() else {
        unreachable!()
    };
    let mut upstream = Upstream::default();
    let denied = Failure::denied(401, Some("Bearer".into()), "requires authorization");
    upstream.posts.push_back(Err(denied));
    let h = Harness::retry(
        config(),
        upstream,
        first.state(),
        json!({"elicitation_0": accept("Ada")}),
        Some(input_requests.clone()),
    );
    assert!(h.log.contains(&Command::ReleaseClaim), "{:?}", h.log);
    assert!(h.log.contains(&Command::DeleteSession), "{:?}", h.log);
    assert_eq!(h.refusal().class, Class::Unauthorized);
}

#[test]
fn a_held_retry_whose_holder_is_gone_loses_the_flow() {
    let first = held_round();
    let h = Harness::retry(
        config(),
        Upstream::default(),
        first.state(),
        json!({}),
        None,
    );
    assert_eq!(h.refusal().code, gcode::FLOW_LOST);
    assert!(h.refusal().message.contains("replica holding"));
    // Nobody else ends the call its state names (a replica that died took its held
    // table and its reaper with it): its session is deleted, or in a data-layer session
    // the call cancelled.
    assert!(h.log.contains(&Command::DeleteSession), "{:?}", h.log);
    let mut data_held = Harness::new_call(in_data_session(), Upstream::default());
    data_held.event(Stream::Call, None, &question(0, "Name?"));
    data_held.advance(Duration::from_millis(10));
    let lost = Flow::call_lost(
        in_data_session(),
        data_held.state(),
        Map::new(),
        Lost::Holder,
        Instant::now(),
    );
    let mut lost = Harness {
        flow: lost,
        upstream: Upstream::default(),
        now: Instant::now(),
        log: Vec::new(),
        ending: None,
    };
    lost.settle();
    assert_eq!(cancellations(&lost).len(), 1, "{:?}", lost.log);
    // One that may have run it on (it saw the retry, then stopped answering) is not
    // interfered with.
    let mid_retry = Flow::call_lost(
        config(),
        first.state(),
        Map::new(),
        Lost::HolderMidRetry,
        Instant::now(),
    );
    let mut mid_retry = Harness {
        flow: mid_retry,
        upstream: Upstream::default(),
        now: Instant::now(),
        log: Vec::new(),
        ending: None,
    };
    mid_retry.settle();
    assert!(
        !mid_retry.log.contains(&Command::DeleteSession),
        "{:?}",
        mid_retry.log
    );
}

#[test]
fn a_table_that_refuses_the_flow_ends_the_call() {
    let upstream = Upstream {
        held: Err(Refusal::internal(
            Class::Overloaded,
            "too many flows are held",
        )),
        ..Upstream::default()
    };
    let mut h = Harness::new_call(config(), upstream);
    h.event(Stream::Call, None, &question(0, "Name?"));
    h.advance(Duration::from_millis(10));
    assert_eq!(h.refusal().class, Class::Overloaded);
}

/// A client that declares URL elicitation, as `config` otherwise is.
fn with_url_elicitation() -> FlowConfig {
    let mut caps = config();
    caps.capabilities
        .insert("elicitation".into(), json!({"url": {}}));
    caps
}

/// A new call under `config` whose upstream answers it with a 2025-11-25
/// URL-elicitation-required error (-32042) naming one URL; and the call's id.
fn url_required_round(config: FlowConfig) -> (Harness, i64) {
    let mut h = Harness::new_call(config, Upstream::default());
    let id = h.call_id();
    let error = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32042, "message": "visit", "data": {"elicitations": [
        {"mode": "url", "url": "https://example.com/a", "message": "Open A"}]}}});
    h.event(Stream::Call, Some("c1"), &error);
    (h, id)
}

/// A re-issue (after a URL elicitation) or a deferred call whose post is refused before
/// anything ran (a 401: the token expired while the user visited the URL) leaves its
/// state good, for the same retry once re-authorized; a re-issue keeps the session its
/// state names.
#[test]
fn a_reissue_or_deferred_call_denied_before_it_ran_leaves_its_state_good() {
    let caps = with_url_elicitation();
    let (h, _) = url_required_round(caps.clone());
    let denied = || Failure::denied(401, Some("Bearer".into()), "requires authorization");
    let upstream = Upstream {
        call_failures: VecDeque::from([denied()]),
        ..Upstream::default()
    };
    let responses = json!({"url_0": {"action": "accept"}});
    let reissued = Harness::retry(caps.clone(), upstream, h.state(), responses, None);
    assert_eq!(reissued.refusal().class, Class::Unauthorized);
    assert!(
        reissued.log.contains(&Command::ReleaseClaim),
        "{:?}",
        reissued.log
    );
    assert!(
        !reissued.log.contains(&Command::DeleteSession),
        "{:?}",
        reissued.log
    );

    let shed = FlowConfig {
        shedding: true,
        ..config()
    };
    let deferred = Harness::new_call(shed, Upstream::default()).state();
    let upstream = Upstream {
        open_failure: Some(denied()),
        ..Upstream::default()
    };
    let h = Harness::retry(config(), upstream, deferred, json!({}), None);
    assert_eq!(h.refusal().class, Class::Unauthorized);
    assert!(h.log.contains(&Command::ReleaseClaim), "{:?}", h.log);
}

#[test]
fn a_url_elicitation_required_error_is_asked_then_the_call_is_posted_again() {
    let caps = with_url_elicitation();
    let (h, id) = url_required_round(caps.clone());
    let state = h.state();
    assert!(matches!(state.waiting, Waiting::Reissue { .. }));
    assert!(h.log.contains(&Command::CloseStreams));
    let mut retry = Harness::retry(
        caps,
        Upstream::default(),
        state,
        json!({"url_0": {"action": "accept"}}),
        None,
    );
    let again = retry.call_id();
    assert_ne!(again, id, "a re-issue goes up under a new id");
    // Its questions may come on the session's GET stream, opened before it goes up.
    let stream = retry.position(is_open(Stream::Session, None));
    let posted = retry.position(|c| matches!(c, Command::PostCall { .. }));
    assert!(stream.is_some() && stream < posted, "{:?}", retry.log);
    retry.event(Stream::Call, Some("d1"), &result(again, "done"));
    assert!(matches!(retry.ending(), Ending::Complete { .. }));
    // A client that did not declare URL elicitation gets -32021.
    let (h, _) = url_required_round(config());
    assert_eq!(h.refusal().code, mcode::MISSING_REQUIRED_CLIENT_CAPABILITY);
}

/// A retry that declines (or cancels) every URL elicitation does not issue the call
/// again: the user refused what the server needs, as a legacy client whose user refuses
/// the URL does not retry. Its session ends. One answering any of them otherwise, or
/// none, goes on with a re-issue (the server decides whether the visit happened).
#[test]
fn a_declined_url_elicitation_does_not_issue_the_call_again() {
    let caps = with_url_elicitation();
    let (h, _) = url_required_round(caps.clone());
    let retry = |responses: Value| {
        Harness::retry(
            caps.clone(),
            Upstream::default(),
            h.state(),
            responses,
            None,
        )
    };
    let posts = |h: &Harness| {
        h.log
            .iter()
            .filter(|c| matches!(c, Command::PostCall { .. }))
            .count()
    };
    for action in ["decline", "cancel"] {
        let declined = retry(json!({"url_0": {"action": action}}));
        assert_eq!(posts(&declined), 0, "{:?}", declined.log);
        assert!(declined.log.contains(&Command::DeleteSession));
        assert!(!declined.log.contains(&Command::ReleaseClaim));
        let refusal = declined.refusal();
        assert_eq!(refusal.code, crate::protocol::jsonrpc::code::INTERNAL_ERROR);
        assert!(
            refusal
                .message
                .contains("declined the URL-mode elicitation"),
            "{refusal}"
        );
    }
    let with_two = json!({"url_0": {"action": "decline"}, "url_1": {"action": "accept"}});
    for goes_on in [with_two, json!({})] {
        let h = retry(goes_on);
        assert_eq!(posts(&h), 1, "{:?}", h.log);
        assert!(h.ending.is_none());
    }
}

#[test]
fn a_round_that_hears_nothing_ends_at_the_silence_limit() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    h.event(Stream::Call, Some("c3"), &json!(""));
    // Polls reopen the silent stream meanwhile; priming events are not messages.
    h.advance(Duration::from_secs(44));
    assert!(h.ending.is_none());
    h.advance(Duration::from_secs(2));
    let refusal = h.refusal();
    assert_eq!(refusal.class, Class::UpstreamTimeout);
    assert!(
        refusal
            .message
            .contains("upstream group 'g' sent nothing for 45 s"),
        "{refusal}"
    );
    assert!(
        refusal.message.contains("tools/call 'ask'") && refusal.message.contains("round 2"),
        "{refusal}"
    );
    let polls = h
        .log
        .iter()
        .filter(|c| is_open(Stream::Call, Some("c3"))(c))
        .count();
    assert!(polls >= 20, "a silent resumable stream is polled: {polls}");
}

/// A silent call stream is polled (reopened after its last event id) only where the
/// round could resume: a group held by configuration, or one that learnt its
/// resumptions fail, keeps reading the live stream (a reopen would drop it for a
/// resumption the upstream cannot serve, or one that replays another stream).
#[test]
fn a_silent_call_stream_is_polled_only_where_the_round_could_resume() {
    let polls = |config: FlowConfig| {
        let mut h = Harness::new_call(config, Upstream::default());
        h.event(Stream::Call, Some("0"), &json!(""));
        h.advance(Duration::from_secs(10));
        assert!(h.ending.is_none());
        h.log
            .iter()
            .filter(|c| is_open(Stream::Call, Some("0"))(c))
            .count()
    };
    assert!(
        polls(config()) > 0,
        "a resumable group's silent stream is polled"
    );
    let mut held = config();
    held.resume = ResumeMode::Hold;
    assert_eq!(polls(held), 0, "resume: hold");
    let mut learnt = config();
    learnt.replay_refused = true;
    assert_eq!(polls(learnt), 0, "a group that learnt its resumptions fail");
}

/// The state of a round handed over by a drain: the client got it alone, no questions.
fn handed_over(h: &Harness) -> &FlowState {
    assert!(h.log.contains(&Command::Note(Note::HandedOver)));
    let Ending::InputRequired {
        input_requests,
        state,
        ..
    } = h.ending()
    else {
        panic!("{:?}", h.ending());
    };
    assert!(input_requests.is_empty(), "a state-only result");
    state
}

#[test]
fn draining_hands_a_resumable_round_over_and_lets_a_held_one_run() {
    let mut h = Harness::new_call(config(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.feed(Input::Draining);
    assert!(matches!(handed_over(&h).waiting, Waiting::Resumable { .. }));
    // Draining before the call's stream showed an event id: handed over once it does.
    let mut early = Harness::new_call(config(), Upstream::default());
    early.feed(Input::Draining);
    assert!(early.ending.is_none(), "not resumable yet");
    early.event(Stream::Call, Some("c1"), &json!(""));
    assert!(early.log.contains(&Command::Note(Note::HandedOver)));
    assert!(matches!(early.ending(), Ending::InputRequired { .. }));
    let mut held = Harness::new_call(config(), Upstream::default());
    held.event(
        Stream::Call,
        None,
        &json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}),
    );
    held.feed(Input::Draining);
    assert!(
        held.ending.is_none(),
        "a round that cannot resume finishes here"
    );
    // Unless the grace period ends first: then the round ends with its upstream call,
    // rather than be cut when the process exits.
    held.feed(Input::GraceEnding);
    assert!(held.log.contains(&Command::DeleteSession));
    let refusal = held.refusal();
    assert_eq!(refusal.class, Class::Overloaded);
    assert!(
        refusal.message.contains("shutting down"),
        "{}",
        refusal.message
    );
}

/// A drain that begins while a retry's resumed stream settles: the answers go up once
/// the stream is live, and the round is then handed over, not run to its end.
#[test]
fn draining_while_a_retry_settles_posts_the_answers_then_hands_the_round_over() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    h.feed(Input::Draining);
    assert!(h.ending.is_none(), "the answers have not gone up yet");
    assert!(h.posted().is_empty());
    h.event(Stream::Call, Some("c3"), &json!(""));
    assert_eq!(
        h.posted(),
        [json!({"jsonrpc": "2.0", "id": 0, "result": accept("Ada")})]
    );
    let state = handed_over(&h);
    let Waiting::Resumable { pending, .. } = &state.waiting else {
        panic!("{:?}", state.waiting);
    };
    assert!(pending.is_empty(), "the answer went up: {pending:?}");
}

/// A client that leaves before its retry's answers went up cancels the call, as it does
/// once they are up: nothing is posted, and the session is deleted.
#[test]
fn a_client_that_leaves_while_its_retry_settles_cancels_the_call() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    h.feed(Input::ClientGone);
    assert_cancelled_before_answering(&h);
}

#[test]
fn a_client_that_leaves_while_an_empty_resumption_backs_off_cancels_the_call() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    h.feed(Input::StreamEnded(Stream::Call));
    assert!(h.ending.is_none(), "an empty resumption is tried again");
    h.feed(Input::ClientGone);
    assert_cancelled_before_answering(&h);
}

fn assert_cancelled_before_answering(h: &Harness) {
    assert_eq!(h.ending(), &Ending::ClientGone);
    assert!(h.posted().is_empty(), "no answer went up");
    assert!(h.log.contains(&Command::CloseStreams) && h.log.contains(&Command::DeleteSession));
    assert!(!h.log.contains(&Command::ReleaseClaim), "{:?}", h.log);
}

#[test]
fn a_client_that_leaves_cancels_the_call() {
    let mut h = Harness::new_call(config(), Upstream::default());
    h.feed(Input::ClientGone);
    assert_eq!(h.ending(), &Ending::ClientGone);
    assert!(h.log.contains(&Command::DeleteSession) && h.log.contains(&Command::CloseStreams));
}

/// A server that sends a POST stream's header only with its first event (TypeScript SDK
/// releases that do not flush it) and asks on the session's GET stream: the question
/// comes while the call's answer is still awaited.
fn withheld() -> Upstream {
    Upstream {
        answer_withheld: true,
        ..Upstream::default()
    }
}

fn session_question(h: &mut Harness) {
    h.feed(Input::Event {
        stream: Stream::Session,
        event: Event::message(Some("g1".into()), question(0, "Name?").to_string()),
    });
}

#[test]
fn a_question_while_the_calls_answer_is_withheld_starts_the_round() {
    let mut first = Harness::new_call(config(), withheld());
    assert!(first.flow.is_posting(), "the call's answer is awaited");
    session_question(&mut first);
    first.advance(Duration::from_millis(50));
    assert!(!first.flow.is_reading(), "the answer may still come");
    first.advance(Duration::from_millis(100));
    // No event id on the call's stream: the round cannot be resumed, and is held with
    // the call's POST still awaiting its answer.
    let state = first.state();
    assert!(matches!(state.waiting, Waiting::Held { .. }), "{state:?}");
    let id = first.call_id();
    let Ending::InputRequired { input_requests, .. } = first.ending() else {
        unreachable!()
    };
    assert_eq!(input_requests.keys().collect::<Vec<_>>(), ["elicitation_0"]);
    let mut h = Harness::retry(
        config(),
        Upstream::default(),
        state,
        json!({"elicitation_0": accept("Ada")}),
        Some(input_requests.clone()),
    );
    assert_eq!(h.posted().len(), 1, "the answer goes up");
    // The call's answer comes once the tool writes to its stream: its header, its result.
    h.feed(Input::CallPosted(Ok(CallReply::Stream)));
    h.event(Stream::Call, Some("c1"), &result(id, "Hello, Ada!"));
    assert!(
        matches!(h.ending(), Ending::Complete { .. }),
        "{:?}",
        h.ending()
    );
}

#[test]
fn a_question_just_before_a_prompt_answer_is_read_after_it_and_the_round_resumes() {
    let mut h = Harness::new_call(config(), withheld());
    session_question(&mut h);
    h.now += Duration::from_millis(3);
    h.feed(Input::CallPosted(Ok(CallReply::Stream)));
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.advance(Duration::from_millis(10));
    let state = h.state();
    let Waiting::Resumable { positions, .. } = &state.waiting else {
        panic!("{state:?}");
    };
    assert_eq!(positions.last_event_id.as_deref(), Some("c1"));
}

#[test]
fn a_call_answered_with_one_message_after_the_session_spoke_completes() {
    let mut first = Harness::new_call(config(), withheld());
    let note = json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "x"}});
    first.feed(Input::Event {
        stream: Stream::Session,
        event: Event::message(None, note.to_string()),
    });
    let id = first.call_id();
    first.feed(Input::CallPosted(Ok(CallReply::Message(result(
        id, "done",
    )))));
    assert!(
        matches!(first.ending(), Ending::Complete { .. }),
        "{:?}",
        first.ending()
    );
}

/// While the call's answer is awaited (an upstream that sends its POST stream's header
/// only with the first event), the client is sent keep-alives as while a round reads,
/// so that idle timeouts in front do not cut it; the answer timeout still ends the wait.
#[test]
fn a_client_waiting_for_a_withheld_answer_is_kept_alive() {
    let keepalives = |h: &Harness| h.log.iter().filter(|c| **c == Command::KeepAlive).count();
    let config = FlowConfig {
        keepalive: Some(Duration::from_secs(15)),
        ..config()
    };
    let mut h = Harness::new_call(config, withheld());
    h.advance(Duration::from_secs(31));
    assert!(h.ending.is_none());
    assert_eq!(keepalives(&h), 2, "{:?}", h.log);
    h.advance(Duration::from_secs(30));
    assert_eq!(h.refusal().class, Class::UpstreamTimeout);
    assert_eq!(keepalives(&h), 3, "none after the wait ended: {:?}", h.log);
}

#[test]
fn a_call_unanswered_with_nothing_else_coming_times_out() {
    let mut h = Harness::new_call(config(), withheld());
    h.advance(Duration::from_secs(59));
    assert!(h.ending.is_none(), "within the answer timeout");
    h.advance(Duration::from_secs(2));
    assert_eq!(
        h.refusal().class,
        Class::UpstreamTimeout,
        "{:?}",
        h.refusal()
    );
    assert!(h.log.contains(&Command::DeleteSession) && h.log.contains(&Command::CloseStreams));
}

#[test]
fn a_client_that_leaves_while_the_call_is_unanswered_cancels_it() {
    let mut h = Harness::new_call(config(), withheld());
    h.feed(Input::ClientGone);
    assert_eq!(h.ending(), &Ending::ClientGone);
    assert!(h.log.contains(&Command::DeleteSession) && h.log.contains(&Command::CloseStreams));
}

#[test]
fn a_round_ends_as_it_fills_up() {
    let mut limited = config();
    limited.round_limits.max_questions = 2;
    let mut h = Harness::new_call(limited, Upstream::default());
    h.event(Stream::Call, Some("c1"), &question(0, "a"));
    assert!(h.ending.is_none());
    h.event(Stream::Call, Some("c2"), &question(1, "b"));
    let Ending::InputRequired { input_requests, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(input_requests.len(), 2, "no quiet window waited");
    assert!(
        !h.flow.is_reading(),
        "what the upstream sends next is the next round's"
    );
}

#[test]
fn questions_on_the_get_stream_carry_its_position_and_a_scoped_store_is_resumed_from_it() {
    let mut h = Harness::new_call(config(), Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(
        Stream::Session,
        Some("g1"),
        &json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {}}),
    );
    h.event(Stream::Session, Some("g2"), &question(0, "Where?"));
    h.advance(Duration::from_millis(10));
    let state = h.state();
    let Waiting::Resumable { positions, .. } = &state.waiting else {
        panic!("{state:?}");
    };
    assert_eq!(
        positions.session_from.as_deref(),
        Some("g1"),
        "before the round's first GET question"
    );
    let first = h;
    let answers = json!({"elicitation_0": accept("Lisbon")});
    let mut scoped = retry_of(&first, config(), Upstream::default(), answers.clone());
    scoped.event(Stream::Call, Some("c2"), &json!(""));
    assert!(scoped.log.iter().any(is_open(Stream::Session, Some("g1"))));
    let mut shared = config();
    shared.session_replay_scoped = false;
    let mut h = retry_of(&first, shared, Upstream::default(), answers);
    h.event(Stream::Call, Some("c2"), &json!(""));
    assert!(
        h.log.iter().any(is_open(Stream::Session, None)),
        "a shared store's GET stream is reopened fresh"
    );
    // The next question, pushed on the GET stream once the answer is in, is read; the
    // round pings the session before it ends, then waits the quiet window.
    h.event(Stream::Session, Some("g9"), &question(1, "Nights?"));
    h.advance(Duration::from_millis(10));
    assert!(h.log.iter().any(|c| matches!(c, Command::Barrier { .. })));
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired { input_requests, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(input_requests.keys().collect::<Vec<_>>(), ["elicitation_1"]);
}

/// Where the group's store is shared by sessions, the retry reopens the GET stream fresh:
/// a question the tool sends there just after one on the call's stream (asyncio.gather of
/// an elicitation and a sampling request without a related id) would be lost if the
/// round ended first. The round pings the session and ends only after the answer, with
/// whatever came before it; where the store keeps sessions apart, nothing is pinged.
#[test]
fn a_round_whose_get_stream_reopens_fresh_pings_the_session_before_it_ends() {
    let mut shared = config();
    shared.session_replay_scoped = false;
    shared.asks_at_once = false;
    shared.capabilities.insert("sampling".into(), json!({}));
    let upstream = Upstream {
        barrier_answered: false,
        ..Upstream::default()
    };
    let mut h = Harness::new_call(shared, upstream);
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    h.advance(Duration::from_millis(100));
    assert!(h.log.iter().any(|c| matches!(c, Command::Barrier { .. })));
    assert!(h.ending.is_none(), "the round waits for the ping's answer");
    let sampling = json!({"jsonrpc": "2.0", "id": 1, "method": "sampling/createMessage",
        "params": {"messages": [], "maxTokens": 5}});
    h.event(Stream::Session, Some("g1"), &sampling);
    h.feed(Input::BarrierPassed);
    h.advance(Duration::from_millis(10));
    let Ending::InputRequired { input_requests, .. } = h.ending() else {
        panic!("{:?}", h.ending());
    };
    assert_eq!(input_requests.len(), 2, "{input_requests:?}");
    let barriers = h
        .log
        .iter()
        .filter(|c| matches!(c, Command::Barrier { .. }))
        .count();
    assert_eq!(barriers, 1, "one ping a round");
    // A store that keeps sessions apart resumes the GET stream: no ping.
    let mut scoped = config();
    scoped.asks_at_once = false;
    let mut h = Harness::new_call(scoped, Upstream::default());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    h.advance(Duration::from_millis(1));
    assert!(!h.log.iter().any(|c| matches!(c, Command::Barrier { .. })));
    assert!(matches!(h.ending(), Ending::InputRequired { .. }));
}

/// The replica that opened a flow deletes its session at the flow's deadline, whether
/// or not a retry runs elsewhere. A round still reading then ends itself just before, with
/// an error naming the limit, not the upstream's failure its session's end would cause.
#[test]
fn a_round_still_reading_at_the_flows_deadline_ends_naming_the_limit() {
    let first = first_round();
    let mut late = config();
    late.now_secs += late.max_flow_seconds - 10;
    let mut h = retry_of(
        &first,
        late,
        Upstream::default(),
        json!({"elicitation_0": accept("Ada")}),
    );
    h.event(Stream::Call, Some("c3"), &json!(""));
    assert_eq!(h.posted().len(), 1, "the answer went up");
    ends_a_second_before_the_deadline(&mut h);
}

/// A retry whose flow ends in 10 s runs on for 9 s, then ends naming the limit, its
/// session deleted.
fn ends_a_second_before_the_deadline(h: &mut Harness) {
    h.advance(Duration::from_millis(8_900));
    assert!(
        h.ending.is_none(),
        "runs on until a second before the deadline"
    );
    h.advance(Duration::from_millis(200));
    let refusal = h.refusal();
    assert_eq!(refusal.class, Class::OverLimit);
    assert!(
        refusal.message.contains("bridge.max_flow_seconds"),
        "{}",
        refusal.message
    );
    assert!(h.log.contains(&Command::DeleteSession));
}

/// A retry whose streams do not come back (the upstream takes the GETs and answers
/// nothing) ends at the flow's deadline naming the limit, not a response timeout later:
/// the shell may stop waiting for a reopening's GETs when the flow wants the clock.
#[test]
fn a_retry_whose_streams_hang_ends_at_the_flows_deadline() {
    let first = first_round();
    let mut late = config();
    late.now_secs += late.max_flow_seconds - 10;
    let hanging = Upstream {
        reopen_withheld: true,
        ..Upstream::default()
    };
    let mut h = retry_of(
        &first,
        late,
        hanging,
        json!({"elicitation_0": accept("Ada")}),
    );
    let reopen = h.log.last().expect("a command");
    assert!(
        matches!(reopen, Command::Get(StreamGet::Reopen { .. })),
        "{reopen:?}"
    );
    ends_a_second_before_the_deadline(&mut h);
    assert!(h.posted().is_empty(), "no answer went up");
}

/// A round whose call stream the upstream ended, and whose reopening (a GET after the
/// stream's last event id) then hangs, ends at its silence or at the flow's deadline,
/// whichever comes first: the flow wants the clock while it reopens, and the shell may
/// cut the GET then.
#[test]
fn a_round_whose_reopened_stream_hangs_ends_at_its_silence_or_the_deadline() {
    let hanging = || Upstream {
        reopen_withheld: true,
        ..Upstream::default()
    };
    let reopened_and_hanging = |config: FlowConfig| {
        let mut h = Harness::new_call(config, hanging());
        h.event(Stream::Call, Some("c1"), &json!(""));
        h.feed(Input::StreamEnded(Stream::Call));
        h.advance(Duration::from_secs(2));
        let open = h.log.last().expect("a command").clone();
        assert!(is_open(Stream::Call, Some("c1"))(&open), "{open:?}");
        h
    };
    // Silence first (45 s).
    let mut h = reopened_and_hanging(config());
    h.advance(Duration::from_secs(42));
    assert!(h.ending.is_none(), "reads on before its silence");
    h.advance(Duration::from_secs(2));
    assert_eq!(h.refusal().class, Class::UpstreamTimeout);
    assert!(h.log.contains(&Command::DeleteSession));
    // The deadline first (10 s).
    let mut short = config();
    short.max_flow_seconds = 10;
    let mut h = reopened_and_hanging(short);
    h.advance(Duration::from_secs(8));
    let refusal = h.refusal();
    assert!(
        refusal.message.contains("bridge.max_flow_seconds"),
        "{refusal}"
    );
}

/// Sooner than the deadline, a retry whose streams do not come back ends at the round's
/// silence, naming it; no answer went up.
#[test]
fn a_retry_whose_streams_hang_ends_at_the_rounds_silence() {
    let first = first_round();
    let hanging = Upstream {
        reopen_withheld: true,
        ..Upstream::default()
    };
    let answers = json!({"elicitation_0": accept("Ada")});
    let mut h = retry_of(&first, config(), hanging, answers);
    h.advance(Duration::from_secs(44));
    assert!(h.ending.is_none(), "waits for the round's silence");
    h.advance(Duration::from_secs(2));
    let refusal = h.refusal();
    assert_eq!(refusal.class, Class::UpstreamTimeout);
    assert!(
        refusal.message.contains("bridge.round_silence_seconds"),
        "{refusal}"
    );
    assert!(h.log.contains(&Command::DeleteSession));
    assert!(h.posted().is_empty(), "no answer went up");
}

/// A client that leaves while a retry's streams reopen (the GETs cut) ends the call, and
/// nothing goes up; at the grace period's end the retry is refused for the client to send
/// again elsewhere, its claim released and its call left waiting.
#[test]
fn a_retry_reopening_its_streams_hears_the_client_leave_and_the_grace_period_end() {
    let first = first_round();
    let hanging = || Upstream {
        reopen_withheld: true,
        ..Upstream::default()
    };
    let answers = || json!({"elicitation_0": accept("Ada")});
    let mut h = retry_of(&first, config(), hanging(), answers());
    h.feed(Input::ClientGone);
    assert!(matches!(h.ending(), Ending::ClientGone));
    assert!(h.log.contains(&Command::DeleteSession));
    assert!(h.posted().is_empty());

    let mut h = retry_of(&first, config(), hanging(), answers());
    h.feed(Input::GraceEnding);
    let refusal = h.refusal();
    assert_eq!(refusal.class, Class::Overloaded);
    assert!(refusal.message.contains("still good"), "{refusal}");
    assert!(h.log.contains(&Command::ReleaseClaim));
    assert!(!h.log.contains(&Command::DeleteSession));
    assert!(h.posted().is_empty());
}

/// The same while a new call's session stream opens, before the call goes up: the
/// session is deleted either way.
#[test]
fn a_call_opening_its_session_stream_hears_the_client_leave_and_the_grace_period_end() {
    let hanging = || Upstream {
        session_stream_withheld: true,
        ..Upstream::default()
    };
    let mut h = Harness::new_call(config(), hanging());
    let open = h.log.last().expect("a command").clone();
    assert!(is_open(Stream::Session, None)(&open), "{open:?}");
    h.feed(Input::ClientGone);
    assert!(matches!(h.ending(), Ending::ClientGone));
    assert!(h.log.contains(&Command::DeleteSession));
    let mut h = Harness::new_call(config(), hanging());
    h.feed(Input::GraceEnding);
    assert_eq!(h.refusal().class, Class::Overloaded);
    assert!(h.log.contains(&Command::DeleteSession));
    assert!(!h.log.iter().any(|c| matches!(c, Command::PostCall { .. })));
}

/// A call whose answer has not come (a server answering in JSON once its tool is done)
/// cannot be handed over: it ends with the grace period's last stretch, and at the flow's
/// deadline, as a round still reading does.
#[test]
fn a_call_whose_answer_has_not_come_ends_at_the_grace_periods_end_and_the_deadline() {
    let mut h = Harness::new_call(config(), withheld());
    h.feed(Input::Draining);
    assert!(h.ending.is_none(), "runs on through the grace period");
    h.feed(Input::GraceEnding);
    assert!(h.log.contains(&Command::DeleteSession));
    assert!(
        h.refusal().message.contains("shutting down"),
        "{}",
        h.refusal().message
    );

    let mut short = config();
    short.max_flow_seconds = 10;
    short.answer_timeout = Duration::from_secs(60);
    let mut h = Harness::new_call(short, withheld());
    h.advance(Duration::from_millis(9_100));
    assert!(h.log.contains(&Command::DeleteSession));
    let refusal = h.refusal();
    assert!(
        refusal.message.contains("bridge.max_flow_seconds"),
        "{}",
        refusal.message
    );
}

#[test]
fn a_stream_the_upstream_closes_mid_call_is_followed_after_its_retry_hint() {
    let mut h = Harness::new_call(config(), Upstream::default());
    let id = h.call_id();
    let priming = Event {
        id: Some("c1".into()),
        event: None,
        data: String::new(),
        retry: Some(500),
    };
    h.feed(Input::Event {
        stream: Stream::Call,
        event: priming,
    });
    h.feed(Input::StreamEnded(Stream::Call));
    h.advance(Duration::from_millis(499));
    assert!(!h.log.iter().any(is_open(Stream::Call, Some("c1"))));
    h.advance(Duration::from_millis(1));
    assert!(h.log.iter().any(is_open(Stream::Call, Some("c1"))));
    h.event(Stream::Call, Some("c2"), &result(id, "done"));
    assert!(matches!(h.ending(), Ending::Complete { .. }));
}

#[test]
fn a_state_too_large_to_come_back_is_never_issued() {
    let mut tight = config();
    tight.max_state_plaintext = 100;
    let mut h = Harness::new_call(tight, Upstream::default());
    h.event(Stream::Call, Some(&"e".repeat(200)), &question(0, "Name?"));
    h.advance(Duration::from_millis(10));
    let refusal = h.refusal();
    assert_eq!(refusal.class, Class::OverLimit);
    assert!(refusal.message.contains("SSE event ids"), "{refusal}");
    assert!(h.log.contains(&Command::DeleteSession));
}

#[test]
fn a_reaper_that_cannot_watch_refuses_the_flow() {
    let upstream = Upstream {
        watched: false,
        ..Upstream::default()
    };
    let mut h = Harness::new_call(config(), upstream);
    h.event(Stream::Call, Some("c1"), &question(0, "Name?"));
    h.advance(Duration::from_millis(10));
    assert_eq!(h.refusal().class, Class::Overloaded);
    assert!(h.log.contains(&Command::DeleteSession));
}

#[test]
fn a_request_the_client_cannot_take_is_refused_upstream_before_the_call_ends() {
    let mut h = Harness::new_call(config(), Upstream::default());
    let sampling = json!({"jsonrpc": "2.0", "id": 3, "method": "sampling/createMessage", "params": {"messages": []}});
    h.event(Stream::Call, Some("c1"), &sampling);
    let refused_at = h
        .position(|c| matches!(c, Command::Post(v) if v["error"]["code"] == -32601))
        .unwrap();
    let finished_at = h.position(|c| matches!(c, Command::Finish(_))).unwrap();
    assert!(refused_at < finished_at);
    assert_eq!(h.refusal().code, mcode::MISSING_REQUIRED_CLIENT_CAPABILITY);
}

#[test]
fn an_answer_that_provably_never_arrived_releases_the_claim() {
    let first = first_round();
    for (failure, class) in [
        (FailureKind::Refused(400), Class::UpstreamError),
        (FailureKind::NotSent, Class::Overloaded),
    ] {
        let mut upstream = Upstream::default();
        upstream
            .posts
            .push_back(Err(Failure::new(failure, "not taken")));
        let mut h = retry_of(
            &first,
            config(),
            upstream,
            json!({"elicitation_0": accept("Ada")}),
        );
        h.event(Stream::Call, Some("c3"), &json!(""));
        assert!(h.log.contains(&Command::ReleaseClaim), "{failure:?}");
        assert!(
            !h.log.contains(&Command::DeleteSession),
            "the call waits for the same state again"
        );
        assert_eq!(h.refusal().class, class);
    }
    // A timeout, or a proxy's 502 or 504, may have delivered it: the claim stays, and
    // the call ends upstream, so that no replica resumes it and posts the answer a
    // second time.
    for (failure, class) in [
        (FailureKind::Timeout, Class::UpstreamTimeout),
        (FailureKind::Refused(502), Class::UpstreamError),
        (FailureKind::Refused(504), Class::UpstreamError),
    ] {
        let mut upstream = Upstream::default();
        upstream
            .posts
            .push_back(Err(Failure::new(failure, "no answer from the server")));
        let mut h = retry_of(
            &first,
            config(),
            upstream,
            json!({"elicitation_0": accept("Ada")}),
        );
        h.event(Stream::Call, Some("c3"), &json!(""));
        assert!(!h.log.contains(&Command::ReleaseClaim), "{failure:?}");
        assert!(h.log.contains(&Command::DeleteSession), "{failure:?}");
        assert_eq!(h.refusal().class, class);
    }
}

#[test]
fn an_answer_that_failed_after_others_went_up_ends_the_call_upstream() {
    let mut upstream = Upstream::default();
    upstream.posts.push_back(Ok(()));
    upstream.posts.push_back(Err(Failure::new(
        FailureKind::Refused(400),
        "refused (HTTP 400)",
    )));
    let mut first = Harness::new_call(config(), Upstream::default());
    first.event(Stream::Call, Some("c1"), &json!(""));
    first.event(Stream::Call, Some("c2"), &question(0, "Color?"));
    first.event(Stream::Call, Some("c3"), &question(1, "Size?"));
    first.advance(Duration::from_millis(10));
    let both = json!({"elicitation_0": accept("red"), "elicitation_1": accept("L")});
    let mut h = retry_of(&first, config(), upstream, both);
    h.event(Stream::Call, Some("c4"), &json!(""));
    assert_eq!(h.posted().len(), 2);
    assert!(!h.log.contains(&Command::ReleaseClaim));
    assert!(h.log.contains(&Command::DeleteSession));
    assert_eq!(h.refusal().class, Class::UpstreamError);
}

#[test]
fn a_data_session_call_reads_only_its_own_stream_and_never_deletes_the_session() {
    let mut in_session = config();
    in_session.data_session = true;
    let mut h = Harness::new_call(in_session, Upstream::default());
    assert!(!h.log.iter().any(|c| matches!(
        c,
        Command::Get(StreamGet::Open {
            stream: Stream::Session,
            ..
        })
    )));
    let id = h.call_id();
    h.event(Stream::Call, Some("c1"), &result(id, "done"));
    assert!(matches!(h.ending(), Ending::Complete { .. }));
    assert!(!h.log.contains(&Command::DeleteSession));
}

#[test]
fn the_previous_layout_flows_complete_on_this_one() {
    // A state the previous release sealed opens as its phase (mrtr::state tests the
    // layout); its retry runs here like any other.
    let first = first_round();
    let state = first.state();
    let old = crate::mrtr::state::v1::FlowState::from(&state);
    let reopened = FlowState::from(old);
    let id = first.call_id();
    let mut h = Harness::retry(
        config(),
        Upstream::default(),
        reopened,
        json!({"elicitation_0": accept("Ada")}),
        None,
    );
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Call, Some("c4"), &result(id, "done"));
    assert!(matches!(h.ending(), Ending::Complete { .. }));
}

fn in_data_session() -> FlowConfig {
    FlowConfig {
        data_session: true,
        ..config()
    }
}

/// The cancellations a flow left for the shell to post.
fn cancellations(h: &Harness) -> Vec<Value> {
    h.log
        .iter()
        .filter_map(|c| match c {
            Command::Cancel(cancel) => Some(cancel.to_json()),
            _ => None,
        })
        .collect()
}

/// A call in a data-layer session that its client leaves is cancelled upstream by id (the
/// session outlives it, so deleting it is not how it ends); closing its stream alone would
/// leave the tool running in the server.
#[test]
fn a_data_session_call_its_client_leaves_is_cancelled_by_id() {
    let mut h = Harness::new_call(in_data_session(), Upstream::default());
    let id = h.call_id();
    h.feed(Input::ClientGone);
    assert_eq!(h.ending(), &Ending::ClientGone);
    assert!(!h.log.contains(&Command::DeleteSession));
    assert_eq!(
        cancellations(&h),
        [
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": id, "reason": "the client cancelled the request"}})
        ]
    );
    let closed = h.position(|c| *c == Command::CloseStreams).expect("closed");
    let cancelled = h.position(|c| matches!(c, Command::Cancel(_)));
    assert!(Some(closed) < cancelled, "{:?}", h.log);
}

/// A data-session call the gateway stops waiting for (here, silent past the limit) is
/// cancelled too; one that completes is not, and outside a data session the session's
/// DELETE ends the call instead.
#[test]
fn a_data_session_call_the_gateway_gives_up_on_is_cancelled_and_a_complete_one_is_not() {
    let mut h = Harness::new_call(in_data_session(), Upstream::default());
    let id = h.call_id();
    h.advance(Duration::from_secs(46));
    assert_eq!(h.refusal().class, Class::UpstreamTimeout);
    // Its client learns why a question may never have come.
    assert!(h.refusal().message.contains("the session's GET stream"));
    let cancelled = cancellations(&h);
    assert_eq!(cancelled.len(), 1, "{:?}", h.log);
    assert_eq!(cancelled[0]["params"]["requestId"], id);

    let mut h = Harness::new_call(in_data_session(), Upstream::default());
    let id = h.call_id();
    h.event(Stream::Call, Some("c1"), &result(id, "done"));
    assert!(matches!(h.ending(), Ending::Complete { .. }));
    assert!(cancellations(&h).is_empty(), "{:?}", h.log);

    let mut h = Harness::new_call(config(), Upstream::default());
    h.advance(Duration::from_secs(46));
    assert!(cancellations(&h).is_empty(), "{:?}", h.log);
    assert!(h.log.contains(&Command::DeleteSession));
}

/// A data-layer session the upstream ends while a call runs in it (the client deleted it
/// from elsewhere, the server restarted) ends for the client as the README says, with
/// `Session ended` and the cookie revoked, and nothing is cancelled in a session that is
/// gone. Outside a data session the call fails as the upstream's error.
#[test]
fn a_data_session_the_upstream_ends_mid_call_ends_for_its_client() {
    let gone = || Upstream {
        call_opens: [Err(Failure::new(
            FailureKind::Gone,
            "no longer has the session",
        ))]
        .into(),
        ..Upstream::default()
    };
    let mut h = Harness::new_call(in_data_session(), gone());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.feed(Input::StreamEnded(Stream::Call));
    h.advance(DEFAULT_RETRY);
    assert_eq!(h.refusal().class, Class::SessionEnded);
    assert_eq!(h.refusal().code, gcode::SESSION_ENDED);
    assert!(cancellations(&h).is_empty(), "{:?}", h.log);

    let mut h = Harness::new_call(config(), gone());
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.feed(Input::StreamEnded(Stream::Call));
    h.advance(DEFAULT_RETRY);
    assert_eq!(h.refusal().class, Class::UpstreamError);
}

/// A held round says what ends its call if its client never continues it: in a data-layer
/// session (not deleted with the flow) the call's cancellation, otherwise nothing (the
/// session is deleted).
#[test]
fn a_held_data_session_round_says_how_its_call_ends_on_expiry() {
    let hold = |data_session: bool| {
        let config = FlowConfig {
            resume: ResumeMode::Hold,
            data_session,
            ..config()
        };
        let mut h = Harness::new_call(config, Upstream::default());
        h.event(Stream::Call, Some("c1"), &question(0, "Name?"));
        h.advance(Duration::from_millis(10));
        let cancel = h.log.iter().find_map(|c| match c {
            Command::Hold {
                cancel_on_expiry, ..
            } => Some(cancel_on_expiry.clone()),
            _ => None,
        });
        (h.call_id(), cancel.expect("the round is held"))
    };
    let (id, cancel) = hold(true);
    let cancel = cancel.expect("a cancellation").to_json();
    assert_eq!(cancel["method"], "notifications/cancelled");
    assert_eq!(cancel["params"]["requestId"], id);
    assert_eq!(hold(false).1, None);
}

/// A data-layer session's call that waits for answers resumably is left to the reaper of
/// the replica that posted it, under its upstream id: a client that never continues it
/// would otherwise leave it running in the server until the session ends. The retry that
/// ends it stops the watch; a held round leaves it to the held table instead.
#[test]
fn a_waiting_data_session_call_is_watched_by_id_until_its_retry_ends_it() {
    let mut first = Harness::new_call(in_data_session(), Upstream::default());
    let id = first.call_id();
    first.event(Stream::Call, Some("c1"), &json!(""));
    first.event(Stream::Call, Some("c2"), &question(0, "Name?"));
    first.advance(Duration::from_millis(10));
    let watch = first.log.iter().find_map(|c| match c {
        Command::Watch { call, .. } => Some(call.clone()),
        _ => None,
    });
    assert_eq!(watch, Some(Some(json!(id))), "{:?}", first.log);
    assert!(matches!(first.ending(), Ending::InputRequired { .. }));
    assert!(!first
        .log
        .iter()
        .any(|c| matches!(c, Command::Unwatch { .. })));

    let responses = json!({"elicitation_0": accept("Ada")});
    let mut h = retry_of(&first, in_data_session(), Upstream::default(), responses);
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Call, Some("c4"), &result(id, "Hello, Ada!"));
    assert!(matches!(h.ending(), Ending::Complete { .. }));
    let unwatch = h.position(|c| *c == Command::Unwatch { call: json!(id) });
    let finish = h.position(|c| matches!(c, Command::Finish(_)));
    assert!(unwatch.is_some() && unwatch < finish, "{:?}", h.log);
    assert!(!h.log.iter().any(|c| matches!(c, Command::Watch { .. })));

    let held = FlowConfig {
        resume: ResumeMode::Hold,
        ..in_data_session()
    };
    let mut h = Harness::new_call(held, Upstream::default());
    h.event(Stream::Call, Some("c1"), &question(0, "Name?"));
    h.advance(Duration::from_millis(10));
    assert!(h.log.iter().any(|c| matches!(c, Command::Hold { .. })));
    assert!(!h.log.iter().any(|c| matches!(c, Command::Watch { .. })));
}

/// A held data-layer session's call that its retry takes from the held table, and whose
/// next round waits resumably, is watched by the retry: the held table no longer owns
/// it, and a client that never continues would leave it waiting in the session.
#[test]
fn a_held_data_session_call_that_goes_on_resumably_is_watched() {
    let mut first = Harness::new_call(in_data_session(), Upstream::default());
    let id = first.call_id();
    first.event(Stream::Call, None, &question(0, "Name?"));
    first.advance(Duration::from_millis(10));
    assert!(first.log.iter().any(|c| matches!(c, Command::Hold { .. })));
    let Ending::InputRequired { input_requests, .. } = first.ending() else {
        unreachable!()
    };
    let mut h = Harness::retry(
        in_data_session(),
        Upstream::default(),
        first.state(),
        json!({"elicitation_0": accept("Ada")}),
        Some(input_requests.clone()),
    );
    h.event(Stream::Call, Some("c3"), &json!(""));
    h.event(Stream::Call, Some("c4"), &question(1, "Age?"));
    h.advance(Duration::from_millis(10));
    assert!(matches!(h.state().waiting, Waiting::Resumable { .. }));
    let watch = h.log.iter().find_map(|c| match c {
        Command::Watch { call, .. } => Some(call.clone()),
        _ => None,
    });
    assert_eq!(watch, Some(Some(json!(id))), "{:?}", h.log);
}

/// A data-layer session's call whose stream ends without a result and cannot be resumed
/// may have ended with its session (deleted by its client elsewhere): its cancellation
/// goes up before the client is answered, and a 404 to it tells the client the session
/// ended; an accepted one leaves the upstream's failure as the answer.
#[test]
fn a_data_session_call_whose_stream_breaks_asks_whether_its_session_ended() {
    let broken = |cancelled: Result<(), Failure>| {
        let upstream = Upstream {
            posts: [cancelled].into(),
            ..Upstream::default()
        };
        let mut h = Harness::new_call(in_data_session(), upstream);
        let id = h.call_id();
        h.feed(Input::StreamEnded(Stream::Call));
        let first = h.log.iter().find_map(|c| match c {
            Command::CancelFirst(cancel) => Some(cancel.to_json()),
            _ => None,
        });
        let cancel = first.expect("the call cancelled before the answer");
        assert_eq!(cancel["method"], "notifications/cancelled");
        assert_eq!(cancel["params"]["requestId"], id);
        let cancel = h.position(|c| matches!(c, Command::CancelFirst(_)));
        let finish = h.position(|c| matches!(c, Command::Finish(_)));
        assert!(cancel < finish, "the client waits for it: {:?}", h.log);
        assert!(cancellations(&h).is_empty(), "cancelled once: {:?}", h.log);
        h.refusal().clone()
    };
    let gone = Failure::new(FailureKind::Gone, "no longer has the session");
    let ended = broken(Err(gone));
    assert_eq!(ended.class, Class::SessionEnded);
    assert_eq!(ended.code, gcode::SESSION_ENDED);
    let failed = broken(Ok(()));
    assert_eq!(failed.class, Class::UpstreamError);
    assert!(
        failed.message.contains("ended without a result"),
        "{failed:?}"
    );
}

/// A data-layer session's call whose refusal of one server request fails (a 500), while a
/// second refusal from the same batch event is still queued: the second one's answer (a
/// 404) is not taken for the cancellation's, which alone says whether the session ended.
#[test]
fn a_cancellation_takes_its_own_answer_not_a_queued_refusals() {
    let failed = Failure::new(FailureKind::Refused(500), "refused the request (HTTP 500)");
    let gone = Failure::new(FailureKind::Gone, "no longer has the session");
    let upstream = Upstream {
        posts: [Err(failed), Err(gone), Ok(())].into(),
        ..Upstream::default()
    };
    let mut h = Harness::new_call(in_data_session(), upstream);
    let unknown =
        |id: u64| json!({"jsonrpc": "2.0", "id": id, "method": "tasks/result", "params": {}});
    h.event(Stream::Call, Some("c1"), &json!([unknown(7), unknown(8)]));
    let refusal = h.refusal();
    assert_eq!(refusal.class, Class::UpstreamError, "{refusal:?}");
    assert!(refusal.message.contains("HTTP 500"), "{refusal:?}");
}

#[test]
fn a_resumption_that_replays_without_end_is_refused_not_held() {
    let first = first_round();
    let mut h = answered(&first, "Ada");
    let progress = json!({"jsonrpc": "2.0", "method": "notifications/message",
        "params": {"level": "info", "data": "x".repeat(1 << 20)}});
    for n in 0..40 {
        if h.ending.is_some() {
            break;
        }
        h.event(Stream::Session, Some(&format!("g{n}")), &progress);
    }
    assert!(h.posted().is_empty(), "no answer went up");
    assert!(
        h.log.contains(&Command::ReleaseClaim),
        "the state stays usable"
    );
    let refusal = h.refusal();
    assert!(
        refusal.message.contains("bytes of events"),
        "{}",
        refusal.message
    );
}

#[test]
fn a_round_whose_only_question_is_cancelled_reads_on() {
    let mut h = Harness::new_call(config(), Upstream::default());
    let id = h.call_id();
    h.event(Stream::Call, Some("c1"), &json!(""));
    h.event(Stream::Call, Some("c2"), &question(0, "Color?"));
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 0, "reason": "decided alone"}});
    h.event(Stream::Call, Some("c3"), &cancel);
    h.advance(Duration::from_millis(50));
    assert!(
        h.ending.is_none(),
        "no round of no questions: {:?}",
        h.ending
    );
    h.event(Stream::Call, Some("c4"), &result(id, "blue"));
    assert!(matches!(h.ending(), Ending::Complete { .. }));
    assert!(
        h.posted().is_empty(),
        "the cancelled question is never answered"
    );
}
