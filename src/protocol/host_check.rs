//! DNS-rebinding protection: which `Host` and `Origin` values the MCP listener accepts.
//!
//! The gateway rewrites `Host` for its upstreams, so an upstream's own protection never
//! sees what the client sent: the gateway must check it. A listener on a loopback address
//! accepts only loopback names by default (`localhost`, `127.0.0.1`, `[::1]`), so a web
//! page whose DNS name resolves to 127.0.0.1 cannot drive a local gateway. Other listeners
//! accept any host unless `allowed_hosts` lists the names to accept.

use std::net::{Ipv6Addr, SocketAddr};

const LOOPBACK_NAMES: &[&str] = &["localhost", "127.0.0.1", "::1"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostPolicy {
    Any,
    /// Lower-case host names (no port, no brackets).
    Only(Vec<String>),
}

impl HostPolicy {
    pub fn for_listener(listen: SocketAddr, allowed_hosts: &[String]) -> HostPolicy {
        if !allowed_hosts.is_empty() {
            return HostPolicy::Only(
                allowed_hosts
                    .iter()
                    .filter_map(|h| allowed_host(h).ok())
                    .collect(),
            );
        }
        if listen.ip().is_loopback() {
            return HostPolicy::Only(LOOPBACK_NAMES.iter().map(|h| h.to_string()).collect());
        }
        HostPolicy::Any
    }

    /// Checks the request's `Host` and, when present, `Origin`. The error names the value.
    pub fn check(&self, host: Option<&str>, origin: Option<&str>) -> Result<(), String> {
        let HostPolicy::Only(allowed) = self else {
            return Ok(());
        };
        let allowed_name = |name: Option<&str>| {
            name.map(canonical)
                .is_some_and(|n| allowed.iter().any(|a| a.eq_ignore_ascii_case(&n)))
        };
        if !allowed_name(host.and_then(authority_host)) {
            return Err(format!("Host '{}' is not allowed", host.unwrap_or("")));
        }
        if let Some(origin) = origin {
            let origin_host = origin
                .split_once("://")
                .and_then(|(_, rest)| authority_host(rest));
            // `null` (sandboxed frames, `file://` pages, cross-origin redirects) names
            // no allowed host: refused like any foreign origin.
            if !allowed_name(origin_host) {
                return Err(format!("Origin '{origin}' is not allowed"));
            }
        }
        Ok(())
    }
}

/// An `allowed_hosts` entry as the policy holds it (lower case, an IPv6 address without
/// brackets), or why it could never match a `Host`: a port (any port is accepted),
/// a scheme or path (a URL), an empty name.
pub fn allowed_host(entry: &str) -> Result<String, String> {
    let unbracketed = entry.strip_prefix('[').and_then(|e| e.strip_suffix(']'));
    if let Some(v6) = unbracketed
        .or(Some(entry))
        .and_then(|e| e.parse::<Ipv6Addr>().ok())
    {
        return Ok(v6.to_string());
    }
    let name_char = |c: char| c.is_ascii_alphanumeric() || "-._".contains(c);
    let problem = if entry.trim_end_matches('.').is_empty() {
        "is empty"
    } else if entry.contains("://") || entry.contains('/') {
        "is a URL: give the host name alone"
    } else if entry.contains('[') || entry.contains(']') {
        "has brackets, which hold only an IPv6 address"
    } else if entry.contains(':') {
        "has a port: give the host name alone (any port is accepted)"
    } else if entry.contains('*') {
        "has a wildcard, which is not matched: list each name"
    } else if entry.contains(',') || entry.contains(' ') {
        "holds several names: give one per entry"
    } else if !entry.is_ascii() {
        "is not ASCII: give an internationalized name in its xn-- form"
    } else if !entry.chars().all(name_char) {
        "is not a host name"
    } else {
        // A fully qualified name's trailing dot names the same host.
        return Ok(entry.trim_end_matches('.').to_ascii_lowercase());
    };
    Err(format!("'{entry}' {problem}"))
}

/// A host name as the policy compares it: an IPv6 address in its canonical form, a name
/// without a trailing dot.
fn canonical(name: &str) -> std::borrow::Cow<'_, str> {
    match name.parse::<Ipv6Addr>() {
        Ok(v6) => v6.to_string().into(),
        Err(_) => name.trim_end_matches('.').into(),
    }
}

/// Why a request's `Host` is malformed, if it is (RFC 9112 §3.2: answered 400, whatever
/// the policy): missing from an HTTP/1.1 request (`host` is `None` also for a value that
/// is not visible ASCII), holding a character no `uri-host[:port]` has (a space, a
/// comma-separated list's `, `, userinfo's `@`), or a port that is not one.
pub fn malformed_host(host: Option<&str>, http11: bool) -> Option<String> {
    let Some(host) = host else {
        return http11.then(|| "an HTTP/1.1 request needs one readable Host header".into());
    };
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._~%!$&'()*+,;=:[]".contains(c);
    if let Some(c) = host.chars().find(|c| !allowed(*c)) {
        return Some(format!(
            "the Host header holds {c:?}, which no host name has"
        ));
    }
    let after_host = match host.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map(|(_, rest)| rest),
        None => Some(host.find(':').map_or("", |at| &host[at..])),
    };
    let Some(after_host) = after_host else {
        return Some("the Host header's IPv6 address has no closing ']'".into());
    };
    let port = after_host.strip_prefix(':').unwrap_or(after_host);
    let is_port = after_host.is_empty()
        || (after_host.starts_with(':')
            && port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u32>().map_or(port.is_empty(), |n| n <= 65535));
    (!is_port).then(|| format!("the Host header's port {after_host:?} is not a port number"))
}

