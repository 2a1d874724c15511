//! Era detection and the validation of a 2026-07-28 request: the `MCP-Protocol-Version`,
//! `Mcp-Method` and `Mcp-Name` headers must match the body, and `_meta` must carry the
//! protocol version and client capabilities. Every refusal is the spec's own error.

use super::state::{Pending, QuestionKind};
use crate::outcome::{Class, Refusal};
use crate::protocol::headers::EndToEnd;
use crate::protocol::trace::TraceContext;
use serde_json::{Map, Value};

pub const MODERN_VERSION: &str = "2026-07-28";
pub const SUPPORTED_VERSIONS: &[&str] = &[MODERN_VERSION];
pub const LEGACY_VERSIONS: &[&str] = &["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];

const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
const META_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
const META_LOG_LEVEL: &str = "io.modelcontextprotocol/logLevel";

/// MCP error codes of the 2026-07-28 revision.
pub mod code {
    pub const HEADER_MISMATCH: i64 = -32020;
    pub const MISSING_REQUIRED_CLIENT_CAPABILITY: i64 = -32021;
    pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;
}

/// The gateway's own error codes, from the range the 2026-07-28 schema leaves to
/// implementations (-32000 to -32019). The data-layer session strawman's -32002 is
/// reserved there ("resource not found" of earlier revisions) and must never be reused.
pub mod gateway_code {
    /// The tool needs a data-layer session and the request carried no cookie.
    pub const SESSION_REQUIRED: i64 = -32010;
    /// The session cookie did not open, expired, or names a session that has ended.
    pub const SESSION_ENDED: i64 = -32011;
    /// The upstream lost the call between rounds and it is not run again: the client
    /// should issue the call again.
    pub const FLOW_LOST: i64 = -32012;
}

/// A log message's severity (the schema's `LoggingLevel`, RFC 5424's), least severe first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Debug,
    Info,
    Notice,
    Warning,
    Error,
    Critical,
    Alert,
    Emergency,
}

impl LogLevel {
    pub const NAMES: [&'static str; 8] = [
        "debug",
        "info",
        "notice",
        "warning",
        "error",
        "critical",
        "alert",
        "emergency",
    ];
    const ALL: [LogLevel; 8] = [
        LogLevel::Debug,
        LogLevel::Info,
        LogLevel::Notice,
        LogLevel::Warning,
        LogLevel::Error,
        LogLevel::Critical,
        LogLevel::Alert,
        LogLevel::Emergency,
    ];

    pub fn parse(name: &str) -> Option<LogLevel> {
        let i = Self::NAMES.iter().position(|n| *n == name)?;
        Some(Self::ALL[i])
    }
}

/// Which protocol era a request speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Era {
    Legacy,
    Modern,
}

/// Decides the era of one request. A legacy (or absent) protocol version means the legacy
/// transport, and so does a session id unless the header names a later version (2026-07-28
/// servers ignore an incoming `Mcp-Session-Id`), and `initialize` unless the header names
/// a later version (then the modern surface answers that `initialize` no longer exists).
/// Any other declared version, in the header or in `_meta`, is answered by the modern
/// surface, which refuses versions it lacks.
pub fn era(
    header_version: Option<&str>,
    meta_version: Option<&str>,
    has_session: bool,
    method: Option<&str>,
) -> Era {
    let declared_modern = |v: Option<&str>| v.is_some_and(|v| !LEGACY_VERSIONS.contains(&v));
    if has_session && !declared_modern(header_version) {
        return Era::Legacy;
    }
    if method == Some("initialize") {
        return if declared_modern(header_version) {
            Era::Modern
        } else {
            Era::Legacy
        };
    }
    if declared_modern(header_version.or(meta_version)) {
        Era::Modern
    } else {
        Era::Legacy
    }
}

/// The request's `logLevel`, one of the schema's `LoggingLevel` names if present.
fn check_log_level(level: Option<&Value>) -> Result<Option<LogLevel>, Refusal> {
    let Some(level) = level else {
        return Ok(None);
    };
    match level.as_str().and_then(LogLevel::parse) {
        Some(level) => Ok(Some(level)),
        None => Err(invalid_params(format!(
            "_meta[\"{META_LOG_LEVEL}\"] must be one of {}",
            LogLevel::NAMES.join(", ")
        ))),
    }
}

