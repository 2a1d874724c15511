//! Hostile and quirky upstreams against the bridge, each scripted on raw sockets: a flood
//! of questions, ids that collide or cannot be carried, event ids too long to seal, and
//! numbers that must cross unchanged. Each case gets a bounded, clear answer.

use crate::common::*;
use crate::scripted::{legacy_basics, Answer, FirstRefused, Gate, ScriptedUpstream, Seen};
use mrtr_gateway::config::{QuietWindowFor, ResumeMode, UpstreamEra};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// An `elicitation/create` request from the server with JSON-RPC id `id`.
fn question(id: Value, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "elicitation/create", "params": {
        "mode": "form", "message": message,
        "requestedSchema": {"type": "object", "properties": {"name": {"type": "string"}}}}})
}

/// A script answering the legacy basics, refusing the session's GET stream, and answering
/// `tools/call` with `call(request)`.
fn serving_calls(
    call: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
) -> impl Fn(&Seen) -> Answer + Send + Sync + 'static {
    move |seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "session-1") {
            return answer;
        }
        match seen.jsonrpc_method().as_deref() {
            Some("tools/call") => call(seen),
            _ => Answer::status(405, &[], b""),
        }
    }
}

fn call_tool(raw: &Raw, extra: Value) -> (u16, Value) {
    let params = tool_params("hostile", extra);
    let reply = raw.modern(1, "tools/call", params, json!({"elicitation": {}}));
    (reply.status, reply.json())
}

fn error_message(body: &Value) -> &str {
    body["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error: {body}"))
}

/// An upstream event over `limits.max_upstream_message_bytes` (here 1 MiB) ends the call
/// with an error naming the limit: the stream is not resumed (a resumption would send the
/// event again) and the group's later flows are not held for it. Under the default
/// (16 MiB) a 5 MiB result, as a screenshot tool's may be, goes through, as it does for
/// legacy clients.
#[test]
fn an_upstream_event_over_the_limit_ends_the_call_and_teaches_nothing() {
    let upstream = ScriptedUpstream::start(serving_calls(|seen| {
        let big = "x".repeat(5 << 20);
        if seen.json().unwrap_or_default()["params"]["arguments"]["whole"] == true {
            let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(),
                "result": {"content": [{"type": "text", "text": big}]}});
            return Answer::json(200, &result);
        }
        let log = json!({"jsonrpc": "2.0", "method": "notifications/message",
            "params": {"level": "info", "data": big}});
        Answer::sse(&[])
            .event(Some("e1"), &json!(""))
            .event(Some("e2"), &log)
    }));
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.limits.max_upstream_message_bytes = 1 << 20;
    });
    let raw = Raw::new(&gw.url);
    let (_, body) = call_tool(&raw, json!({}));
    let message = error_message(&body);
    assert!(
        message.contains("an SSE event exceeds 1048576 bytes")
            && message.contains("limits.max_upstream_message_bytes")
            && message.contains("call's stream"),
        "{message}"
    );
    let resumed = upstream
        .requests()
        .iter()
        .any(|s| s.method == "GET" && s.header("last-event-id").is_some());
    assert!(!resumed, "the call's stream was resumed");
    let resumable = metric_with(&gw.admin, "mrtr_gateway_upstream_resumable", "default");
    assert_ne!(
        resumable,
        Some(0.0),
        "the group's flows are held from now on"
    );

    let defaults = TestGateway::start(&[&upstream.url()], &test_keys());
    let (status, body) = call_tool(
        &Raw::new(&defaults.url),
        json!({"arguments": {"whole": true}}),
    );
    let text = body["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(
        (status, text.len()),
        (200, 5 << 20),
        "{}",
        &body.to_string()[..200.min(body.to_string().len())]
    );
}

