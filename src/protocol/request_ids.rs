//! Request ids on legacy pass-through, made unique per upstream session.
//!
//! Servers name a request's SSE stream after its JSON-RPC id (the Python SDK does), and
//! event stores written like the SDKs' examples keep one store for all sessions, keyed by
//! stream. Clients number their requests alike (0, 1, 2, …), so a client resuming its
//! call's stream with `Last-Event-ID` would be replayed what other sessions' requests with
//! the same id were sent after its position: another user's results.
//!
//! So every request id a legacy client sends goes upstream wrapped into one that names its
//! upstream session: `mrtr.<tag>.n.<integer>` or `mrtr.<tag>.s.<base64url of the string>`,
//! where the tag is a digest of the upstream session id (`IdTag`; a
//! request outside any session, `initialize`, gets a random one). `notifications/cancelled`
//! names the wrapped id too. What the upstream sends back is unwrapped as it streams
//! (`Unwrap`): each such JSON string under the exchange's own tag that is an `"id"`
//! member's value becomes the client's id again; one under another tag, or anywhere else
//! (text a user stored upstream, a tool echoing its request's id), is content and passes
//! as it is. Nothing is kept: any replica unwraps what another wrapped.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;

/// The longest client id (as JSON text) the gateway wraps; a longer one is refused.
pub const MAX_CLIENT_ID: usize = 1024;

/// What starts a wrapped id on the wire: its opening quote and prefix.
const MARK: &[u8] = b"\"mrtr.";
/// The searcher for `MARK`, built once: `memmem::find` builds one per call.
static MARK_FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(MARK));
/// Characters of a tag: 12 bytes of digest in base64url.
pub const TAG_CHARS: usize = 16;
/// The longest wrapped id as JSON text, quotes included.
const MAX_WRAPPED: usize = MARK.len() + TAG_CHARS + 3 + MAX_CLIENT_ID.div_ceil(3) * 4 + 1;

/// What marks a client's ids as sent in one upstream session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdTag(String);

impl IdTag {
    /// The tag of an upstream session (the same on every replica; session ids are unique
    /// per server, and servers that share an event store share sessions too).
    pub fn of_session(upstream_session: &str) -> IdTag {
        let mut digest = Sha256::new();
        digest.update(b"mrtr-gateway request ids\0");
        digest.update(upstream_session.as_bytes());
        IdTag(URL_SAFE_NO_PAD.encode(&digest.finalize()[..12]))
    }

    /// A tag for requests outside any session (`initialize`).
    pub fn random() -> IdTag {
        IdTag(URL_SAFE_NO_PAD.encode(rand::random::<[u8; 12]>()))
    }

    /// The tag's characters, as a call stream's sealed event ids carry a tag that is not
    /// its session's (`event_ids`), so that the stream's resumption unwraps under it.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// A tag from its characters (`as_bytes`): `TAG_CHARS` of base64url.
    pub fn from_bytes(bytes: &[u8]) -> Option<IdTag> {
        let base64url = |b: &u8| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_';
        if bytes.len() != TAG_CHARS || !bytes.iter().all(base64url) {
            return None;
        }
        String::from_utf8(bytes.to_vec()).ok().map(IdTag)
    }

    /// `id` wrapped, as JSON text: an integer or a string (what `jsonrpc::classify` lets
    /// through). Built in one buffer: every request on pass-through has one.
    fn wrap(&self, id: &Value) -> Option<String> {
        let mut out = String::with_capacity(MARK.len() + TAG_CHARS + 24);
        out.push_str("\"mrtr.");
        out.push_str(&self.0);
        match id {
            Value::Number(n) if n.is_i64() || n.is_u64() => {
                use std::fmt::Write;
                let _ = write!(out, ".n.{n}");
            }
            Value::String(s) => {
                out.push_str(".s.");
                URL_SAFE_NO_PAD.encode_string(s, &mut out);
            }
            _ => return None,
        }
        out.push('"');
        Some(out)
    }
}

/// Why a body's ids could not be wrapped.
#[derive(Debug, PartialEq, Eq)]
pub enum WrapError {
    /// A client id longer than `MAX_CLIENT_ID` bytes.
    IdTooLong,
    /// Not the JSON-RPC object (or batch of them) `jsonrpc::classify` accepted.
    NotMessages,
}

