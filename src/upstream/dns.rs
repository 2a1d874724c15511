//! DNS discovery for an upstream group whose endpoint names a Kubernetes headless Service
//! (or any name with several A/AAAA records): pingora's load balancer asks `DnsDiscovery`
//! for the current set every `dns_refresh_ms`, and the name is resolved asynchronously
//! with hickory, on the balancer's background task, never on a request path.
//!
//! An answer replaces the set, and an answer without addresses empties it (the pods are
//! gone). A failed lookup (timeout, SERVFAIL, refused) is an error, so the balancer keeps
//! the set it had: a resolver hiccup does not take the group down.

use async_trait::async_trait;
use hickory_resolver::config::{NameServerConfigGroup, ResolveHosts, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::ProtoErrorKind;
use hickory_resolver::{ResolveError, TokioResolver};
use pingora::lb::discovery::ServiceDiscovery;
use pingora::lb::selection::RoundRobin;
use pingora::lb::{Backend, Backends, LoadBalancer};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

/// The addresses of one DNS name, each with the endpoint URL's port.
pub struct DnsDiscovery {
    /// The group, for logs.
    group: String,
    name: String,
    port: u16,
    resolver: TokioResolver,
    /// The last answer, to log changes once rather than every refresh.
    last: Mutex<Option<BTreeSet<SocketAddr>>>,
}

/// Why a lookup gave no answer (the set in use is kept).
#[derive(Debug)]
pub struct LookupFailed(String);

impl std::fmt::Display for LookupFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl DnsDiscovery {
    /// Resolves `name` with the DNS server at `nameserver` (UDP, TCP for truncated
    /// answers), or with the system resolver (`/etc/resolv.conf`, its search domains and
    /// `/etc/hosts`). Reads those files now, at start; looks nothing up.
    pub fn new(
        group: &str,
        name: &str,
        port: u16,
        nameserver: Option<SocketAddr>,
    ) -> Result<DnsDiscovery, String> {
        let provider = TokioConnectionProvider::default();
        let builder = match nameserver {
            Some(server) => {
                let servers =
                    NameServerConfigGroup::from_ips_clear(&[server.ip()], server.port(), true);
                let config = ResolverConfig::from_parts(None, Vec::new(), servers);
                let mut builder = TokioResolver::builder_with_config(config, provider);
                // The configured server is the only source: /etc/hosts is not read.
                builder.options_mut().use_hosts_file = ResolveHosts::Never;
                builder
            }
            None => TokioResolver::builder(provider).map_err(|e| {
                format!("cannot read the system resolver configuration ({e}); set dns_resolver")
            })?,
        };
        Ok(DnsDiscovery {
            group: group.to_string(),
            name: name.to_string(),
            port,
            resolver: builder.build(),
            last: Mutex::new(None),
        })
    }

    /// The name's current A and AAAA addresses, with the port. Empty when the name has no
    /// address (NXDOMAIN, or no records). A family whose lookup failed keeps its last
    /// addresses (a resolver that fails AAAA queries and answers A ones, as some
    /// firewalls and DNS64 setups do, must not freeze the set); an error when both failed.
    pub async fn resolve(&self) -> Result<BTreeSet<SocketAddr>, LookupFailed> {
        // Every refresh asks the DNS server, so an answer is never older than one refresh.
        self.resolver.clear_cache();
        let (v4, v6) = tokio::join!(
            self.resolver.ipv4_lookup(self.name.as_str()),
            self.resolver.ipv6_lookup(self.name.as_str())
        );
        let mut addrs = BTreeSet::new();
        let v4 = v4.map(|found| found.iter().map(|a| IpAddr::V4(a.0)).collect::<Vec<_>>());
        let v6 = v6.map(|found| found.iter().map(|a| IpAddr::V6(a.0)).collect::<Vec<_>>());
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut failed = Vec::new();
        for (family, answer, v4) in [("A", v4, true), ("AAAA", v6, false)] {
            match answer {
                Ok(ips) => addrs.extend(ips.into_iter().map(|ip| SocketAddr::new(ip, self.port))),
                Err(e) if has_no_address(&e) => {}
                Err(e) => {
                    let kept = last.iter().flatten().filter(|a| a.is_ipv4() == v4);
                    addrs.extend(kept);
                    failed.push(format!("{family} lookup of '{}' failed: {e}", self.name));
                }
            }
        }
        match failed.len() {
            2 => Err(LookupFailed(failed.join("; "))),
            1 => {
                tracing::debug!(group = %self.group, error = %failed[0], "DNS lookup of one family failed; its last addresses kept");
                Ok(addrs)
            }
            _ => Ok(addrs),
        }
    }

    /// Logs a changed answer once.
    fn note(&self, addrs: &BTreeSet<SocketAddr>) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_ref() == Some(addrs) {
            return;
        }
        if addrs.is_empty() {
            tracing::warn!(group = %self.group, name = %self.name, "DNS name has no address; the group has no endpoint until it has");
        } else {
            let list: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
            tracing::info!(group = %self.group, name = %self.name, endpoints = %list.join(", "), "DNS answer changed");
        }
        *last = Some(addrs.clone());
    }
}

/// An authoritative "no address": the name does not exist, or has no record of the type.
/// SERVFAIL, REFUSED and the like also come back as "no records", but say nothing about
/// the name, so they are failures.
fn has_no_address(e: &ResolveError) -> bool {
    e.proto().is_some_and(|proto| {
        matches!(
            proto.kind(),
            ProtoErrorKind::NoRecordsFound {
                response_code: ResponseCode::NoError | ResponseCode::NXDomain,
                ..
            }
        )
    })
}

#[async_trait]
impl ServiceDiscovery for DnsDiscovery {
    async fn discover(&self) -> pingora::Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        match self.resolve().await {
            Ok(addrs) => {
                self.note(&addrs);
                let backends = addrs.iter().map(|addr| backend(*addr)).collect();
                Ok((backends, HashMap::new()))
            }
            Err(e) => {
                tracing::warn!(group = %self.group, error = %e, "DNS lookup failed; the group keeps its last known endpoints");
                Err(pingora::Error::explain(
                    pingora::ErrorType::Custom("DNS lookup failed"),
                    e.0,
                ))
            }
        }
    }
}

/// A balancer whose backends are `discovery`'s answers, resolved by the balancer's
/// background service every `refresh` (nothing is looked up here).
pub fn balancer(discovery: DnsDiscovery, refresh: Duration) -> LoadBalancer<RoundRobin> {
    let mut balancer = LoadBalancer::from_backends(Backends::new(Box::new(discovery)));
    balancer.update_frequency = Some(refresh);
    balancer
}

/// Whether `addr` is in the balancer's current backends, the name's last answer.
pub fn in_answer(balancer: &LoadBalancer<RoundRobin>, addr: SocketAddr) -> bool {
    balancer.backends().get_backend().contains(&backend(addr))
}

/// A discovered address as the balancer's backend.
pub fn backend(addr: SocketAddr) -> Backend {
    Backend {
        addr: pingora::protocols::l4::socket::SocketAddr::Inet(addr),
        weight: 1,
        ext: Default::default(),
    }
}