/// An answer whose header trickles in a byte at a time, or whose body stalls after part
/// of it came: each is given up at the group's response timeout (here 300 ms), the legacy
/// client told so under its own id, the modern client with a bounded error; neither
/// waits without end (no stream idle limit is configured).
#[test]
fn an_answer_that_trickles_or_stalls_is_given_up_at_the_response_timeout() {
    let header = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 101\r\n\r\n";
    let trickled = move || {
        header.bytes().fold(Answer::silent(), |answer, byte| {
            answer.bytes([byte]).pause(Duration::from_millis(100))
        })
    };
    let stalled = move || Answer::raw(header).bytes(b"{\"jsonrpc\": \"2.0\", \"id\"");
    let within = |what: &str, started: Instant| {
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "{what}: {took:?}");
    };
    for (what, answer) in [("trickled", trickled()), ("stalled", stalled())] {
        let upstream = ScriptedUpstream::start(move |_: &Seen| answer.clone());
        let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
            c.upstreams[0].response_timeout_ms = 300
        });
        let started = Instant::now();
        let init = json!({"jsonrpc": "2.0", "id": 5, "method": "initialize", "params": {}});
        let reply = Raw::new(&gw.url).post(None, &init);
        let status = reply.status;
        let body = reply.json();
        assert_eq!((status, &body["id"]), (504, &json!(5)), "{what}: {body}");
        within(what, started);
    }
    // A body relayed as it comes (chunked, or too long to be read whole) whose header went
    // out: the response is cut at the timeout, not left open.
    let chunked = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\na\r\n{\"jsonrpc\"\r\n";
    let long = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2097152\r\n\r\n{\"jsonrpc\"";
    for (what, head) in [("chunked", chunked), ("long", long)] {
        let upstream = ScriptedUpstream::start(move |_: &Seen| Answer::raw(head));
        let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
            c.upstreams[0].response_timeout_ms = 300
        });
        let started = Instant::now();
        let init =
            json!({"jsonrpc": "2.0", "id": 5, "method": "initialize", "params": {}}).to_string();
        let request = format!(
            "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
             accept: application/json, text/event-stream\r\ncontent-length: {}\r\n\r\n{init}",
            init.len()
        );
        // Ended (closed or reset) before the client's 5 s read timeout.
        let answer = raw_exchange(gw.port, request.as_bytes(), Duration::from_secs(5));
        assert!(answer.starts_with("HTTP/1.1 200"), "{what}: {answer}");
        within(what, started);
    }
    let upstream = ScriptedUpstream::start(serving_calls(move |_| stalled()));
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].response_timeout_ms = 300
    });
    let started = Instant::now();
    let (_, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert!(
        error_message(&body).contains("did not answer in time"),
        "{body}"
    );
    within("a bridged call's answer", started);
}

/// An answer relayed with an error status counts as that error, not as `ok`: the
/// upstream's 401 to a legacy `initialize` is `unauthorized`, its 500 `upstream_error`.
#[test]
fn a_relayed_error_status_counts_as_that_error() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let method = seen.json().unwrap_or_default()["method"].clone();
        match method.as_str() {
            Some("initialize") => Answer::status(401, &[("www-authenticate", "Bearer")], b""),
            _ => Answer::status(500, &[], b""),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}});
    assert_eq!(raw.post(None, &init).status, 401);
    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    assert_eq!(raw.post(None, &ping).status, 500);
    let counted = |labels: &str| metric_with(&gw.admin, "mrtr_gateway_requests_total", labels);
    let unauthorized = r#"era="legacy",method="initialize",outcome="unauthorized""#;
    let upstream_error = r#"era="legacy",method="ping",outcome="upstream_error""#;
    // A request is counted once its response is done, which may be just after the client
    // has read it.
    wait_until("both requests counted", Duration::from_secs(5), || {
        counted(unauthorized).is_some() && counted(upstream_error).is_some()
    });
    assert_eq!(counted(unauthorized), Some(1.0));
    assert_eq!(counted(upstream_error), Some(1.0));
    assert_eq!(
        counted(r#"era="legacy",method="initialize",outcome="ok""#),
        None
    );
}

/// A large JSON answer the upstream sends at once, to a client that reads it slowly: the
/// response timeout bounds the upstream's sending, not the client's reading
/// (`client_write_timeout_ms` does), so the answer arrives whole.
#[test]
fn a_slow_reader_gets_a_large_answer_whole_past_the_response_timeout() {
    let size = 16 << 20;
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":5,"result":{{"x":"{}"}}}}"#,
        "a".repeat(size)
    );
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
        body.len()
    );
    let answer = format!("{head}{body}\r\n0\r\n\r\n");
    let upstream = ScriptedUpstream::start(move |_: &Seen| Answer::raw(answer.as_bytes()));
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].response_timeout_ms = 300
    });
    let init = json!({"jsonrpc": "2.0", "id": 5, "method": "initialize", "params": {}}).to_string();
    let request = format!(
        "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{init}",
        init.len()
    );
    let (status, mut client) = raw_status(gw.port, request.as_bytes(), Duration::from_secs(20));
    assert_eq!(status, "HTTP/1.1 200");
    // The slow reader: nothing read for three response timeouts, while the gateway's
    // writes to it wait.
    std::thread::sleep(Duration::from_millis(900));
    let mut rest = Vec::new();
    let read = std::io::Read::read_to_end(&mut client, &mut rest);
    assert!(read.is_ok(), "{read:?}");
    let relayed = rest.iter().filter(|b| **b == b'a').count();
    assert!(relayed >= size, "the answer was cut: {} bytes", rest.len());
}