impl fmt::Display for WrapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WrapError::IdTooLong => write!(f, "a request id is longer than {MAX_CLIENT_ID} bytes as JSON text (quotes and escapes included)"),
            WrapError::NotMessages => f.write_str("the body is not JSON-RPC messages"),
        }
    }
}

impl std::error::Error for WrapError {}

/// `body` with the ids of its requests, and the request ids its cancellations name,
/// wrapped under `tag`; `None` when it has none (responses, other notifications), so the
/// body goes up as it came. Only the ids are replaced: every other byte stays the
/// client's, and params are not parsed.
pub fn wrap_body(body: &[u8], tag: &IdTag) -> Result<Option<Vec<u8>>, WrapError> {
    let text = std::str::from_utf8(body).map_err(|_| WrapError::NotMessages)?;
    let batch = text.trim_start().starts_with('[');
    let messages: Vec<Envelope> = if batch {
        serde_json::from_str(text).map_err(|_| WrapError::NotMessages)?
    } else {
        vec![serde_json::from_str(text).map_err(|_| WrapError::NotMessages)?]
    };
    let mut splices = Vec::new();
    for message in &messages {
        if let Some(id) = message.id_to_wrap()? {
            let wrapped = tag.wrap(&parse_id(id)?);
            splices.extend(wrapped.map(|w| (span(text, id), w)));
        }
    }
    if splices.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(body.len() + 40 * splices.len());
    let mut at = 0;
    for (span, wrapped) in splices {
        out.extend_from_slice(&body[at..span.start]);
        out.extend_from_slice(wrapped.as_bytes());
        at = span.end;
    }
    out.extend_from_slice(&body[at..]);
    Ok(Some(out))
}

/// The members of a message that say whether it carries a client's request id.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    params: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Cancellation<'a> {
    #[serde(borrow, rename = "requestId")]
    request_id: Option<&'a RawValue>,
}

impl<'a> Envelope<'a> {
    /// A request's id, or the request id a cancellation names.
    fn id_to_wrap(&self) -> Result<Option<&'a RawValue>, WrapError> {
        let Some(method) = &self.method else {
            return Ok(None);
        };
        if self.id.is_some() {
            return Ok(self.id);
        }
        let Some(params) = self.params.filter(|_| method == "notifications/cancelled") else {
            return Ok(None);
        };
        match serde_json::from_str::<Cancellation>(params.get()) {
            Ok(cancellation) => Ok(cancellation.request_id),
            // An object that does not read as one names a member twice: refused, as a
            // message naming its own id twice is (which `requestId` would go up?).
            Err(_) if params.get().starts_with('{') => Err(WrapError::NotMessages),
            Err(_) => Ok(None),
        }
    }
}

fn parse_id(raw: &RawValue) -> Result<Value, WrapError> {
    if raw.get().len() > MAX_CLIENT_ID {
        return Err(WrapError::IdTooLong);
    }
    serde_json::from_str(raw.get()).map_err(|_| WrapError::NotMessages)
}

/// Where `raw`, borrowed from `text`, lies in it.
fn span(text: &str, raw: &RawValue) -> std::ops::Range<usize> {
    let start = raw.get().as_ptr() as usize - text.as_ptr() as usize;
    start..start + raw.get().len()
}

/// Unwraps the ids in a body as it streams, chunk by chunk: a wrapped id split between
/// chunks is held back until it is whole (at most `MAX_WRAPPED` bytes). Anything that is
/// not a well-formed wrapped id under the exchange's tag passes unchanged, so an escaped
/// one inside a string (`\"mrtr.…\"`, which cannot end in a bare quote), or one under
/// another session's tag, is left alone.
pub struct Unwrap {
    tag: IdTag,
    held: Vec<u8>,
    /// The last bytes given out (at most `KEY_LOOKBACK`): what precedes a mark at the
    /// start of the next chunk.
    recent: Vec<u8>,
    /// Ids unwrapped so far: responses to the client's requests given out.
    unwrapped: usize,
}

