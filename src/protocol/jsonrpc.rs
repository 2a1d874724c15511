//! JSON-RPC 2.0 as MCP uses it: classifying a POSTed body into requests, notifications
//! and responses without materialising params or results, building error bodies, and
//! reading JSON text as JavaScript writes it (`from_slice_lenient`).

use serde::de::{DeserializeOwned, DeserializeSeed, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// Standard JSON-RPC error codes used by the gateway.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL_ERROR: i64 = -32603;
}

/// The cancellation of a request (`notifications/cancelled`): the request it names, and
/// why.
#[derive(Clone, Debug, PartialEq)]
pub struct Cancellation {
    pub request_id: Value,
    pub reason: &'static str,
}

impl Cancellation {
    /// The notification, as a client cancels a request.
    pub fn to_json(&self) -> Value {
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": self.request_id, "reason": self.reason}})
    }
}

/// What one JSON-RPC message is.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Request { id: Value, method: String },
    Notification { method: String },
    Response { id: Value },
}

impl Message {
    pub fn method(&self) -> Option<&str> {
        match self {
            Message::Request { method, .. } | Message::Notification { method } => Some(method),
            Message::Response { .. } => None,
        }
    }

    pub fn id(&self) -> Option<&Value> {
        match self {
            Message::Request { id, .. } | Message::Response { id } => Some(id),
            Message::Notification { .. } => None,
        }
    }
}

/// A POSTed body: one message, or a batch (2025-03-26 allowed batches).
#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    Single(Message),
    Batch(Vec<Message>),
}

impl Body {
    /// The request id to echo in an error about this body, when there is exactly one.
    pub fn id(&self) -> Option<&Value> {
        match self {
            Body::Single(m) => m.id(),
            Body::Batch(_) => None,
        }
    }

    /// The method of a single message, for logs and metrics.
    pub fn method(&self) -> Option<&str> {
        match self {
            Body::Single(m) => m.method(),
            Body::Batch(_) => Some("batch"),
        }
    }

    pub fn is_initialize(&self) -> bool {
        self.method() == Some("initialize")
    }
}

/// A body the gateway refuses, with the JSON-RPC error it answers.
#[derive(Clone, Debug, PartialEq)]
pub struct Invalid {
    pub code: i64,
    pub message: String,
    pub id: Option<Value>,
}

#[derive(Deserialize)]
struct Envelope<'a> {
    jsonrpc: Option<String>,
    /// As sent, not yet built: `Some` for an explicit `"id": null` too, which is not a
    /// valid request id; one that is an array or object is refused unbuilt.
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    method: Option<String>,
    result: Option<IgnoredAny>,
    error: Option<IgnoredAny>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// A batch's messages, refused past `max` before the rest is built: what is past it is
/// only checked as JSON (`IgnoredAny`), so a body of a million `{}` costs no million
/// envelopes. `None`: more than `max`.
struct BoundedBatch(usize);

impl<'de> DeserializeSeed<'de> for BoundedBatch {
    type Value = Option<Vec<Envelope<'de>>>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for BoundedBatch {
    type Value = Option<Vec<Envelope<'de>>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "a batch of JSON-RPC messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Envelope<'de>>()? {
            if items.len() == self.0 {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                return Ok(None);
            }
            items.push(item);
        }
        Ok(Some(items))
    }
}

/// Classifies a POSTed body. The longest batch accepted is `max_batch`.
pub fn classify(body: &[u8], max_batch: usize) -> Result<Body, Invalid> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first == Some(&b'[') {
        let mut json = serde_json::Deserializer::from_slice(body);
        let items = BoundedBatch(max_batch)
            .deserialize(&mut json)
            .and_then(|items| json.end().map(|()| items))
            .map_err(parse_error)?;
        let Some(items) = items.filter(|items| !items.is_empty()) else {
            return Err(invalid(
                None,
                format!("a batch must hold 1 to {max_batch} messages"),
            ));
        };
        let messages = items.into_iter().map(message).collect::<Result<_, _>>()?;
        return Ok(Body::Batch(messages));
    }
    let envelope: Envelope = serde_json::from_slice(body).map_err(parse_error)?;
    message(envelope).map(Body::Single)
}

