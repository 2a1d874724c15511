//! The bridged call's state machine (`mrtr::flow::Flow`) driven by arbitrary sequences:
//! how the request starts (a new call, or a retry of each phase with some answers), how
//! the upstream answers each command (opened or failed, posted or refused), and what
//! arrives meanwhile (questions, results, other calls' results, notifications, priming
//! events, garbage, ended streams, a client leaving, draining, the clock). Invariants:
//! the flow finishes exactly once; it completes only with the response to the call it
//! posted last; no answer goes upstream twice, and only answers the client gave; a held
//! round's unanswered questions are asked again; every state it issues fits the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mrtr_gateway::config::ResumeMode;
use mrtr_gateway::mrtr::flow::{
    CallReply, Command, Ending, Failure, FailureKind, Flow, FlowConfig, Input, Stream, StreamGet,
};
use mrtr_gateway::mrtr::modern::LogLevel;
use mrtr_gateway::mrtr::state::{
    Asked, FlowState, HeldAt, Pending, Positions, QuestionKind, ReadBefore, UpstreamCall,
    UpstreamFacts, UpstreamId, Waiting,
};
use mrtr_gateway::mrtr::translate::{Relay, RoundLimits};
use mrtr_gateway::outcome::{Class, Refusal};
use mrtr_gateway::protocol::revision::Revision;
use mrtr_gateway::protocol::sse::Event;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The fuzzer's bytes, read one at a time (zeros once they run out).
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    fn done(&self) -> bool {
        self.0.is_empty()
    }
}

fn config(b: &mut Bytes) -> FlowConfig {
    let flags = b.next();
    let mut capabilities = Map::new();
    capabilities.insert("elicitation".into(), json!({"url": {}}));
    FlowConfig {
        group: "g".into(),
        method: "tools/call".into(),
        target: "t".into(),
        capabilities,
        relay: Relay {
            progress_token: (flags & 1 != 0).then(|| serde_json::json!("p")),
            log_level: (flags & 1 != 0).then_some(LogLevel::Debug),
        },
        restartable: flags & 2 != 0,
        data_session: flags & 4 != 0,
        round_limits: RoundLimits {
            max_questions: 1 + usize::from(b.next() % 4),
            max_bytes: 4096,
        },
        max_rounds: 4,
        max_state_plaintext: 200 + usize::from(b.next()) * 4,
        max_state_bytes: 4096,
        kid_len: 2,
        quiet_window: Duration::from_millis(10),
        asks_at_once: b.next() % 2 == 0,
        poll: Duration::from_millis(500),
        answer_timeout: Duration::from_secs(60),
        silence: Duration::from_secs(5),
        silence_seconds: 5,
        keepalive: (flags & 8 != 0).then(|| Duration::from_millis(300)),
        request_state_ttl_seconds: 600,
        max_flow_seconds: 1800,
        resume: match (flags >> 4) % 3 {
            0 => ResumeMode::Auto,
            1 => ResumeMode::Resumable,
            _ => ResumeMode::Hold,
        },
        replay_refused: false,
        primes: match (flags >> 6) % 3 {
            0 => None,
            1 => Some(true),
            _ => Some(false),
        },
        session_replay_scoped: flags & 0x80 != 0,
        sessions_kept_apart: (flags & 0x80 != 0).then_some(true),
        shedding: b.next() % 16 == 0,
        now_secs: 1_000_000,
        now_ms: 1_000_000_000,
        flow_id: 1,
    }
}

fn pending() -> Vec<Pending> {
    (0..2)
        .map(|i| Pending {
            key: format!("elicitation_{i}"),
            upstream_id: UpstreamId::Number(i),
            fingerprint: Some(i as u64),
            // The second question came on the session's GET stream.
            asked: Asked {
                kind: Some(QuestionKind::Elicitation),
                on_session: i == 1,
            },
        })
        .collect()
}