/// How far back from a mark its `"id":` key is looked for.
const KEY_LOOKBACK: usize = 16;

impl Unwrap {
    /// Unwraps the ids wrapped under `tag`: the upstream session's, or the one the
    /// exchange's request was wrapped under.
    pub fn new(tag: IdTag) -> Unwrap {
        Unwrap {
            tag,
            held: Vec::new(),
            recent: Vec::new(),
            unwrapped: 0,
        }
    }

    /// How many wrapped ids (responses to the client's requests) were given back so far.
    pub fn unwrapped(&self) -> usize {
        self.unwrapped
    }

    /// The bytes of `chunk` that can go to the client now.
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        if self.held.is_empty() && !may_hold_mark(&chunk) {
            remember_tail(&mut self.recent, &chunk);
            return chunk;
        }
        let input = if self.held.is_empty() {
            &chunk[..]
        } else {
            self.held.extend_from_slice(&chunk);
            &self.held[..]
        };
        let mut out = Vec::with_capacity(input.len());
        let found = &mut self.unwrapped;
        let kept = unwrap_into(input, &self.tag, &self.recent, (&mut out, found), false);
        let rest = input[kept..].to_vec();
        self.held = rest;
        remember_tail(&mut self.recent, &out);
        out.into()
    }

    /// What was held back, at the end of the body.
    pub fn finish(&mut self) -> Bytes {
        let mut out = Vec::with_capacity(self.held.len());
        let found = &mut self.unwrapped;
        unwrap_into(&self.held, &self.tag, &self.recent, (&mut out, found), true);
        self.held.clear();
        self.recent.clear();
        out.into()
    }
}

/// Keeps the last `KEY_LOOKBACK` bytes of what `recent` and then `given` were.
fn remember_tail(recent: &mut Vec<u8>, given: &[u8]) {
    if given.len() >= KEY_LOOKBACK {
        recent.clear();
        recent.extend_from_slice(&given[given.len() - KEY_LOOKBACK..]);
        return;
    }
    recent.extend_from_slice(given);
    let excess = recent.len().saturating_sub(KEY_LOOKBACK);
    recent.drain(..excess);
}

/// Whether the bytes before a mark (`before`: the end of `recent`, then `out`) make it
/// the value of an `"id"` member: a message's id, the only place a client's id comes back
/// in. The same text anywhere else (a tool's text content that echoes it) is content.
fn follows_id_key(recent: &[u8], out: &[u8]) -> bool {
    let mut tail = [0u8; KEY_LOOKBACK];
    let from_out = out.len().min(KEY_LOOKBACK);
    let from_recent = (KEY_LOOKBACK - from_out).min(recent.len());
    let len = from_recent + from_out;
    tail[..from_recent].copy_from_slice(&recent[recent.len() - from_recent..]);
    tail[from_recent..len].copy_from_slice(&out[out.len() - from_out..]);
    let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    let before = &tail[..len];
    let Some(colon) = before.iter().rposition(|b| !is_space(b)) else {
        return false;
    };
    if before[colon] != b':' {
        return false;
    }
    let key_end = before[..colon].iter().rposition(|b| !is_space(b));
    key_end.is_some_and(|end| before[..=end].ends_with(b"\"id\""))
}

/// Whether `chunk` holds a mark, or ends with the start of one.
fn may_hold_mark(chunk: &[u8]) -> bool {
    MARK_FINDER.find(chunk).is_some() || mark_begun_at_end(chunk) > 0
}

/// How many bytes at the end of `bytes` may begin a mark.
fn mark_begun_at_end(bytes: &[u8]) -> usize {
    (1..MARK.len())
        .rev()
        .find(|&n| bytes.ends_with(&MARK[..n]))
        .unwrap_or(0)
}