/// A 2026-07-28 request the gateway answers in one exchange (`tools/list`) over an SSE
/// answer that first sends a log notification and a keep-alive event of its own type:
/// the answer is the response, not the first message; and a bridged call's stream that
/// sends such an event before its result completes.
#[test]
fn the_answer_is_the_response_after_notifications_and_other_event_types() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "session-1") {
            return answer;
        }
        let log = json!({"jsonrpc": "2.0", "method": "notifications/message",
            "params": {"level": "info", "data": "listing"}});
        let result = match seen.jsonrpc_method().as_deref() {
            Some("tools/list") => json!({"tools": []}),
            _ => json!({"content": [{"type": "text", "text": "done"}]}),
        };
        let response = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": result});
        Answer::sse(&[])
            .event(None, &log)
            .chunk("event: ping\ndata: 2026-11-27 02:40:00\n\n")
            .event(None, &response)
            .end()
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let listed = raw.modern(1, "tools/list", json!({}), json!({})).json();
    assert_eq!(listed["result"]["tools"], json!([]), "{listed}");
    let (_, called) = call_tool(&raw, json!({}));
    assert_eq!(called["result"]["content"][0]["text"], "done", "{called}");
}

/// JSON text as JavaScript writes it: `JSON.stringify` escapes a lone UTF-16 surrogate
/// (a string cut inside an emoji) as `\ud83d`. A result carrying one, as a JSON body or
/// in an SSE event, and a client's arguments carrying one, go through with the
/// replacement character in its place; they used to fail the call as "invalid JSON".
#[test]
fn lone_surrogate_escapes_cross_the_bridge_as_the_replacement_character() {
    let cut = r#""cut \ud83d""#;
    let upstream = ScriptedUpstream::start(serving_calls(move |seen: &Seen| {
        let response = format!(
            r#"{{"jsonrpc":"2.0","id":{},"result":{{"content":[{{"type":"text","text":{cut}}}]}}}}"#,
            seen.jsonrpc_id()
        );
        match seen.json().unwrap_or_default()["params"]["arguments"]["form"].as_str() {
            Some("json") => Answer::status(
                200,
                &[("content-type", "application/json")],
                response.as_bytes(),
            ),
            _ => Answer::sse(&[]).event(None, &json!(response)).end(),
        }
    }));
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    for form in ["json", "sse"] {
        let params = json!({"name": "hostile", "arguments": {"form": form, "text": "CUT"}});
        let (headers, body) = modern_request(1, "tools/call", params, json!({}));
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let body = body.to_string().replace("CUT", "held \\udc00");
        let reply = raw.request("POST", &headers, Some(&body)).json();
        assert_eq!(
            reply["result"]["content"][0]["text"], "cut \u{fffd}",
            "{form}: {reply}"
        );
    }
    let calls: Vec<Value> = upstream
        .requests()
        .iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("tools/call"))
        .filter_map(|s| s.json())
        .collect();
    assert_eq!(calls.len(), 2);
    for call in calls {
        assert_eq!(
            call["params"]["arguments"]["text"], "held \u{fffd}",
            "{call}"
        );
    }
}

/// An upstream's -32002 (resource not found up to 2025-11-25) reaches a 2026-07-28 client
/// as -32602, which that revision says it with (it reserves -32002), message and data
/// kept; other codes pass unchanged.
#[test]
fn a_legacy_resource_not_found_is_said_as_2026_07_28_says_it() {
    let upstream = ScriptedUpstream::start(serving_calls(|seen: &Seen| {
        let code = seen.json().unwrap_or_default()["params"]["arguments"]["code"].clone();
        let error =
            json!({"code": code, "message": "Resource not found", "data": {"uri": "file:///x"}});
        Answer::json(
            200,
            &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "error": error}),
        )
    }));
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    for (sent, seen) in [(-32002, -32602), (-32001, -32001)] {
        let (_, body) = call_tool(&raw, json!({"arguments": {"code": sent}}));
        assert_eq!(body["error"]["code"], seen, "{body}");
        assert_eq!(body["error"]["message"], "Resource not found", "{body}");
        assert_eq!(body["error"]["data"], json!({"uri": "file:///x"}), "{body}");
    }
}

/// An upstream's -32042 (URL elicitation required, 2025-11-25 only) whose elicitations
/// name no url and message cannot become URL-mode input requests; a 2026-07-28 client,
/// for which -32042 is reserved, hears -32603 saying so, not -32042.
#[test]
fn a_url_elicitation_required_error_without_a_usable_elicitation_is_not_relayed_as_32042() {
    let upstream = ScriptedUpstream::start(serving_calls(|seen: &Seen| {
        let elicitations = json!([{"mode": "url", "message": "Open it"}, {"mode": "url"}]);
        let error = json!({"code": -32042, "message": "Consent needed", "data": {"elicitations": elicitations}});
        Answer::json(
            200,
            &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "error": error}),
        )
    }));
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let (_, body) = call_tool(&raw, json!({}));
    assert_eq!(body["error"]["code"], -32603, "{body}");
    let message = error_message(&body);
    assert!(message.contains("named no url and message"), "{body}");
    assert!(message.contains("Consent needed"), "{body}");
}

