//! The SSE parser on arbitrary bytes: it never panics, never yields an event larger than
//! its bound, and yields the same events however the stream is split into chunks.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mrtr_gateway::protocol::sse::{Event, Parser};

const LIMIT: usize = 4096;

/// Feeds `stream` in chunks of `size` bytes; `None` once the bound is exceeded.
fn parse(stream: &[u8], size: usize) -> Option<Vec<Event>> {
    let mut parser = Parser::new(LIMIT);
    let mut events = Vec::new();
    for chunk in stream.chunks(size) {
        parser.push(chunk, &mut events).ok()?;
    }
    Some(events)
}

fuzz_target!(|input: &[u8]| {
    let Some((&split, stream)) = input.split_first() else {
        return;
    };
    let whole = parse(stream, stream.len().max(1));
    let pieces = parse(stream, usize::from(split % 17) + 1);
    if let Some(events) = &whole {
        for e in events {
            assert!(e.data.len() <= LIMIT, "an event over the bound");
        }
    }
    // A CR at a chunk's end may still be waiting for its LF, which can change where the
    // bound trips; compare only when neither feeding hit it.
    if let (Some(a), Some(b)) = (&whole, &pieces) {
        assert_eq!(a, b, "chunking changed the events");
    }
});
