//! The demo server's tools. Interactive ones are offered only when the client declared
//! the capability they need at `initialize`, as real legacy servers do.

use super::session::{DemoSession, ServerRequestError};
use super::stream::EventStream;
use serde_json::{json, Value};

pub struct Tool {
    pub name: &'static str,
    pub description: &'static str,
    /// The client capability the tool needs, if any.
    pub needs: Option<&'static str>,
    /// Whether the tool answers over SSE (it streams or asks the client).
    pub streams: bool,
    pub input_schema: fn() -> Value,
}

fn no_args() -> Value {
    json!({"type": "object", "properties": {}})
}
fn text_arg() -> Value {
    json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
}
fn add_args() -> Value {
    json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]})
}
fn steps_arg() -> Value {
    json!({"type": "object", "properties": {"steps": {"type": "integer", "minimum": 1, "maximum": 100}}})
}

fn interview_args() -> Value {
    json!({"type": "object", "properties": {
        "rounds": {"type": "integer", "minimum": 1, "maximum": 10},
        "questions": {"type": "integer", "minimum": 1, "maximum": 10}
    }})
}

pub const TOOLS: &[Tool] = &[
    Tool {
        name: "echo",
        description: "Returns the text it is given.",
        needs: None,
        streams: false,
        input_schema: text_arg,
    },
    Tool {
        name: "add",
        description: "Adds two numbers.",
        needs: None,
        streams: false,
        input_schema: add_args,
    },
    Tool {
        name: "count",
        description: "Counts to `steps`, sending a progress notification per step, over SSE.",
        needs: None,
        streams: true,
        input_schema: steps_arg,
    },
    Tool {
        name: "ask_name",
        description: "Asks the user for their name (elicitation) and greets them.",
        needs: Some("elicitation"),
        streams: true,
        input_schema: no_args,
    },
    Tool {
        name: "plan_trip",
        description:
            "Asks for a destination, then for the number of nights (two elicitation rounds).",
        needs: Some("elicitation"),
        streams: true,
        input_schema: no_args,
    },
    Tool {
        name: "interview",
        description: "Asks `questions` elicitations at once, `rounds` times in a row, and lists the answers (the benchmarks' multi-round tool).",
        needs: Some("elicitation"),
        streams: true,
        input_schema: interview_args,
    },
    Tool {
        name: "summarize",
        description: "Asks the client's model to summarize a text (sampling).",
        needs: Some("sampling"),
        streams: true,
        input_schema: text_arg,
    },
    Tool {
        name: "show_roots",
        description: "Lists the client's roots.",
        needs: Some("roots"),
        streams: true,
        input_schema: no_args,
    },
];

pub fn find(name: &str) -> Option<&'static Tool> {
    TOOLS.iter().find(|t| t.name == name)
}

pub fn offered(tool: &Tool, capabilities: &Value) -> bool {
    tool.needs.is_none_or(|cap| capabilities.get(cap).is_some())
}

pub fn list(capabilities: &Value) -> Value {
    let tools: Vec<Value> = TOOLS
        .iter()
        .filter(|t| offered(t, capabilities))
        .map(|t| json!({"name": t.name, "description": t.description, "inputSchema": (t.input_schema)()}))
        .collect();
    json!({ "tools": tools })
}

pub fn text_result(text: impl Into<String>) -> Value {
    json!({"content": [{"type": "text", "text": text.into()}]})
}

fn error_result(text: impl Into<String>) -> Value {
    json!({"content": [{"type": "text", "text": text.into()}], "isError": true})
}

/// A tool that answers at once (no SSE).
pub fn call_plain(name: &str, args: &Value) -> Value {
    match name {
        "echo" => text_result(args["text"].as_str().unwrap_or_default()),
        "add" => match (args["a"].as_f64(), args["b"].as_f64()) {
            (Some(a), Some(b)) => text_result(format!("{}", a + b)),
            _ => error_result("add needs numbers a and b"),
        },
        _ => error_result(format!("unknown tool {name}")),
    }
}

