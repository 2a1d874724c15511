//! Upstream groups: their endpoints resolved to socket addresses (once at start, or from
//! a DNS name's current answer), round-robin selection over healthy endpoints with
//! pingora's load balancer, and the membership check that keeps a sealed endpoint from
//! ever naming an address outside the configuration or the current answer.

pub mod dns;
pub mod exchange;
pub mod idle;
pub mod legacy_session;

use self::legacy_session::{LegacySession, SessionError};
use crate::config::{
    parse_endpoint_url, Config, ConfigError, Discovery, EndpointUrl, ToolPolicy,
    UpstreamGroupConfig,
};
use crate::protocol::headers::HeaderPolicy;
use crate::protocol::oauth::PublicResource;
use crate::tls::upstream::{EndpointTls, GroupTls};
use pingora::lb::health_check::TcpHealthCheck;
use pingora::lb::selection::RoundRobin;
use pingora::lb::LoadBalancer;
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

/// Where the DELETE of a session nobody will use goes when its first attempt failed
/// (`LegacySession::abandon`): the gateway's reaper, which sends it again when the
/// upstream may take it later. Nobody else knows of such a session.
pub trait DeleteLater: Send + Sync {
    /// Keeps the DELETE of `session`, which `failed`, to be sent again.
    fn delete_later(&self, session: &LegacySession<'_>, failed: &SessionError);
}

/// One upstream MCP endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: SocketAddr,
    /// The `Host` header to send.
    pub authority: String,
    /// The upstream's MCP path.
    pub path: String,
    /// How to speak TLS to it (`https://`); `None`: plain HTTP.
    pub tls: Option<EndpointTls>,
    /// Another replica's peer listener, not an upstream: its exchanges are timed under
    /// one `peer` label, so that replicas replaced by the hundred add no series.
    pub peer: bool,
}

#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub connect: Duration,
    pub response: Duration,
    pub stream_idle: Option<Duration>,
}

pub struct UpstreamGroup {
    pub name: String,
    pub era: crate::config::UpstreamEra,
    /// How a bridged call waits for its client between rounds.
    pub resume: crate::config::ResumeMode,
    pub path: String,
    members: Members,
    pub timeouts: Timeouts,
    pub health_check_interval: Option<Duration>,
    /// How often the endpoints are resolved again (`discovery: dns`).
    pub dns_refresh: Option<Duration>,
    /// Per-tool policies, by tool name.
    pub tools: BTreeMap<String, ToolPolicy>,
    /// Which of a client's end-to-end headers its bridged exchanges carry.
    pub forward_headers: HeaderPolicy,
    /// The URL clients reach the group at, when configured for the group itself.
    pub public_url: Option<PublicResource>,
    /// Protected-resource metadata the gateway serves for the group, when configured.
    pub resource_metadata: Option<serde_json::Value>,
    balancer: Arc<LoadBalancer<RoundRobin>>,
}

/// Which addresses are the group's endpoints.
enum Members {
    /// The configured endpoints, resolved at start.
    Static(Vec<Endpoint>),
    /// The balancer's current backends, the DNS name's last answer; each is an endpoint
    /// with the configured URL's authority (the `Host` a Kubernetes backend expects), path
    /// and TLS (the name every pod's certificate must be valid for).
    Dns {
        authority: String,
        path: String,
        tls: Option<EndpointTls>,
    },
}

impl UpstreamGroup {
    fn build(
        at: &str,
        cfg: &UpstreamGroupConfig,
        dns_resolver: Option<SocketAddr>,
    ) -> Result<UpstreamGroup, ConfigError> {
        let tls = Self::load_tls(at, cfg)?;
        let (members, mut balancer) = match cfg.discovery {
            Discovery::Static => Self::resolve_static(at, cfg, tls.as_ref())?,
            Discovery::Dns => Self::discover_by_dns(at, cfg, dns_resolver, tls.as_ref())?,
        };
        let health_check_interval = (cfg.health_check_interval_ms > 0)
            .then(|| Duration::from_millis(cfg.health_check_interval_ms));
        if let Some(every) = health_check_interval {
            balancer.set_health_check(TcpHealthCheck::new());
            balancer.health_check_frequency = Some(every);
        }
        let dns_refresh =
            (cfg.discovery == Discovery::Dns).then(|| Duration::from_millis(cfg.dns_refresh_ms));
        Ok(UpstreamGroup {
            name: cfg.name.clone(),
            era: cfg.era,
            resume: cfg.resume,
            tools: cfg.tools.clone(),
            forward_headers: HeaderPolicy::parse(&cfg.forward_headers)
                .map_err(|p| ConfigError::at(format!("{at}.forward_headers"), p))?,
            public_url: cfg.public_url.as_deref().and_then(PublicResource::parse),
            resource_metadata: cfg.resource_metadata.clone(),
            path: cfg.path.clone(),
            members,
            timeouts: Timeouts {
                connect: Duration::from_millis(cfg.connect_timeout_ms),
                response: Duration::from_millis(cfg.response_timeout_ms),
                stream_idle: (cfg.stream_idle_timeout_ms > 0)
                    .then(|| Duration::from_millis(cfg.stream_idle_timeout_ms)),
            },
            health_check_interval,
            dns_refresh,
            balancer: Arc::new(balancer),
        })
    }