/// The refusals of an invalid 2026-07-28 request (all HTTP 400, with the spec's codes).
fn header_mismatch(message: impl Into<String>) -> Refusal {
    Refusal::new(Class::BadRequest, code::HEADER_MISMATCH, message)
}

fn unsupported_version(version: &str) -> Refusal {
    let shown: String = version.chars().take(64).collect();
    Refusal::new(
        Class::BadRequest,
        code::UNSUPPORTED_PROTOCOL_VERSION,
        format!("Unsupported protocol version '{shown}'"),
    )
    .with_data(serde_json::json!({"supported": SUPPORTED_VERSIONS, "requested": shown}))
}

/// Refuses an `MCP-Protocol-Version` header naming a version the gateway does not speak
/// (-32022, listing those it does). It is told first, before the method is looked up:
/// the request's other requirements are not this revision's to state.
pub fn check_header_version(header: Option<&str>) -> Result<(), Refusal> {
    match header {
        Some(h) if !SUPPORTED_VERSIONS.contains(&h) && !LEGACY_VERSIONS.contains(&h) => {
            Err(unsupported_version(h))
        }
        _ => Ok(()),
    }
}

fn invalid_params(message: impl Into<String>) -> Refusal {
    Refusal::new(
        Class::BadRequest,
        crate::protocol::jsonrpc::code::INVALID_PARAMS,
        message,
    )
}

/// The request headers the modern surface checks.
#[derive(Clone, Copy, Debug, Default)]
pub struct ModernHeaders<'a> {
    pub protocol_version: Option<&'a str>,
    pub method: Option<&'a str>,
    pub name: Option<&'a str>,
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
    /// One of the three headers above that mirror the body, if the request carries it
    /// more than once with different values (which one a reader takes is anyone's guess).
    pub repeated: Option<&'static str>,
    /// One of them, if the request carries it with bytes that are not visible ASCII
    /// (read as absent above).
    pub unreadable: Option<&'static str>,
}

/// A validated 2026-07-28 request.
#[derive(Clone, Debug, PartialEq)]
pub struct ModernRequest {
    pub id: Value,
    pub method: String,
    pub params: Map<String, Value>,
    pub client_capabilities: Map<String, Value>,
    /// The tool or prompt name, or the resource uri, for the methods that carry one.
    pub target: Option<String>,
    /// The least severe log messages the request wants (`_meta` `logLevel`); none without it.
    pub log_level: Option<LogLevel>,
    pub progress_token: Option<Value>,
    /// The W3C trace context of the request's headers, for every upstream request.
    pub trace: TraceContext,
    /// The end-to-end headers every upstream request of its flow carries (the shell
    /// fills them in by the group's policy).
    pub headers: EndToEnd,
}

/// The body parameter `Mcp-Name` mirrors for `method`, if any.
pub fn name_param(method: &str) -> Option<&'static str> {
    match method {
        "tools/call" | "prompts/get" => Some("name"),
        "resources/read" => Some("uri"),
        _ => None,
    }
}

/// Decodes a header value that may use the `=?base64?…?=` form for non-ASCII text.
pub fn decode_header_value(value: &str) -> Option<String> {
    use base64::Engine;
    match value
        .strip_prefix("=?base64?")
        .and_then(|v| v.strip_suffix("?="))
    {
        Some(b64) => {
            let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
            String::from_utf8(raw).ok()
        }
        None => Some(value.to_string()),
    }
}

