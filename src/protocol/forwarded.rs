//! The forwarding headers an upstream gets: `X-Forwarded-For`, `Forwarded` (RFC 7239),
//! `X-Forwarded-Proto` and `X-Forwarded-Host`. A client's own are believed only from a
//! trusted peer (a proxy in front, `forwarded.trusted_peers`), which then gets its address
//! appended; from any other peer they are dropped and replaced, so a client cannot make
//! an upstream believe it came from elsewhere. Other proxies' claims of the kind
//! (`X-Real-IP`, `X-Original-URL`, `CLAIMS`) are dropped from such a peer too.

use super::scheme::Scheme;
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use std::net::IpAddr;

pub const X_FORWARDED_FOR: &str = "x-forwarded-for";
pub const FORWARDED: &str = "forwarded";
pub const X_FORWARDED_PROTO: &str = "x-forwarded-proto";
pub const X_FORWARDED_HOST: &str = "x-forwarded-host";
/// Every header this module writes; the client's are replaced, never passed on as sent.
pub const NAMES: [&str; 4] = [
    X_FORWARDED_FOR,
    FORWARDED,
    X_FORWARDED_PROTO,
    X_FORWARDED_HOST,
];

/// Other headers by which a proxy in front says where a request came from, how, or what
/// it asked for (nginx's and CDNs' client address, the scheme as Rack, Spring and IIS
/// read it, IIS's rewritten URL): some upstreams believe them, so a client's are passed
/// on only from a trusted peer.
pub const CLAIMS: [&str; 16] = [
    "x-real-ip",
    "true-client-ip",
    "x-client-ip",
    "x-cluster-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-forwarded-server",
    "x-original-url",
    "x-rewrite-url",
    "x-forwarded-ssl",
    "x-forwarded-scheme",
    "x-forwarded-protocol",
    "front-end-https",
    "x-url-scheme",
];

/// Whether a client's header `name` goes on as sent, from a peer that is `trusted` or
/// not: never a forwarding header (the gateway writes its own), a claim of `CLAIMS` only
/// from a trusted peer.
pub fn passes(name: &str, trusted: bool) -> bool {
    !NAMES.contains(&name) && (trusted || !CLAIMS.contains(&name))
}

/// A network in CIDR notation (`10.0.0.0/8`, `fd00::/8`); a bare address is one host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    pub fn parse(text: &str) -> Result<Cidr, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let network: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("'{text}' is not an IP address or CIDR network"))?;
        let bits = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => bits,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= bits)
                .ok_or_else(|| format!("'{text}': the prefix length must be 0 to {bits}"))?,
        };
        Ok(Cidr { network, prefix })
    }

    /// The prefix length: 0 takes in every address of its family.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                same_prefix(&net.octets(), &ip.octets(), self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                same_prefix(&net.octets(), &ip.octets(), self.prefix)
            }
            _ => false,
        }
    }
}

/// Whether the first `prefix` bits of `a` and `b` agree.
fn same_prefix(a: &[u8], b: &[u8], prefix: u8) -> bool {
    let prefix = usize::from(prefix);
    let (whole, rest) = (prefix / 8, prefix % 8);
    if a[..whole] != b[..whole] {
        return false;
    }
    rest == 0 || (a[whole] ^ b[whole]) >> (8 - rest) == 0
}

/// The peers whose forwarding headers are believed; empty, none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedPeers(Vec<Cidr>);

impl TrustedPeers {
    /// Parses a list of networks; `Err` names the index of the bad entry and why.
    pub fn parse(list: &[String]) -> Result<TrustedPeers, (usize, String)> {
        list.iter()
            .enumerate()
            .map(|(i, text)| Cidr::parse(text).map_err(|e| (i, e)))
            .collect::<Result<_, _>>()
            .map(TrustedPeers)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|net| net.contains(ip))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What this hop knows of the request it received.
#[derive(Clone, Copy, Debug)]
pub struct Hop<'a> {
    /// The address the request came from.
    pub peer: IpAddr,
    /// Whether the peer's own forwarding headers are believed.
    pub trusted: bool,
    /// The `Host` the request named.
    pub host: Option<&'a str>,
    /// The scheme it arrived over.
    pub proto: Scheme,
}

/// The forwarding headers for the next hop, to set in place of any `client` sent: from a
/// trusted peer its chain is kept and the peer appended, from any other the chain starts
/// at the peer.
pub fn forwarding_headers(client: &HeaderMap, hop: &Hop) -> Vec<(HeaderName, HeaderValue)> {
    let peer = hop.peer.to_canonical();
    let believed = |name: &str| hop.trusted.then(|| joined(client, name)).flatten();
    let chain = |prior: Option<String>, this: String| match prior {
        Some(prior) => format!("{prior}, {this}"),
        None => this,
    };
    let address = peer.to_string();
    let mut element = String::with_capacity(64);
    element.push_str("for=");
    push_node(&mut element, peer, &address);
    if let Some(host) = hop.host {
        element.push_str(";host=");
        push_quoted(&mut element, host);
    }
    element.push_str(";proto=");
    element.push_str(hop.proto.as_str());
    let mut out = vec![
        (
            names::X_FORWARDED_FOR,
            chain(believed(X_FORWARDED_FOR), address),
        ),
        (names::FORWARDED, chain(believed(FORWARDED), element)),
        (
            names::X_FORWARDED_PROTO,
            believed(X_FORWARDED_PROTO).unwrap_or_else(|| hop.proto.as_str().to_string()),
        ),
    ];
    if let Some(host) = believed(X_FORWARDED_HOST).or(hop.host.map(str::to_string)) {
        out.push((names::X_FORWARDED_HOST, host));
    }
    out.into_iter()
        .filter_map(|(name, value)| Some((name, HeaderValue::from_str(&value).ok()?)))
        .collect()
}