    /// The group's TLS settings, loaded when one of its endpoints is `https://`.
    fn load_tls(at: &str, cfg: &UpstreamGroupConfig) -> Result<Option<Arc<GroupTls>>, ConfigError> {
        let any_https = cfg
            .endpoints
            .iter()
            .any(|url| parse_endpoint_url(url).is_ok_and(|e| e.tls));
        if !any_https {
            return Ok(None);
        }
        GroupTls::load(at, &cfg.name, &cfg.tls).map(Some)
    }

    /// Resolves every endpoint now (blocking DNS, at start).
    fn resolve_static(
        at: &str,
        cfg: &UpstreamGroupConfig,
        tls: Option<&Arc<GroupTls>>,
    ) -> Result<(Members, LoadBalancer<RoundRobin>), ConfigError> {
        let mut endpoints = Vec::with_capacity(cfg.endpoints.len());
        for (j, url) in cfg.endpoints.iter().enumerate() {
            let err = |problem: String| ConfigError {
                path: format!("{at}.endpoints[{j}]"),
                problem,
            };
            let parsed = parse_endpoint_url(url).map_err(err)?;
            let addr = (parsed.host.as_str(), parsed.port)
                .to_socket_addrs()
                .map_err(|e| err(format!("cannot resolve '{}': {e}", parsed.host)))?
                .next()
                .ok_or_else(|| err(format!("'{}' resolves to no address", parsed.host)))?;
            // Sealed tokens and states name their endpoint by address, and the balancer
            // picks by address: two endpoints on one address would be one.
            if let Some(k) = endpoints.iter().position(|e: &Endpoint| e.addr == addr) {
                return Err(err(format!(
                    "has the address {addr} of endpoints[{k}]: a group's endpoints are told apart by address (sessions name theirs by it), so servers on one address (paths or virtual hosts behind one ingress) go in groups of their own"
                )));
            }
            endpoints.push(Endpoint {
                addr,
                tls: endpoint_tls(&parsed, tls),
                peer: false,
                authority: parsed.authority,
                path: parsed.path,
            });
        }
        let balancer = LoadBalancer::<RoundRobin>::try_from_iter(endpoints.iter().map(|e| e.addr))
            .map_err(|e| ConfigError {
                path: format!("{at}.endpoints"),
                problem: e.to_string(),
            })?;
        Ok((Members::Static(endpoints), balancer))
    }

    /// A balancer whose backends are the DNS name's answers, resolved by its background
    /// service from the start on: nothing is looked up here, so an unresolvable name at
    /// start is no error (the group has no endpoint until the name resolves).
    fn discover_by_dns(
        at: &str,
        cfg: &UpstreamGroupConfig,
        dns_resolver: Option<SocketAddr>,
        tls: Option<&Arc<GroupTls>>,
    ) -> Result<(Members, LoadBalancer<RoundRobin>), ConfigError> {
        let url = cfg
            .endpoints
            .first()
            .map(String::as_str)
            .unwrap_or_default();
        let parsed = parse_endpoint_url(url)
            .map_err(|p| ConfigError::at(format!("{at}.endpoints[0]"), p))?;
        let discovery = dns::DnsDiscovery::new(&cfg.name, &parsed.host, parsed.port, dns_resolver)
            .map_err(|p| ConfigError::at(format!("{at}.discovery"), p))?;
        let balancer = dns::balancer(discovery, Duration::from_millis(cfg.dns_refresh_ms));
        let members = Members::Dns {
            tls: endpoint_tls(&parsed, tls),
            authority: parsed.authority,
            path: parsed.path,
        };
        Ok((members, balancer))
    }

