//! Socket-free MCP protocol logic: JSON-RPC classification and error bodies, the SSE
//! codec, the sealed legacy session token and event ids, W3C trace context, which headers cross a hop
//! and forwarding headers, the legacy revision a session negotiated, the scheme a request arrived over, OAuth resource discovery
//! through the gateway, the request target of an upstream exchange. Nothing here does
//! I/O; the gateway shell feeds bytes in and acts on what comes out.

pub mod cors;
pub mod event_ids;
pub mod forwarded;
pub mod headers;
pub mod host_check;
pub mod jsonrpc;
pub mod oauth;
pub mod request_ids;
pub mod revision;
pub mod scheme;
pub mod session_token;
pub mod sse;
pub mod target;
pub mod trace;
