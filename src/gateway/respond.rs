//! Writing complete responses to the client: JSON-RPC errors in the protocol's own form,
//! and small JSON or text bodies, always framed with a Content-Length.

use crate::protocol::jsonrpc;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use serde_json::Value;

/// Writes a whole response. Errors mean the client is gone; there is nothing to add.
pub async fn write(session: &mut ServerSession, status: u16, content_type: &str, body: Bytes) {
    let Ok(header) = ResponseHeader::build(status, Some(3)) else {
        return;
    };
    write_with(session, header, content_type, body).await
}

/// Writes a whole response under a header the caller started (extra headers set).
pub async fn write_with(
    session: &mut ServerSession,
    mut header: ResponseHeader,
    content_type: &str,
    body: Bytes,
) {
    let _ = header.insert_header("content-type", content_type);
    let _ = header.insert_header("content-length", body.len());
    if session
        .write_response_header(Box::new(header))
        .await
        .is_ok()
    {
        let _ = session.write_response_body(body, true).await;
    }
}

/// A JSON-RPC error with an HTTP status.
pub async fn error(
    session: &mut ServerSession,
    status: u16,
    id: Option<&Value>,
    code: i64,
    message: &str,
) {
    let body = jsonrpc::error_body(id, code, message, None);
    write(session, status, "application/json", body.into()).await;
}