    /// The next healthy endpoint for a new session, round-robin.
    pub fn pick(&self) -> Option<Endpoint> {
        let candidates = match &self.members {
            Members::Static(endpoints) => endpoints.len(),
            Members::Dns { .. } => self.balancer.backends().get_backend().len(),
        };
        let backend = self.balancer.select(b"", candidates.max(1) * 2)?;
        let addr = backend.addr.as_inet().copied()?;
        self.endpoint(addr)
    }

    /// The next endpoint `pick` gives that is not among `tried` (after an endpoint that
    /// refused the connection, for a request that therefore ran nowhere).
    pub fn pick_other(&self, tried: &[SocketAddr]) -> Option<Endpoint> {
        let candidates = match &self.members {
            Members::Static(endpoints) => endpoints.len(),
            Members::Dns { .. } => self.balancer.backends().get_backend().len(),
        };
        (0..candidates)
            .filter_map(|_| self.pick())
            .find(|e| !tried.contains(&e.addr))
    }

    /// The endpoint at `addr`, if this group has one: a configured endpoint, or an
    /// address of the DNS name's current answer (an address that left it is unknown).
    pub fn endpoint(&self, addr: SocketAddr) -> Option<Endpoint> {
        match &self.members {
            Members::Static(endpoints) => endpoints.iter().find(|e| e.addr == addr).cloned(),
            Members::Dns {
                authority,
                path,
                tls,
            } => dns::in_answer(&self.balancer, addr).then(|| Endpoint {
                addr,
                authority: authority.clone(),
                path: path.clone(),
                tls: tls.clone(),
                peer: false,
            }),
        }
    }

    /// Whether the balancer must run as a background service: to health-check its
    /// endpoints, or to resolve them.
    pub fn needs_background_service(&self) -> bool {
        self.health_check_interval.is_some() || self.dns_refresh.is_some()
    }

    /// The balancer, to run as a background health-check and discovery service.
    pub fn balancer(&self) -> Arc<LoadBalancer<RoundRobin>> {
        self.balancer.clone()
    }
}

/// TLS to an endpoint whose URL is `https://`: its host is the name its certificate must
/// be valid for.
fn endpoint_tls(parsed: &EndpointUrl, group: Option<&Arc<GroupTls>>) -> Option<EndpointTls> {
    let group = group.filter(|_| parsed.tls)?;
    Some(EndpointTls::new(&parsed.host, group.clone()))
}

/// Every configured group.
pub struct Upstreams {
    pub groups: Vec<UpstreamGroup>,
}

