//! SSE event ids sealed for legacy clients (`protocol::event_ids`) on arbitrary upstream
//! bytes: the rewriter never panics; every id a client can parse out of what it gives is
//! empty or opens to an id the upstream sent (no upstream id reaches a client as it
//! was), with the call's request-id tag where it carries one; the events are the same
//! however the body is split into chunks; and, where no id is too long to seal, the
//! events' other fields are the upstream's.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use mrtr_gateway::keys::{Key, KeyRing};
use mrtr_gateway::protocol::event_ids::{
    binding, open, EventIds, Rewrite, Stream, MAX_UPSTREAM_EVENT_ID,
};
use mrtr_gateway::protocol::request_ids::IdTag;
use mrtr_gateway::protocol::sse::{Event, Parser};
use std::sync::{Arc, OnceLock};

fn ring() -> Arc<KeyRing> {
    static RING: OnceLock<Arc<KeyRing>> = OnceLock::new();
    let make = || Arc::new(KeyRing::from_keys(vec![Key::new("f", &[9; 32]).unwrap()]).unwrap());
    RING.get_or_init(make).clone()
}

/// `body` through the rewriter in chunks of `size` bytes.
fn rewrite(body: &[u8], size: usize, tag: Option<&IdTag>) -> Vec<u8> {
    let mut ids = EventIds::new(Rewrite {
        ring: ring(),
        binding: binding(&[3; 32], Some("fuzz")),
        stream: Stream::Call,
        tag: tag.cloned(),
    });
    let mut out = Vec::new();
    for chunk in body.chunks(size) {
        out.extend_from_slice(&ids.push(Bytes::copy_from_slice(chunk)));
    }
    out.extend_from_slice(&ids.finish());
    out
}

fn events(body: &[u8]) -> Vec<Event> {
    let mut parser = Parser::new(usize::MAX);
    let mut out = Vec::new();
    parser.push(body, &mut out).expect("no bound");
    out
}

/// The events of a rewritten body, their ids opened; each must be one the upstream `sent`,
/// with `tag`.
fn opened(body: &[u8], sent: &[u8], tag: Option<&IdTag>) -> Vec<Event> {
    let bound = binding(&[3; 32], Some("fuzz"));
    let mut out = events(body);
    for event in &mut out {
        let Some(id) = event.id.as_mut().filter(|id| !id.is_empty()) else {
            continue;
        };
        let position = open(&ring(), &bound, id).expect("an id the client gets opens");
        assert_eq!(position.stream, Stream::Call);
        assert_eq!(position.tag.as_ref(), tag);
        let upstream_id = &position.upstream_id[..];
        assert!(
            sent.windows(upstream_id.len()).any(|w| w == upstream_id),
            "an id the upstream did not send"
        );
        *id = String::from_utf8_lossy(upstream_id).into_owned();
    }
    out
}

fuzz_target!(|input: &[u8]| {
    let Some((&split, body)) = input.split_first() else {
        return;
    };
    let tag = (split >= 0x80).then(|| IdTag::from_bytes(b"tag-of_a-request").expect("a tag"));
    let tag = tag.as_ref();
    let whole = opened(&rewrite(body, body.len().max(1), tag), body, tag);
    let chunked = opened(&rewrite(body, usize::from(split % 23) + 1, tag), body, tag);
    assert_eq!(whole, chunked, "chunking changed the events");
    if body.len() <= MAX_UPSTREAM_EVENT_ID {
        let fields = |e: &Event| (e.event.clone(), e.data.clone(), e.retry);
        let before: Vec<_> = events(body).iter().map(fields).collect();
        let after: Vec<_> = whole.iter().map(fields).collect();
        assert_eq!(before, after, "the events' other fields changed");
    }
});