/// A state of phase `kind`; a resumable one says `primes` of the upstream's priming.
fn prior(kind: u8, data_session: bool, primes: Option<bool>) -> FlowState {
    let call = UpstreamCall {
        endpoint: "10.0.0.7:3001".parse().unwrap(),
        session: "s1".into(),
        id: UpstreamId::Number(5),
        data_session,
        version: Revision::default(),
    };
    let waiting = match kind {
        1 => Waiting::Resumable {
            call,
            pending: pending(),
            positions: Positions {
                last_event_id: Some("c2".into()),
                round_start: Some("c1".into()),
                session_from: Some("g1".into()),
                session_replayable: true,
                read_before: ReadBefore {
                    call: 1,
                    session: 1,
                },
                upstream: UpstreamFacts {
                    primes,
                    sessions_kept_apart: None,
                },
            },
        },
        2 => Waiting::Held {
            call,
            pending: pending(),
            at: HeldAt {
                owner: None,
                slot: 9,
            },
        },
        3 => Waiting::Reissue { call },
        _ => Waiting::Deferred { data_session },
    };
    FlowState {
        group: "g".into(),
        flow_id: 1,
        started_ms: 0,
        flow_deadline: 1_001_800,
        expires_at: 1_000_600,
        round: 1,
        known: Vec::new(),
        waiting,
    }
}

fn failure(b: &mut Bytes) -> Failure {
    let kind = match b.next() % 6 {
        0 => FailureKind::NoEndpoint,
        1 => FailureKind::Unreachable,
        2 => FailureKind::Gone,
        3 => FailureKind::Refused(400),
        4 => FailureKind::Timeout,
        _ => FailureKind::Broken,
    };
    Failure::new(kind, "fuzzed")
}

fn ok_or_fail(b: &mut Bytes) -> Result<(), Failure> {
    if b.next() % 5 == 0 {
        Err(failure(b))
    } else {
        Ok(())
    }
}

/// What the fuzzer observed of one run.
#[derive(Default)]
struct Seen {
    finishes: usize,
    last_call_id: Option<i64>,
    answers: HashMap<String, usize>,
    ending: Option<Ending>,
    /// The call's answer is withheld, to come at a later step.
    withheld: bool,
    /// The flow cancelled a call upstream.
    cancelled: bool,
}