impl ModernRequest {
    /// Validates a parsed JSON-RPC request against its headers.
    pub fn validate(
        id: Value,
        method: &str,
        params: Option<&Value>,
        headers: ModernHeaders,
    ) -> Result<ModernRequest, Refusal> {
        let params = match params {
            None => Map::new(),
            Some(Value::Object(p)) => p.clone(),
            Some(_) => return Err(invalid_params("params must be an object")),
        };
        check_header_version(headers.protocol_version)?;
        let meta = params
            .get("_meta")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                invalid_params("params._meta is required in protocol version 2026-07-28")
            })?;
        if let Some(name) = headers.repeated {
            return Err(header_mismatch(format!(
                "the {name} header appears more than once, with different values"
            )));
        }
        if let Some(name) = headers.unreadable {
            return Err(header_mismatch(format!(
                "the {name} header is not visible ASCII: send other text as =?base64?…?= (the base64 of its UTF-8)"
            )));
        }
        let version = meta
            .get(META_VERSION)
            .and_then(Value::as_str)
            .ok_or_else(|| {
                invalid_params(format!("params._meta[\"{META_VERSION}\"] is required"))
            })?;
        match headers.protocol_version {
            Some(h) if h == version => {}
            Some(h) => {
                return Err(header_mismatch(format!(
                    "MCP-Protocol-Version header '{h}' does not match _meta version '{version}'"
                )))
            }
            None => {
                return Err(header_mismatch(
                    "the MCP-Protocol-Version header is required",
                ))
            }
        }
        if !SUPPORTED_VERSIONS.contains(&version) {
            return Err(unsupported_version(version));
        }
        let client_capabilities = match meta.get(META_CAPABILITIES) {
            Some(Value::Object(capabilities)) => capabilities.clone(),
            Some(_) => {
                return Err(invalid_params(format!(
                    "params._meta[\"{META_CAPABILITIES}\"] must be an object"
                )))
            }
            None => {
                return Err(invalid_params(format!(
                    "params._meta[\"{META_CAPABILITIES}\"] is required"
                )))
            }
        };
        match headers.method {
            Some(m) if m == method => {}
            Some(m) => {
                return Err(header_mismatch(format!(
                    "Mcp-Method header '{m}' does not match the body's method '{method}'"
                )))
            }
            None => return Err(header_mismatch("the Mcp-Method header is required")),
        }
        let target = check_name(method, &params, headers.name)?;
        // Each answer is checked against the question it answers (`check_answers`), once
        // the state says which are pending: other keys are ignored, as the spec asks.
        if params.get("inputResponses").is_some_and(|r| !r.is_object()) {
            return Err(invalid_params("inputResponses must be an object"));
        }
        if params.get("requestState").is_some_and(|v| !v.is_string()) {
            return Err(invalid_params("requestState must be a string"));
        }
        let log_level = check_log_level(meta.get(META_LOG_LEVEL))?;
        Ok(ModernRequest {
            id,
            method: method.to_string(),
            log_level,
            progress_token: meta.get("progressToken").cloned(),
            trace: TraceContext::from_headers(headers.traceparent, headers.tracestate),
            headers: EndToEnd::default(),
            client_capabilities,
            target,
            params,
        })
    }
}

/// Each answer a retry gives to a pending question is a result object (`ElicitResult`,
/// `CreateMessageResult` or `ListRootsResult`: anything else is refused before it could be
/// posted upstream) of the shape its question asks for, where the state says what the
/// question was (`check_answer`). Answers under other keys are ignored.
pub fn check_answers(pending: &[Pending], responses: &Map<String, Value>) -> Result<(), Refusal> {
    for pending in pending {
        let Some(answer) = responses.get(&pending.key) else {
            continue;
        };
        if !answer.is_object() {
            let key: String = pending.key.chars().take(64).collect();
            return Err(invalid_params(format!(
                "inputResponses[{}] must be an object: an ElicitResult, CreateMessageResult or ListRootsResult",
                Value::from(key)
            )));
        }
        if let Some(kind) = pending.asked.kind {
            check_answer(&pending.key, kind, answer)?;
        }
    }
    Ok(())
}