fn form(message: &str, field: &str, kind: &str) -> Value {
    json!({
        "mode": "form",
        "message": message,
        "requestedSchema": {"type": "object", "properties": {field: {"type": kind}}, "required": [field]}
    })
}

/// The accepted content's `field`, or a text naming what the user did instead.
fn accepted(answer: &Value, field: &str) -> Result<Value, String> {
    match answer["action"].as_str() {
        Some("accept") => answer["content"]
            .get(field)
            .cloned()
            .ok_or_else(|| format!("the answer has no '{field}'")),
        Some(other) => Err(format!("the user chose to {other}")),
        None => Err("the answer has no action".into()),
    }
}

/// Runs a streaming tool to its result. Progress and server requests go on `stream`.
pub async fn call_streaming(
    session: &DemoSession,
    stream: &EventStream,
    name: &str,
    args: &Value,
    progress_token: Option<&Value>,
) -> Result<Value, ServerRequestError> {
    Ok(match name {
        "count" => {
            let steps = args["steps"].as_u64().unwrap_or(3).clamp(1, 100);
            for step in 1..=steps {
                if let Some(token) = progress_token {
                    stream.send(
                        &json!({"jsonrpc": "2.0", "method": "notifications/progress",
                        "params": {"progressToken": token, "progress": step, "total": steps}}),
                    );
                }
            }
            text_result(format!("counted to {steps}"))
        }
        "ask_name" => {
            let answer = session
                .ask(
                    stream,
                    "elicitation/create",
                    form("What is your name?", "name", "string"),
                )
                .await?;
            match accepted(&answer, "name") {
                Ok(name) => text_result(format!("Hello, {}!", name.as_str().unwrap_or("?"))),
                Err(why) => text_result(why),
            }
        }
        "plan_trip" => {
            let first = session
                .ask(
                    stream,
                    "elicitation/create",
                    form("Where do you want to go?", "destination", "string"),
                )
                .await?;
            let destination = match accepted(&first, "destination") {
                Ok(d) => d.as_str().unwrap_or("?").to_string(),
                Err(why) => return Ok(text_result(why)),
            };
            let message = format!("How many nights in {destination}?");
            let second = session
                .ask(
                    stream,
                    "elicitation/create",
                    form(&message, "nights", "integer"),
                )
                .await?;
            match accepted(&second, "nights") {
                Ok(n) => text_result(format!("Trip to {destination} for {n} nights")),
                Err(why) => text_result(why),
            }
        }
        "interview" => {
            let rounds = args["rounds"].as_u64().unwrap_or(1).clamp(1, 10);
            let questions = args["questions"].as_u64().unwrap_or(1).clamp(1, 10);
            let mut answers = Vec::new();
            for round in 1..=rounds {
                let asked: Vec<_> = (1..=questions)
                    .map(|q| {
                        let message = format!("Round {round}, question {q}?");
                        let params = form(&message, "answer", "string");
                        session.send_request(stream, "elicitation/create", params)
                    })
                    .collect();
                for asked in asked {
                    match accepted(&session.answer_to(asked).await?, "answer") {
                        Ok(a) => answers.push(a.as_str().unwrap_or("?").to_string()),
                        Err(why) => return Ok(text_result(why)),
                    }
                }
            }
            text_result(format!("answers: {}", answers.join(", ")))
        }
        "summarize" => {
            let text = args["text"].as_str().unwrap_or_default();
            let params = json!({"messages": [{"role": "user", "content": {"type": "text", "text": format!("Summarize: {text}")}}], "maxTokens": 100});
            let answer = session
                .ask(stream, "sampling/createMessage", params)
                .await?;
            text_result(format!(
                "summary: {}",
                answer["content"]["text"].as_str().unwrap_or("")
            ))
        }
        "show_roots" => {
            let answer = session.ask(stream, "roots/list", json!({})).await?;
            let uris: Vec<&str> = answer["roots"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["uri"].as_str())
                .collect();
            text_result(format!("roots: {}", uris.join(", ")))
        }
        other => error_result(format!("unknown tool {other}")),
    })
}