fn parse_error(e: serde_json::Error) -> Invalid {
    let message = if e.is_data() {
        format!("the body is not a JSON-RPC message object: {e}")
    } else {
        format!("the body is not valid JSON: {e}")
    };
    let code = if e.is_data() {
        code::INVALID_REQUEST
    } else {
        code::PARSE_ERROR
    };
    Invalid {
        code,
        message,
        id: None,
    }
}

fn invalid(id: Option<Value>, message: String) -> Invalid {
    Invalid {
        code: code::INVALID_REQUEST,
        message,
        id,
    }
}

fn valid_id(id: &Value) -> bool {
    id.is_string() || id.is_i64() || id.is_u64()
}

fn message(e: Envelope) -> Result<Message, Invalid> {
    let not_an_id = || invalid(None, "\"id\" must be a string or an integer".into());
    // An array or object is no id, and is not built to be told so.
    let id = match e.id.map(RawValue::get) {
        Some(text) if text.starts_with(['[', '{']) => return Err(not_an_id()),
        Some(text) => Some(serde_json::from_str::<Value>(text).map_err(|_| not_an_id())?),
        None => None,
    };
    if e.jsonrpc.as_deref() != Some("2.0") {
        return Err(invalid(id, "\"jsonrpc\" must be \"2.0\"".into()));
    }
    if id.as_ref().is_some_and(|id| !valid_id(id)) {
        return Err(not_an_id());
    }
    match (e.method, id, e.result.is_some() || e.error.is_some()) {
        (Some(method), _, true) => Err(invalid(
            None,
            format!("a message with method '{method}' cannot carry result or error"),
        )),
        (Some(method), Some(id), false) => Ok(Message::Request { id, method }),
        (Some(method), None, false) => Ok(Message::Notification { method }),
        (None, Some(id), true) => Ok(Message::Response { id }),
        (None, id, _) => Err(invalid(
            id,
            "a message needs a \"method\", or an \"id\" with a \"result\" or \"error\"".into(),
        )),
    }
}

/// A JSON-RPC error response body.
pub fn error_body(id: Option<&Value>, code: i64, message: &str, data: Option<Value>) -> Vec<u8> {
    let mut error = json!({ "code": code, "message": message });
    if let Some(data) = data {
        error["data"] = data;
    }
    let body =
        json!({ "jsonrpc": "2.0", "id": id.cloned().unwrap_or(Value::Null), "error": error });
    serde_json::to_vec(&body).expect("a JSON value always serializes")
}

/// `value` as JSON text, written straight into one buffer. `Value::to_string` (its
/// `Display`) passes every token through the formatter instead, at about twice the
/// instructions; the text is the same.
pub fn text_of(value: &Value) -> String {
    serde_json::to_string(value).expect("a JSON value always serializes")
}

/// The length of `value`'s JSON text (`text_of`), counted as it is written, without
/// building it.
pub fn text_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value).expect("a JSON value always serializes");
    count.0
}

