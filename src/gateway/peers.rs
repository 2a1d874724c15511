//! The other gateway replicas, for hold mode: which addresses are peers (a configured
//! list, or a DNS name's current answer), and forwarding a client's retry to the replica
//! that holds its flow, relaying that replica's response back unchanged.
//!
//! The owner named in a `requestState` is trusted only because the state opened under
//! the key ring; it is still checked against the peer set, so a state can never send the
//! gateway to an arbitrary address. The forwarded request is the client's own (its
//! credentials included): the owner authenticates it and opens the state again.

use super::passthrough;
use super::Gateway;
use crate::config::{split_host_port, ConfigError, Discovery, PeerOptions};
use crate::outcome::{Class, Outcome, Refusal};
use crate::protocol::headers;
use crate::upstream::dns::{self, DnsDiscovery};
use crate::upstream::exchange::ExchangeFailure;
use crate::upstream::{Endpoint, Timeouts};
use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::lb::selection::RoundRobin;
use pingora::lb::LoadBalancer;
use pingora::protocols::http::ServerSession;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Which addresses are gateway replicas.
enum Members {
    Static(Vec<SocketAddr>),
    /// The balancer's current backends are the DNS name's last answer.
    Dns(Arc<LoadBalancer<RoundRobin>>),
}

pub struct Peers {
    /// This replica's peer address, sealed into the states of the flows it holds.
    pub advertise: Option<SocketAddr>,
    members: Members,
    connect_timeout: Duration,
}

impl Peers {
    /// The peer set of the configuration; a DNS name is resolved later, in the background.
    pub fn build(
        options: &PeerOptions,
        resolver: Option<SocketAddr>,
    ) -> Result<Peers, ConfigError> {
        let members = match options.discovery {
            Discovery::Static => Members::Static(
                options
                    .members
                    .iter()
                    .filter_map(|m| crate::config::peer_addr(m))
                    .collect(),
            ),
            Discovery::Dns => Members::Dns(Arc::new(Self::dns_balancer(options, resolver)?)),
        };
        Ok(Peers {
            advertise: options.advertised(),
            members,
            connect_timeout: Duration::from_millis(options.connect_timeout_ms),
        })
    }

    fn dns_balancer(
        options: &PeerOptions,
        resolver: Option<SocketAddr>,
    ) -> Result<LoadBalancer<RoundRobin>, ConfigError> {
        let member = options
            .members
            .first()
            .map(String::as_str)
            .unwrap_or_default();
        let (host, port) = split_host_port(member)
            .ok_or_else(|| ConfigError::at("peers.members[0]", "not HOST:PORT"))?;
        let discovery = DnsDiscovery::new("peers", host, port, resolver)
            .map_err(|p| ConfigError::at("peers.discovery", p))?;
        let refresh = Duration::from_millis(options.dns_refresh_ms);
        Ok(dns::balancer(discovery, refresh))
    }

    /// Whether the peer set is known: a DNS name's answer holds a replica. Before its
    /// first answer (at start, or while the resolver fails then), or with an empty one,
    /// an owner missing from it says nothing of whether the owner is gone.
    pub fn known(&self) -> bool {
        match &self.members {
            Members::Static(_) => true,
            Members::Dns(balancer) => !balancer.backends().get_backend().is_empty(),
        }
    }

    /// Whether `addr` is a replica's peer address now.
    pub fn contains(&self, addr: SocketAddr) -> bool {
        match &self.members {
            Members::Static(list) => list.contains(&addr),
            Members::Dns(balancer) => dns::in_answer(balancer, addr),
        }
    }

    /// The balancer that resolves a DNS peer set, to run as a background service.
    pub fn discovery_service(&self) -> Option<Arc<LoadBalancer<RoundRobin>>> {
        match &self.members {
            Members::Dns(balancer) => Some(balancer.clone()),
            Members::Static(_) => None,
        }
    }

