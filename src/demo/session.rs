//! One demo MCP session: its declared client capabilities, its event streams, and the
//! server requests it has sent and not yet seen answered.

use super::stream::EventStream;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

#[derive(Debug)]
pub enum ServerRequestError {
    /// The client answered with a JSON-RPC error.
    Refused(Value),
    /// No answer in time, or the session ended.
    NoAnswer,
}

impl std::fmt::Display for ServerRequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerRequestError::Refused(error) => {
                write!(f, "the client refused the request: {error}")
            }
            ServerRequestError::NoAnswer => write!(f, "the client did not answer the request"),
        }
    }
}

/// A server request sent and not yet answered.
pub struct Asked {
    id: i64,
    rx: oneshot::Receiver<Value>,
}

pub struct DemoSession {
    pub capabilities: Value,
    streams: Mutex<HashMap<u64, Arc<EventStream>>>,
    next_stream: AtomicU64,
    pending: Mutex<HashMap<i64, oneshot::Sender<Value>>>,
    next_request: AtomicI64,
    /// Whether a standalone GET stream is being read.
    pub standalone_open: AtomicBool,
    /// How long a tool waits for the client to answer a server request.
    answer_timeout: Duration,
}

impl DemoSession {
    pub fn new(capabilities: Value, answer_timeout: Duration) -> DemoSession {
        DemoSession {
            capabilities,
            answer_timeout,
            streams: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            next_request: AtomicI64::new(0),
            standalone_open: AtomicBool::new(false),
        }
    }

    pub fn open_stream(&self) -> Arc<EventStream> {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let stream = Arc::new(EventStream::new(id));
        self.streams
            .lock()
            .expect("streams lock")
            .insert(id, stream.clone());
        stream
    }

    /// Ends every stream of the session, as SDK servers do when a session is deleted.
    pub fn end(&self) {
        for stream in self.streams.lock().expect("streams lock").values() {
            stream.close();
        }
    }

    pub fn stream(&self, id: u64) -> Option<Arc<EventStream>> {
        self.streams.lock().expect("streams lock").get(&id).cloned()
    }

    /// Sends a server request on `stream` and waits for the client's answer.
    pub async fn ask(
        &self,
        stream: &EventStream,
        method: &str,
        params: Value,
    ) -> Result<Value, ServerRequestError> {
        let asked = self.send_request(stream, method, params);
        self.answer_to(asked).await
    }

    /// Sends a server request on `stream`; [`DemoSession::answer_to`] waits for its answer.
    /// Several may be sent before waiting, as servers that ask in parallel do.
    pub fn send_request(&self, stream: &EventStream, method: &str, params: Value) -> Asked {
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().expect("pending lock").insert(id, tx);
        stream.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        Asked { id, rx }
    }

    /// The client's answer to a request sent with [`DemoSession::send_request`].
    pub async fn answer_to(&self, asked: Asked) -> Result<Value, ServerRequestError> {
        let Asked { id, rx } = asked;
        let answer = tokio::time::timeout(self.answer_timeout, rx).await;
        self.pending.lock().expect("pending lock").remove(&id);
        match answer {
            Ok(Ok(message)) => match message.get("result") {
                Some(result) => Ok(result.clone()),
                None => Err(ServerRequestError::Refused(message["error"].clone())),
            },
            _ => Err(ServerRequestError::NoAnswer),
        }
    }

    /// Delivers a client's JSON-RPC response; false if no request waits for that id.
    pub fn answer(&self, message: Value) -> bool {
        let Some(id) = message["id"].as_i64() else {
            return false;
        };
        let waiting = self.pending.lock().expect("pending lock").remove(&id);
        waiting.is_some_and(|tx| tx.send(message).is_ok())
    }
}