/// Copies `input` to `out` with its ids wrapped under `tag` unwrapped (those that are an
/// `"id"` member's value, `recent` being what was given out before); returns how much of
/// `input` it consumed (all of it at the end of the body, else up to a wrapped id not yet
/// whole), and counts the ids it unwrapped in `unwrapped`.
fn unwrap_into(
    input: &[u8],
    tag: &IdTag,
    recent: &[u8],
    (out, unwrapped): (&mut Vec<u8>, &mut usize),
    at_end: bool,
) -> usize {
    let mut at = 0;
    while let Some(found) = MARK_FINDER.find(&input[at..]) {
        let start = at + found;
        out.extend_from_slice(&input[at..start]);
        let wrapped = match follows_id_key(recent, out) {
            true => read_wrapped(&input[start..], tag),
            false => Wrapped::Not,
        };
        match wrapped {
            Wrapped::Id(len, original) => {
                out.extend_from_slice(original.as_bytes());
                at = start + len;
                *unwrapped += 1;
            }
            Wrapped::Incomplete if !at_end => return start,
            Wrapped::Incomplete | Wrapped::Not => {
                out.push(input[start]);
                at = start + 1;
            }
        }
    }
    // A tail that may begin a mark waits for the next chunk.
    let tail = match at_end {
        true => input.len(),
        false => input.len() - mark_begun_at_end(&input[at..]),
    };
    out.extend_from_slice(&input[at..tail]);
    tail
}

enum Wrapped {
    /// A wrapped id `len` bytes long, and the client's id as JSON text.
    Id(usize, String),
    /// The input ends before a wrapped id could be told from something else.
    Incomplete,
    Not,
}

/// Reads an id wrapped under `expected` at the start of `input` (which begins with
/// `MARK`).
fn read_wrapped(input: &[u8], expected: &IdTag) -> Wrapped {
    let body_start = MARK.len() + TAG_CHARS + 3;
    let Some(end) = input
        .iter()
        .skip(MARK.len())
        .position(|&b| !is_wrapped_char(b))
    else {
        return if input.len() < MAX_WRAPPED {
            Wrapped::Incomplete
        } else {
            Wrapped::Not
        };
    };
    let end = MARK.len() + end;
    if input[end] != b'"' || end < body_start || end + 1 > MAX_WRAPPED {
        return Wrapped::Not;
    }
    let inner = &input[MARK.len()..end];
    let (tag, rest) = inner.split_at(TAG_CHARS);
    if tag != expected.0.as_bytes() {
        return Wrapped::Not;
    }
    let original = match rest {
        [b'.', b'n', b'.', digits @ ..] => integer(digits),
        [b'.', b's', b'.', encoded @ ..] => string(encoded),
        _ => None,
    };
    match original {
        Some(original) => Wrapped::Id(end + 1, original),
        None => Wrapped::Not,
    }
}

/// Characters a wrapped id is made of: base64url, the dots and a minus sign.
fn is_wrapped_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

/// An integer as `wrap_body` writes one (its canonical form): anything else (`007`,
/// `+7`), which only an upstream forging ids could send, would not be JSON given back.
fn integer(digits: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(digits).ok()?;
    let canonical = match text.parse::<i64>() {
        Ok(n) => n.to_string(),
        Err(_) => text.parse::<u64>().ok()?.to_string(),
    };
    (canonical == text).then_some(canonical)
}