fn answer(
    command: &Command,
    b: &mut Bytes,
    seen: &mut Seen,
    config: &FlowConfig,
    now: Instant,
) -> Option<Input> {
    match command {
        Command::OpenSession => Some(if b.next() % 6 == 0 {
            Input::SessionFailed(failure(b))
        } else {
            Input::SessionOpened {
                endpoint: "10.0.0.7:3001".parse().unwrap(),
                session: Some("s1".into()),
                version: Revision::default(),
                warm: b.next() % 2 == 0,
                session_stream: b.next() % 2 == 0,
            }
        }),
        Command::Get(StreamGet::Open { stream, .. }) => Some(Input::StreamOpened {
            stream: *stream,
            result: ok_or_fail(b),
        }),
        Command::Get(StreamGet::Reopen { .. }) => Some(Input::Reopened {
            result: ok_or_fail(b),
            call_at: now,
            session_resumed: b.next() % 2 == 0,
        }),
        Command::PostCall { id } => {
            seen.last_call_id = Some(*id);
            // Some servers withhold the call's answer until its stream's first event.
            if b.next() % 5 == 0 {
                seen.withheld = true;
                return None;
            }
            Some(call_reply(b, *id))
        }
        // A failed data-layer session call's cancellation, posted before the client is
        // answered.
        Command::CancelFirst(cancel) => {
            assert!(config.data_session, "a cancellation outside a data session");
            let id = cancel.request_id.as_i64();
            assert_eq!(id, seen.last_call_id, "another call cancelled");
            seen.cancelled = true;
            Some(Input::Posted(ok_or_fail(b)))
        }
        Command::Post(message) => {
            // Answers to the client's questions; a ping (id 9) is answered each time.
            if message.get("result").is_some() && message["id"] != 9 {
                *seen.answers.entry(message["id"].to_string()).or_default() += 1;
            }
            Some(Input::Posted(ok_or_fail(b)))
        }
        // A data-layer session outlives its calls: a call given up on there is cancelled
        // by id, and only there; a flow's own session is deleted instead.
        Command::DeleteSession => {
            assert!(!config.data_session, "a data-layer session was deleted");
            None
        }
        Command::Cancel(cancel) => {
            assert!(
                config.data_session,
                "a cancellation outside a data-layer session"
            );
            let id = cancel.request_id.as_i64();
            assert_eq!(id, seen.last_call_id, "another call cancelled");
            seen.cancelled = true;
            None
        }
        // The reaper watches a flow's own session, or in a data-layer session the call
        // this request posted, never another.
        Command::Watch { call, .. } => {
            match call {
                Some(id) => {
                    assert!(config.data_session, "a call watched outside a data session");
                    assert_eq!(id.as_i64(), seen.last_call_id, "another call watched");
                }
                None => assert!(!config.data_session, "a data-layer session watched"),
            }
            Some(Input::Watched(match b.next() % 8 {
                0 => Err(Refusal::internal(Class::Overloaded, "the table is full")),
                _ => Ok(()),
            }))
        }
        Command::Unwatch { .. } => {
            assert!(
                config.data_session,
                "a call unwatched outside a data session"
            );
            None
        }
        Command::Hold { .. } => Some(Input::Held(Ok(HeldAt {
            owner: None,
            slot: 3,
        }))),
        Command::Finish(ending) => {
            seen.finishes += 1;
            if let Ending::Complete { message, .. } = ending {
                assert!(!seen.cancelled, "a call completed after it was cancelled");
                assert_eq!(
                    message["id"].as_i64(),
                    seen.last_call_id,
                    "completed with another call's response"
                );
            }
            if let Ending::InputRequired { state, .. } = ending {
                assert!(
                    state.plaintext_len() <= config.max_state_plaintext,
                    "a state over the limit was issued"
                );
            }
            seen.ending = Some(ending.clone());
            None
        }
        _ => None,
    }
}

fn call_reply(b: &mut Bytes, id: i64) -> Input {
    Input::CallPosted(match b.next() % 6 {
        0 => Err(failure(b)),
        1 => Ok(CallReply::Message(result(id))),
        _ => Ok(CallReply::Stream),
    })
}

fn result(id: i64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": {"content": []}})
}

fn event(b: &mut Bytes, seen: &Seen) -> Input {
    let stream = if b.next() % 3 == 0 {
        Stream::Session
    } else {
        Stream::Call
    };
    let id = match b.next() % 4 {
        0 => None,
        n => Some(format!("e{}", u16::from(n) * 256 + u16::from(b.next()))),
    };
    let data = match b.next() % 8 {
        0 => String::new(),
        1 | 2 => json!({"jsonrpc": "2.0", "id": b.next() % 4, "method": "elicitation/create",
            "params": {"mode": "form", "message": "q", "requestedSchema": {"type": "object"}}})
        .to_string(),
        3 => result(seen.last_call_id.unwrap_or(5)).to_string(),
        4 => result(i64::from(b.next())).to_string(),
        5 => {
            json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}).to_string()
        }
        6 => json!({"jsonrpc": "2.0", "id": 9, "method": "ping"}).to_string(),
        _ => "not json".into(),
    };
    Input::Event {
        stream,
        event: Event::message(id, data),
    }
}

fn drain(flow: &mut Flow, b: &mut Bytes, seen: &mut Seen, config: &FlowConfig, now: Instant) {
    while let Some(command) = flow.poll_command() {
        if let Some(input) = answer(&command, b, seen, config, now) {
            flow.handle(input, now);
        }
    }
}

