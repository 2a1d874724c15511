//! A legacy upstream session driven on behalf of a modern client: `initialize` with the
//! client's declared capabilities (legacy servers register tools by them), then
//! `notifications/initialized`, then calls, answers to server requests, resumption GETs,
//! and finally DELETE.

use super::exchange::{ExchangeError, Response, UpstreamClient};
use super::{Endpoint, Timeouts};
use crate::protocol::headers::MCP_SESSION_ID;
use crate::protocol::sse;
use crate::protocol::trace::TraceContext;
use bytes::Bytes;
use pingora::http::RequestHeader;
use serde_json::{json, Value};

/// The legacy revision the gateway speaks upstream.
pub const UPSTREAM_VERSION: &str = "2025-11-25";
/// Largest upstream SSE event or JSON body the bridge reads.
pub const MAX_UPSTREAM_MESSAGE: usize = 4 << 20;

pub struct LegacySession<'a> {
    pub client: &'a UpstreamClient,
    pub endpoint: Endpoint,
    pub timeouts: &'a Timeouts,
    pub session_id: Option<String>,
    pub version: String,
    /// The client request's trace context, sent with every request of this session.
    pub trace: TraceContext,
    /// A data-layer session's: it outlives the flows run in it, which never delete it.
    pub persistent: bool,
}

/// Why the upstream could not be driven.
#[derive(Debug)]
pub enum SessionError {
    /// The group has no healthy endpoint for a new session.
    NoEndpoint,
    Exchange(ExchangeError),
    /// The upstream answered something other than what the protocol requires.
    Protocol(String),
    /// The upstream refused the request with this HTTP status (4xx or 5xx; a 404 in an
    /// established session is `Gone`).
    Refused(u16),
    /// The upstream no longer has the session (HTTP 404).
    Gone,
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::NoEndpoint => write!(f, "no healthy upstream endpoint is available"),
            SessionError::Exchange(e) => write!(f, "{e}"),
            SessionError::Protocol(e) => write!(f, "{e}"),
            SessionError::Refused(status) => {
                write!(f, "the upstream refused the request (HTTP {status})")
            }
            SessionError::Gone => write!(f, "the upstream session is gone (HTTP 404)"),
        }
    }
}

impl From<ExchangeError> for SessionError {
    fn from(e: ExchangeError) -> Self {
        SessionError::Exchange(e)
    }
}

impl<'a> LegacySession<'a> {
    /// Opens a session: initialize, then notifications/initialized. Returns the
    /// InitializeResult.
    pub async fn open(
        client: &'a UpstreamClient,
        endpoint: Endpoint,
        timeouts: &'a Timeouts,
        capabilities: &Value,
        client_info: &Value,
        trace: &TraceContext,
    ) -> Result<(LegacySession<'a>, Value), SessionError> {
        let mut session = LegacySession {
            client,
            endpoint,
            timeouts,
            session_id: None,
            version: UPSTREAM_VERSION.into(),
            trace: trace.clone(),
            persistent: false,
        };
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": UPSTREAM_VERSION, "capabilities": capabilities, "clientInfo": client_info}});
        let mut response = session.post(&init).await?;
        session.session_id = response
            .header()
            .headers
            .get(MCP_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let message = read_single(&mut response).await;
        client.finish(response).await;
        let result = message?
            .get("result")
            .cloned()
            .ok_or_else(|| SessionError::Protocol("initialize failed upstream".into()))?;
        if let Some(v) = result["protocolVersion"].as_str() {
            session.version = v.to_string();
        }
        client.metrics.upstream_session("opened");
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        session.post_and_expect_accepted(&initialized).await?;
        Ok((session, result))
    }

    /// A session opened earlier, possibly by another replica.
    pub fn resume(
        client: &'a UpstreamClient,
        endpoint: Endpoint,
        timeouts: &'a Timeouts,
        session_id: String,
    ) -> LegacySession<'a> {
        LegacySession {
            client,
            endpoint,
            timeouts,
            session_id: Some(session_id),
            version: UPSTREAM_VERSION.into(),
            trace: TraceContext::default(),
            persistent: false,
        }
    }

    fn request(&self, method: &str, body_len: usize, last_event_id: Option<&str>) -> RequestHeader {
        let mut req = RequestHeader::build(method, self.endpoint.path.as_bytes(), Some(8))
            .expect("valid method and path");
        let _ = req.insert_header("host", self.endpoint.authority.as_str());
        let accept = if method == "GET" {
            "text/event-stream"
        } else {
            "application/json, text/event-stream"
        };
        let _ = req.insert_header("accept", accept);
        let _ = req.insert_header("mcp-protocol-version", self.version.as_str());
        if let Some(sid) = &self.session_id {
            let _ = req.insert_header(MCP_SESSION_ID, sid.as_str());
        }
        if let Some(id) = last_event_id {
            let _ = req.insert_header("last-event-id", id);
        }
        for (name, value) in self.trace.headers() {
            let _ = req.insert_header(name, value);
        }
        if method == "POST" {
            let _ = req.insert_header("content-type", "application/json");
            let _ = req.insert_header("content-length", body_len);
        }
        req
    }

    /// POSTs one JSON-RPC message and returns the response with its header read.
    pub async fn post(&self, message: &Value) -> Result<Response, SessionError> {
        let body = Bytes::from(message.to_string());
        let req = self.request("POST", body.len(), None);
        let response = self
            .client
            .send(&self.endpoint, self.timeouts, req, body)
            .await?;
        let status = response.header().status.as_u16();
        if status >= 400 {
            self.client.finish(response).await;
            return Err(self.refused(status));
        }
        Ok(response)
    }

