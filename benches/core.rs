//! Micro benchmarks of the per-request protocol core: sealing and opening a session
//! token, parsing SSE events (LF, CRLF, split chunks), classifying a JSON-RPC body.
//! Run: `cargo bench --bench core`. `cargo test --benches` runs each once as a check.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use mrtr_gateway::keys::KeyRing;
use mrtr_gateway::protocol::jsonrpc;
use mrtr_gateway::protocol::session_token::SessionToken;
use mrtr_gateway::protocol::sse::Parser;

const KEY: &str = "bench:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8";

fn token() -> SessionToken {
    SessionToken {
        group: "default".into(),
        endpoint: "10.0.0.7:3001".parse().unwrap(),
        upstream_session: "5b0c3a1e-4d2f-4f8e-9c1a-7f6e5d4c3b2a".into(),
        issued_at: 1_795_000_000,
    }
}

fn session_token(c: &mut Criterion) {
    let ring = KeyRing::parse(KEY).unwrap();
    let binding = [7u8; 32];
    let sealed = token().seal(&ring, &binding);
    let mut g = c.benchmark_group("session_token");
    g.bench_function("seal", |b| {
        b.iter(|| token().seal(black_box(&ring), &binding))
    });
    g.bench_function("open", |b| {
        b.iter(|| SessionToken::open(black_box(&ring), &binding, black_box(&sealed)).unwrap())
    });
    g.finish();
}

const EVENT: &str = "id: 0-1\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"elicitation/create\",\"params\":{\"mode\":\"form\",\"message\":\"What is your name?\",\"requestedSchema\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"}},\"required\":[\"name\"]}}}\n\n";

fn sse(c: &mut Criterion) {
    let lf = EVENT.as_bytes().to_vec();
    let crlf = EVENT.replace('\n', "\r\n").into_bytes();
    let mut g = c.benchmark_group("sse_event");
    for (name, wire, piece) in [
        ("lf", &lf, usize::MAX),
        ("crlf", &crlf, usize::MAX),
        ("crlf_split_17", &crlf, 17),
    ] {
        g.throughput(Throughput::Elements(1));
        g.bench_function(name, |b| {
            let mut parser = Parser::new(1 << 20);
            let mut out = Vec::with_capacity(1);
            b.iter(|| {
                out.clear();
                for chunk in wire.chunks(piece.min(wire.len())) {
                    parser.push(black_box(chunk), &mut out).unwrap();
                }
                assert_eq!(out.len(), 1);
            })
        });
    }
    g.finish();
}

fn classify(c: &mut Criterion) {
    let call = br#"{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{"name":"search","arguments":{"query":"pingora mrtr gateway","limit":10,"filters":{"lang":"rust","stars":">100"}},"_meta":{"progressToken":"p-12"}}}"#;
    c.bench_function("jsonrpc_classify_tools_call", |b| {
        b.iter(|| jsonrpc::classify(black_box(call), 64).unwrap())
    });
}

criterion_group!(benches, session_token, sse, classify);
criterion_main!(benches);