fuzz_target!(|input: &[u8]| {
    let mut b = Bytes(input);
    let config = config(&mut b);
    let mut now = Instant::now();
    let kind = b.next() % 5;
    let mask = b.next();
    let mut responses = Map::new();
    for p in pending()
        .iter()
        .filter(|p| mask & (1 << p.upstream_id.to_json().as_i64().unwrap_or(0)) != 0)
    {
        responses.insert(
            p.key.clone(),
            json!({"action": "accept", "content": {"n": p.key}}),
        );
    }
    let held_questions: Map<String, Value> = pending()
        .iter()
        .map(|p| {
            (
                p.key.clone(),
                json!({"method": "elicitation/create", "params": {"message": "q"}}),
            )
        })
        .collect();
    let mut flow = match kind {
        0 => Flow::new_call(config.clone(), now),
        2 if mask & 0x80 != 0 => Flow::retry(
            config.clone(),
            prior(2, config.data_session, None),
            responses.clone(),
            Some(held_questions.clone()),
            now,
        ),
        k => Flow::retry(
            config.clone(),
            prior(
                k,
                config.data_session,
                [None, Some(false), Some(true)][(mask as usize >> 4) % 3],
            ),
            responses.clone(),
            None,
            now,
        ),
    };
    // A retry goes on with the call an earlier request posted (id 5).
    let mut seen = Seen {
        last_call_id: matches!(kind, 1..=3).then_some(5),
        ..Seen::default()
    };
    for _ in 0..400 {
        drain(&mut flow, &mut b, &mut seen, &config, now);
        if flow.is_done() {
            break;
        }
        if b.done() {
            // Out of input: let time run until the flow gives up (the silence limit).
            now += Duration::from_secs(1);
            flow.handle_timeout(now);
            continue;
        }
        match b.next() % 10 {
            0..=4 if flow.is_reading() => {
                let input = event(&mut b, &seen);
                flow.handle(input, now);
            }
            // While the call's answer is awaited, only the session's stream is read.
            0..=3 if flow.is_posting() => {
                if let Input::Event { event, .. } = event(&mut b, &seen) {
                    flow.handle(
                        Input::Event {
                            stream: Stream::Session,
                            event,
                        },
                        now,
                    );
                }
            }
            4 if std::mem::take(&mut seen.withheld) => {
                let id = seen.last_call_id.unwrap_or(5);
                let reply = call_reply(&mut b, id);
                flow.handle(reply, now);
            }
            5 => flow.handle(Input::StreamEnded(Stream::Call), now),
            6 => flow.handle(Input::StreamEnded(Stream::Session), now),
            7 if b.next() % 16 == 0 => {
                // The flow waits for the upstream or the clock: a client that leaves
                // now cancels it, whatever it waits for (told once, as the shell does).
                flow.handle(Input::ClientGone, now);
                drain(&mut flow, &mut b, &mut seen, &config, now);
                assert!(flow.is_done(), "a client that left did not end the flow");
            }
            8 if b.next() % 8 == 0 => flow.handle(Input::Draining, now),
            _ => {
                now += Duration::from_millis(u64::from(b.next()) * 20);
                flow.handle_timeout(now);
            }
        }
    }
    drain(&mut flow, &mut b, &mut seen, &config, now);
    assert!(seen.finishes <= 1, "a flow finished twice");
    assert!(
        flow.is_done() || seen.finishes == 0,
        "finished but not done"
    );
    for (id, times) in &seen.answers {
        assert_eq!(*times, 1, "the answer to {id} went up {times} times");
    }
    // Only answers the client gave went up (a restartable re-run also answers from the
    // state).
    if !config.restartable {
        let given: Vec<String> = match kind {
            1 | 2 => pending()
                .iter()
                .filter(|p| responses.contains_key(&p.key))
                .map(|p| p.upstream_id.to_json().to_string())
                .collect(),
            _ => Vec::new(),
        };
        for id in seen.answers.keys() {
            assert!(
                given.contains(id),
                "answered {id}, which the client did not answer"
            );
        }
    }
    // A held round's retry asks again every question it left unanswered.
    if let (2, Some(Ending::InputRequired { input_requests, .. })) = (kind, &seen.ending) {
        if mask & 0x80 != 0 && !config.restartable {
            for p in pending().iter().filter(|p| !responses.contains_key(&p.key)) {
                assert!(
                    input_requests.contains_key(&p.key),
                    "{} was not asked again",
                    p.key
                );
            }
        }
    }
});
