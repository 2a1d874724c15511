//! An upstream's HTTP response on arbitrary bytes, read the way the gateway reads one
//! (`upstream::exchange::read_response_from`): pingora's HTTP/1 client session with the
//! gateway's handling of interim responses and protocol switches, then the body, then
//! the SSE parser on an SSE body. Whatever the bytes, nothing panics, every read ends
//! (the stream is in memory and closes after the input) and no event exceeds its bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mrtr_gateway::protocol::sse::Parser;
use mrtr_gateway::upstream::exchange::read_response_from;
use std::sync::OnceLock;
use tokio::io::AsyncWriteExt;

const EVENT_LIMIT: usize = 4096;
/// More body reads than any input of the fuzzer's size can need.
const MAX_READS: usize = 1 << 16;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

async fn read(input: &[u8]) {
    // The gateway's request goes into the upstream end's buffer; the response comes out.
    let (client, mut upstream) = tokio::io::duplex(input.len() + 4096);
    if upstream.write_all(input).await.is_err() || upstream.shutdown().await.is_err() {
        return;
    }
    let stream: pingora::protocols::Stream = Box::new(client);
    let Ok(mut response) = read_response_from(stream).await else {
        return;
    };
    let sse = response.is_sse();
    let mut parser = Parser::new(EVENT_LIMIT);
    let mut events = Vec::new();
    for _ in 0..MAX_READS {
        let Ok(Some(chunk)) = response.next_chunk().await else {
            return;
        };
        if sse && parser.push(&chunk, &mut events).is_err() {
            return;
        }
        for event in events.drain(..) {
            assert!(event.data.len() <= EVENT_LIMIT, "an event over the bound");
        }
    }
    panic!("the body did not end within {MAX_READS} reads of an in-memory stream");
}

fuzz_target!(|input: &[u8]| {
    runtime().block_on(read(input));
});