/// The answer under `key` has the shape of the result its question asks for (the
/// schema's `ElicitResult`, `CreateMessageResult` or `ListRootsResult`, their required
/// members): one that has not is refused, naming what is wrong, before it goes upstream.
pub fn check_answer(key: &str, kind: QuestionKind, answer: &Value) -> Result<(), Refusal> {
    let (fits, method, needs) = match kind {
        QuestionKind::Elicitation => (
            is_elicit_result(answer),
            "elicitation/create",
            "an action of \"accept\", \"decline\" or \"cancel\", and content, if any, an object whose values are strings, numbers, booleans or arrays of strings",
        ),
        QuestionKind::Sampling => (
            is_create_message_result(answer),
            "sampling/createMessage",
            "a role of \"user\" or \"assistant\", a model, and content: a block or an array of blocks, each text (with text), image or audio (with data and mimeType), tool_use (with id, name and an input object) or tool_result (with toolUseId and a content array)",
        ),
        QuestionKind::Roots => (
            is_list_roots_result(answer),
            "roots/list",
            "roots, an array of objects each with a uri that starts with file:// and a name, if any, a string",
        ),
    };
    if fits {
        return Ok(());
    }
    let key: String = key.chars().take(64).collect();
    Err(invalid_params(format!(
        "inputResponses[{}] answers {method}: its result needs {needs}",
        Value::from(key)
    )))
}

/// `value[name]` is a string, one of `allowed` unless that is empty.
fn str_member(value: &Value, name: &str, allowed: &[&str]) -> bool {
    value
        .get(name)
        .and_then(Value::as_str)
        .is_some_and(|v| allowed.is_empty() || allowed.contains(&v))
}

/// The schema's `ElicitResult`: an action, and content of primitive values.
fn is_elicit_result(answer: &Value) -> bool {
    let primitive = |v: &Value| match v {
        Value::String(_) | Value::Number(_) | Value::Bool(_) => true,
        Value::Array(items) => items.iter().all(Value::is_string),
        _ => false,
    };
    str_member(answer, "action", &["accept", "decline", "cancel"])
        && match answer.get("content") {
            None => true,
            Some(Value::Object(content)) => content.values().all(primitive),
            Some(_) => false,
        }
}

/// The schema's `CreateMessageResult`: a role, a model, and content of sampling blocks.
fn is_create_message_result(answer: &Value) -> bool {
    let block = |b: &Value| match b.get("type").and_then(Value::as_str) {
        Some("text") => str_member(b, "text", &[]),
        Some("image" | "audio") => str_member(b, "data", &[]) && str_member(b, "mimeType", &[]),
        Some("tool_use") => {
            str_member(b, "id", &[])
                && str_member(b, "name", &[])
                && b.get("input").is_some_and(Value::is_object)
        }
        Some("tool_result") => {
            str_member(b, "toolUseId", &[]) && b.get("content").is_some_and(Value::is_array)
        }
        _ => false,
    };
    str_member(answer, "role", &["user", "assistant"])
        && str_member(answer, "model", &[])
        && match answer.get("content") {
            Some(Value::Array(blocks)) => blocks.iter().all(block),
            Some(one) => block(one),
            None => false,
        }
}

/// The schema's `ListRootsResult`: roots whose uris are `file://` URIs.
fn is_list_roots_result(answer: &Value) -> bool {
    let root = |r: &Value| {
        r.get("uri")
            .and_then(Value::as_str)
            .is_some_and(|uri| uri.starts_with("file://"))
            && r.get("name").is_none_or(Value::is_string)
    };
    answer
        .get("roots")
        .and_then(Value::as_array)
        .is_some_and(|roots| roots.iter().all(root))
}

