//! The Pingora shell: the MCP listener's application, which routes each request to the
//! group serving its path and drives the upstream exchange itself ("handler mode"), the
//! admin listener, and the assembly of both into a pingora `Server`.

pub mod admin;
pub mod admission;
pub mod bridge;
pub mod connections;
pub mod cors;
pub mod learnt;
pub mod passthrough;
pub mod peers;
pub mod precise_sleep;
pub mod preface;
pub mod reaper;
pub mod reload;
pub mod respond;
pub mod server;
pub mod signals;
pub mod upstream_side;
pub mod wellknown;

pub use admission::Admission;
pub use upstream_side::UpstreamSide;

use crate::config::{Config, ConfigError};
use crate::keys::{KeyRing, SharedKeyRing};
use crate::metrics::Metrics;
use crate::mrtr::modern::{era, Era};
use crate::outcome::Class;
use crate::principal::Unauthenticated;
use crate::protocol::headers::{LAST_EVENT_ID, MCP_SESSION_ID};
use crate::protocol::jsonrpc::{self, code, Body};
use crate::protocol::oauth::{PublicResource, WellKnown};
use crate::protocol::scheme::Scheme;
use crate::upstream::Upstreams;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use passthrough::Client;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

/// Shortest wait for each read of a client's request body (at least `body_timeout_ms`).
const CLIENT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The methods an MCP endpoint serves, for a 405's `Allow` (GET and DELETE for 2025-era
/// clients; OPTIONS for browsers' preflights).
const ENDPOINT_METHODS: &str = "POST, GET, DELETE, OPTIONS";
/// Room for the first read of a kept-alive connection's next request.
const NEXT_REQUEST_BUFFER: usize = 4096;

/// Everything one gateway instance shares across requests, by concern; each handler
/// takes the parts it uses.
pub struct Gateway {
    pub config: Config,
    pub admission: Admission,
    pub sealing: Sealing,
    pub upstreams: UpstreamSide,
    pub flows: FlowTables,
    pub runtime: Runtime,
}

/// The keys states, cookies and session tokens are sealed with, and the states this
/// replica has accepted (replays are refused).
pub struct Sealing {
    /// The key ring, swapped whole when the keys file is reloaded.
    pub keys: Arc<SharedKeyRing>,
    pub used_states: std::sync::Mutex<crate::mrtr::replay::UsedStates>,
}

/// The flows this replica holds, and the replicas that hold the others.
pub struct FlowTables {
    /// The flows this replica holds (hold mode).
    pub held: Arc<bridge::hold::HeldFlows>,
    /// The other replicas, to forward retries of flows they hold.
    pub peers: peers::Peers,
}

/// What the process as a whole shares: metrics and the drain of a graceful shutdown.
pub struct Runtime {
    pub metrics: Arc<Metrics>,
    /// Set when a graceful shutdown begins.
    pub drain: Arc<admin::Drain>,
}

impl Gateway {
    pub fn new(
        config: Config,
        keys: Arc<KeyRing>,
        upstreams: Upstreams,
    ) -> Result<Gateway, ConfigError> {
        let admission = Admission::new(&config)?;
        let resolver = config.dns_resolver.as_ref().and_then(|r| r.parse().ok());
        let bridge = &config.bridge;
        let flows = FlowTables {
            held: Arc::new(bridge::hold::HeldFlows::new(
                bridge.max_held_flows,
                bridge.max_held_flows_per_principal,
                bridge.max_held_bytes_per_flow,
            )),
            peers: peers::Peers::build(&config.peers, resolver)?,
        };
        let reaper = Arc::new(reaper::Reaper::new(
            bridge.max_watched_sessions,
            bridge.max_watched_sessions_per_principal,
        ));
        let used_states = crate::mrtr::replay::UsedStates::new(
            bridge.max_used_states,
            bridge.max_used_states_per_principal,
        );
        let metrics = Arc::new(Metrics::new());
        metrics.keys_loaded.set(keys.kids().count() as i64);
        let sealing = Sealing {
            keys: Arc::new(SharedKeyRing::new(keys)),
            used_states: std::sync::Mutex::new(used_states),
        };
        let upstreams = UpstreamSide::new(&config, upstreams, metrics.clone(), reaper);
        Ok(Gateway {
            config,
            admission,
            sealing,
            upstreams,
            flows,
            runtime: Runtime {
                metrics,
                drain: Arc::default(),
            },
        })
    }

