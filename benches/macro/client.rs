//! The load generator's HTTP/1.1 client: one keep-alive connection per `Conn` (hyper),
//! JSON or SSE replies, and an event reader for streams held open.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use mrtr_gateway::protocol::sse;
use serde_json::Value;
use std::collections::VecDeque;
use tokio::net::TcpStream;

/// Largest SSE event the client accepts.
const MAX_EVENT: usize = 1 << 20;

pub struct Conn {
    addr: String,
    sender: Option<SendRequest<Full<Bytes>>>,
}

pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    body: Incoming,
}

impl Conn {
    pub fn new(addr: &str) -> Conn {
        Conn {
            addr: addr.to_string(),
            sender: None,
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, String> {
        let tcp = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", self.addr))?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        let (sender, connection) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| format!("handshake {}: {e}", self.addr))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    /// Sends one request, reconnecting first if the previous connection closed.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<String>,
    ) -> Result<Reply, String> {
        let ready = match self.sender.as_mut() {
            Some(s) => s.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            // The server closed the previous connection: a client reconnects.
            let mut fresh = self.connect().await?;
            fresh.ready().await.map_err(|e| format!("not ready: {e}"))?;
            self.sender = Some(fresh);
        }
        let sender = self.sender.as_mut().expect("connected above");
        let mut request = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.addr);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let body = Full::new(Bytes::from(body.unwrap_or_default()));
        let request = request.body(body).map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("{method} {path}: {e}"))?;
        let (parts, body) = response.into_parts();
        Ok(Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        })
    }
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }

    fn is_sse(&self) -> bool {
        self.header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream"))
    }

    pub async fn bytes(self) -> Result<Bytes, String> {
        self.body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| format!("body: {e}"))
    }

    /// The JSON-RPC response with `id`: the body itself, or the SSE event carrying it.
    pub async fn response_to(self, id: u64) -> Result<Value, String> {
        let status = self.status;
        if !self.is_sse() {
            let body = self.bytes().await?;
            return serde_json::from_slice(&body)
                .map_err(|e| format!("HTTP {status}: {e}: {}", String::from_utf8_lossy(&body)));
        }
        let mut events = self.events();
        while let Some(message) = events.next().await? {
            if message["id"] == id && message.get("method").is_none() {
                return Ok(message);
            }
        }
        Err(format!(
            "HTTP {status}: the stream ended without response {id}"
        ))
    }

    pub fn events(self) -> Events {
        Events {
            body: self.body,
            parser: sse::Parser::new(MAX_EVENT),
            ready: VecDeque::new(),
        }
    }
}

/// The JSON messages of an SSE response, as they arrive.
pub struct Events {
    body: Incoming,
    parser: sse::Parser,
    ready: VecDeque<Value>,
}

impl Events {
    pub async fn next(&mut self) -> Result<Option<Value>, String> {
        loop {
            if let Some(message) = self.ready.pop_front() {
                return Ok(Some(message));
            }
            let Some(frame) = self.body.frame().await else {
                return Ok(None);
            };
            let frame = frame.map_err(|e| format!("stream: {e}"))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let mut events = Vec::new();
            self.parser
                .push(&data, &mut events)
                .map_err(|e| e.to_string())?;
            for event in events.into_iter().filter(|e| !e.data.is_empty()) {
                let message = serde_json::from_str(&event.data).map_err(|e| e.to_string())?;
                self.ready.push_back(message);
            }
        }
    }
}