fn string(encoded: &[u8]) -> Option<String> {
    let bytes = URL_SAFE_NO_PAD.decode(encoded).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    serde_json::to_string(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tag() -> IdTag {
        IdTag::of_session("session-a")
    }

    fn wrapped(body: Value) -> Value {
        let bytes = serde_json::to_vec(&body).unwrap();
        let out = wrap_body(&bytes, &tag())
            .unwrap()
            .expect("something wrapped");
        serde_json::from_slice(&out).unwrap()
    }

    /// Unwraps `text` pushed in pieces cut at `cuts`.
    fn unwrap_in_pieces(text: &[u8], cuts: &[usize]) -> Vec<u8> {
        unwrap_counting(text, cuts).0
    }

    /// `unwrap_in_pieces`, and how many ids it unwrapped.
    fn unwrap_counting(text: &[u8], cuts: &[usize]) -> (Vec<u8>, usize) {
        let mut unwrap = Unwrap::new(tag());
        let mut out = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain([&text.len()]) {
            out.extend_from_slice(&unwrap.push(Bytes::copy_from_slice(&text[from..cut])));
            from = cut;
        }
        out.extend_from_slice(&unwrap.finish());
        (out, unwrap.unwrapped())
    }

    /// `text` unwraps to `expected` cut in two anywhere, and cut byte by byte in one pass.
    fn assert_unwraps_cut_anywhere(text: &str, expected: &str) {
        for cut in 0..=text.len() {
            let got = unwrap_in_pieces(text.as_bytes(), &[cut]);
            assert_eq!(String::from_utf8(got).unwrap(), expected, "cut at {cut}");
        }
        let every_byte: Vec<usize> = (1..text.len()).collect();
        let got = unwrap_in_pieces(text.as_bytes(), &every_byte);
        assert_eq!(String::from_utf8(got).unwrap(), expected);
    }

    #[test]
    fn ids_of_one_session_differ_from_another_sessions_and_map_back() {
        let call =
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "x"}});
        let a = wrapped(call.clone());
        let other = IdTag::of_session("session-b");
        let b = wrap_body(&serde_json::to_vec(&call).unwrap(), &other)
            .unwrap()
            .unwrap();
        let b: Value = serde_json::from_slice(&b).unwrap();
        assert_ne!(
            a["id"], b["id"],
            "two sessions' id 2 name different streams"
        );
        assert_eq!(a["params"], call["params"]);
        let answer = json!({"jsonrpc": "2.0", "id": a["id"], "result": {}}).to_string();
        let back = unwrap_in_pieces(answer.as_bytes(), &[]);
        assert_eq!(serde_json::from_slice::<Value>(&back).unwrap()["id"], 2);
    }

    /// The form every release wraps in and unwraps, so that replicas of two releases
    /// unwrap each other's ids.
    #[test]
    fn ids_wrap_in_the_documented_form() {
        let tag = tag();
        let at = |id: Value| {
            wrapped(json!({"jsonrpc": "2.0", "id": id, "method": "ping"}))["id"].clone()
        };
        assert_eq!(at(json!(7)), format!("mrtr.{}.n.7", tag.0));
        assert_eq!(at(json!(-3)), format!("mrtr.{}.n.-3", tag.0));
        assert_eq!(at(json!("a?")), format!("mrtr.{}.s.YT8", tag.0));
        assert_eq!(tag.0.len(), TAG_CHARS);
    }

    #[test]
    fn string_ids_any_text_come_back_equal() {
        for id in ["abc", "", "a\"b\\c\n", "ключ", "mrtr.x", "-1"] {
            let out = wrapped(json!({"jsonrpc": "2.0", "id": id, "method": "ping"}));
            let text = format!(
                "data: {{\"jsonrpc\":\"2.0\",\"id\":{},\"result\":{{}}}}\n\n",
                out["id"]
            );
            let back = String::from_utf8(unwrap_in_pieces(text.as_bytes(), &[])).unwrap();
            let data: Value =
                serde_json::from_str(back.trim_start_matches("data: ").trim()).unwrap();
            assert_eq!(data["id"], id, "{back}");
        }
        for id in [json!(0), json!(-7), json!(u64::MAX)] {
            let out = wrapped(json!({"jsonrpc": "2.0", "id": id, "method": "ping"}));
            let back = unwrap_in_pieces(json!({"id": out["id"]}).to_string().as_bytes(), &[]);
            assert_eq!(serde_json::from_slice::<Value>(&back).unwrap()["id"], id);
        }
    }

    /// A wrapped integer id in any form but the one `wrap_body` writes (which only an
    /// upstream forging ids could send) is left as it is: given back, `007` would not be
    /// JSON.
    #[test]
    fn only_the_canonical_integer_form_unwraps() {
        for forged in ["007", "+7", "-0", "00"] {
            let text = format!(r#"{{"id":"mrtr.{}.n.{forged}"}}"#, tag().0);
            let back = unwrap_in_pieces(text.as_bytes(), &[]);
            assert_eq!(String::from_utf8(back).unwrap(), text, "{forged}");
        }
    }

    #[test]
    fn batches_and_cancellations_are_wrapped_and_responses_and_notifications_are_not() {
        let batch = json!([
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1, "reason": "x"}},
            {"jsonrpc": "2.0", "id": 9, "result": {}},
        ]);
        let out = wrapped(batch);
        assert_eq!(out[1]["params"]["requestId"], out[0]["id"]);
        assert_eq!(out[1]["params"]["reason"], "x");
        assert_eq!(
            out[2]["id"], 9,
            "a response to the server keeps the server's id"
        );
        // A cancellation naming its request twice goes up neither wrapped nor raw.
        let twice = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1,"requestId":2}}"#;
        assert_eq!(wrap_body(twice, &tag()), Err(WrapError::NotMessages));
        let not_an_object = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":"x"}"#;
        assert_eq!(wrap_body(not_an_object, &tag()), Ok(None));
        for untouched in [
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            json!({"jsonrpc": "2.0", "id": "s1", "result": {"action": "accept"}}),
        ] {
            let bytes = serde_json::to_vec(&untouched).unwrap();
            assert_eq!(wrap_body(&bytes, &tag()), Ok(None));
        }
    }

    #[test]
    fn an_overlong_id_is_refused() {
        let id = "x".repeat(MAX_CLIENT_ID);
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "ping"}).to_string();
        assert_eq!(
            wrap_body(body.as_bytes(), &tag()),
            Err(WrapError::IdTooLong)
        );
    }

    #[test]
    fn a_wrapped_id_split_anywhere_unwraps_and_other_text_is_untouched() {
        let out = wrapped(json!({"jsonrpc": "2.0", "id": "k-1", "method": "ping"}));
        let text = format!(
            "id: 5\ndata: {{\"id\":{},\"result\":{{\"text\":\"\\\"mrtr.not-an-id\\\" \\\"mrtr.\"}}}}\n\n:\n\n",
            out["id"]
        );
        let expected = text.replace(out["id"].to_string().as_str(), "\"k-1\"");
        assert_unwraps_cut_anywhere(&text, &expected);
    }

    /// A tool that echoes its request's (wrapped) id as text gets its text back as sent:
    /// only a message's `"id"` member is the client's id.
    #[test]
    fn only_id_members_are_unwrapped_and_content_keeps_its_text() {
        let out = wrapped(json!({"jsonrpc": "2.0", "id": 6, "method": "tools/call"}));
        let id = out["id"].to_string();
        let text = format!(
            "data: {{\"jsonrpc\":\"2.0\",\"id\" : {id},\"result\":{{\"content\":[{{\"type\":\"text\",\"text\":{id}}}],\"ids\":[{id}]}}}}\n\n"
        );
        let expected = text.replacen(&id, "6", 1);
        assert_unwraps_cut_anywhere(&text, &expected);
        for cut in 0..=text.len() {
            let (_, unwrapped) = unwrap_counting(text.as_bytes(), &[cut]);
            assert_eq!(
                unwrapped, 1,
                "one response to the client went by (cut at {cut})"
            );
        }
    }

    #[test]
    fn only_ids_under_the_exchanges_tag_are_unwrapped() {
        let ours = wrapped(json!({"jsonrpc": "2.0", "id": 5, "method": "ping"}));
        let theirs = IdTag::of_session("session-b").wrap(&json!(5)).unwrap();
        let text = format!(r#"{{"id":{},"result":{{"text":{theirs}}}}}"#, ours["id"]);
        let back: Value = serde_json::from_slice(&unwrap_in_pieces(text.as_bytes(), &[])).unwrap();
        assert_eq!(back["id"], 5);
        assert_eq!(
            back["result"]["text"].to_string(),
            theirs,
            "another session's id is content, left as it is"
        );
    }

    #[test]
    fn what_is_held_back_is_bounded() {
        let mut unwrap = Unwrap::new(tag());
        let mut out = Vec::new();
        out.extend_from_slice(&unwrap.push(Bytes::from_static(b"\"mrtr.")));
        for _ in 0..1000 {
            out.extend_from_slice(&unwrap.push(Bytes::from_static(b"aaaaaaaa")));
            assert!(unwrap.held.len() <= MAX_WRAPPED + 8);
        }
        out.extend_from_slice(&unwrap.finish());
        assert_eq!(out.len(), 6 + 8000, "nothing lost");
    }
}
