//! The Pingora shell: the MCP listener's application, which routes each request to the
//! group serving its path and drives the upstream exchange itself ("handler mode"), the
//! admin listener, and the assembly of both into a pingora `Server`.

pub mod admin;
pub mod bridge;
pub mod passthrough;
pub mod reaper;
pub mod respond;
pub mod server;

use crate::config::{Config, UpstreamEra};
use crate::keys::KeyRing;
use crate::metrics::Metrics;
use crate::mrtr::modern::{era, Era};
use crate::principal::PrincipalSource;
use crate::protocol::headers::MCP_SESSION_ID;
use crate::protocol::host_check::HostPolicy;
use crate::protocol::jsonrpc::{self, code, Body};
use crate::upstream::exchange::UpstreamClient;
use crate::upstream::legacy_session::{LegacySession, SessionError};
use crate::upstream::{UpstreamGroup, Upstreams};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// After a probe of an `era: auto` group got no verdict (the upstream was unreachable),
/// how long until the next one; until then the group is bridged.
const PROBE_RETRY: Duration = Duration::from_secs(10);

/// What probing an `era: auto` group found.
#[derive(Clone, Copy)]
enum Probed {
    Verdict(bool),
    RetryAfter(Instant),
}

/// Longest wait for each read of a client's request body.
const CLIENT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything one gateway instance shares across requests.
pub struct Gateway {
    pub config: Config,
    pub keys: Arc<KeyRing>,
    pub upstreams: Upstreams,
    pub client: UpstreamClient,
    pub metrics: Arc<Metrics>,
    host_policy: HostPolicy,
    pub reaper: Arc<reaper::Reaper>,
    /// Each group's InitializeResult, learnt from the first session opened there; it
    /// answers `server/discover` and names the server in every modern result.
    initialize_results: std::sync::Mutex<std::collections::HashMap<String, Value>>,
    /// For `era: auto` groups, what the probe found.
    modern_only: std::sync::Mutex<std::collections::HashMap<String, Probed>>,
}

impl Gateway {
    pub fn new(config: Config, keys: Arc<KeyRing>, upstreams: Upstreams) -> Gateway {
        let listen = config.listen.parse().expect("validated listen address");
        let host_policy = HostPolicy::for_listener(listen, &config.allowed_hosts);
        let reaper = Arc::new(reaper::Reaper::new(config.bridge.max_watched_sessions));
        Gateway {
            reaper,
            host_policy,
            initialize_results: Default::default(),
            modern_only: Default::default(),
            config,
            keys,
            upstreams,
            client: UpstreamClient::default(),
            metrics: Arc::new(Metrics::new()),
        }
    }

    pub fn remember_initialize(&self, group: &UpstreamGroup, result: &Value) {
        let mut cache = self
            .initialize_results
            .lock()
            .expect("initialize cache lock");
        cache
            .entry(group.name.clone())
            .or_insert_with(|| result.clone());
    }

