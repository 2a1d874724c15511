//! The JSON-RPC classifier and the 2026-07-28 request validation on arbitrary bodies and
//! headers: no panic; a classified request has the method the body names; a validated
//! request's headers agree with its body; the lenient parse accepts all that the strict
//! one does, as the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mrtr_gateway::mrtr::modern::{ModernHeaders, ModernRequest};
use mrtr_gateway::protocol::jsonrpc;
use serde_json::Value;

fuzz_target!(|input: &[u8]| {
    // The first line names the headers (version, method, name, traceparent, tracestate),
    // the rest is the body.
    let (head, body) = match input.iter().position(|&b| b == b'\n') {
        Some(i) => (&input[..i], &input[i + 1..]),
        None => (&[][..], input),
    };
    let head = String::from_utf8_lossy(head);
    let mut fields = head.split('|');
    let (version, header_method, name) = (fields.next(), fields.next(), fields.next());
    let headers = ModernHeaders {
        protocol_version: version,
        method: header_method,
        name,
        traceparent: fields.next(),
        tracestate: fields.next(),
        repeated: fields.next().map(|_| "Mcp-Name"),
        unreadable: fields.next().map(|_| "Mcp-Method"),
    };
    let lenient = jsonrpc::from_slice_lenient::<Value>(body);
    if let Ok(strict) = serde_json::from_slice::<Value>(body) {
        assert_eq!(lenient.ok(), Some(strict));
    }
    let Ok(parsed) = jsonrpc::classify(body, 64) else {
        return;
    };
    let Ok(message) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if let Some(method) = parsed.method() {
        if message.is_object() {
            assert_eq!(message["method"].as_str(), Some(method));
        }
    }
    let (Some(method), Some(id)) = (message["method"].as_str(), message.get("id")) else {
        return;
    };
    if let Ok(request) = ModernRequest::validate(id.clone(), method, message.get("params"), headers)
    {
        assert_eq!(
            header_method,
            Some(method),
            "validated with a mismatched Mcp-Method"
        );
        assert_eq!(request.method, method);
    }
});
