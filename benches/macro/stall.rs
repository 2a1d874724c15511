//! Stalls: sequential bridged flows against the Python SDK server with an event store
//! (`tests/fixtures/py_legacy_server.py`, `ask_name`: one question, then the result),
//! each timed whole. A flow whose result lands between a resumption's replay and its
//! live stream waits for the next poll (`resume_poll_ms`); the distribution's tail shows
//! whether that still happens. The same flows also go through a gateway that opens no
//! upstream session ahead of demand: a client that retries at once meets the warm
//! session's replacement opening at the server together with its retry.

use crate::client::Conn;
use crate::mcp::{legacy_call_flow, result_text, LegacyCall};
use crate::procs;
use crate::report::Report;
use serde_json::{json, Map, Value};
use std::path::Path;
use std::time::Instant;

const TOOL: &str = "ask_name";

/// Runs `flows` flows one after another through a gateway in front of the Python server.
pub async fn measure(flows: usize, dir: &Path, report: &mut Report) {
    let Some(python) = procs::python_backend() else {
        report.skipped(
            "stalls",
            "the Python fixture is not installed (bash tests/setup.sh)",
        );
        return;
    };
    let (gateway, _admin) = procs::gateway(dir, &python, crate::DEFAULT_GATEWAY);
    let cold_options = procs::GatewayOptions {
        warm_sessions_per_shape: 0,
        ..crate::DEFAULT_GATEWAY
    };
    let (cold_gateway, _cold_admin) = procs::gateway(dir, &python, cold_options);
    let mut conn = Conn::new(&gateway.addr);
    let mut cold = Conn::new(&cold_gateway.addr);
    // One flow first: the upstream's era and priming are learnt once per replica.
    for conn in [&mut conn, &mut cold] {
        if let Err(e) = flow(conn, "warm").await {
            report.failed("stalls: the warm-up flow", &e);
            return;
        }
    }
    // The baseline: the same flows driven directly by a legacy client, which holds the
    // call's stream open; its tail is the server's own.
    let (mut stream, mut side) = (Conn::new(&python.addr), Conn::new(&python.addr));
    let mut bridged = Vec::with_capacity(flows);
    let mut bridged_cold = Vec::with_capacity(flows);
    let mut direct = Vec::with_capacity(flows);
    for n in 0..flows {
        let tag = format!("s{n}");
        for (conn, times) in [(&mut conn, &mut bridged), (&mut cold, &mut bridged_cold)] {
            let started = Instant::now();
            if let Err(e) = flow(conn, &tag).await {
                return report.failed(&format!("stalls: bridged flow {n}"), &e);
            }
            times.push(started.elapsed());
        }
        let started = Instant::now();
        let expected = format!("Hello, {tag}!");
        let call = LegacyCall {
            tool: TOOL,
            arguments: json!({}),
            expected: &expected,
        };
        let answered = legacy_call_flow(&mut stream, &mut side, call, |_| accept_name(&tag)).await;
        if let Err(e) = answered {
            return report.failed(&format!("stalls: direct flow {n}"), &e);
        }
        direct.push(started.elapsed());
    }
    report.stalls(&bridged, &bridged_cold, &direct, &python);
}

/// One `ask_name` flow: the question, then the answer and the result. Returns when the
/// question came.
pub async fn flow(conn: &mut Conn, tag: &str) -> Result<Instant, String> {
    let retry = first_round(conn, tag).await?;
    let asked = Instant::now();
    answer_round(conn, retry, tag).await.map(|()| asked)
}

/// An `ask_name` flow's first round: the retry that answers its question as `tag`.
pub async fn first_round(conn: &mut Conn, tag: &str) -> Result<Map<String, Value>, String> {
    let first = call(conn, 1, Map::new()).await?;
    let result = &first["result"];
    let requests = result["inputRequests"]
        .as_object()
        .ok_or_else(|| format!("no question: {first}"))?;
    let responses: Map<String, Value> = requests
        .iter()
        .map(|(key, _)| (key.clone(), accept_name(tag)))
        .collect();
    let mut retry = Map::new();
    retry.insert("inputResponses".into(), Value::Object(responses));
    retry.insert("requestState".into(), result["requestState"].clone());
    Ok(retry)
}

/// An `ask_name` flow's retry, whose result must greet `tag`.
pub async fn answer_round(
    conn: &mut Conn,
    retry: Map<String, Value>,
    tag: &str,
) -> Result<(), String> {
    let done = call(conn, 2, retry).await?;
    let text = result_text(&done)?;
    let want = format!("Hello, {tag}!");
    (text == want)
        .then_some(())
        .ok_or_else(|| format!("got {text:?}, wanted {want:?}"))
}

pub fn accept_name(tag: &str) -> Value {
    json!({"action": "accept", "content": {"name": tag}})
}

async fn call(conn: &mut Conn, id: u64, retry: Map<String, Value>) -> Result<Value, String> {
    let mut params = json!({"name": TOOL, "arguments": {},
        "_meta": {"io.modelcontextprotocol/protocolVersion": crate::mcp::MODERN,
                  "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}});
    params.as_object_mut().expect("an object").extend(retry);
    let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params});
    let headers = [
        ("content-type", "application/json"),
        ("accept", crate::mcp::ACCEPT),
        ("mcp-protocol-version", crate::mcp::MODERN),
        ("mcp-method", "tools/call"),
        ("mcp-name", TOOL),
    ];
    let reply = conn
        .send("POST", crate::mcp::PATH, &headers, Some(body.to_string()))
        .await?;
    reply.response_to(id).await
}