/// A call's response against JSON-RPC (a result that is not an object, a result and an
/// error both, an error that is not an object) reaches the client as an error saying what
/// was wrong, not relayed as a result; an error object without a message says so.
#[test]
fn a_malformed_response_to_a_call_is_named_not_relayed() {
    let cases = [
        (json!({"result": 5}), "a result that is not an object"),
        (json!({"result": null}), "a result that is not an object"),
        (
            json!({"result": {"content": []}, "error": {"code": 1, "message": "m"}}),
            "both a result and an error",
        ),
        (json!({"error": "boom"}), "an error that is not an object"),
        (
            json!({"error": {"code": -32000}}),
            "an error that has no message",
        ),
    ];
    for (body, named) in cases {
        let response = body.clone();
        let upstream = ScriptedUpstream::start(serving_calls(move |seen| {
            let mut message = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id()});
            message
                .as_object_mut()
                .unwrap()
                .extend(response.as_object().unwrap().clone());
            Answer::json(200, &message)
        }));
        let gw = TestGateway::start(&[&upstream.url()], &test_keys());
        let (_, reply) = call_tool(&Raw::new(&gw.url), json!({}));
        assert!(reply.get("result").is_none(), "{body}: {reply}");
        assert!(error_message(&reply).contains(named), "{body}: {reply}");
    }
}

pub fn question_flood_case() -> usize {
    // 200 questions of 16 KB each, sent without pause, then the stream stays open.
    let upstream = ScriptedUpstream::start(serving_calls(|_| {
        let pad = "q".repeat(16 << 10);
        (0..200).fold(Answer::sse(&[]), |answer, i| {
            answer.event(Some(&format!("e{i}")), &question(json!(i), &pad))
        })
    }));
    let asked = |window_for: QuietWindowFor| {
        let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
            c.limits.max_input_requests_per_round = 16;
            c.limits.max_request_state_bytes = 16 << 10;
            c.bridge.quiet_window_for = window_for;
            // A round that waits ends at the limit, not at the window: a long one keeps
            // a loaded machine's slow upstream from ending it first.
            c.bridge.quiet_window_ms = 5000;
        });
        let started = Instant::now();
        let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
        assert_eq!(status, 200, "{body}");
        let asked = body["result"]["inputRequests"]
            .as_object()
            .unwrap_or_else(|| panic!("no inputRequests: {body}"))
            .len();
        println!(
            "a flood of 200 questions of 16 KB ({window_for:?}): the round ended at {asked} after {:?}",
            started.elapsed()
        );
        asked
    };
    // A round that waits for more questions ends as it reaches the limit; one that ends
    // once nothing more is readable asks what had arrived, within the limit.
    assert_eq!(
        asked(QuietWindowFor::All),
        16,
        "the round ends at the limit"
    );
    assert!((1..=16).contains(&asked(QuietWindowFor::Parallel)));

    // Questions whose bytes pass the limit in one round end the call with an error
    // naming it.
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.limits.max_input_requests_bytes = 64 << 10;
        c.bridge.quiet_window_for = QuietWindowFor::All;
        c.bridge.quiet_window_ms = 5000;
    });
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert_eq!(status, 200, "{body}");
    assert!(
        error_message(&body).contains("limits.max_input_requests_bytes"),
        "{body}"
    );
    2
}

#[test]
fn a_flood_of_questions_ends_the_round_at_its_limit() {
    question_flood_case();
}