    /// Opens an upstream session on a healthy endpoint of `group` with the client's
    /// declared capabilities, and remembers the group's InitializeResult.
    pub async fn open_upstream<'g>(
        &'g self,
        group: &'g UpstreamGroup,
        capabilities: &Value,
        client_info: &Value,
    ) -> Result<(LegacySession<'g>, Value), SessionError> {
        let endpoint = group.pick().ok_or(SessionError::NoEndpoint)?;
        let opened = LegacySession::open(
            &self.client,
            endpoint,
            &group.timeouts,
            capabilities,
            client_info,
        )
        .await?;
        self.remember_initialize(group, &opened.1);
        Ok(opened)
    }

    /// The group's InitializeResult, opening (and closing) a session to learn it once.
    pub async fn initialize_result(
        &self,
        group: &UpstreamGroup,
        client_info: &Value,
    ) -> Result<Value, SessionError> {
        if let Some(known) = self
            .initialize_results
            .lock()
            .expect("initialize cache lock")
            .get(&group.name)
        {
            return Ok(known.clone());
        }
        let (session, result) = self.open_upstream(group, &json!({}), client_info).await?;
        session.delete().await;
        Ok(result)
    }

    /// Whether 2026-07-28 requests to `group` are relayed unchanged rather than bridged.
    pub async fn relays(&self, group: &UpstreamGroup, client_info: &Value) -> bool {
        match group.era {
            UpstreamEra::Legacy => false,
            UpstreamEra::Modern => true,
            UpstreamEra::Auto => {
                let probed = self
                    .modern_only
                    .lock()
                    .expect("era cache lock")
                    .get(&group.name)
                    .copied();
                match probed {
                    Some(Probed::Verdict(modern_only)) => return modern_only,
                    Some(Probed::RetryAfter(at)) if Instant::now() < at => return false,
                    _ => {}
                }
                let probed = match self.probe_modern_only(group, client_info).await {
                    Some(verdict) => Probed::Verdict(verdict),
                    None => Probed::RetryAfter(Instant::now() + PROBE_RETRY),
                };
                self.modern_only
                    .lock()
                    .expect("era cache lock")
                    .insert(group.name.clone(), probed);
                matches!(probed, Probed::Verdict(true))
            }
        }
    }

    /// An upstream that refuses `initialize` but answers `server/discover` speaks only
    /// 2026-07-28. `None` when it could not be reached: no verdict, probe again later.
    async fn probe_modern_only(&self, group: &UpstreamGroup, client_info: &Value) -> Option<bool> {
        match self.initialize_result(group, client_info).await {
            Ok(_) => Some(false),
            Err(SessionError::Protocol(_)) => {
                let endpoint = group.pick()?;
                Some(
                    crate::upstream::legacy_session::answers_modern_discover(
                        &self.client,
                        endpoint,
                        &group.timeouts,
                    )
                    .await,
                )
            }
            Err(_) => None,
        }
    }

    /// The upstream's serverInfo for modern results, once known.
    pub fn server_info(&self, group: &UpstreamGroup) -> Value {
        let cache = self
            .initialize_results
            .lock()
            .expect("initialize cache lock");
        cache
            .get(&group.name)
            .map(|r| r["serverInfo"].clone())
            .unwrap_or_else(|| json!({"name": group.name, "version": "unknown"}))
    }

    pub fn principal_source(&self) -> &PrincipalSource {
        &self.config.principal
    }

    async fn handle(&self, session: &mut ServerSession) {
        if let Err(why) = self
            .host_policy
            .check(header(session, "host"), header(session, "origin"))
        {
            let message = format!("Forbidden: {why} (DNS-rebinding protection; see allowed_hosts)");
            respond::error(session, 403, None, code::INVALID_REQUEST, &message).await;
            return;
        }
        let path = session.req_header().uri.path();
        let Some(group) = self.upstreams.by_path(path) else {
            let message = format!("no MCP endpoint at {path}");
            respond::error(session, 404, None, code::INVALID_REQUEST, &message).await;
            return;
        };
        let method = session.req_header().method.clone();
        if !matches!(method.as_str(), "POST" | "GET" | "DELETE") {
            let message = format!("method {method} is not allowed; use POST, GET or DELETE");
            respond::error(session, 405, None, code::INVALID_REQUEST, &message).await;
            return;
        }
        let has_session = session.get_header(MCP_SESSION_ID).is_some();
        let version = header(session, "mcp-protocol-version").map(str::to_string);
        if method != http::Method::POST {
            match era(version.as_deref(), None, has_session, None) {
                Era::Modern => {
                    let message = format!(
                        "{method} is not supported in protocol version 2026-07-28; use POST"
                    );
                    respond::error(session, 405, None, code::INVALID_REQUEST, &message).await;
                }
                Era::Legacy => {
                    passthrough::serve(self, session, group, Bytes::new(), None, "legacy").await
                }
            }
            return;
        }
        let Ok((body, parsed)) = self.read_json_body(session).await else {
            return;
        };
        match era(version.as_deref(), None, has_session, parsed.method()) {
            Era::Modern => bridge::serve(self, session, group, body, parsed).await,
            Era::Legacy => {
                passthrough::serve(self, session, group, body, Some(parsed), "legacy").await
            }
        }
    }

    /// The principal binding of a request.
    pub fn principal(&self, session: &ServerSession) -> [u8; 32] {
        let source = self.principal_source();
        let value = source
            .header_name()
            .and_then(|name| session.get_header(name))
            .map(|v| v.as_bytes());
        source.digest(value)
    }

    /// Reads and classifies a POST body within the configured limits; on failure the
    /// client has had its answer.
    async fn read_json_body(&self, session: &mut ServerSession) -> Result<(Bytes, Body), ()> {
        let limits = &self.config.limits;
        let declared = header(session, "content-length").and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limits.max_body_bytes) {
            too_large(session, limits.max_body_bytes).await;
            return Err(());
        }
        let mut body = BytesMut::with_capacity(declared.unwrap_or(1024).min(limits.max_body_bytes));
        loop {
            match session.read_request_body().await {
                Ok(Some(chunk)) if body.len() + chunk.len() > limits.max_body_bytes => {
                    too_large(session, limits.max_body_bytes).await;
                    return Err(());
                }
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(e) => {
                    tracing::info!(error = %e, "client request body not read");
                    return Err(());
                }
            }
        }
        match jsonrpc::classify(&body, limits.max_batch) {
            Ok(parsed) => Ok((body.freeze(), parsed)),
            Err(invalid) => {
                respond::error(
                    session,
                    400,
                    invalid.id.as_ref(),
                    invalid.code,
                    &invalid.message,
                )
                .await;
                Err(())
            }
        }
    }
}

fn header<'s>(session: &'s ServerSession, name: &str) -> Option<&'s str> {
    session.get_header(name).and_then(|v| v.to_str().ok())
}

async fn too_large(session: &mut ServerSession, limit: usize) {
    let message = format!("request body exceeds the limit of {limit} bytes");
    session.set_keepalive(None);
    respond::error(session, 413, None, code::INVALID_REQUEST, &message).await;
}

#[async_trait]
impl HttpServerApp for Gateway {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        match session.read_request().await {
            Ok(true) => {}
            _ => return None,
        }
        session.set_read_timeout(Some(CLIENT_BODY_READ_TIMEOUT));
        session.set_keepalive(if *shutdown.borrow() { None } else { Some(60) });
        self.handle(&mut session).await;
        let settings = HttpPersistentSettings::for_session(&session);
        match session.finish().await {
            Ok(stream) => stream.map(|s| ReusedHttpStream::from_reusable_stream(s, settings)),
            Err(_) => None,
        }
    }
}
