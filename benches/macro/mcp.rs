//! The MCP exchanges the harness drives: a legacy client's calls, the legacy stateful
//! elicitation flow (initialize, held stream, answers POSTed back), and a 2026-07-28
//! client's MRTR flow, against the demo's `interview` tool. Every flow checks that its
//! result lists exactly its own answers, so a lost or crossed answer is an error.

use crate::client::{Conn, Reply};
use serde_json::{json, Map, Value};
use std::time::Instant;

pub const PATH: &str = "/mcp";
const LEGACY: &str = "2025-11-25";
pub const MODERN: &str = "2026-07-28";
pub const ACCEPT: &str = "application/json, text/event-stream";

pub async fn legacy_post(
    conn: &mut Conn,
    session: Option<&str>,
    body: Value,
) -> Result<Reply, String> {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("accept", ACCEPT),
        ("mcp-protocol-version", LEGACY),
    ];
    if let Some(s) = session {
        headers.push(("mcp-session-id", s));
    }
    conn.send("POST", PATH, &headers, Some(body.to_string()))
        .await
}

pub async fn expect_status(reply: Reply, status: u16, what: &str) -> Result<(), String> {
    let got = reply.status;
    let body = reply.bytes().await?;
    if got != status {
        return Err(format!(
            "{what}: HTTP {got}, not {status}: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    Ok(())
}

/// A legacy session: initialize (declaring elicitation), then `notifications/initialized`.
pub async fn initialize(conn: &mut Conn) -> Result<String, String> {
    let params = json!({"protocolVersion": LEGACY, "capabilities": {"elicitation": {}},
        "clientInfo": {"name": "mrtr-bench", "version": "1"}});
    let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params});
    let reply = legacy_post(conn, None, body).await?;
    let session = reply
        .header("mcp-session-id")
        .ok_or("initialize: no Mcp-Session-Id")?;
    let init = reply.response_to(0).await?;
    if init.get("result").is_none() {
        return Err(format!("initialize failed: {init}"));
    }
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let reply = legacy_post(conn, Some(&session), note).await?;
    expect_status(reply, 202, "notifications/initialized").await?;
    Ok(session)
}

pub async fn delete(conn: &mut Conn, session: &str) -> Result<(), String> {
    let headers = [
        ("mcp-session-id", session),
        ("mcp-protocol-version", LEGACY),
    ];
    let reply = conn.send("DELETE", PATH, &headers, None).await?;
    expect_status(reply, 200, "DELETE").await
}

/// The first text of a successful tool result.
pub fn result_text(message: &Value) -> Result<&str, String> {
    let result = message
        .get("result")
        .ok_or_else(|| format!("not a result: {message}"))?;
    if result["isError"] == true {
        return Err(format!("tool error: {message}"));
    }
    result["content"][0]["text"]
        .as_str()
        .ok_or_else(|| format!("no text: {message}"))
}

/// One `tools/call` in a legacy session; checks the result's text.
pub async fn call(
    conn: &mut Conn,
    session: &str,
    id: u64,
    name: &str,
    arguments: Value,
    expect: &str,
) -> Result<(), String> {
    let params = json!({"name": name, "arguments": arguments, "_meta": {"progressToken": id}});
    let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params});
    let message = legacy_post(conn, Some(session), body)
        .await?
        .response_to(id)
        .await?;
    match result_text(&message)? {
        text if text == expect => Ok(()),
        text => Err(format!("{name}: expected {expect:?}, got {text:?}")),
    }
}

/// What an interview flow is asked and must answer.
#[derive(Clone, Copy)]
pub struct Interview {
    pub rounds: u64,
    pub questions: u64,
}

impl Interview {
    pub fn arguments(self) -> Value {
        json!({"rounds": self.rounds, "questions": self.questions})
    }

    /// The result a flow tagged `tag` must end with: every answer, in the order asked.
    pub fn expected(self, tag: &str) -> String {
        let answers: Vec<String> = (1..=self.rounds)
            .flat_map(|r| (1..=self.questions).map(move |q| (r, q)))
            .map(|(r, q)| answer_text(tag, &format!("Round {r}, question {q}?")))
            .collect();
        format!("answers: {}", answers.join(", "))
    }
}

fn answer_text(tag: &str, question: &str) -> String {
    format!("{tag}/{question}")
}

pub fn accept(tag: &str, question: &Value) -> Value {
    let message = question["message"].as_str().unwrap_or_default();
    json!({"action": "accept", "content": {"answer": answer_text(tag, message)}})
}

/// The legacy stateful flow, directly against the backend: initialize, the call's stream
/// held open, each question answered by a POST on a second connection, then DELETE.
pub async fn legacy_flow(
    stream: &mut Conn,
    side: &mut Conn,
    interview: Interview,
    tag: &str,
) -> Result<(), String> {
    let call = LegacyCall {
        tool: "interview",
        arguments: interview.arguments(),
        expected: &interview.expected(tag),
    };
    legacy_call_flow(stream, side, call, |params| accept(tag, params)).await
}