    /// Whether a flow held at `owner` is held by this replica.
    pub fn is_me(&self, owner: Option<SocketAddr>) -> bool {
        owner == self.advertise
    }
}

/// Why a retry was not forwarded to the replica holding its flow.
#[derive(Debug)]
pub enum NotForwarded {
    /// The owner left the peer set, or does not answer: the flow is lost with it. `sent`:
    /// the retry may have reached it (it failed or stopped answering after the
    /// connection opened), and its answers the call.
    OwnerGone { why: String, sent: bool },
    /// This replica could not open a connection (out of file descriptors): nothing was
    /// sent, and the owner may well hold the flow still.
    NoDescriptor,
    /// This replica does not know its peers yet (`Peers::known`): nothing was sent, and
    /// the owner may well hold the flow still.
    PeersUnknown,
    /// This replica is in its grace period's last stretch. `sent`: the owner was
    /// continuing the retry, and the exchange is dropped (the owner, seeing its
    /// connection close, cancels the call as it would for a client of its own); else
    /// nothing was sent, and the owner holds the flow still.
    ShuttingDown { sent: bool },
}

/// Forwards the client's request (its headers and the body already read) to `owner`'s peer
/// listener, on the path the client used, and relays the response. The owner's answer,
/// success or error, is the client's; a streamed one this replica's shutdown cuts ends
/// with `last_word` (an SSE event), and `Outcome::Drained`. `Err` says why it was not
/// forwarded.
pub async fn forward(
    gw: &Gateway,
    session: &mut ServerSession,
    owner: SocketAddr,
    body: &Bytes,
    last_word: &Bytes,
) -> Result<Outcome, NotForwarded> {
    if gw.runtime.drain.is_near_end() {
        return Err(NotForwarded::ShuttingDown { sent: false });
    }
    if !gw.flows.peers.known() {
        return Err(NotForwarded::PeersUnknown);
    }
    if !gw.flows.peers.contains(owner) {
        let why = format!("{owner} is not in the peer set");
        return Err(NotForwarded::OwnerGone { why, sent: false });
    }
    // The client's query too: the owner carries it upstream like the client's headers.
    let uri = &session.req_header().uri;
    let path = uri
        .path_and_query()
        .map_or(uri.path(), |p| p.as_str())
        .to_string();
    let endpoint = peer_endpoint(owner, path);
    let timeouts = Timeouts {
        connect: gw.flows.peers.connect_timeout,
        // The owner answers when its round ends: bounded by the flow's own limits.
        response: Duration::from_secs(gw.config.bridge.max_flow_seconds),
        stream_idle: None,
    };
    let request = forwarded_request(session, &endpoint, body);
    // The owner answers when its round ends, which may be long: a client that leaves
    // meanwhile drops the exchange, and the owner, seeing its connection close, cancels
    // the call as it would for a client of its own. An owner that stops answering
    // anything (frozen, or hung) loses the flow as one that is gone does. So does this
    // replica's shutdown: near its grace period's end, the client is told.
    let sent = tokio::select! {
        () = gw.runtime.drain.wait_near_end() => return Err(NotForwarded::ShuttingDown { sent: true }),
        sent = gw.upstreams.client.send(&endpoint, &timeouts, request, body.clone()) => sent,
        _ = session.read_body_or_idle(true) => return Ok(Outcome::ClientGone),
        why = watch_owner(gw, owner) => return Err(NotForwarded::OwnerGone { why, sent: true }),
    };
    let mut response = sent.map_err(|e| match e.failure() {
        ExchangeFailure::NoDescriptor => NotForwarded::NoDescriptor,
        failure => NotForwarded::OwnerGone {
            why: e.to_string(),
            sent: failure != ExchangeFailure::Connect,
        },
    })?;
    let header = passthrough::relayed_header(session, response.header());
    let last_word = Some(last_word);
    // The owner may stop answering mid-answer too (frozen once its header went out, its
    // stream kept alive by this replica's keep-alive comments): the checks go on until
    // the answer ends, and cut it then.
    let relayed = tokio::select! {
        outcome = passthrough::relay(gw, session, header, &mut response, None, None, last_word) => Ok(outcome),
        why = watch_owner(gw, owner) => Err(why),
    };
    gw.upstreams.client.finish(response).await;
    let why = match relayed {
        Ok(outcome) => return Ok(outcome),
        Err(why) => why,
    };
    tracing::info!(%owner, %why, "the replica holding the flow stopped answering mid-answer");
    // The client sees its answer cut off, as from an upstream that broke off its body.
    super::respond::abort(session).await;
    let refusal = Refusal::internal(Class::UpstreamError, OWNER_GONE_MID_ANSWER);
    Ok(Outcome::Refused(refusal))
}