    /// Counts a finished client request and logs its one access line (target
    /// `mrtr_gateway::access`; a bridged flow's id comes from the enclosing span).
    pub fn record(
        &self,
        era: &'static str,
        method: &'static str,
        outcome: &crate::outcome::Outcome,
        started: Instant,
    ) {
        self.count(era, method, outcome.label(), started);
    }

    fn count(&self, era: &'static str, method: &'static str, outcome: &str, started: Instant) {
        self.runtime
            .metrics
            .requests
            .with_label_values(&[era, method, outcome])
            .inc();
        // Whole microseconds: `4.516`, not `4.5160160000000005`.
        let ms = started.elapsed().as_micros() as f64 / 1000.0;
        tracing::info!(target: "mrtr_gateway::access", era, method, outcome, ms, "request");
    }

    /// A header that names the request's session, position or caller, when it appears
    /// more than once.
    fn repeated_identity(&self, session: &ServerSession) -> Option<&str> {
        let headers = &session.req_header().headers;
        let repeated = [MCP_SESSION_ID, LAST_EVENT_ID]
            .into_iter()
            .find(|name| headers.get_all(*name).iter().count() > 1);
        repeated.or(self.admission.repeated_principal_header(session))
    }

    /// Serves one client request, and counts it where no path it took did: the gateway's
    /// own refusals before a request reaches pass-through, the bridge or a discovery
    /// document (their method is not read yet: `other`).
    async fn handle(&self, session: &mut ServerSession, arrival: Arrival) {
        let started = Instant::now();
        if let Some(class) = self.route(session, arrival).await {
            let has_session = session.get_header(MCP_SESSION_ID).is_some();
            let version = header(session, "mcp-protocol-version");
            let era = match era(version, None, has_session, None) {
                Era::Modern => "modern",
                Era::Legacy => "legacy",
            };
            self.count(era, "other", class.label(), started);
        }
    }

