//! Legacy request ids wrapped on the way up and unwrapped on the way back
//! (`protocol::request_ids`) on arbitrary bytes: wrapping never panics and gives JSON
//! whose request id unwraps to the client's (as an answer's `id`, not as content);
//! unwrapping never panics, holds back a
//! bounded amount, and gives the same bytes however the body is split into chunks.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use mrtr_gateway::protocol::request_ids::{wrap_body, IdTag, Unwrap};
use serde_json::value::RawValue;
use serde_json::Value;

/// The tag the target's ids are wrapped under.
fn tag() -> IdTag {
    IdTag::of_session("fuzz")
}

/// Unwraps `body`'s ids wrapped under `tag()`, fed in chunks of `size` bytes.
fn unwrap(body: &[u8], size: usize) -> Vec<u8> {
    let mut unwrap = Unwrap::new(tag());
    let mut out = Vec::new();
    for chunk in body.chunks(size) {
        out.extend_from_slice(&unwrap.push(Bytes::copy_from_slice(chunk)));
    }
    out.extend_from_slice(&unwrap.finish());
    out
}

fuzz_target!(|input: &[u8]| {
    let Some((&split, body)) = input.split_first() else {
        return;
    };
    let whole = unwrap(body, body.len().max(1));
    assert_eq!(
        whole,
        unwrap(body, usize::from(split % 23) + 1),
        "chunking changed the bytes"
    );

    let Ok(Some(wrapped)) = wrap_body(body, &tag()) else {
        return;
    };
    serde_json::from_slice::<Box<RawValue>>(&wrapped).expect("wrapped bodies are JSON");
    serde_json::from_slice::<Box<RawValue>>(body).expect("a body that wrapped is JSON");
    // JSON a `Value` cannot hold (an object whose key is serde_json's own arbitrary-
    // precision number marker) passes as bytes; its ids are compared where it can.
    let (Ok(wrapped), Ok(original)) = (
        serde_json::from_slice::<Value>(&wrapped),
        serde_json::from_slice::<Value>(body),
    ) else {
        return;
    };
    if let (Some(id), Some(sent)) = (original.get("id"), wrapped.get("id")) {
        if original.get("method").is_some() && id != sent {
            let answer = serde_json::json!({"jsonrpc": "2.0", "id": sent, "result": {}});
            let back = unwrap(answer.to_string().as_bytes(), 7);
            let back: Value = serde_json::from_slice(&back).expect("an unwrapped answer is JSON");
            assert_eq!(&back["id"], id, "the id did not come back");
            // The same text as content is left as it is.
            let echoed = serde_json::json!({"result": {"text": sent}}).to_string();
            assert_eq!(
                unwrap(echoed.as_bytes(), 5),
                echoed.as_bytes(),
                "content unwrapped"
            );
        }
    }
});
