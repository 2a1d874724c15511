//! An embedded legacy MCP server (2025-11-25 Streamable HTTP) for `mrtr-gateway demo`
//! and the benchmarks: sessions, an event store that honours `Last-Event-ID`, and tools
//! that ask for elicitation (one over two rounds), sampling and roots. A tool keeps
//! running when its client disconnects; the client resumes with GET and `Last-Event-ID`.

mod session;
mod stream;
mod tools;

use crate::protocol::headers::MCP_SESSION_ID;
use crate::protocol::jsonrpc::{self, code};
use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use rand::RngCore;
use serde_json::{json, Value};
use session::DemoSession;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stream::EventStream;

const SUPPORTED_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"];
const MAX_BODY: usize = 1 << 20;
/// How many sessions the demo server holds, and how long its tools wait for answers.
#[derive(Clone, Copy, Debug)]
pub struct DemoOptions {
    /// Past this many sessions, `initialize` gets 503.
    pub max_sessions: usize,
    /// How long a tool waits for the client to answer a server request.
    pub answer_timeout: Duration,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            max_sessions: 100_000,
            answer_timeout: Duration::from_secs(600),
        }
    }
}

pub struct DemoServer {
    sessions: Mutex<HashMap<String, Arc<DemoSession>>>,
    options: DemoOptions,
}

/// A complete response.
struct Reply {
    status: u16,
    body: Option<Value>,
    session_id: Option<String>,
}

impl Reply {
    fn json(body: Value) -> Reply {
        Reply {
            status: 200,
            body: Some(body),
            session_id: None,
        }
    }
    fn status(status: u16) -> Reply {
        Reply {
            status,
            body: None,
            session_id: None,
        }
    }
    fn error(status: u16, id: Option<&Value>, code: i64, message: &str) -> Reply {
        let body = serde_json::from_slice(&jsonrpc::error_body(id, code, message, None))
            .expect("error bodies are JSON");
        Reply {
            status,
            body: Some(body),
            session_id: None,
        }
    }
}

/// What a request turns into: a complete reply, or an SSE stream to follow from an index.
enum Answer {
    Reply(Reply),
    Stream(Arc<EventStream>, usize),
    /// The session's standalone GET stream: the session takes another once it ends (its
    /// client left), as SDK servers do.
    Standalone(Arc<EventStream>, Arc<DemoSession>),
}