pub fn colliding_ids_case() -> usize {
    let done = Gate::new();
    let finish = done.clone();
    let upstream = ScriptedUpstream::start(serving_calls(move |seen| {
        let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
            "content": [{"type": "text", "text": "done"}]}});
        // No event ids: the gateway holds the stream and reads on after the answers.
        Answer::sse(&[])
            .event(None, &question(json!(7), "Number seven?"))
            .event(None, &question(json!("7"), "Text seven?"))
            .wait(&finish)
            .event(None, &result)
            .end()
    }));
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].resume = ResumeMode::Hold;
    });
    let raw = Raw::new(&gw.url);
    let (_, first) = call_tool(&raw, json!({}));
    let asked = first["result"]["inputRequests"]
        .as_object()
        .unwrap_or_else(|| panic!("no inputRequests: {first}"));
    assert_eq!(asked.len(), 2, "both questions reach the client: {first}");
    let answer_of = |message: &str| {
        let (key, _) = asked
            .iter()
            .find(|(_, q)| q["params"]["message"] == message)
            .unwrap_or_else(|| panic!("no question '{message}': {first}"));
        key.clone()
    };
    let responses = json!({
        answer_of("Number seven?"): {"action": "accept", "content": {"name": "number"}},
        answer_of("Text seven?"): {"action": "accept", "content": {"name": "text"}},
    });
    // Once both answers are upstream, the held stream goes on to the result.
    let retry =
        json!({"inputResponses": responses, "requestState": first["result"]["requestState"]});
    let (status, body) = std::thread::scope(|scope| {
        scope.spawn(|| {
            wait_until("both answers upstream", Duration::from_secs(10), || {
                answers_in(&upstream.requests()).len() == 2
            });
            done.open();
        });
        call_tool(&raw, retry)
    });
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["result"]["content"][0]["text"], "done", "{body}");
    let answers = answers_in(&upstream.requests());
    let by_id = |id: Value| {
        answers
            .iter()
            .find(|a| a["id"] == id)
            .map(|a| a["result"]["content"]["name"].clone())
    };
    assert_eq!(by_id(json!(7)), Some(json!("number")), "{answers:?}");
    assert_eq!(by_id(json!("7")), Some(json!("text")), "{answers:?}");
    1
}

#[test]
fn server_request_ids_7_and_text_7_are_two_questions_answered_apart() {
    colliding_ids_case();
}

/// The JSON-RPC responses (answers to server requests) the upstream received.
fn answers_in(requests: &[Seen]) -> Vec<Value> {
    requests
        .iter()
        .filter_map(Seen::json)
        .filter(|m| m.get("method").is_none() && m.get("result").is_some())
        .collect()
}

pub fn uncarried_ids_case() -> usize {
    let long = json!("i".repeat(5000));
    let ids = [
        json!(1.5),
        json!(u64::MAX),
        Value::Null,
        json!({"k": 1}),
        long,
    ];
    for id in ids.clone() {
        let asked = id.clone();
        let upstream = ScriptedUpstream::start(serving_calls(move |_| {
            Answer::sse(&[]).event(Some("e1"), &question(asked.clone(), "Name?"))
        }));
        let gw = TestGateway::start(&[&upstream.url()], &test_keys());
        let started = Instant::now();
        let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
        assert_eq!(status, 200, "{id}: {body}");
        assert!(
            error_message(&body).contains("elicitation/create with"),
            "{id}: {body}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "{id}: slow");
        let refused = upstream
            .requests()
            .iter()
            .filter_map(Seen::json)
            .any(|m| m["id"] == id && m["error"]["code"] == -32600);
        assert!(refused, "{id}: the upstream was not told");
    }
    ids.len()
}

#[test]
fn server_request_ids_the_gateway_cannot_carry_end_the_call_with_a_clear_error() {
    uncarried_ids_case();
}

/// A server that asks a second question under the id of one still unanswered (two
/// counters, one per stream, both from 0) could not be answered apart: the call ends at
/// once with an error naming the id, and the upstream is told; the same question
/// delivered twice is asked once.
#[test]
fn a_second_question_under_an_unanswered_id_ends_the_call_clearly() {
    let upstream = ScriptedUpstream::start(serving_calls(|_| {
        Answer::sse(&[])
            .event(Some("e1"), &question(json!(5), "Name?"))
            .event(Some("e2"), &question(json!(5), "Name?"))
            .event(Some("e3"), &question(json!(5), "Age?"))
    }));
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let started = Instant::now();
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert_eq!(status, 200, "{body}");
    assert!(
        error_message(&body).contains("elicitation/create with id 5 while"),
        "{body}"
    );
    assert!(started.elapsed() < Duration::from_secs(5), "slow");
    let refusals = upstream
        .requests()
        .iter()
        .filter_map(Seen::json)
        .filter(|m| m["id"] == 5 && m["error"]["code"] == -32600)
        .count();
    assert_eq!(refusals, 1, "the upstream is told once");
}

/// An upstream that opens a session but then fails the handshake (it refuses
/// `notifications/initialized`) gets that session deleted: nobody will use it, and many
/// SDK servers keep a session until it is.
#[test]
fn a_session_whose_handshake_failed_is_deleted() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| match seen.jsonrpc_method().as_deref() {
        Some("notifications/initialized") => Answer::status(400, &[], b"no"),
        _ => legacy_basics(seen, "half-open").unwrap_or_else(|| Answer::status(405, &[], b"")),
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert!(
        status >= 400 || body.get("error").is_some(),
        "{status} {body}"
    );
    let deleted =
        |s: &Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some("half-open");
    let opened = |s: &Seen| s.jsonrpc_method().as_deref() == Some("initialize");
    wait_until(
        "every opened session deleted",
        Duration::from_secs(5),
        || {
            let seen = upstream.requests();
            let opened = seen.iter().filter(|s| opened(s)).count();
            opened > 0 && seen.iter().filter(|s| deleted(s)).count() == opened
        },
    );
}

/// An upstream whose session id the 2025 transport forbids (a space in it) or that no
/// state could carry (longer than 256 characters) opens no bridged call: the client is
/// told why, and the session, of no use to anyone, is deleted.
#[test]
fn a_session_id_the_gateway_cannot_carry_ends_the_call_clearly_and_is_deleted() {
    for id in ["two words".to_string(), "x".repeat(300)] {
        let session = id.clone();
        let upstream = ScriptedUpstream::start(move |seen: &Seen| {
            if seen.jsonrpc_method().as_deref() == Some("tools/call") {
                let result = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {
                    "content": [{"type": "text", "text": "done"}]}});
                return Answer::json(200, &result);
            }
            legacy_basics(seen, &session).unwrap_or_else(|| Answer::status(405, &[], b""))
        });
        let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
            c.upstreams[0].era = UpstreamEra::Legacy;
        });
        let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
        let message = error_message(&body);
        assert!(
            message.contains("Mcp-Session-Id the gateway cannot carry"),
            "{status} {body}"
        );
        let seen = upstream.requests();
        assert!(
            !seen
                .iter()
                .any(|s| s.jsonrpc_method().as_deref() == Some("tools/call")),
            "no call went up in a session it could not name"
        );
        wait_until("the session deleted", Duration::from_secs(5), || {
            let deleted =
                |s: &Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some(&id);
            upstream.requests().iter().any(deleted)
        });
    }
}