fn check_name(
    method: &str,
    params: &Map<String, Value>,
    header: Option<&str>,
) -> Result<Option<String>, Refusal> {
    let Some(field) = name_param(method) else {
        return Ok(None);
    };
    let body = params
        .get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| invalid_params(format!("params.{field} is required for {method}")))?;
    let header = header
        .ok_or_else(|| header_mismatch(format!("the Mcp-Name header is required for {method}")))?;
    match decode_header_value(header) {
        Some(decoded) if decoded == body => Ok(Some(body.to_string())),
        _ => Err(header_mismatch(format!(
            "Mcp-Name header does not match the body's '{field}' parameter"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(extra: Value) -> Value {
        let mut p = json!({"_meta": {META_VERSION: MODERN_VERSION, META_CAPABILITIES: {"elicitation": {}}}});
        p.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        p
    }

    fn headers<'a>(method: &'a str, name: Option<&'a str>) -> ModernHeaders<'a> {
        ModernHeaders {
            protocol_version: Some(MODERN_VERSION),
            method: Some(method),
            name,
            ..Default::default()
        }
    }

    #[test]
    fn eras() {
        assert_eq!(
            era(Some("2026-07-28"), None, false, Some("tools/call")),
            Era::Modern
        );
        assert_eq!(
            era(Some("2099-01-01"), None, false, Some("tools/call")),
            Era::Modern
        );
        assert_eq!(
            era(None, Some("2026-07-28"), false, Some("tools/call")),
            Era::Modern
        );
        assert_eq!(
            era(Some("2025-11-25"), None, false, Some("tools/call")),
            Era::Legacy
        );
        assert_eq!(era(None, None, false, Some("tools/list")), Era::Legacy);
        assert_eq!(
            era(Some("2026-07-28"), None, true, Some("tools/call")),
            Era::Modern,
            "a 2026-07-28 request's stray session id is ignored"
        );
        assert_eq!(
            era(Some("2025-11-25"), None, true, Some("tools/call")),
            Era::Legacy
        );
        assert_eq!(
            era(None, Some("2026-07-28"), true, Some("tools/call")),
            Era::Legacy,
            "a session's requests declare their version in the header"
        );
        let init = |header, meta| era(header, meta, false, Some("initialize"));
        assert_eq!(
            init(Some("2026-07-28"), None),
            Era::Modern,
            "initialize no longer exists there"
        );
        assert_eq!(init(Some("2025-11-25"), None), Era::Legacy);
        assert_eq!(init(None, None), Era::Legacy);
        assert_eq!(init(None, Some("2026-07-28")), Era::Legacy);
    }

    #[test]
    fn a_valid_tool_call() {
        let p = params(json!({"name": "ask", "arguments": {}, "_x": 1}));
        let r = ModernRequest::validate(
            json!(1),
            "tools/call",
            Some(&p),
            headers("tools/call", Some("ask")),
        )
        .unwrap();
        assert_eq!(r.target.as_deref(), Some("ask"));
        assert!(r.client_capabilities.contains_key("elicitation"));
        let b64 = format!(
            "=?base64?{}?=",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "ünï")
        );
        let p = params(json!({"name": "ünï"}));
        assert!(ModernRequest::validate(
            json!(1),
            "tools/call",
            Some(&p),
            headers("tools/call", Some(&b64))
        )
        .is_ok());
    }

    #[test]
    fn the_log_level_is_a_schema_level() {
        let with_level = |level: Value| {
            let mut p = params(json!({"name": "ask"}));
            p["_meta"][META_LOG_LEVEL] = level;
            ModernRequest::validate(
                json!(1),
                "tools/call",
                Some(&p),
                headers("tools/call", Some("ask")),
            )
        };
        let r = with_level(json!("warning")).unwrap();
        assert_eq!(r.log_level, Some(LogLevel::Warning));
        assert!(LogLevel::Debug < LogLevel::Info && LogLevel::Alert < LogLevel::Emergency);
        for bad in [json!("verbose"), json!("WARNING"), json!(3)] {
            let refusal = with_level(bad.clone()).unwrap_err();
            assert_eq!(
                refusal.code,
                crate::protocol::jsonrpc::code::INVALID_PARAMS,
                "{bad}"
            );
            assert!(
                refusal.message.contains("debug, info, notice"),
                "{}",
                refusal.message
            );
        }
    }

    #[test]
    fn refusals_use_the_spec_codes() {
        let p = params(json!({"name": "ask"}));
        let v = |p: &Value, h: ModernHeaders| {
            ModernRequest::validate(json!(1), "tools/call", Some(p), h).unwrap_err()
        };
        assert_eq!(
            v(&p, headers("tools/call", Some("other"))).code,
            code::HEADER_MISMATCH
        );
        assert_eq!(
            v(&p, headers("tools/call", None)).code,
            code::HEADER_MISMATCH
        );
        assert_eq!(
            v(&p, headers("tools/list", Some("ask"))).code,
            code::HEADER_MISMATCH
        );
        let mut h = headers("tools/call", Some("ask"));
        h.protocol_version = Some("2025-11-25");
        assert_eq!(v(&p, h).code, code::HEADER_MISMATCH);
        let future =
            json!({"name": "ask", "_meta": {META_VERSION: "2099-01-01", META_CAPABILITIES: {}}});
        let mut h = headers("tools/call", Some("ask"));
        h.protocol_version = Some("2099-01-01");
        let r = v(&future, h);
        assert_eq!(
            (r.class.status(), r.code),
            (400, code::UNSUPPORTED_PROTOCOL_VERSION)
        );
        assert_eq!(r.data.unwrap()["supported"], json!([MODERN_VERSION]));
        // Told before what the body lacks, which only 2026-07-28 requires.
        for unknown in ["1999-01-01", "x", ""] {
            let mut h = headers("tools/call", Some("ask"));
            h.protocol_version = Some(unknown);
            let r = v(&json!({"name": "ask"}), h);
            assert_eq!(r.code, code::UNSUPPORTED_PROTOCOL_VERSION, "{unknown}");
            assert!(r.message.contains(&format!("'{unknown}'")), "{}", r.message);
        }
        let no_caps = json!({"name": "ask", "_meta": {META_VERSION: MODERN_VERSION}});
        assert_eq!(v(&no_caps, headers("tools/call", Some("ask"))).code, -32602);
        assert_eq!(
            v(&json!({"name": "ask"}), headers("tools/call", Some("ask"))).code,
            -32602
        );
        let bad_state = params(json!({"name": "ask", "requestState": 5}));
        assert_eq!(
            v(&bad_state, headers("tools/call", Some("ask"))).code,
            -32602
        );
        let answers = |answer: Value| {
            params(json!({"name": "ask", "inputResponses": {"elicitation_1": answer}}))
        };
        // An answer is checked against its question once the state names it: a bare one
        // under a key nothing asked is ignored (`check_answers` refuses one pending).
        let bare = ModernRequest::validate(
            json!(1),
            "tools/call",
            Some(&answers(json!("Ann"))),
            headers("tools/call", Some("ask")),
        );
        assert!(bare.is_ok());
        let not_a_map = params(json!({"name": "ask", "inputResponses": ["x"]}));
        assert_eq!(
            v(&not_a_map, headers("tools/call", Some("ask"))).code,
            -32602
        );
        let accepted = answers(json!({"action": "accept", "content": {"name": "Ann"}}));
        let ok = ModernRequest::validate(
            json!(1),
            "tools/call",
            Some(&accepted),
            headers("tools/call", Some("ask")),
        );
        assert!(ok.is_ok());
    }

    #[test]
    fn a_mirrored_header_repeated_with_another_value_is_a_mismatch() {
        let repeated = ModernHeaders {
            repeated: Some("Mcp-Name"),
            ..headers("tools/call", Some("ask"))
        };
        let params = params(json!({"name": "ask"}));
        let refused =
            ModernRequest::validate(json!(1), "tools/call", Some(&params), repeated).unwrap_err();
        assert_eq!(refused.code, code::HEADER_MISMATCH);
        assert!(refused
            .message
            .contains("the Mcp-Name header appears more than once"));
        let unreadable = ModernHeaders {
            unreadable: Some("Mcp-Name"),
            ..headers("tools/call", None)
        };
        let refused =
            ModernRequest::validate(json!(1), "tools/call", Some(&params), unreadable).unwrap_err();
        assert_eq!(refused.code, code::HEADER_MISMATCH);
        assert!(
            refused.message.contains("not visible ASCII"),
            "{}",
            refused.message
        );
        let caps =
            json!({"name": "ask", "_meta": {META_VERSION: MODERN_VERSION, META_CAPABILITIES: 5}});
        let h = headers("tools/call", Some("ask"));
        let refused = ModernRequest::validate(json!(1), "tools/call", Some(&caps), h).unwrap_err();
        assert!(
            refused.message.contains("must be an object"),
            "{}",
            refused.message
        );
    }

    #[test]
    fn an_answer_must_fit_the_question_it_answers() {
        use QuestionKind::*;
        let fits = |kind, answer: Value| check_answer("k", kind, &answer).is_ok();
        let text = json!({"type": "text", "text": "hi"});
        assert!(fits(Elicitation, json!({"action": "decline"})));
        assert!(fits(
            Elicitation,
            json!({"action": "accept", "content": {"n": 1}})
        ));
        assert!(!fits(Elicitation, json!({"action": "yes"})));
        assert!(!fits(
            Elicitation,
            json!({"action": "accept", "content": "Ann"})
        ));
        let sampled = json!({"role": "assistant", "content": text, "model": "m"});
        assert!(fits(Sampling, sampled));
        let several = json!({"role": "assistant", "content": [text], "model": "m"});
        assert!(fits(Sampling, several));
        assert!(!fits(
            Sampling,
            json!({"role": "assistant", "content": text})
        ));
        assert!(
            !fits(Sampling, json!({"action": "accept"})),
            "an elicitation's"
        );
        assert!(fits(
            Roots,
            json!({"roots": [{"uri": "file:///a", "name": "a"}]})
        ));
        assert!(fits(Roots, json!({"roots": []})));
        assert!(!fits(Roots, json!({"roots": [{"name": "a"}]})));
        let root = |uri: &str| json!({"roots": [{"uri": uri}]});
        assert!(
            !fits(Roots, root("https://example.com/a")),
            "not a file:// uri"
        );
        assert!(!fits(
            Roots,
            json!({"roots": [{"uri": "file:///a", "name": 1}]})
        ));
        assert!(fits(
            Elicitation,
            json!({"action": "accept", "content": {"s": "a", "b": true, "tags": ["x"]}})
        ));
        let nested = json!({"action": "accept", "content": {"where": {"city": "Lisbon"}}});
        assert!(!fits(Elicitation, nested), "a value that is not primitive");
        let sampled =
            |content: Value| json!({"role": "assistant", "content": content, "model": "m"});
        for block in [
            json!({"type": "image", "data": "AA==", "mimeType": "image/png"}),
            json!({"type": "tool_use", "id": "t1", "name": "f", "input": {}}),
            json!({"type": "tool_result", "toolUseId": "t1", "content": []}),
            json!([]),
        ] {
            assert!(fits(Sampling, sampled(block.clone())), "{block}");
        }
        for block in [
            json!({"type": "text"}),
            json!({"text": "hi"}),
            json!({"type": "image", "data": "AA=="}),
            json!({"type": "video", "data": "AA==", "mimeType": "video/mp4"}),
            json!("hi"),
        ] {
            assert!(!fits(Sampling, sampled(block.clone())), "{block}");
        }
        let pending = |kind| Pending {
            key: "k".into(),
            upstream_id: crate::mrtr::state::UpstreamId::Number(0),
            fingerprint: None,
            asked: crate::mrtr::state::Asked {
                kind,
                on_session: false,
            },
        };
        let answers = |answer: Value| json!({"k": answer}).as_object().unwrap().clone();
        let wrong = answers(json!({"action": "accept"}));
        assert!(check_answers(&[pending(Some(Roots))], &wrong).is_err());
        // A bare answer to a pending question is refused whatever the state says of it;
        // one under a key nothing asked is ignored.
        let bare = check_answers(&[pending(None)], &answers(json!("Ann"))).unwrap_err();
        assert!(
            bare.message
                .contains("inputResponses[\"k\"] must be an object"),
            "{}",
            bare.message
        );
        let stray = json!({"k": {"roots": []}, "note": "x"})
            .as_object()
            .unwrap()
            .clone();
        assert!(check_answers(&[pending(Some(Roots))], &stray).is_ok());
        assert!(
            check_answers(&[pending(None)], &wrong).is_ok(),
            "a state that does not say its kind"
        );
        let refused = check_answer("k", Roots, &json!({"action": "accept"})).unwrap_err();
        assert_eq!(refused.code, -32602);
        assert!(
            refused
                .message
                .contains("inputResponses[\"k\"] answers roots/list"),
            "{}",
            refused.message
        );
    }
}