fn result(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

fn new_session_id() -> String {
    let mut bytes = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl DemoServer {
    pub fn new(options: DemoOptions) -> DemoServer {
        DemoServer {
            sessions: Mutex::default(),
            options,
        }
    }

    fn session(&self, id: &str) -> Option<Arc<DemoSession>> {
        self.sessions
            .lock()
            .expect("sessions lock")
            .get(id)
            .cloned()
    }

    async fn route(&self, http: &mut ServerSession) -> Answer {
        let sid = http
            .get_header(MCP_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let method = http.req_header().method.as_str().to_string();
        let session = sid.as_deref().map(|id| (id, self.session(id)));
        match (method.as_str(), session) {
            (_, Some((_, None))) => Answer::Reply(Reply::error(
                404,
                None,
                code::INVALID_REQUEST,
                "Session not found",
            )),
            ("POST", None) => self.post_without_session(http).await,
            ("POST", Some((_, Some(s)))) => self.post(http, &s).await,
            ("GET", Some((_, Some(s)))) => self.get(http, &s),
            ("DELETE", Some((id, Some(s)))) => {
                self.sessions.lock().expect("sessions lock").remove(id);
                s.end();
                Answer::Reply(Reply::status(200))
            }
            ("GET" | "DELETE", None) => Answer::Reply(Reply::error(
                400,
                None,
                code::INVALID_REQUEST,
                "Mcp-Session-Id required",
            )),
            _ => Answer::Reply(Reply::status(405)),
        }
    }

    async fn post_without_session(&self, http: &mut ServerSession) -> Answer {
        let message = match read_message(http).await {
            Ok(m) => m,
            Err(reply) => return Answer::Reply(reply),
        };
        if message["method"] != "initialize" {
            return Answer::Reply(Reply::error(
                400,
                message.get("id"),
                code::INVALID_REQUEST,
                "Bad Request: no session; send initialize first",
            ));
        }
        if self.sessions.lock().expect("sessions lock").len() >= self.options.max_sessions {
            return Answer::Reply(Reply::error(
                503,
                message.get("id"),
                code::INTERNAL_ERROR,
                "too many sessions",
            ));
        }
        let params = &message["params"];
        let asked = params["protocolVersion"].as_str().unwrap_or_default();
        let version = SUPPORTED_VERSIONS
            .iter()
            .find(|v| **v == asked)
            .unwrap_or(&SUPPORTED_VERSIONS[0]);
        let id = new_session_id();
        let capabilities = params["capabilities"].clone();
        let session = Arc::new(DemoSession::new(capabilities, self.options.answer_timeout));
        self.sessions
            .lock()
            .expect("sessions lock")
            .insert(id.clone(), session);
        let init = json!({
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": {"name": "mrtr-demo", "version": env!("CARGO_PKG_VERSION")},
            "instructions": "A demo legacy MCP server: try ask_name, plan_trip, summarize, show_roots."
        });
        let mut reply = Reply::json(result(&message["id"], init));
        reply.session_id = Some(id);
        Answer::Reply(reply)
    }

    async fn post(&self, http: &mut ServerSession, session: &Arc<DemoSession>) -> Answer {
        let message = match read_message(http).await {
            Ok(m) => m,
            Err(reply) => return Answer::Reply(reply),
        };
        let id = message.get("id").cloned();
        let method = message["method"].as_str().map(str::to_string);
        match (method, id) {
            (None, Some(_)) => {
                let known = session.answer(message);
                Answer::Reply(if known {
                    Reply::status(202)
                } else {
                    Reply::error(
                        400,
                        None,
                        code::INVALID_REQUEST,
                        "no pending request has that id",
                    )
                })
            }
            (Some(_), None) => Answer::Reply(Reply::status(202)),
            (Some(method), Some(id)) => self.request(session, &method, id, &message["params"]),
            (None, None) => Answer::Reply(Reply::error(
                400,
                None,
                code::INVALID_REQUEST,
                "not a JSON-RPC message",
            )),
        }
    }

    fn request(
        &self,
        session: &Arc<DemoSession>,
        method: &str,
        id: Value,
        params: &Value,
    ) -> Answer {
        let reply = match method {
            "ping" => result(&id, json!({})),
            "tools/list" => result(&id, tools::list(&session.capabilities)),
            "tools/call" => return self.call(session, id, params),
            _ => {
                return Answer::Reply(Reply::error(
                    200,
                    Some(&id),
                    code::METHOD_NOT_FOUND,
                    &format!("Method not found: {method}"),
                ))
            }
        };
        Answer::Reply(Reply::json(reply))
    }

    fn call(&self, session: &Arc<DemoSession>, id: Value, params: &Value) -> Answer {
        let name = params["name"].as_str().unwrap_or_default();
        let args = params.get("arguments").cloned().unwrap_or(json!({}));
        let tool = match tools::find(name) {
            Some(t) if tools::offered(t, &session.capabilities) => t,
            _ => {
                return Answer::Reply(Reply::error(
                    200,
                    Some(&id),
                    code::INVALID_PARAMS,
                    &format!("Unknown tool: {name}"),
                ))
            }
        };
        if !tool.streams {
            return Answer::Reply(Reply::json(result(&id, tools::call_plain(name, &args))));
        }
        let stream = session.open_stream();
        let progress_token = params["_meta"].get("progressToken").cloned();
        let (task_session, task_stream) = (session.clone(), stream.clone());
        tokio::spawn(async move {
            let outcome = tools::call_streaming(
                &task_session,
                &task_stream,
                tool.name,
                &args,
                progress_token.as_ref(),
            )
            .await;
            let final_message = match outcome {
                Ok(value) => result(&id, value),
                Err(e) => serde_json::from_slice(&jsonrpc::error_body(
                    Some(&id),
                    code::INTERNAL_ERROR,
                    &e.to_string(),
                    None,
                ))
                .expect("JSON"),
            };
            task_stream.finish(&final_message);
        });
        Answer::Stream(stream, 0)
    }

    fn get(&self, http: &ServerSession, session: &Arc<DemoSession>) -> Answer {
        let last = http
            .get_header("last-event-id")
            .and_then(|v| v.to_str().ok());
        match last {
            Some(last) => match stream::parse_event_id(last)
                .and_then(|(s, next)| Some((session.stream(s)?, next)))
            {
                Some((stream, next)) => Answer::Stream(stream, next),
                None => Answer::Reply(Reply::error(
                    404,
                    None,
                    code::INVALID_REQUEST,
                    "unknown Last-Event-ID",
                )),
            },
            None if session.standalone_open.swap(true, Ordering::AcqRel) => {
                Answer::Reply(Reply::error(
                    409,
                    None,
                    code::INVALID_REQUEST,
                    "Conflict: Only one SSE stream is allowed per session",
                ))
            }
            None => Answer::Standalone(session.open_stream(), session.clone()),
        }
    }
}

async fn read_message(http: &mut ServerSession) -> Result<Value, Reply> {
    let mut body = Vec::new();
    while let Some(chunk) = http
        .read_request_body()
        .await
        .map_err(|_| Reply::status(400))?
    {
        if body.len() + chunk.len() > MAX_BODY {
            return Err(Reply::error(
                413,
                None,
                code::INVALID_REQUEST,
                "body too large",
            ));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice::<Value>(&body)
        .ok()
        .filter(Value::is_object)
        .ok_or_else(|| Reply::error(400, None, code::PARSE_ERROR, "Parse error"))
}

async fn write_reply(http: &mut ServerSession, reply: Reply) {
    let body = reply
        .body
        .map(|b| Bytes::from(b.to_string()))
        .unwrap_or_default();
    let Ok(mut header) = ResponseHeader::build(reply.status, Some(4)) else {
        return;
    };
    if !body.is_empty() {
        let _ = header.insert_header("content-type", "application/json");
    }
    let _ = header.insert_header("content-length", body.len());
    if let Some(id) = reply.session_id {
        let _ = header.insert_header(MCP_SESSION_ID, id);
    }
    if http.write_response_header(Box::new(header)).await.is_ok() && !body.is_empty() {
        let _ = http.write_response_body(body, true).await;
    }
}

/// Follows `stream` from index `from` until it ends or the client goes away.
async fn write_stream(http: &mut ServerSession, stream: &EventStream, mut from: usize) {
    let Ok(mut header) = ResponseHeader::build(200, Some(4)) else {
        return;
    };
    let _ = header.insert_header("content-type", "text/event-stream");
    let _ = header.insert_header("cache-control", "no-cache");
    let _ = header.insert_header("transfer-encoding", "chunked");
    if http.write_response_header(Box::new(header)).await.is_err() {
        return;
    }
    loop {
        let batch = stream.since(from);
        if !batch.wire.is_empty()
            && http
                .write_response_body(batch.wire.into(), false)
                .await
                .is_err()
        {
            return;
        }
        from = batch.next;
        if batch.closed {
            let _ = http.write_response_body(Bytes::new(), true).await;
            return;
        }
        tokio::select! {
            _ = stream.wait_past(from) => {}
            _ = http.read_body_or_idle(true) => return,
        }
    }
}

#[async_trait]
impl HttpServerApp for DemoServer {
    async fn process_new_http(
        self: &Arc<Self>,
        mut http: ServerSession,
        _shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        // Keeps the bytes of a next request that arrives while a stream is written.
        http.set_pipelining_enabled(true);
        if !http.read_request().await.ok()? {
            return None;
        }
        match self.route(&mut http).await {
            Answer::Reply(reply) => write_reply(&mut http, reply).await,
            Answer::Stream(stream, from) => write_stream(&mut http, &stream, from).await,
            Answer::Standalone(stream, session) => {
                write_stream(&mut http, &stream, 0).await;
                session.standalone_open.store(false, Ordering::Release);
            }
        }
        let settings = HttpPersistentSettings::for_session(&http);
        let stream = http.finish().await.ok()??;
        Some(ReusedHttpStream::from_reusable_stream(stream, settings))
    }
}

/// Runs the demo server alone, on `threads` worker threads, until SIGTERM, SIGQUIT or
/// SIGINT.
pub fn serve(listen: &str, threads: usize, options: DemoOptions) {
    let conf = pingora::server::configuration::ServerConf {
        threads: threads.max(1),
        ..Default::default()
    };
    let mut server = pingora::server::Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    server.add_service(service(listen, options));
    crate::gateway::server::run(server);
}

/// A pingora service running the demo server on `listen`.
pub fn service(
    listen: &str,
    options: DemoOptions,
) -> pingora::services::listening::Service<DemoServer> {
    let mut service = pingora::services::listening::Service::new(
        "demo MCP server".to_string(),
        DemoServer::new(options),
    );
    service.add_tcp(listen);
    service
}