/// Why a forwarded retry's answer was cut.
const OWNER_GONE_MID_ANSWER: &str =
    "the replica holding the call stopped answering while it relayed this retry's answer";

/// The path on which a replica's peer listener answers 200 at once: while a forwarded
/// retry waits for its round, the forwarding replica checks that the owner still answers.
pub const ALIVE_PATH: &str = "/.mrtr-gateway/alive";

/// How often a forwarding replica checks that the owner still answers, how long each
/// check may take, and how many checks in a row may fail before the flow is given up.
const ALIVE_EVERY: Duration = Duration::from_secs(3);
const ALIVE_WITHIN: Duration = Duration::from_secs(2);
const ALIVE_MISSES: u32 = 2;

/// `path` at another replica's peer listener, which speaks plain HTTP: keep it on the
/// replicas' own network.
fn peer_endpoint(owner: SocketAddr, path: String) -> Endpoint {
    Endpoint {
        addr: owner,
        authority: owner.to_string(),
        path,
        tls: None,
        peer: true,
    }
}

/// Returns once `owner` has failed `ALIVE_MISSES` checks in a row, saying so. Any HTTP
/// answer counts (a release without the alive path answers 404).
async fn watch_owner(gw: &Gateway, owner: SocketAddr) -> String {
    let endpoint = peer_endpoint(owner, ALIVE_PATH.to_string());
    let timeouts = Timeouts {
        connect: gw.flows.peers.connect_timeout.min(ALIVE_WITHIN),
        response: ALIVE_WITHIN,
        stream_idle: None,
    };
    let mut misses = 0;
    loop {
        tokio::time::sleep(ALIVE_EVERY).await;
        let Ok(mut request) = RequestHeader::build("GET", ALIVE_PATH.as_bytes(), Some(1)) else {
            return "cannot build the check".to_string();
        };
        let _ = request.insert_header("host", endpoint.authority.as_str());
        let check = gw
            .upstreams
            .client
            .send(&endpoint, &timeouts, request, Bytes::new());
        match tokio::time::timeout(ALIVE_WITHIN, check).await {
            Ok(Ok(response)) => {
                misses = 0;
                gw.upstreams.client.finish(response).await;
            }
            // This replica's want of descriptors says nothing of the owner.
            Ok(Err(e)) if e.failure() == ExchangeFailure::NoDescriptor => {}
            _ => misses += 1,
        }
        if misses >= ALIVE_MISSES {
            return format!("{owner} stopped answering ({ALIVE_MISSES} checks in a row)");
        }
    }
}

/// The client's request as the owner gets it: the end-to-end headers (credentials,
/// trace context, MCP headers) and the body, with the owner as `Host`.
fn forwarded_request(session: &ServerSession, endpoint: &Endpoint, body: &Bytes) -> RequestHeader {
    let client = session.req_header();
    let mut req = RequestHeader::build("POST", endpoint.path.as_bytes(), Some(16))
        .expect("a path the gateway routed is valid");
    for (name, value) in headers::forwardable_request(&client.headers) {
        let _ = req.append_header(name, value);
    }
    let _ = req.insert_header("host", endpoint.authority.as_str());
    let _ = req.insert_header("content-length", body.len());
    req
}