/// That DELETE, when the upstream cannot take it at once (a 503 while it restarts), is
/// sent again later: nobody else knows of the session.
#[test]
fn a_session_whose_handshake_failed_has_a_delete_that_failed_sent_again() {
    let (upstream, deletes) =
        FirstRefused::deletes_in_front_of(|seen: &Seen| match seen.jsonrpc_method().as_deref() {
            Some("notifications/initialized") => Answer::status(400, &[], b"no"),
            _ => legacy_basics(seen, "half-open").unwrap_or_else(|| Answer::status(405, &[], b"")),
        });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.bridge.warm_sessions_per_shape = 0;
    });
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert!(
        status >= 400 || body.get("error").is_some(),
        "{status} {body}"
    );
    // Each session opened (the call's, and the era probe's) is deleted; the one refused
    // first is deleted again by the reaper.
    deletes.assert_every_session_deleted_the_refused_one_again(&gw, &upstream);
}

/// The same, with an upstream that stops answering after `initialize`: the DELETE of the
/// unusable session is tried, but the client's error does not wait another response
/// timeout for it.
#[test]
fn a_silent_upstream_does_not_hold_the_handshake_error_for_the_delete() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        let initialize = seen.jsonrpc_method().as_deref() == Some("initialize");
        match legacy_basics(seen, "half-open") {
            Some(answer) if initialize => answer,
            _ => Answer::silent(),
        }
    });
    let timeout = Duration::from_secs(4);
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].response_timeout_ms = timeout.as_millis() as u64;
        c.bridge.warm_sessions_per_shape = 0;
    });
    let started = Instant::now();
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    let took = started.elapsed();
    assert!(
        status >= 400 || body.get("error").is_some(),
        "{status} {body}"
    );
    let delete = |s: &Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some("half-open");
    assert!(
        upstream.requests().iter().any(delete),
        "no DELETE was tried"
    );
    // Per session opened: one response timeout for the notification, and at most 2 s
    // for the DELETE (not another response timeout).
    let opens = upstream
        .requests()
        .iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
        .count() as u32;
    let bound = (timeout + Duration::from_secs(2)) * opens + Duration::from_millis(2000);
    assert!(took < bound, "the error took {took:?}, over {bound:?}");
}

pub fn long_event_id_case() -> usize {
    let long_id = "e".repeat(6000);
    let upstream = ScriptedUpstream::start(serving_calls(move |_| {
        Answer::sse(&[]).event(Some(&long_id), &question(json!(1), "Name?"))
    }));
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert_eq!(status, 200, "{body}");
    let message = error_message(&body);
    assert!(
        message.contains("max_request_state_bytes (4096)") && message.contains("SSE event ids"),
        "{body}"
    );
    1
}

#[test]
fn a_state_too_long_to_accept_is_never_issued() {
    long_event_id_case();
}