    /// POSTs a notification or a response, which the upstream must accept with 202.
    pub async fn post_and_expect_accepted(&self, message: &Value) -> Result<(), SessionError> {
        let mut response = self.post(message).await?;
        let status = response.header().status.as_u16();
        let _ = response.read_all(64 << 10).await;
        self.client.finish(response).await;
        match status {
            200..=299 => Ok(()),
            other => Err(SessionError::Protocol(format!("expected 202, got {other}"))),
        }
    }

    /// GET on the session: the standalone stream, or a resumption after `last_event_id`
    /// (counted in `upstream_resumptions_total`).
    pub async fn get(&self, last_event_id: Option<&str>) -> Result<Response, SessionError> {
        let got = self.get_stream(last_event_id).await;
        if last_event_id.is_some() {
            let outcome = if got.is_ok() { "ok" } else { "failed" };
            self.client
                .metrics
                .upstream_resumptions
                .with_label_values(&[outcome])
                .inc();
        }
        got
    }

    /// A GET on the session, not counted as a resumption (probes).
    pub(crate) async fn get_stream(
        &self,
        last_event_id: Option<&str>,
    ) -> Result<Response, SessionError> {
        let req = self.request("GET", 0, last_event_id);
        let response = self
            .client
            .send(&self.endpoint, self.timeouts, req, Bytes::new())
            .await?;
        let status = response.header().status.as_u16();
        if status != 200 {
            self.client.finish(response).await;
            return Err(self.refused(status));
        }
        if !response.is_sse() {
            self.client.finish(response).await;
            return Err(SessionError::Protocol(
                "the upstream answered a GET of its session without an SSE stream".into(),
            ));
        }
        Ok(response)
    }

    /// Why the upstream refused a request with `status`: a 404 in an established
    /// session means the session is gone.
    fn refused(&self, status: u16) -> SessionError {
        if status == 404 && self.session_id.is_some() {
            return SessionError::Gone;
        }
        SessionError::Refused(status)
    }

    /// Ends the upstream session (best effort).
    pub async fn delete(&self) {
        self.delete_counting("deleted").await
    }

    /// Ends the session of a flow its client abandoned (best effort).
    pub async fn reap(&self) {
        self.delete_counting("reaped").await
    }

    async fn delete_counting(&self, event: &'static str) {
        if self.session_id.is_none() {
            return;
        }
        let req = self.request("DELETE", 0, None);
        if let Ok(mut response) = self
            .client
            .send(&self.endpoint, self.timeouts, req, Bytes::new())
            .await
        {
            let _ = response.read_all(64 << 10).await;
            self.client.finish(response).await;
            self.client.metrics.upstream_session(event);
        }
    }
}

/// Reads the single JSON-RPC message of a response: a JSON body, or the first message
/// event of an SSE body.
pub async fn read_single(response: &mut Response) -> Result<Value, SessionError> {
    if !response.is_sse() {
        let body = response.read_all(MAX_UPSTREAM_MESSAGE).await?;
        return serde_json::from_slice(&body)
            .map_err(|e| SessionError::Protocol(format!("upstream sent invalid JSON: {e}")));
    }
    let mut parser = sse::Parser::new(MAX_UPSTREAM_MESSAGE);
    let mut events = Vec::new();
    while let Some(chunk) = response.next_chunk().await? {
        parser
            .push(&chunk, &mut events)
            .map_err(|e| SessionError::Protocol(e.to_string()))?;
        if let Some(event) = events.iter().find(|e| !e.data.is_empty()) {
            return serde_json::from_str(&event.data)
                .map_err(|e| SessionError::Protocol(format!("upstream sent invalid JSON: {e}")));
        }
    }
    Err(SessionError::Protocol(
        "the upstream stream ended without a message".into(),
    ))
}

/// Whether the upstream answers a 2026-07-28 `server/discover` with a DiscoverResult
/// naming that version.
pub async fn answers_modern_discover(
    client: &UpstreamClient,
    endpoint: &Endpoint,
    timeouts: &Timeouts,
) -> bool {
    let version = crate::mrtr::modern::MODERN_VERSION;
    let message = json!({"jsonrpc": "2.0", "id": 0, "method": "server/discover", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": version, "io.modelcontextprotocol/clientCapabilities": {}}}});
    let body = Bytes::from(message.to_string());
    let Ok(mut req) = RequestHeader::build("POST", endpoint.path.as_bytes(), Some(8)) else {
        return false;
    };
    for (name, value) in [
        ("host", endpoint.authority.as_str()),
        ("accept", "application/json, text/event-stream"),
        ("content-type", "application/json"),
        ("mcp-protocol-version", version),
        ("mcp-method", "server/discover"),
    ] {
        let _ = req.insert_header(name, value);
    }
    let _ = req.insert_header("content-length", body.len());
    let Ok(mut response) = client.send(endpoint, timeouts, req, body).await else {
        return false;
    };
    let answer = read_single(&mut response).await;
    client.finish(response).await;
    answer.is_ok_and(|m| {
        m["result"]["supportedVersions"]
            .as_array()
            .is_some_and(|v| v.iter().any(|x| x == version))
    })
}
