//! Socket-free MCP protocol logic: JSON-RPC classification and error bodies, the SSE
//! codec, the sealed legacy session token, W3C trace context, forwarding headers and the
//! scheme a request arrived over. Nothing here does I/O; the gateway shell
//! feeds bytes in and acts on what comes out.

pub mod forwarded;
pub mod headers;
pub mod host_check;
pub mod jsonrpc;
pub mod scheme;
pub mod session_token;
pub mod sse;
pub mod trace;