/// Whether JSON text holds more than `most` values, counted without building any: each
/// `[`, `{`, `,` and `:` outside strings starts one more (a close estimate of what
/// parsing it would allocate). Stops counting past `most`.
pub fn holds_more_values_than(text: &[u8], most: usize) -> bool {
    let (mut values, mut in_string, mut escaped) = (1usize, false, false);
    for &byte in text {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' | b',' | b':' => {
                values += 1;
                if values > most {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

/// Parses JSON text as JavaScript writes it. `JSON.stringify` escapes a lone UTF-16
/// surrogate (a string cut inside an emoji) as `\ud83d`, which JSON's grammar allows
/// (RFC 8259 §8.2) but a Rust string cannot hold: text that does not parse is parsed
/// again with each lone surrogate escape read as U+FFFD, the replacement character. Any
/// other error stands.
pub fn from_slice_lenient<T: DeserializeOwned>(text: &[u8]) -> serde_json::Result<T> {
    serde_json::from_slice(text).or_else(|e| match replace_lone_surrogates(text) {
        Some(mended) => serde_json::from_slice(&mended),
        None => Err(e),
    })
}

const REPLACEMENT_ESCAPE: &[u8; 6] = b"\\ufffd";

/// `text` with every `\uXXXX` escape of a lone surrogate (one not in a high-low pair)
/// replaced by `\ufffd`, the same length; `None` when it has none.
fn replace_lone_surrogates(text: &[u8]) -> Option<Vec<u8>> {
    let unit_at = |i: usize| -> Option<u16> {
        let hex = text.get(i..i + 6)?.strip_prefix(b"\\u")?;
        u16::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()
    };
    let mut mended: Option<Vec<u8>> = None;
    let mut in_string = false;
    let mut i = 0;
    while i < text.len() {
        match (in_string, text[i]) {
            (false, b'"') => in_string = true,
            (false, _) => {}
            (true, b'"') => in_string = false,
            (true, b'\\') => {
                let step = match unit_at(i) {
                    Some(0xD800..=0xDBFF) if matches!(unit_at(i + 6), Some(0xDC00..=0xDFFF)) => 12,
                    Some(0xD800..=0xDFFF) => {
                        let out = mended.get_or_insert_with(|| text.to_vec());
                        out[i..i + 6].copy_from_slice(REPLACEMENT_ESCAPE);
                        6
                    }
                    Some(_) => 6,
                    None => 2,
                };
                i += step;
                continue;
            }
            (true, _) => {}
        }
        i += 1;
    }
    mended
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_len_counts_the_text_without_building_it() {
        let question = json!({"method": "elicitation/create", "params": {
            "message": "Name \"quoted\", tab\t, ü, 😀, \u{1}",
            "big": from_slice_lenient::<Value>(b"123456789012345678901234567890.50").unwrap(),
            "requestedSchema": {"type": "object", "properties": {"n": {"type": "number"}}},
            "list": [null, true, false, -0.5, [], {}],
        }});
        for value in [question.clone(), json!(null), json!(""), json!([1, "x"])] {
            assert_eq!(text_len(&value), text_of(&value).len(), "{value}");
        }
        let (len, bytes) = crate::test_alloc::allocated_by(|| text_len(&question));
        assert_eq!((len, bytes), (text_of(&question).len(), 0));
    }

    #[test]
    fn lone_surrogate_escapes_read_as_the_replacement_character() {
        let parse = |text: &str| from_slice_lenient::<Value>(text.as_bytes()).unwrap();
        assert_eq!(parse(r#"{"t":"cut \ud83d"}"#)["t"], "cut \u{fffd}");
        assert_eq!(
            parse(r#"{"t":"\udc00x"}"#)["t"],
            "\u{fffd}x",
            "a lone low one"
        );
        assert_eq!(parse(r#"{"t":"\ud83d\ud83d\ude00"}"#)["t"], "\u{fffd}😀");
        assert_eq!(parse(r#"{"\ud800":1}"#)["\u{fffd}"], 1, "in a key");
        assert_eq!(parse(r#"["\ud83d\ude00"]"#)[0], "😀", "a pair stands");
        assert_eq!(
            parse(r#"{"t":"\\ud83d"}"#)["t"],
            "\\ud83d",
            "an escaped backslash before `ud83d` is no escape"
        );
        assert_eq!(parse(r#"{"t":"\"\ud83d"}"#)["t"], "\"\u{fffd}");
        assert!(replace_lone_surrogates(br#"{"t":"\ud83d\ude00","u":"\u00e9"}"#).is_none());
        assert!(
            from_slice_lenient::<Value>(br#"{"t":"\ud83d"#).is_err(),
            "still unterminated"
        );
        assert!(from_slice_lenient::<Value>(br#"{"t":"\uzzzz"}"#).is_err());
        assert!(
            from_slice_lenient::<Value>(br#"{"t": \ud83d}"#).is_err(),
            "outside a string"
        );
    }

    fn one(body: &str) -> Result<Message, Invalid> {
        match classify(body.as_bytes(), 16)? {
            Body::Single(m) => Ok(m),
            Body::Batch(_) => panic!("expected a single message"),
        }
    }

    #[test]
    fn classifies_the_three_kinds() {
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}}"#),
            Ok(Message::Request {
                id: json!(1),
                method: "tools/call".into()
            })
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            Ok(Message::Notification {
                method: "notifications/initialized".into()
            })
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":"0","result":{"action":"accept"}}"#),
            Ok(Message::Response { id: json!("0") })
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":0,"error":{"code":-1,"message":"no"}}"#),
            Ok(Message::Response { id: json!(0) })
        );
    }

    #[test]
    fn rejects_with_the_right_code_and_a_reason() {
        let e = one("{not json").unwrap_err();
        assert_eq!(e.code, code::PARSE_ERROR);
        let e = one(r#"{"id":1,"method":"x"}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_REQUEST);
        assert!(e.message.contains("jsonrpc"));
        assert_eq!(e.id, Some(json!(1)));
        let e = one(r#"{"jsonrpc":"2.0","id":1.5,"method":"x"}"#).unwrap_err();
        assert!(e.message.contains("id"));
        let e = one(r#"{"jsonrpc":"2.0","id":null,"method":"x"}"#).unwrap_err();
        assert!(e.message.contains("id"));
        let e = one(r#"{"jsonrpc":"2.0","id":1}"#).unwrap_err();
        assert!(e.message.contains("method"));
        let e = one(r#"{"jsonrpc":"2.0","method":"x","result":{}}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_REQUEST);
        assert_eq!(one("42").unwrap_err().code, code::INVALID_REQUEST);
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","method":7}"#).unwrap_err().code,
            code::INVALID_REQUEST
        );
    }

    #[test]
    fn batches_are_bounded() {
        let m = r#"{"jsonrpc":"2.0","method":"n"}"#;
        let ok = format!("[{m},{m}]");
        assert!(matches!(classify(ok.as_bytes(), 2), Ok(Body::Batch(v)) if v.len() == 2));
        let long = format!("[{m},{m},{m}]");
        assert!(classify(long.as_bytes(), 2).is_err());
        assert!(classify(b"[]", 2).is_err());
        // Past the bound the rest is only checked as JSON, and the bound is what is told.
        let huge = format!("[{}{{}}]", "{},".repeat(1 << 20));
        let (refused, bytes) = crate::test_alloc::allocated_by(|| classify(huge.as_bytes(), 2));
        let e = refused.unwrap_err();
        assert!(e.message.contains("1 to 2 messages"), "{}", e.message);
        assert!(
            bytes < 64 << 10,
            "a refused batch of 3 MiB allocated {bytes} bytes"
        );
        let broken = format!("[{m},{m},{m},{{]");
        assert_eq!(
            classify(broken.as_bytes(), 2).unwrap_err().code,
            code::PARSE_ERROR
        );
        assert_eq!(
            classify(format!("[{m}] x").as_bytes(), 2).unwrap_err().code,
            code::PARSE_ERROR
        );
    }

    #[test]
    fn values_are_counted_outside_strings_only() {
        let body = br#"{"a":[1,2,{"b":"x,y:[{\"}"}]}"#;
        assert!(
            !holds_more_values_than(body, 8),
            "punctuation in a string is text"
        );
        assert!(holds_more_values_than(body, 7));
        let many = format!("[{}0]", "0,".repeat(1000));
        assert!(holds_more_values_than(many.as_bytes(), 1000));
        assert!(!holds_more_values_than(many.as_bytes(), 1002));
    }

    #[test]
    fn an_id_that_is_a_container_is_refused_unbuilt() {
        let id = format!("[{}0]", "0,".repeat(1 << 20));
        let body = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"x"}}"#);
        let (refused, bytes) = crate::test_alloc::allocated_by(|| classify(body.as_bytes(), 2));
        assert!(bytes < 64 << 10, "an id of 2 MiB allocated {bytes} bytes");
        let e = refused.unwrap_err();
        assert!(e.message.contains("\"id\" must be"), "{}", e.message);
        assert_eq!(e.id, None);
        let body = r#"{"jsonrpc":"2.0","id":{"a":1},"method":"x"}"#;
        assert!(classify(body.as_bytes(), 2).is_err());
        let body = r#"{"jsonrpc":"2.0","id": "a" ,"method":"x"}"#;
        assert!(
            matches!(classify(body.as_bytes(), 2), Ok(Body::Single(Message::Request { id, .. })) if id == "a")
        );
    }

    #[test]
    fn error_body_shape() {
        let body = error_body(Some(&json!(3)), -32600, "bad", Some(json!({"k":1})));
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            json!({"jsonrpc":"2.0","id":3,"error":{"code":-32600,"message":"bad","data":{"k":1}}})
        );
        let v: Value = serde_json::from_slice(&error_body(None, -1, "m", None)).unwrap();
        assert_eq!(v["id"], Value::Null);
    }
}