    /// Routes a request; `Some` with what it was refused as where the gateway refused it
    /// itself (the paths it is routed to count their own).
    async fn route(&self, session: &mut ServerSession, arrival: Arrival) -> Option<Class> {
        // Every response header asks it whether to close the connection after it.
        let drain = self.runtime.drain.clone();
        session.req_header_mut().extensions_mut().insert(drain);
        if let Some(message) = target_too_long(session) {
            refuse_and_close(session, 414, code::INVALID_REQUEST, &message).await;
            return Some(Class::TooLarge);
        }
        if let Err(message) = check_header_limits(session, &self.config.limits) {
            refuse_and_close(session, 431, code::INVALID_REQUEST, &message).await;
            return Some(Class::TooLarge);
        }
        if let Some(message) = unsupported_coding(session) {
            refuse_and_close(session, 501, code::INVALID_REQUEST, &message).await;
            return Some(Class::BadRequest);
        }
        if let Some(message) = coded_body(session) {
            // RFC 7694 §3: the 415 says which codings would be taken.
            session.set_keepalive(None);
            respond::invalid_request_with(session, 415, ("accept-encoding", "identity"), &message)
                .await;
            linger(session).await;
            return Some(Class::BadRequest);
        }
        let http11 = session.req_header().version == http::Version::HTTP_11;
        let host = request_host(session);
        if let Some(message) = (arrival == Arrival::Client)
            .then(|| crate::protocol::host_check::malformed_host(host, http11))
            .flatten()
        {
            refuse_and_close(session, 400, code::INVALID_REQUEST, &message).await;
            return Some(Class::BadRequest);
        }
        // A forwarded retry's Host and Origin were checked by the replica it reached (and
        // its CORS headers are that replica's to add).
        let host_checked = match arrival {
            Arrival::Client => {
                // An origin the CORS policy lists is one the operator chose to let in.
                let granted = cors::grant(&self.admission.cors, session);
                let origin = header(session, "origin").filter(|_| !granted);
                self.admission
                    .host_policy
                    .check(request_host(session), origin)
            }
            Arrival::Peer => Ok(()),
        };
        if let Err(why) = host_checked {
            let message = format!(
                "Forbidden: {why} (DNS-rebinding protection; see allowed_hosts, and \
                 cors_allowed_origins for web origins)"
            );
            respond::error(session, 403, None, code::INVALID_REQUEST, &message).await;
            return Some(Class::Forbidden);
        }
        let path = session.req_header().uri.path();
        if arrival == Arrival::Peer && path == peers::ALIVE_PATH {
            // A replica's check, not a client's request: not counted.
            respond::write(session, 200, "text/plain", Bytes::from_static(b"alive\n")).await;
            return None;
        }
        let group = self.upstreams.groups.by_path(path);
        let method = session.req_header().method.clone();
        // The peer listener serves retries only: no discovery document, no preflight (its
        // Host and Origin are not checked).
        if arrival == Arrival::Peer && (group.is_none() || method != http::Method::POST) {
            return refuse_on_peer_listener(session).await;
        }
        if group.is_none() && WellKnown::of(path).is_none() {
            let message = format!("no MCP endpoint at {path}");
            respond::error(session, 404, None, code::INVALID_REQUEST, &message).await;
            return Some(Class::BadRequest);
        }
        // Only a POST's body is read: a GET's, DELETE's or relayed OPTIONS's, left on the
        // connection, would be taken (by the relay's watch for the client's close) for the
        // next request's start.
        let relayed_bodiless = matches!(method.as_str(), "GET" | "DELETE" | "OPTIONS");
        if relayed_bodiless && !session.is_body_empty() {
            let message = format!("a {method} request carries no body here");
            refuse_and_close(session, 400, code::INVALID_REQUEST, &message).await;
            return Some(Class::BadRequest);
        }
        // Relayed preflights included: which session a request names is not left to the
        // reader.
        if let Some(name) = group.and_then(|_| self.repeated_identity(session)) {
            let message = format!("the {name} header appears more than once; send one");
            respond::error(session, 400, None, code::INVALID_REQUEST, &message).await;
            return Some(Class::BadRequest);
        }
        if method == http::Method::OPTIONS {
            return self.serve_options(session, group, arrival).await;
        }
        let Some(group) = group else {
            // Discovery documents are public: served before any credential is checked.
            wellknown::serve(self, session).await;
            return None;
        };
        if !matches!(method.as_str(), "POST" | "GET" | "DELETE") {
            let message = format!("method {method} is not allowed; use POST, GET or DELETE");
            respond::method_not_allowed(session, ENDPOINT_METHODS, &message).await;
            return Some(Class::BadRequest);
        }
        let principal = match self.admission.principal(session) {
            Ok(p) => p,
            Err(Unauthenticated(why)) => {
                let public = self.admission.public_resource(session, group);
                unauthenticated(session, &why, &public).await;
                return Some(Class::Unauthorized);
            }
        };
        let has_session = session.get_header(MCP_SESSION_ID).is_some();
        let version = header(session, "mcp-protocol-version").map(str::to_string);
        // The era the headers say; a POST's body may still name a legacy method.
        let header_era = era(version.as_deref(), None, has_session, None);
        let modern_post = method == http::Method::POST && header_era == Era::Modern;
        if arrival == Arrival::Peer && !modern_post {
            return refuse_on_peer_listener(session).await;
        }
        if method != http::Method::POST {
            match header_era {
                Era::Modern => {
                    let message = format!(
                        "{method} is not supported in protocol version 2026-07-28; use POST"
                    );
                    respond::method_not_allowed(session, ENDPOINT_METHODS, &message).await;
                    return Some(Class::BadRequest);
                }
                Era::Legacy => {
                    let body = Bytes::new();
                    passthrough::serve(self, session, group, body, None, Client::Legacy, &principal)
                        .await
                }
            }
            return None;
        }
        let (body, parsed) = match self.read_json_body(session).await {
            Ok(read) => read,
            Err(refused) => return refused,
        };
        match era(version.as_deref(), None, has_session, parsed.method()) {
            Era::Modern => {
                let request = bridge::Incoming {
                    body,
                    parsed,
                    principal,
                    arrival,
                };
                // The bridge's future is the largest by far: on the heap, so that a legacy
                // request's future (moved onto the heap whole per request) stays small.
                Box::pin(bridge::serve(self, session, group, request)).await
            }
            Era::Legacy if arrival == Arrival::Peer => {
                return refuse_on_peer_listener(session).await
            }
            Era::Legacy => {
                let parsed = Some(parsed);
                passthrough::serve(
                    self,
                    session,
                    group,
                    body,
                    parsed,
                    Client::Legacy,
                    &principal,
                )
                .await
            }
        }
        None
    }