impl Upstreams {
    /// Resolves every static endpoint (blocking DNS: call at start, never on a request
    /// path); `discovery: dns` groups resolve later, in their balancer's background service.
    pub fn build(config: &Config) -> Result<Upstreams, ConfigError> {
        let dns_resolver = match &config.dns_resolver {
            Some(addr) => Some(addr.parse().map_err(|_| {
                ConfigError::at(
                    "dns_resolver",
                    format!("'{addr}' is not an IP:PORT socket address"),
                )
            })?),
            None => None,
        };
        let groups = config
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, g)| UpstreamGroup::build(&format!("upstreams[{i}]"), g, dns_resolver))
            .collect::<Result<_, _>>()?;
        Ok(Upstreams { groups })
    }

    pub fn by_path(&self, path: &str) -> Option<&UpstreamGroup> {
        self.groups.iter().find(|g| g.path == path)
    }

    pub fn by_name(&self, name: &str) -> Option<&UpstreamGroup> {
        self.groups.iter().find(|g| *g.name == *name)
    }

    /// Whether `endpoint` is a member of a group now (a DNS group's answer changes).
    pub fn holds(&self, endpoint: &Endpoint) -> bool {
        self.groups.iter().any(|g| {
            g.endpoint(endpoint.addr)
                .is_some_and(|e| e.authority == endpoint.authority && e.path == endpoint.path)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(endpoints: &[&str]) -> UpstreamGroup {
        let cfg = UpstreamGroupConfig::new("g", endpoints.iter().map(|s| s.to_string()).collect());
        UpstreamGroup::build("upstreams[0]", &cfg, None).unwrap()
    }

    #[test]
    fn picks_rotate_over_endpoints() {
        let g = group(&["http://127.0.0.1:1/a", "http://127.0.0.1:2/b"]);
        let picks: Vec<u16> = (0..4).map(|_| g.pick().unwrap().addr.port()).collect();
        assert_ne!(picks[0], picks[1]);
        assert_eq!(picks[0], picks[2]);
        assert_eq!(
            g.endpoint("127.0.0.1:2".parse().unwrap()).unwrap().path,
            "/b"
        );
        assert!(g.endpoint("127.0.0.1:3".parse().unwrap()).is_none());
    }

    /// An endpoint is held while a group has it at that address, name and path.
    #[test]
    fn upstreams_hold_their_groups_endpoints_only() {
        let upstreams = Upstreams {
            groups: vec![
                group(&["http://127.0.0.1:1/a"]),
                group(&["http://127.0.0.1:2/b"]),
            ],
        };
        let held = group(&["http://127.0.0.1:2/b"]).pick().unwrap();
        assert!(upstreams.holds(&held));
        let elsewhere = Endpoint {
            addr: "127.0.0.1:3".parse().unwrap(),
            ..held.clone()
        };
        let other_path = Endpoint {
            path: "/c".into(),
            ..held
        };
        assert!(!upstreams.holds(&elsewhere) && !upstreams.holds(&other_path));
    }

    #[test]
    fn endpoints_on_one_address_are_refused_naming_both() {
        let urls = ["http://127.0.0.1:1/tenant-x", "http://127.0.0.1:1/tenant-y"];
        let cfg = UpstreamGroupConfig::new("g", urls.iter().map(|s| s.to_string()).collect());
        let e = UpstreamGroup::build("upstreams[0]", &cfg, None)
            .err()
            .expect("refused");
        assert_eq!(e.path, "upstreams[0].endpoints[1]");
        assert!(e.problem.contains("127.0.0.1:1 of endpoints[0]"), "{e}");
        assert!(e.problem.contains("groups of their own"), "{e}");
    }

    #[test]
    fn https_endpoints_are_verified_against_their_urls_host() {
        let g = group(&["https://127.0.0.1:1/a", "http://127.0.0.1:2/b"]);
        let tls = g.endpoint("127.0.0.1:1".parse().unwrap()).unwrap().tls;
        let tls = tls.expect("an https endpoint speaks TLS");
        assert_eq!(
            tls.server_name, "127.0.0.1",
            "an IP address is the name too"
        );
        assert!(tls.verifies());
        let plain = g.endpoint("127.0.0.1:2".parse().unwrap()).unwrap();
        assert!(plain.tls.is_none());
        let mut cfg = UpstreamGroupConfig::new("g", vec!["https://mcp.svc.local:8443/m".into()]);
        cfg.discovery = Discovery::Dns;
        let nowhere = Some("127.0.0.1:9".parse().unwrap());
        let dns = UpstreamGroup::build("upstreams[0]", &cfg, nowhere).unwrap();
        let Members::Dns { tls, authority, .. } = &dns.members else {
            panic!("a DNS group")
        };
        assert_eq!(tls.as_ref().unwrap().server_name, "mcp.svc.local");
        assert_eq!(authority, "mcp.svc.local:8443");
    }

    #[test]
    fn unresolvable_hosts_name_the_endpoint() {
        let cfg = UpstreamGroupConfig::new("g", vec!["http://no-such-host.invalid:1/".into()]);
        let e = UpstreamGroup::build("upstreams[0]", &cfg, None)
            .err()
            .unwrap();
        assert_eq!(e.path, "upstreams[0].endpoints[0]");
    }

    #[test]
    fn a_dns_group_starts_without_resolving_and_without_endpoints() {
        let mut cfg = UpstreamGroupConfig::new("g", vec!["http://no-such-host.invalid:1/m".into()]);
        cfg.discovery = Discovery::Dns;
        cfg.health_check_interval_ms = 0;
        let nowhere = Some("127.0.0.1:9".parse().unwrap());
        let g = UpstreamGroup::build("upstreams[0]", &cfg, nowhere).unwrap();
        assert!(g.needs_background_service());
        assert_eq!(g.dns_refresh, Some(Duration::from_millis(5000)));
        assert!(g.pick().is_none());
        assert!(g.endpoint("127.0.0.1:1".parse().unwrap()).is_none());
        let static_group = group(&["http://127.0.0.1:1/a"]);
        assert_eq!(static_group.dns_refresh, None);
    }
}