/// A tool called in a legacy flow, and the result text it must give.
pub struct LegacyCall<'a> {
    pub tool: &'a str,
    pub arguments: Value,
    pub expected: &'a str,
}

/// `legacy_flow` for any tool: each question's params go to `answer` for its result.
pub async fn legacy_call_flow(
    stream: &mut Conn,
    side: &mut Conn,
    call: LegacyCall<'_>,
    answer: impl Fn(&Value) -> Value,
) -> Result<(), String> {
    let session = initialize(side).await?;
    legacy_call_in(stream, side, &session, call, answer).await?;
    delete(side, &session).await
}

/// One call of a legacy client that keeps its session: the call's stream held open, each
/// question answered by a POST on `side`.
pub async fn legacy_call_in(
    stream: &mut Conn,
    side: &mut Conn,
    session: &str,
    call: LegacyCall<'_>,
    answer: impl Fn(&Value) -> Value,
) -> Result<(), String> {
    let session = session.to_string();
    let params = json!({"name": call.tool, "arguments": call.arguments});
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params});
    let mut events = legacy_post(stream, Some(&session), body).await?.events();
    loop {
        let message = events
            .next()
            .await?
            .ok_or("the call's stream ended without a result")?;
        if message["method"] == "elicitation/create" {
            let result = answer(&message["params"]);
            let answer = json!({"jsonrpc": "2.0", "id": message["id"], "result": result});
            let reply = legacy_post(side, Some(&session), answer).await?;
            expect_status(reply, 202, "answer").await?;
        } else if message["id"] == 1 {
            check(result_text(&message)?, call.expected)?;
            break;
        }
    }
    while events.next().await?.is_some() {}
    Ok(())
}

pub fn check(text: &str, expected: &str) -> Result<(), String> {
    (text == expected)
        .then_some(())
        .ok_or_else(|| format!("expected {expected:?}, got {text:?}"))
}

/// Where a 2026-07-28 flow stands after one round.
pub enum Step {
    /// An `InputRequiredResult`: the retry's `inputResponses` and `requestState`.
    Input {
        retry: Map<String, Value>,
    },
    Done(String),
}

/// One 2026-07-28 `tools/call` of the interview: the first (`retry` empty) or a retry.
pub async fn modern_round(
    conn: &mut Conn,
    id: u64,
    interview: Interview,
    retry: Map<String, Value>,
    tag: &str,
) -> Result<Step, String> {
    let message = modern_call(conn, id, interview, retry).await?;
    let result = &message["result"];
    match result["resultType"].as_str() {
        Some("input_required") => {
            let requests = result["inputRequests"]
                .as_object()
                .ok_or_else(|| format!("no inputRequests: {message}"))?;
            let responses: Map<String, Value> = requests
                .iter()
                .map(|(key, q)| (key.clone(), accept(tag, &q["params"])))
                .collect();
            let mut retry = Map::new();
            retry.insert("inputResponses".into(), Value::Object(responses));
            retry.insert("requestState".into(), result["requestState"].clone());
            Ok(Step::Input { retry })
        }
        Some("complete") => Ok(Step::Done(result_text(&message)?.to_string())),
        _ => Err(format!("unexpected reply: {message}")),
    }
}

/// A 2026-07-28 `tools/call` of the interview, and the JSON-RPC response to it.
pub async fn modern_call(
    conn: &mut Conn,
    id: u64,
    interview: Interview,
    retry: Map<String, Value>,
) -> Result<Value, String> {
    let mut params = json!({"name": "interview", "arguments": interview.arguments(),
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                  "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}});
    params.as_object_mut().expect("an object").extend(retry);
    let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params});
    let headers = [
        ("content-type", "application/json"),
        ("accept", ACCEPT),
        ("mcp-protocol-version", MODERN),
        ("mcp-method", "tools/call"),
        ("mcp-name", "interview"),
    ];
    let reply = conn
        .send("POST", PATH, &headers, Some(body.to_string()))
        .await?;
    reply.response_to(id).await
}

/// A whole 2026-07-28 flow through the gateway: rounds until the result, which must list
/// exactly this flow's answers. Returns when the first round's answer came.
pub async fn modern_flow(
    conn: &mut Conn,
    interview: Interview,
    tag: &str,
) -> Result<Instant, String> {
    let mut retry = Map::new();
    let mut first_round = None;
    for id in 1..=interview.rounds + 1 {
        let step = modern_round(conn, id, interview, retry, tag).await?;
        let ended = *first_round.get_or_insert_with(Instant::now);
        match step {
            Step::Input { retry: next } => retry = next,
            Step::Done(text) => return check(&text, &interview.expected(tag)).map(|()| ended),
        }
    }
    Err("more rounds than the tool asks".into())
}

/// The length of a retry's `requestState`.
pub fn state_len(retry: &Map<String, Value>) -> usize {
    retry["requestState"].as_str().map_or(0, str::len)
}
