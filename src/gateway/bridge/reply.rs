//! The client's side of a bridged request: a JSON response, or an SSE response once a
//! notification (progress, an opted-in log message) has to be streamed; and the fields
//! every 2026-07-28 result carries.

use crate::gateway::{cors, respond};
use crate::metrics::InUse;
use crate::mrtr::data_session::META_KEY;
use crate::outcome::{Outcome, Refusal};
use crate::protocol::{jsonrpc, sse};
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use prometheus::IntGauge;
use serde_json::{json, Map, Value};

/// The client's response: JSON at the end, or SSE once a notification has been sent.
pub struct ClientReply {
    pub id: Value,
    pub accepts_sse: bool,
    /// Whether the response streams (SSE), counted in `active_client_streams` while it
    /// does.
    pub streaming: Option<InUse>,
    /// The gauge a streaming response holds up (`active_client_streams`).
    pub streams: IntGauge,
    /// In a data-layer session: the refreshed cookie every result carries in
    /// `_meta["mcp/session"]`.
    pub cookie: Option<Value>,
}

impl ClientReply {
    /// Streams a notification to the client, switching its response to SSE if it
    /// accepts it (else the notification is dropped); `Err` when the write failed: the
    /// client left, or stopped reading.
    pub async fn notify(&mut self, session: &mut ServerSession, message: &Value) -> Result<(), ()> {
        let event = sse::Event::message(None, jsonrpc::text_of(message)).encode();
        self.stream(session, Bytes::from(event)).await.map(drop)
    }

    /// Writes a keep-alive comment, switching the response to SSE if the client accepts
    /// it: `Ok(true)` when one was written, `Err` when the write failed.
    pub async fn keep_alive(&mut self, session: &mut ServerSession) -> Result<bool, ()> {
        let comment = Bytes::from_static(sse::KEEP_ALIVE);
        self.stream(session, comment).await
    }

    /// Writes `bytes` on the SSE response (started if need be): `Ok(false)` when the client
    /// does not accept SSE, `Err` when a write failed.
    async fn stream(&mut self, session: &mut ServerSession, bytes: Bytes) -> Result<bool, ()> {
        if !self.accepts_sse {
            return Ok(false);
        }
        if !self.start_stream(session).await {
            return Err(());
        }
        respond::write_body(session, bytes, false)
            .await
            .map(|()| true)
    }

    /// Sends the SSE response header unless it was sent; false when the client does not
    /// accept SSE or is gone.
    async fn start_stream(&mut self, session: &mut ServerSession) -> bool {
        if !self.accepts_sse {
            return false;
        }
        if self.streaming.is_some() {
            return true;
        }
        let Ok(mut header) = ResponseHeader::build(200, Some(4)) else {
            return false;
        };
        let _ = header.insert_header("content-type", "text/event-stream");
        let _ = header.insert_header("cache-control", "no-cache");
        let _ = header.insert_header("x-accel-buffering", "no");
        respond::frame_unknown_length(session, &mut header);
        cors::decorate(session, &mut header);
        let started = respond::write_header(session, header).await.is_ok();
        self.streaming = started.then(|| InUse::new(&self.streams));
        started
    }

    /// Answers with `result`; returns whether the client took it.
    pub async fn result(self, session: &mut ServerSession, mut result: Value) -> bool {
        if let (Some(cookie), Some(meta)) = (&self.cookie, meta_of(&mut result)) {
            meta.insert(META_KEY.into(), cookie.clone());
        }
        self.finish(
            session,
            200,
            json!({"jsonrpc": "2.0", "id": self.id, "result": result}),
        )
        .await
    }