/// `NAMES` as header names, built at compile time.
mod names {
    use http::header::HeaderName;
    pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static(super::X_FORWARDED_FOR);
    pub const FORWARDED: HeaderName = HeaderName::from_static(super::FORWARDED);
    pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static(super::X_FORWARDED_PROTO);
    pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static(super::X_FORWARDED_HOST);
}

/// Every value of `name`, joined as one list; `None` when absent, empty or not text.
fn joined(headers: &HeaderMap, name: &str) -> Option<String> {
    let values: Option<Vec<&str>> = headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().ok().map(str::trim))
        .collect();
    let values: Vec<&str> = values?.into_iter().filter(|v| !v.is_empty()).collect();
    (!values.is_empty()).then(|| values.join(", "))
}

/// Appends an RFC 7239 node, `ip` written as `address`: an IPv4 address as it is, an
/// IPv6 one bracketed and quoted.
fn push_node(out: &mut String, ip: IpAddr, address: &str) {
    match ip {
        IpAddr::V4(_) => out.push_str(address),
        IpAddr::V6(_) => {
            out.push_str("\"[");
            out.push_str(address);
            out.push_str("]\"");
        }
    }
}

/// Appends `text` as an RFC 7230 quoted-string.
fn push_quoted(out: &mut String, text: &str) {
    out.reserve(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn render(headers: Vec<(HeaderName, HeaderValue)>) -> Vec<(String, String)> {
        headers
            .into_iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
            .collect()
    }

    fn hop(peer: &str, trusted: bool) -> Hop<'static> {
        Hop {
            peer: peer.parse().unwrap(),
            trusted,
            host: Some("mcp.example.com"),
            proto: Scheme::Http,
        }
    }

    const SPOOFED: &[(&str, &str)] = &[
        ("x-forwarded-for", "6.6.6.6"),
        ("x-forwarded-for", "7.7.7.7"),
        ("forwarded", "for=6.6.6.6;proto=https"),
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "evil.example"),
    ];

    #[test]
    fn an_untrusted_peers_chain_is_replaced() {
        let out = render(forwarding_headers(
            &client(SPOOFED),
            &hop("192.0.2.7", false),
        ));
        assert_eq!(
            out,
            [
                ("x-forwarded-for".into(), "192.0.2.7".into()),
                (
                    "forwarded".into(),
                    "for=192.0.2.7;host=\"mcp.example.com\";proto=http".into()
                ),
                ("x-forwarded-proto".into(), "http".into()),
                ("x-forwarded-host".into(), "mcp.example.com".into()),
            ]
        );
    }

    #[test]
    fn a_request_that_arrived_over_tls_says_https() {
        let mut over_tls = hop("192.0.2.7", false);
        over_tls.proto = Scheme::Https;
        let out = render(forwarding_headers(&client(SPOOFED), &over_tls));
        assert_eq!(
            out[1].1,
            "for=192.0.2.7;host=\"mcp.example.com\";proto=https"
        );
        assert_eq!(out[2], ("x-forwarded-proto".into(), "https".into()));
    }

    #[test]
    fn a_trusted_peers_chain_is_kept_and_the_peer_appended() {
        let out = render(forwarding_headers(&client(SPOOFED), &hop("10.1.2.3", true)));
        assert_eq!(out[0].1, "6.6.6.6, 7.7.7.7, 10.1.2.3");
        assert_eq!(
            out[1].1,
            "for=6.6.6.6;proto=https, for=10.1.2.3;host=\"mcp.example.com\";proto=http"
        );
        assert_eq!(
            (out[2].1.as_str(), out[3].1.as_str()),
            ("https", "evil.example")
        );
        let bare = render(forwarding_headers(
            &HeaderMap::new(),
            &hop("10.1.2.3", true),
        ));
        assert_eq!(bare[0].1, "10.1.2.3");
    }

    #[test]
    fn ipv6_nodes_are_bracketed_and_quoted_and_hosts_escaped() {
        let mut h = hop("2001:db8::17", false);
        h.host = Some("a\"b");
        let out = render(forwarding_headers(&HeaderMap::new(), &h));
        assert_eq!(out[0].1, "2001:db8::17");
        assert_eq!(
            out[1].1,
            "for=\"[2001:db8::17]\";host=\"a\\\"b\";proto=http"
        );
        let mapped = render(forwarding_headers(
            &HeaderMap::new(),
            &hop("::ffff:10.0.0.1", false),
        ));
        assert_eq!(mapped[0].1, "10.0.0.1");
    }

    #[test]
    fn networks_parse_and_match() {
        let peers =
            TrustedPeers::parse(&["10.0.0.0/8".into(), "fd00::/8".into(), "192.0.2.1".into()])
                .unwrap();
        for inside in ["10.255.0.1", "fd12::1", "192.0.2.1", "::ffff:10.0.0.1"] {
            assert!(peers.contains(inside.parse().unwrap()), "{inside}");
        }
        for outside in ["11.0.0.1", "fe80::1", "192.0.2.2", "127.0.0.1"] {
            assert!(!peers.contains(outside.parse().unwrap()), "{outside}");
        }
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/12")
            .unwrap()
            .contains("10.15.0.1".parse().unwrap()));
        assert!(!Cidr::parse("10.0.0.0/12")
            .unwrap()
            .contains("10.16.0.1".parse().unwrap()));
        let bad = TrustedPeers::parse(&["10.0.0.0/8".into(), "10.0.0.0/33".into()]);
        assert_eq!(bad.unwrap_err().0, 1);
        assert!(Cidr::parse("example.com").is_err());
        assert!(TrustedPeers::default().is_empty());
    }
}