pub fn restartable_long_answer_case() -> usize {
    let (_python, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].tools.insert(
            "plan_trip".into(),
            mrtr_gateway::config::ToolPolicy {
                restartable: true,
                ..Default::default()
            },
        );
    });
    let raw = Raw::new(&gw.url);
    let trip = |id: u64, extra: Value| {
        let params = tool_params("plan_trip", extra);
        let reply = raw.modern(id, "tools/call", params, json!({"elicitation": {}}));
        (reply.status, reply.json())
    };
    let (_, first) = trip(1, json!({}));
    let long = "L".repeat(3000);
    let (status, second) = trip(2, answer(&first, json!({"destination": long})));
    assert_eq!(status, 200, "{second}");
    let message = error_message(&second);
    assert!(
        message.contains("max_request_state_bytes") && message.contains("restartable"),
        "{second}"
    );
    1
}

#[test]
fn a_restartable_tools_long_answers_get_a_clear_error_when_the_state_is_sealed() {
    restartable_long_answer_case();
}

pub fn exact_numbers_case() -> usize {
    const EXACT: &str = r#"{"small": 1e2, "big": 123456789012345678901234567890, "fraction": 1.50, "negative": -0.0}"#;
    let upstream = ScriptedUpstream::start(serving_calls(|seen| {
        let text = format!(
            r#"{{"jsonrpc": "2.0", "id": {}, "result": {{"content": [], "structuredContent": {EXACT}}}}}"#,
            seen.jsonrpc_id()
        );
        Answer::status(
            200,
            &[("content-type", "application/json")],
            text.as_bytes(),
        )
    }));
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let body = format!(
        r#"{{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {{"name": "exact", "arguments": {EXACT},
        "_meta": {{"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {{}}}}}}}}"#
    );
    let reply = Raw::new(&gw.url).request(
        "POST",
        &[
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "exact"),
        ],
        Some(&body),
    );
    let answer = reply.text();
    let sent = upstream
        .requests()
        .into_iter()
        .find(|s| s.jsonrpc_method().as_deref() == Some("tools/call"))
        .expect("the call went upstream");
    let sent = String::from_utf8_lossy(&sent.body).into_owned();
    // Every number keeps its value, its precision and its form (integer, decimal with its
    // digits, exponent); only an exponent's spelling is normalised (`1e2` as `1e+2`).
    for number in ["1e+2", "123456789012345678901234567890", "1.50", "-0.0"] {
        assert!(sent.contains(number), "upstream got {sent}");
        assert!(answer.contains(number), "client got {answer}");
    }
    4
}

#[test]
fn numbers_cross_the_bridge_with_their_exact_value_and_form() {
    exact_numbers_case();
}

/// A legacy upstream's result that dresses itself as an `InputRequiredResult` (its own
/// `resultType`, `inputRequests` and `requestState`) reaches the client as what it is, a
/// complete result: the client is never asked questions no upstream request waits on,
/// with a state the gateway never sealed. Bridged calls and one-shot requests alike.
#[test]
fn an_upstream_result_cannot_pose_as_a_round() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "session-1") {
            return answer;
        }
        let result = json!({"content": [], "tools": [], "resultType": "input_required",
            "inputRequests": {"k": {"method": "roots/list"}}, "requestState": "forged"});
        let response = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": result});
        Answer::sse(&[]).event(None, &response).end()
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let (_, called) = call_tool(&raw, json!({}));
    let listed = raw.modern(2, "tools/list", json!({}), json!({})).json();
    for answer in [called, listed] {
        let result = &answer["result"];
        assert_eq!(result["resultType"], "complete", "{answer}");
        assert!(result.get("inputRequests").is_none(), "{answer}");
        assert!(result.get("requestState").is_none(), "{answer}");
    }
}

/// A gateway in front of `upstream` that finds an answer late past 300 ms: the
/// connection's time and the response's. It opens no warm sessions.
fn impatient_gateway(upstream: &ScriptedUpstream) -> TestGateway {
    TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].connect_timeout_ms = 100;
        c.upstreams[0].response_timeout_ms = 200;
        c.bridge.warm_sessions_per_shape = 0;
    })
}

/// `answer`, sent after `late`.
fn late_answer(answer: Answer, late: Duration) -> Answer {
    Answer::silent().pause(late).bytes(answer.pieces_bytes())
}