    /// Serves an `OPTIONS` (a browser's preflight, which carries no credentials) before
    /// any credential is checked: under the gateway's CORS policy it answers itself;
    /// otherwise an endpoint's is relayed to the upstream as a reverse proxy does, as the
    /// anonymous principal (a session token it names opens only if an anonymous client
    /// was given it), and a discovery document's is refused like any method but GET.
    async fn serve_options(
        &self,
        session: &mut ServerSession,
        group: Option<&crate::upstream::UpstreamGroup>,
        arrival: Arrival,
    ) -> Option<Class> {
        if arrival == Arrival::Peer {
            return refuse_on_peer_listener(session).await;
        }
        if self.admission.cors.is_gateways() {
            cors::answer_options(session).await;
            return None;
        }
        let Some(group) = group else {
            wellknown::serve(self, session).await;
            return None;
        };
        let anonymous = self.admission.principal_source.digest(None);
        let body = Bytes::new();
        passthrough::serve(self, session, group, body, None, Client::Legacy, &anonymous).await;
        None
    }

    /// Reads and classifies a POST body within the configured limits; on failure the
    /// client has had its answer (what it was refused as; `None`: it left).
    async fn read_json_body(
        &self,
        session: &mut ServerSession,
    ) -> Result<(Bytes, Body), Option<Class>> {
        let limits = &self.config.limits;
        let declared = header(session, "content-length").and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limits.max_body_bytes) {
            too_large(session, limits.max_body_bytes).await;
            return Err(Some(Class::TooLarge));
        }
        if expects_continue(session) {
            // The interim 100 goes out before the body by design; pingora would take it
            // for an answer given early and end the connection after this request.
            session.set_close_on_response_before_downstream_finish(false);
            let sent = respond::write_continue(session).await;
            session.set_close_on_response_before_downstream_finish(true);
            if sent.is_err() {
                return Err(None);
            }
        }
        // Reserved up to what a body usually is, grown as bytes come: a declared length
        // is a promise, and connections that declare large bodies and send little would
        // otherwise each hold up to `max_body_bytes`.
        let reserved = declared.unwrap_or(1024).min(INITIAL_BODY_CAPACITY);
        let mut body = BytesMut::with_capacity(reserved.min(limits.max_body_bytes));
        let deadline = Instant::now() + Duration::from_millis(limits.body_timeout_ms);
        loop {
            let read = tokio::time::timeout_at(deadline.into(), session.read_request_body());
            match read.await {
                Ok(Ok(Some(chunk))) if body.len() + chunk.len() > limits.max_body_bytes => {
                    too_large(session, limits.max_body_bytes).await;
                    return Err(Some(Class::TooLarge));
                }
                Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
                Ok(Ok(None)) => break,
                // A body that cannot be read leaves its connection without framing: it is
                // answered and closed, so no byte after it runs as a request.
                Ok(Err(e)) if e.etype() != &pingora::ErrorType::ReadTimedout => {
                    tracing::info!(error = %e, "client request body not read");
                    let message = format!(
                        "the request body could not be read ({}): its framing is invalid or it ended early",
                        e.etype().as_str()
                    );
                    session.set_keepalive(None);
                    respond::error(session, 400, None, code::INVALID_REQUEST, &message).await;
                    return Err(Some(Class::BadRequest));
                }
                Ok(Err(_)) | Err(_) => {
                    let message = format!(
                        "the request body did not arrive within {} ms",
                        limits.body_timeout_ms
                    );
                    session.set_keepalive(None);
                    respond::error(session, 408, None, code::INVALID_REQUEST, &message).await;
                    return Err(Some(Class::BadRequest));
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
                Err(Some(Class::BadRequest))
            }
        }
    }
}