    /// Answers with a JSON-RPC error. `status` is the HTTP status the failure deserves;
    /// a server-side one (5xx: the upstream failed, the gateway is overloaded) goes out as
    /// 200 carrying the error, because the official TypeScript client (2.4.0) reads a
    /// JSON-RPC error only from a 200 or a 400 response and reports any other status as
    /// a transport failure (`CLIENT_HTTP_NOT_IMPLEMENTED`), hiding the message. Refusals
    /// of the request itself keep their 4xx.
    pub async fn error(
        self,
        session: &mut ServerSession,
        status: u16,
        code: i64,
        message: &str,
        data: Option<Value>,
    ) {
        let status = if status >= 500 { 200 } else { status };
        let mut error = json!({"code": code, "message": message});
        if let Some(data) = data {
            error["data"] = data;
        }
        self.finish(
            session,
            status,
            json!({"jsonrpc": "2.0", "id": self.id, "error": error}),
        )
        .await;
    }

    /// Answers with `refusal` (its class's status, as `error` maps it), and a denial's
    /// challenge in `WWW-Authenticate` (which official clients act on: they start their
    /// OAuth flow).
    pub async fn refuse(self, session: &mut ServerSession, refusal: Refusal) -> Outcome {
        let status = refusal.class.status();
        match &refusal.challenge {
            Some(challenge) if self.streaming.is_none() => {
                let body =
                    jsonrpc::error_body(Some(&self.id), refusal.code, &refusal.message, None);
                if let Ok(mut header) = ResponseHeader::build(status, Some(4)) {
                    // Bytes, not text: a challenge may carry UTF-8 (HTTP's obs-text).
                    let value = http::HeaderValue::from_bytes(challenge.as_bytes());
                    if let Ok(value) = value {
                        let _ = header.insert_header(http::header::WWW_AUTHENTICATE, value);
                    }
                    respond::write_with(session, header, "application/json", body.into()).await;
                }
            }
            _ => {
                let data = refusal.data.clone();
                self.error(session, status, refusal.code, &refusal.message, data)
                    .await
            }
        }
        Outcome::Refused(refusal)
    }

    /// Writes the response's last message; returns whether the client took it.
    async fn finish(&self, session: &mut ServerSession, status: u16, message: Value) -> bool {
        if self.streaming.is_some() {
            let event = sse::Event::message(None, jsonrpc::text_of(&message)).encode();
            respond::write_body(session, Bytes::from(event), true)
                .await
                .is_ok()
        } else {
            respond::write(
                session,
                status,
                "application/json",
                Bytes::from(jsonrpc::text_of(&message)),
            )
            .await
        }
    }
}

/// A complete result as the client gets it: what every 2026-07-28 result carries added.
/// A legacy upstream's result is complete whatever it says: a `resultType` of its own
/// (with `inputRequests` and a `requestState` the gateway never checked or sealed) would
/// ask the client questions no upstream request waits on, so those three members are
/// the gateway's to set.
pub fn decorate(mut result: Value, server_info: &Value, cacheable: bool) -> Value {
    if let Some(r) = result.as_object_mut() {
        r.insert("resultType".into(), json!("complete"));
        r.remove("inputRequests");
        r.remove("requestState");
    }
    decorate_as_is(result, server_info, cacheable)
}

/// Adds what every 2026-07-28 result carries to one the gateway made (its own
/// `InputRequiredResult`), whose `resultType` stands.
pub fn decorate_as_is(mut result: Value, server_info: &Value, cacheable: bool) -> Value {
    if let Some(r) = result.as_object_mut() {
        if cacheable {
            r.entry("ttlMs").or_insert(json!(0));
            r.entry("cacheScope").or_insert(json!("private"));
        }
    }
    if let Some(meta) = meta_of(&mut result) {
        meta.insert(
            "io.modelcontextprotocol/serverInfo".into(),
            server_info.clone(),
        );
    }
    result
}

/// A result's `_meta`, created if absent (or replacing one that is not an object);
/// `None` when the result itself is not an object.
pub fn meta_of(result: &mut Value) -> Option<&mut Map<String, Value>> {
    let r = result.as_object_mut()?;
    let meta = r.entry("_meta").or_insert(json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    meta.as_object_mut()
}
