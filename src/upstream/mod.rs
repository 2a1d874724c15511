//! Upstream groups: their endpoints resolved to socket addresses, round-robin selection
//! over healthy endpoints with pingora's load balancer, and the membership check that
//! keeps a sealed endpoint from ever naming an address outside the configuration.

pub mod exchange;
pub mod legacy_session;

use crate::config::{parse_endpoint_url, Config, ConfigError, UpstreamGroupConfig};
use pingora::lb::health_check::TcpHealthCheck;
use pingora::lb::selection::RoundRobin;
use pingora::lb::LoadBalancer;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

/// One upstream MCP endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: SocketAddr,
    /// The `Host` header to send.
    pub authority: String,
    /// The upstream's MCP path.
    pub path: String,
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
    pub path: String,
    pub endpoints: Vec<Endpoint>,
    pub timeouts: Timeouts,
    pub health_check_interval: Option<Duration>,
    balancer: Arc<LoadBalancer<RoundRobin>>,
}

impl UpstreamGroup {
    fn build(at: &str, cfg: &UpstreamGroupConfig) -> Result<UpstreamGroup, ConfigError> {
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
            endpoints.push(Endpoint {
                addr,
                authority: parsed.authority,
                path: parsed.path,
            });
        }
        let mut balancer = LoadBalancer::<RoundRobin>::try_from_iter(
            endpoints.iter().map(|e| e.addr),
        )
        .map_err(|e| ConfigError {
            path: format!("{at}.endpoints"),
            problem: e.to_string(),
        })?;
        let health_check_interval = (cfg.health_check_interval_ms > 0)
            .then(|| Duration::from_millis(cfg.health_check_interval_ms));
        if let Some(every) = health_check_interval {
            balancer.set_health_check(TcpHealthCheck::new());
            balancer.health_check_frequency = Some(every);
        }
        Ok(UpstreamGroup {
            name: cfg.name.clone(),
            era: cfg.era,
            path: cfg.path.clone(),
            endpoints,
            timeouts: Timeouts {
                connect: Duration::from_millis(cfg.connect_timeout_ms),
                response: Duration::from_millis(cfg.response_timeout_ms),
                stream_idle: (cfg.stream_idle_timeout_ms > 0)
                    .then(|| Duration::from_millis(cfg.stream_idle_timeout_ms)),
            },
            health_check_interval,
            balancer: Arc::new(balancer),
        })
    }

    /// The next healthy endpoint for a new session, round-robin.
    pub fn pick(&self) -> Option<Endpoint> {
        let backend = self.balancer.select(b"", self.endpoints.len().max(1) * 2)?;
        let addr = backend.addr.as_inet().copied()?;
        self.endpoint(addr)
    }

    /// The configured endpoint at `addr`, if this group has one.
    pub fn endpoint(&self, addr: SocketAddr) -> Option<Endpoint> {
        self.endpoints.iter().find(|e| e.addr == addr).cloned()
    }

    /// The balancer, to run as a background health-check service.
    pub fn balancer(&self) -> Arc<LoadBalancer<RoundRobin>> {
        self.balancer.clone()
    }
}

/// Every configured group.
pub struct Upstreams {
    pub groups: Vec<UpstreamGroup>,
}

impl Upstreams {
    /// Resolves every endpoint (blocking DNS: call at start, never on a request path).
    pub fn build(config: &Config) -> Result<Upstreams, ConfigError> {
        let groups = config
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, g)| UpstreamGroup::build(&format!("upstreams[{i}]"), g))
            .collect::<Result<_, _>>()?;
        Ok(Upstreams { groups })
    }

    pub fn by_path(&self, path: &str) -> Option<&UpstreamGroup> {
        self.groups.iter().find(|g| g.path == path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(endpoints: &[&str]) -> UpstreamGroup {
        let cfg = UpstreamGroupConfig::new("g", endpoints.iter().map(|s| s.to_string()).collect());
        UpstreamGroup::build("upstreams[0]", &cfg).unwrap()
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

    #[test]
    fn unresolvable_hosts_name_the_endpoint() {
        let cfg = UpstreamGroupConfig::new("g", vec!["http://no-such-host.invalid:1/".into()]);
        let e = UpstreamGroup::build("upstreams[0]", &cfg).err().unwrap();
        assert_eq!(e.path, "upstreams[0].endpoints[0]");
    }
}