/// The host name of an authority `host[:port]` or `[v6][:port]`, with any path cut off.
fn authority_host(authority: &str) -> Option<&str> {
    let authority = authority.split('/').next()?;
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split_once(']').map(|(h, _)| h);
    }
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_hosts_are_names_alone() {
        assert_eq!(allowed_host("MCP.example.com").unwrap(), "mcp.example.com");
        assert_eq!(allowed_host("[::1]").unwrap(), "::1");
        assert_eq!(allowed_host("::1").unwrap(), "::1");
        for (entry, problem) in [
            ("127.0.0.1:8080", "has a port"),
            ("https://mcp.example.com", "is a URL"),
            ("mcp.example.com/mcp", "is a URL"),
            ("", "is empty"),
            (".", "is empty"),
            ("a b", "holds several names"),
            ("a.example,b.example", "holds several names"),
            ("[10.1.2.3]", "has brackets"),
            ("[example.org]", "has brackets"),
            ("*.example.com", "has a wildcard"),
            ("exa$mple.com", "is not a host name"),
            ("bücher.example", "xn-- form"),
        ] {
            let refused = allowed_host(entry).unwrap_err();
            assert!(refused.contains(problem), "{refused}");
        }
        assert_eq!(allowed_host("0:0:0:0:0:0:0:1").unwrap(), "::1");
        assert_eq!(allowed_host("example.org.").unwrap(), "example.org");
        let listen = "0.0.0.0:8080".parse().unwrap();
        let dotted = HostPolicy::for_listener(listen, &["example.org.".into()]);
        for host in ["example.org", "example.org.:8080"] {
            assert!(dotted.check(Some(host), None).is_ok(), "{host}");
        }
        for listed in ["[::1]", "0:0:0:0:0:0:0:1"] {
            let listen = "0.0.0.0:8080".parse().unwrap();
            let policy = HostPolicy::for_listener(listen, &[listed.into()]);
            for host in ["[::1]:8080", "[0:0:0:0:0:0:0:1]", "[::0001]"] {
                assert!(policy.check(Some(host), None).is_ok(), "{listed} {host}");
            }
        }
    }

    #[test]
    fn a_missing_or_malformed_host_is_told_apart_from_a_foreign_one() {
        assert!(malformed_host(None, true).is_some());
        assert!(
            malformed_host(None, false).is_none(),
            "HTTP/1.0 may omit it"
        );
        for bad in [
            "127.0.0.1, evil.example",
            "127.0.0.1 evil.example",
            "u@127.0.0.1",
            "localhost:abc",
            "localhost:99999",
            "localhost:80:80",
            "[::1",
            "[::1]x",
            "localhost:184467440737095516160",
        ] {
            assert!(malformed_host(Some(bad), true).is_some(), "{bad}");
        }
        for good in [
            "127.0.0.1:8080",
            "[::1]:80",
            "[::1]",
            "evil.example",
            "",
            "h:",
            "h:65535",
        ] {
            assert!(malformed_host(Some(good), true).is_none(), "{good}");
        }
    }

    fn loopback() -> HostPolicy {
        HostPolicy::for_listener("127.0.0.1:8080".parse().unwrap(), &[])
    }

    #[test]
    fn loopback_listeners_accept_only_loopback_names() {
        let p = loopback();
        for host in [
            "localhost:8080",
            "127.0.0.1:8080",
            "[::1]:8080",
            "LOCALHOST",
            "127.0.0.1",
        ] {
            assert!(p.check(Some(host), None).is_ok(), "{host}");
        }
        assert!(p
            .check(Some("evil.example.com"), None)
            .unwrap_err()
            .contains("evil.example.com"));
        assert!(p.check(None, None).is_err());
        assert!(p
            .check(Some("localhost:1"), Some("http://evil.example.com"))
            .is_err());
        assert!(p
            .check(Some("localhost:1"), Some("http://localhost:3000"))
            .is_ok());
        assert!(p
            .check(Some("localhost:1"), Some("http://[::1]:3000"))
            .is_ok());
        for foreign in ["null", "NULL", "file://", "file:///home/x.html"] {
            let refused = p.check(Some("localhost:1"), Some(foreign));
            assert!(refused.unwrap_err().contains(foreign), "{foreign}");
        }
    }

    #[test]
    fn other_listeners_accept_any_host_unless_configured() {
        let any = HostPolicy::for_listener("0.0.0.0:8080".parse().unwrap(), &[]);
        assert!(any
            .check(Some("mcp.example.com"), Some("https://app.example.com"))
            .is_ok());
        let only =
            HostPolicy::for_listener("0.0.0.0:8080".parse().unwrap(), &["MCP.example.com".into()]);
        assert!(only.check(Some("mcp.example.com:443"), None).is_ok());
        assert!(only.check(Some("other.example.com"), None).is_err());
    }
}