/// The DELETE of the session a late answer to `initialize` opens, when the upstream cannot
/// take it at once (a 503 while it restarts), is sent again later.
#[test]
fn a_late_sessions_delete_that_failed_is_sent_again() {
    let late = Duration::from_millis(600);
    let (upstream, deletes) = FirstRefused::deletes_in_front_of(move |seen: &Seen| {
        let initialize = seen.jsonrpc_method().as_deref() == Some("initialize");
        match legacy_basics(seen, "late-1") {
            Some(answer) if initialize => late_answer(answer, late),
            Some(answer) => answer,
            None => Answer::status(405, &[], b""),
        }
    });
    let gw = impatient_gateway(&upstream);
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert_eq!(status, 200, "{body}");
    assert!(
        error_message(&body).contains("did not answer in time"),
        "{body}"
    );
    // Each session a late answer opened is deleted; the one refused first, again.
    deletes.assert_every_session_deleted_the_refused_one_again(&gw, &upstream);
}

/// An upstream that answers `initialize` only after the group's response timeout (a pause,
/// an overloaded pod) still opens the session: the request fails in time, and the session
/// the late answer names is ended rather than left to the upstream's expiry (SDK servers
/// keep sessions until they are deleted). So for a bridged call's session, and for a
/// legacy client's `initialize` through pass-through, whose client never learns the id;
/// the DELETE carries the client's credentials.
#[test]
fn a_session_whose_initialize_answered_late_is_ended() {
    let late = Duration::from_millis(600);
    // `initialize` is answered late with session `late-1`; a client named `on-time` is
    // answered at once with `kept-1`, and its `initialize` again within that session late.
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let initialize = seen.jsonrpc_method().as_deref() == Some("initialize");
        let on_time = seen
            .json()
            .is_some_and(|m| m["params"]["clientInfo"]["name"] == "on-time");
        let session = match seen.header("mcp-session-id") {
            Some("kept-1") => "kept-1",
            _ if on_time => "kept-1",
            _ => "late-1",
        };
        match legacy_basics(seen, session) {
            Some(answer) if initialize && !on_time => late_answer(answer, late),
            Some(answer) => answer,
            None => Answer::status(405, &[], b""),
        }
    });
    let gw = impatient_gateway(&upstream);
    let deletes = |of: &str| {
        let requests = upstream.requests();
        let ended = |s: &&Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some(of);
        requests
            .iter()
            .filter(ended)
            .cloned()
            .collect::<Vec<Seen>>()
    };
    let (status, body) = call_tool(&Raw::new(&gw.url), json!({}));
    assert_eq!(status, 200, "{body}");
    assert!(
        error_message(&body).contains("opening a session (initialize): did not answer in time"),
        "{body}"
    );
    wait_until("the bridged session ended", Duration::from_secs(10), || {
        !deletes("late-1").is_empty()
    });

    let raw = Raw::new(&gw.url);
    // Within a session of its own, a late answer names that session: it is left alone.
    let kept = raw.post(None, &legacy_initialize("on-time"));
    assert_eq!(kept.status, 200);
    let token = kept.session.expect("a session token");
    let again = raw.post(Some(&token), &legacy_initialize("again"));
    assert_eq!(again.status, 504, "the legacy client hears the timeout");
    // Outside any session: a client that never learns the id.
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("x-api-key", "k-7"),
    ];
    let legacy = raw.request(
        "POST",
        &headers,
        Some(&legacy_initialize("late").to_string()),
    );
    assert_eq!(legacy.status, 504, "the legacy client hears the timeout");
    let as_the_client = |s: &Seen| s.header("x-api-key") == Some("k-7");
    wait_until(
        "the pass-through session ended",
        Duration::from_secs(10),
        || deletes("late-1").iter().any(as_the_client),
    );
    assert!(
        deletes("kept-1").is_empty(),
        "the client's own session was ended"
    );
}

/// A legacy client that leaves while its `initialize` is on its way (a timeout of its
/// own, a closed tab) never learns of the session the answer opens: the gateway ends it,
/// with the client's credentials, rather than leave it to the upstream's expiry.
#[test]
fn a_session_whose_initialize_client_left_is_ended() {
    let answer = Gate::new();
    let held = answer.clone();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let initialize = seen.jsonrpc_method().as_deref() == Some("initialize");
        match legacy_basics(seen, "left-1") {
            Some(sent) if initialize => Answer::silent().wait(&held).bytes(sent.pieces_bytes()),
            Some(sent) => sent,
            None => Answer::status(405, &[], b""),
        }
    });
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let body = legacy_initialize("leaving").to_string();
    let request = format!(
        "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\nx-api-key: k-8\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let client = raw_send(gw.port, request.as_bytes(), Duration::from_secs(10));
    upstream.wait_for(1, Duration::from_secs(10));
    drop(client);
    answer.open();
    let ended = |s: &Seen| {
        s.method == "DELETE"
            && s.header("mcp-session-id") == Some("left-1")
            && s.header("x-api-key") == Some("k-8")
    };
    wait_until("the session ended", Duration::from_secs(10), || {
        upstream.requests().iter().any(ended)
    });
}