/// Whether the client waits for `100 Continue` before sending its body. The gateway
/// answers it itself, once the request passed every check made before the body is read,
/// and never forwards `Expect` (it sends the body upstream whole, at once).
fn expects_continue(session: &ServerSession) -> bool {
    pingora::protocols::http::v1::common::is_expect_continue_req(session.req_header())
}

/// A request answered before its body was read (refused for its path, its host or its
/// credentials; or one that asked for `100 Continue` and may never send the body) leaves
/// the connection unable to carry another request. It is closed after a lingering drain
/// of whatever body arrives: closed with the body's bytes unread, the kernel would
/// reset it, and a client still sending would meet the reset before it read the answer
/// (a 401's challenge, which starts its authorization).
async fn close_if_body_unread(session: &mut ServerSession) {
    if !session.is_body_done() {
        session.set_keepalive(None);
        linger(session).await;
    }
}

fn header<'s>(session: &'s ServerSession, name: &str) -> Option<&'s str> {
    session.get_header(name).and_then(|v| v.to_str().ok())
}

/// The host the request names: its `Host` header, or an HTTP/2 request's `:authority`
/// (pingora checked that the two agree when both are present).
pub fn request_host(session: &ServerSession) -> Option<&str> {
    header(session, "host").or_else(|| session.req_header().uri.authority().map(|a| a.as_str()))
}

/// The scheme the request arrived over: `https` when its connection is TLS (the MCP
/// listener with `tls:`), `http` otherwise (the peer listener is always plain HTTP).
pub fn request_scheme(session: &ServerSession) -> Scheme {
    Scheme::over_tls(session.digest().is_some_and(|d| d.ssl_digest.is_some()))
}

/// Refuses requests with more headers, or more header bytes, than the limits allow.
/// A request target (path and query) longer than `MAX_TARGET_BYTES`, which the upstream
/// request could not carry once the endpoint's own path and query are added.
fn target_too_long(session: &ServerSession) -> Option<String> {
    let most = crate::protocol::target::MAX_TARGET_BYTES;
    let uri = &session.req_header().uri;
    let bytes = uri
        .path_and_query()
        .map_or(0, |target| target.as_str().len());
    (bytes > most).then(|| {
        format!("the request target (path and query) is {bytes} bytes, above the limit of {most}")
    })
}

fn check_header_limits(
    session: &ServerSession,
    limits: &crate::config::Limits,
) -> Result<(), String> {
    let headers = &session.req_header().headers;
    if headers.len() > limits.max_header_count {
        return Err(format!(
            "the request has {} headers, above the limit of {}",
            headers.len(),
            limits.max_header_count
        ));
    }
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if bytes > limits.max_header_bytes {
        return Err(format!(
            "the request headers hold {bytes} bytes, above the limit of {}",
            limits.max_header_bytes
        ));
    }
    Ok(())
}

/// Where a request arrived: from a client on the MCP listener, or forwarded by another
/// replica to the peer listener (a retry of a flow this replica holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    Client,
    Peer,
}

/// The peer listener serves only forwarded retries of held flows.
pub(crate) async fn refuse_on_peer_listener(session: &mut ServerSession) -> Option<Class> {
    let message = "the peer listener serves only 2026-07-28 retries of flows this replica holds";
    respond::error(session, 403, None, code::INVALID_REQUEST, message).await;
    Some(Class::Forbidden)
}

/// Refuses a request whose bearer token did not verify (RFC 6750), naming where the
/// group's protected-resource metadata is (RFC 9728 §5.1), which tells an MCP client
/// where to get a token.
async fn unauthenticated(session: &mut ServerSession, why: &str, public: &PublicResource) {
    let body = jsonrpc::error_body(
        None,
        code::INVALID_REQUEST,
        &format!("Unauthorized: {why}"),
        None,
    );
    let Ok(mut header) = pingora::http::ResponseHeader::build(401, Some(4)) else {
        return;
    };
    let metadata = format!("resource_metadata=\"{}\"", public.metadata_url());
    // A request without credentials is told none of what went wrong (RFC 6750 §3.1).
    let challenge = match session.get_header(http::header::AUTHORIZATION) {
        None => format!("Bearer {metadata}"),
        Some(_) => {
            format!("Bearer error=\"invalid_token\", error_description=\"{why}\", {metadata}")
        }
    };
    let _ = header.insert_header("www-authenticate", challenge);
    respond::write_with(session, header, "application/json", body.into()).await;
}

async fn too_large(session: &mut ServerSession, limit: usize) {
    let message = format!("request body exceeds the limit of {limit} bytes");
    refuse_and_close(session, 413, code::INVALID_REQUEST, &message).await;
}

/// How long a refused request's unread body is drained before the connection closes.
const LINGER: Duration = Duration::from_secs(1);

/// Why a request's transfer coding is refused (RFC 9112 §6.1: 501), if it is: the only
/// one the gateway reads is `chunked`, once.
fn unsupported_coding(session: &ServerSession) -> Option<String> {
    let codings = codings(session, http::header::TRANSFER_ENCODING);
    (!codings.is_empty() && codings != ["chunked"]).then(|| {
        format!(
            "the request's Transfer-Encoding '{}' is not supported: send the body chunked or with a Content-Length",
            codings.join(", ")
        )
    })
}

/// A request body in a content coding (`Content-Encoding: gzip`): the gateway reads every
/// body as JSON-RPC, so it would check one message and forward another under a header
/// that tells the upstream to decode it (RFC 9110 §15.5.16: 415).
fn coded_body(session: &ServerSession) -> Option<String> {
    let mut codings = codings(session, http::header::CONTENT_ENCODING);
    codings.retain(|coding| coding != "identity");
    (!codings.is_empty()).then(|| {
        format!(
            "the request's Content-Encoding '{}' is not supported: send the body uncoded",
            codings.join(", ")
        )
    })
}

/// The codings a request's `header` lists, over all its lines, lower-cased.
fn codings(session: &ServerSession, header: http::HeaderName) -> Vec<String> {
    let values = session.req_header().headers.get_all(header);
    (values.iter())
        .flat_map(|value| value.to_str().unwrap_or("?").split(','))
        .map(|coding| coding.trim().to_ascii_lowercase())
        .filter(|coding| !coding.is_empty())
        .collect()
}

/// Answers with an error and closes the connection. The unread body is drained for a
/// moment first (a lingering close): closing on unread data would reset the connection,
/// and the client could lose the answer before reading it.
async fn refuse_and_close(session: &mut ServerSession, status: u16, code: i64, message: &str) {
    session.set_keepalive(None);
    respond::error(session, status, None, code, message).await;
    linger(session).await;
}

/// Reads off, for a moment, what is left of a refused request's body before its
/// connection closes.
async fn linger(session: &mut ServerSession) {
    let _ = tokio::time::timeout(LINGER, session.drain_request_body()).await;
}

/// The most a request body's buffer reserves before its bytes arrive.
const INITIAL_BODY_CAPACITY: usize = 64 << 10;

/// Answers a request whose header could not be parsed (a malformed request line or
/// header, or a target longer than a URI may be) 400, as pingora's proxy does, then closes
/// the connection; one with more header lines than the parser reads (`error`'s cause,
/// httparse's), 431, as one over `limits.max_header_count` is. Pingora's error text quotes
/// the raw header, credentials included: it is neither logged nor sent.
async fn refuse_unreadable_header(session: &mut ServerSession, error: &pingora::Error) {
    let too_many = error
        .cause
        .as_ref()
        .is_some_and(|cause| cause.to_string() == "too many headers");
    let (status, message) = if too_many {
        (
            431,
            "the request header has more lines than the gateway reads (256)",
        )
    } else {
        (
            400,
            "the request header could not be parsed: a malformed request line or header, or a \
             request target longer than 65534 bytes",
        )
    };
    tracing::info!(status, "client request header not parsed: refused");
    let body = jsonrpc::error_body(None, code::INVALID_REQUEST, message, None);
    let Ok(mut header) = pingora::http::ResponseHeader::build(status, Some(3)) else {
        return session.shutdown().await;
    };
    let _ = header.insert_header("content-type", "application/json");
    let _ = header.insert_header("content-length", body.len());
    let _ = session.write_error_response(header, body.into()).await;
    session.shutdown().await;
}

/// A listener's application: the MCP listener's (`Arrival::Client`) or the peer
/// listener's (`Arrival::Peer`), both serving one shared gateway.
pub struct Listener {
    gw: Arc<Gateway>,
    arrival: Arrival,
    /// Whether the listener's connection cap is nearly reached (`ConnectionCap::crowding`):
    /// idle kept-alive connections are closed, and answers say `Connection: close`.
    crowding: Option<watch::Receiver<bool>>,
    /// An HTTP/2 connection (over TLS, by ALPN) that carries no stream for as long as an
    /// idle HTTP/1.1 connection is kept is closed, so idle connections do not hold the
    /// connection cap's slots.
    options: HttpServerOptions,
}

impl Listener {
    pub fn new(
        gw: Arc<Gateway>,
        arrival: Arrival,
        crowding: Option<watch::Receiver<bool>>,
    ) -> Listener {
        let mut options = HttpServerOptions::default();
        options.h2_idle_timeout = Some(gw.config.limits.client_idle_timeout());
        Listener {
            gw,
            arrival,
            crowding,
            options,
        }
    }

    fn is_crowded(&self) -> bool {
        self.crowding.as_ref().is_some_and(|c| *c.borrow())
    }

    /// Waits on a kept-alive connection for the first bytes of its next request, for at
    /// most `limits.client_idle_timeout_ms`, and not once the gateway shuts down or the
    /// listener is crowded. The header timeout counts from these bytes, not from the
    /// last response: a connection may idle longer than a request may take to arrive.
    /// Bytes that already arrived win over the drain: closing on them unread would reset
    /// the connection and lose a request the client has sent.
    async fn next_request_begins(
        &self,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<(Stream, BytesMut)> {
        let mut first = BytesMut::with_capacity(NEXT_REQUEST_BUFFER);
        let idle = self.gw.config.limits.client_idle_timeout();
        let mut shutdown = shutdown.clone();
        let mut crowding = self.crowding.clone();
        let crowded = async {
            match crowding.as_mut() {
                Some(crowding) => crowding.wait_for(|crowded| *crowded).await.is_ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            read = tokio::time::timeout(idle, stream.read_buf(&mut first)) => match read {
                Ok(Ok(n)) if n > 0 => Some((stream, first)),
                _ => None,
            },
            Ok(_) = shutdown.wait_for(|down| *down) => None,
            true = crowded => None,
        }
    }
}

#[async_trait]
impl HttpServerApp for Listener {
    fn server_options(&self) -> Option<&HttpServerOptions> {
        Some(&self.options)
    }

    /// Pingora's bounded HTTP/2 defaults, with the requests one connection carries at
    /// once at `limits.max_streams_per_connection` (pingora's own is 100).
    fn h2_options(&self) -> Option<pingora::protocols::http::v2::server::H2Options> {
        let mut options = pingora::protocols::http::v2::server::default_h2_options();
        options.max_concurrent_streams(self.gw.config.limits.max_streams_per_connection);
        Some(options)
    }

    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let header_timeout = Duration::from_millis(self.gw.config.limits.header_timeout_ms);
        // While a response is relayed the client side is watched for a disconnect; a
        // client that already sends its next request must keep those bytes. Pipelining
        // stashes them for the next request on this connection (answered in order).
        session.set_pipelining_enabled(true);
        match tokio::time::timeout(header_timeout, session.read_request()).await {
            Ok(Ok(true)) => {}
            Ok(Err(e)) if e.etype == pingora::ErrorType::InvalidHTTPHeader => {
                // Within a write's bound: a client that reads nothing does not hold the
                // connection (pingora's writes and shutdown wait without one).
                let write_timeout =
                    Duration::from_millis(self.gw.config.limits.client_write_timeout_ms);
                let refusing = refuse_unreadable_header(&mut session, &e);
                let _ = tokio::time::timeout(write_timeout, refusing).await;
                return None;
            }
            _ => return None,
        }
        // Each read of the body waits at least as long as the whole body may take, so a
        // stalled body meets `body_timeout_ms` and its 408.
        let limits = &self.gw.config.limits;
        let body_timeout = Duration::from_millis(limits.body_timeout_ms);
        session.set_read_timeout(Some(CLIENT_BODY_READ_TIMEOUT.max(body_timeout)));
        session.set_write_timeout(Some(Duration::from_millis(limits.client_write_timeout_ms)));
        // Pingora decided per request whether the connection may be reused: not after a
        // request with both Content-Length and Transfer-Encoding (RFC 9112 §6.1: bytes
        // after its body must never run as a request), nor for HTTP/1.0 without
        // `Connection: keep-alive`. Only a connection it left alive gets the idle timeout.
        // A crowded listener closes the connection after this answer, and says so.
        let reusable =
            session.get_keepalive().is_some() && !*shutdown.borrow() && !self.is_crowded();
        let idle_seconds = self.gw.config.limits.client_idle_timeout().as_secs().max(1);
        session.set_keepalive(reusable.then_some(idle_seconds));
        self.gw.handle(&mut session, self.arrival).await;
        if respond::given_up(&session) {
            return None;
        }
        close_if_body_unread(&mut session).await;
        let mut settings = HttpPersistentSettings::for_session(&session);
        // Finishing flushes what the response left queued: within one write's bound.
        let write_timeout = Duration::from_millis(limits.client_write_timeout_ms);
        let finished = tokio::time::timeout(write_timeout, session.finish()).await;
        let (stream, pipelined) = finished.ok()?.ok()??.into_parts();
        let (stream, next) = match pipelined.filter(|bytes| !bytes.is_empty()) {
            Some(pipelined) => (stream, pipelined),
            None => self.next_request_begins(stream, shutdown).await?,
        };
        settings.set_pipelined_prefix(next);
        Some(ReusedHttpStream::new(stream, Some(settings)))
    }
}

/// A gateway in front of an address nothing listens on: enough for unit tests of the
/// shell that never reach an upstream.
#[cfg(test)]
pub(crate) fn test_gateway() -> Gateway {
    let mut config = Config::default();
    config.apply_overrides(None, None, vec!["http://127.0.0.1:1/mcp".into()]);
    let keys = Arc::new(KeyRing::parse("k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap());
    let upstreams = Upstreams::build(&config).expect("upstreams");
    Gateway::new(config, keys, upstreams).expect("a gateway")
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_gateway as gateway;

    /// A request's whole handling is one future per connection task, living on a worker
    /// thread's stack while polled: it must stay small, in debug builds too, where nothing
    /// is optimised (a bridged retry's chain of nested `async fn`s once needed 2 MiB).
    /// pingora also moves it onto the heap per request, inside `process_new_http`'s: a
    /// copy of every byte, and above jemalloc's largest small class (14 KiB) a large
    /// extent. Rare paths therefore await their futures boxed (13 KiB before they did).
    #[test]
    fn a_requests_future_is_small() {
        let gw = gateway();
        let (client, _server) = tokio::io::duplex(64);
        let mut session = ServerSession::new_http1(Box::new(client));
        let handle = gw.handle(&mut session, Arrival::Client);
        let bytes = std::mem::size_of_val(&handle);
        println!("a request's future: {bytes} bytes");
        assert!(bytes < 8 << 10, "a request's future takes {bytes} bytes");
    }

    /// A request already sent on a kept-alive connection when the drain begins is served,
    /// not dropped with its bytes unread (which resets the connection and loses it). Both
    /// are ready at once here, many times over: an unbiased choice would drop some.
    #[tokio::test]
    async fn a_request_that_arrived_before_the_drain_is_read() {
        let listener = Listener::new(Arc::new(gateway()), Arrival::Client, None);
        let (_draining, shutdown) = watch::channel(true);
        for _ in 0..64 {
            let (client, mut server) = tokio::io::duplex(1024);
            let request = b"POST /mcp HTTP/1.1\r\n";
            tokio::io::AsyncWriteExt::write_all(&mut server, request)
                .await
                .unwrap();
            let next = listener
                .next_request_begins(Box::new(client), &shutdown)
                .await;
            let (_, first) = next.expect("the request that arrived is read");
            assert_eq!(&first[..], request);
        }
    }
}
