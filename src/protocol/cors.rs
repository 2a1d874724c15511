//! Cross-origin access for browser clients: which web origins may read the gateway's
//! answers (`cors_allowed_origins`), and the headers that tell a browser so.
//!
//! With no origins configured the gateway keeps out of CORS: a preflight is relayed to
//! the upstream like any legacy request, and the upstream's own `Access-Control-*`
//! headers reach the client unchanged (what a reverse proxy does). With origins
//! configured the gateway owns the policy: it answers preflights itself (before any
//! credential is checked: a browser sends none on a preflight), grants each response to
//! an allowed origin, including its own bridged answers and its errors, and drops the
//! upstream's `Access-Control-*` headers so a browser never sees two answers. A listed
//! origin also passes the listener's `Origin` check ([`super::host_check`]).
//!
//! No credentials mode is granted (`Access-Control-Allow-Credentials`): MCP clients send
//! credentials in `Authorization`, which a preflight lets through by name.

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// The response headers a browser client must be able to read: the session id, the
/// negotiated version, and the challenge that starts OAuth discovery.
const EXPOSED: &str = "Mcp-Session-Id, Mcp-Protocol-Version, WWW-Authenticate";
const METHODS: &str = "GET, POST, DELETE";
/// How long a browser may cache a preflight (Chromium caps it at 7200 s).
const MAX_AGE_SECONDS: &str = "600";
/// Longest `Access-Control-Request-Headers` echoed back.
const MAX_REQUESTED_HEADERS: usize = 4096;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CorsPolicy {
    /// No policy: CORS is the upstream's business.
    #[default]
    Upstream,
    /// Every origin (`*`).
    AnyOrigin,
    /// Serialized origins (`scheme://host[:port]`), lower-case.
    Origins(Vec<String>),
}

/// A request's allowed origin: what its response's CORS headers name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorsGrant {
    origin: HeaderValue,
}

impl CorsPolicy {
    /// The policy of `cors_allowed_origins`; the error names the entry that is not an
    /// origin.
    pub fn parse(origins: &[String]) -> Result<CorsPolicy, (usize, String)> {
        if origins.is_empty() {
            return Ok(CorsPolicy::Upstream);
        }
        if origins.iter().any(|o| o == "*") {
            return Ok(CorsPolicy::AnyOrigin);
        }
        let mut parsed = Vec::with_capacity(origins.len());
        for (i, origin) in origins.iter().enumerate() {
            parsed.push(serialized_origin(origin).ok_or_else(|| {
                let problem = format!(
                    "'{origin}' is not an origin: write scheme://host[:port] with no path, or *"
                );
                (i, problem)
            })?);
        }
        Ok(CorsPolicy::Origins(parsed))
    }

    /// Whether the gateway answers preflights and writes CORS headers itself.
    pub fn is_gateways(&self) -> bool {
        *self != CorsPolicy::Upstream
    }

    /// The grant for a request's `Origin`, when the policy allows it. `*` grants any
    /// origin with a host, never an opaque one (`null`: sandboxed frames, `file://`
    /// pages), which no list can name either.
    pub fn grant(&self, origin: Option<&HeaderValue>) -> Option<CorsGrant> {
        let origin = origin?;
        let allowed = match self {
            CorsPolicy::Upstream => false,
            CorsPolicy::AnyOrigin => origin
                .to_str()
                .is_ok_and(|o| serialized_origin(o).is_some()),
            CorsPolicy::Origins(list) => origin
                .to_str()
                .is_ok_and(|o| list.iter().any(|a| a.eq_ignore_ascii_case(o))),
        };
        allowed.then(|| CorsGrant {
            origin: origin.clone(),
        })
    }
}

impl CorsGrant {
    /// The headers every response to the granted request carries.
    pub fn response_headers(&self) -> [(HeaderName, HeaderValue); 3] {
        [
            (
                http::header::ACCESS_CONTROL_ALLOW_ORIGIN,
                self.origin.clone(),
            ),
            (
                http::header::ACCESS_CONTROL_EXPOSE_HEADERS,
                HeaderValue::from_static(EXPOSED),
            ),
            (http::header::VARY, HeaderValue::from_static("Origin")),
        ]
    }

    /// The headers answering a preflight `request`: the methods an MCP endpoint serves,
    /// the request headers it asked for (any: a listed origin is trusted to send what
    /// its client needs, `Authorization` included), and private-network access when a
    /// browser asks for it (a public page reaching a gateway on a private address).
    pub fn preflight_headers(&self, request: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
        let mut out = vec![
            (
                http::header::ACCESS_CONTROL_ALLOW_ORIGIN,
                self.origin.clone(),
            ),
            (
                http::header::ACCESS_CONTROL_ALLOW_METHODS,
                HeaderValue::from_static(METHODS),
            ),
            (
                http::header::ACCESS_CONTROL_MAX_AGE,
                HeaderValue::from_static(MAX_AGE_SECONDS),
            ),
            (
                http::header::VARY,
                HeaderValue::from_static(
                    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
                ),
            ),
        ];
        if let Some(asked) = request
            .get(http::header::ACCESS_CONTROL_REQUEST_HEADERS)
            .filter(|v| is_header_name_list(v))
        {
            out.push((http::header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone()));
        }
        let private_network = request
            .get("access-control-request-private-network")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        if private_network {
            out.push((
                HeaderName::from_static("access-control-allow-private-network"),
                HeaderValue::from_static("true"),
            ));
        }
        out
    }
}

/// Whether a response header is one of CORS's (`Access-Control-*`).
pub fn is_cors_header(name: &HeaderName) -> bool {
    name.as_str().starts_with("access-control-")
}

/// `scheme://host[:port]`, lower-cased, when `text` is an origin and nothing more.
fn serialized_origin(text: &str) -> Option<String> {
    let text = text.strip_suffix('/').unwrap_or(text);
    let (scheme, authority) = text.split_once("://")?;
    let scheme_ok = !scheme.is_empty()
        && scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b));
    let authority_ok = !authority.is_empty()
        && !authority.contains(['/', '?', '#', '@'])
        && authority.parse::<http::uri::Authority>().is_ok();
    (scheme_ok && authority_ok).then(|| text.to_ascii_lowercase())
}

/// A comma-separated list of header names (what a browser sends), bounded.
fn is_header_name_list(value: &HeaderValue) -> bool {
    let Ok(text) = value.to_str() else {
        return false;
    };
    text.len() <= MAX_REQUESTED_HEADERS
        && text
            .split(',')
            .map(str::trim)
            .all(|name| !name.is_empty() && HeaderName::from_bytes(name.as_bytes()).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &'static str) -> HeaderValue {
        HeaderValue::from_static(text)
    }

    fn listed() -> CorsPolicy {
        CorsPolicy::parse(&[
            "https://App.example.com".into(),
            "http://localhost:6274/".into(),
        ])
        .unwrap()
    }

    #[test]
    fn listed_origins_are_granted_and_others_are_not() {
        let policy = listed();
        assert!(policy.is_gateways());
        for granted in ["https://app.example.com", "HTTP://LOCALHOST:6274"] {
            assert!(policy.grant(Some(&value(granted))).is_some(), "{granted}");
        }
        for refused in [
            "https://app.example.com:8443",
            "http://app.example.com",
            "https://evil.example.com",
            "null",
        ] {
            assert!(policy.grant(Some(&value(refused))).is_none(), "{refused}");
        }
        assert!(policy.grant(None).is_none());
    }

    #[test]
    fn without_origins_the_upstream_keeps_cors() {
        let policy = CorsPolicy::parse(&[]).unwrap();
        assert!(!policy.is_gateways());
        assert!(policy.grant(Some(&value("https://a.example"))).is_none());
    }

    #[test]
    fn a_star_grants_the_origin_it_was_asked_by() {
        let policy = CorsPolicy::parse(&["*".into()]).unwrap();
        let grant = policy.grant(Some(&value("https://any.example"))).unwrap();
        let headers = grant.response_headers();
        assert_eq!(headers[0].1, "https://any.example");
        assert_eq!(headers[2].1, "Origin");
        for opaque in ["null", "NULL", "file://", "file:///home/x.html"] {
            assert!(policy.grant(Some(&value(opaque))).is_none(), "{opaque}");
        }
    }

    #[test]
    fn entries_that_are_not_origins_are_refused_by_index() {
        for bad in [
            "app.example.com",
            "https://app.example.com/mcp",
            "https://user@app.example.com",
            "https://",
            "https://app.example.com?x=1",
        ] {
            let err = CorsPolicy::parse(&["https://ok.example".into(), bad.into()]).unwrap_err();
            assert_eq!(err.0, 1, "{bad}");
            assert!(err.1.contains(bad), "{bad}: {}", err.1);
        }
    }

    #[test]
    fn a_preflight_echoes_well_formed_requested_headers_only() {
        let grant = listed()
            .grant(Some(&value("https://app.example.com")))
            .unwrap();
        let mut request = HeaderMap::new();
        request.insert(
            http::header::ACCESS_CONTROL_REQUEST_HEADERS,
            value("content-type, mcp-protocol-version,authorization"),
        );
        request.insert("access-control-request-private-network", value("true"));
        let out: HeaderMap = grant.preflight_headers(&request).into_iter().collect();
        assert_eq!(
            out[http::header::ACCESS_CONTROL_ALLOW_HEADERS],
            "content-type, mcp-protocol-version,authorization"
        );
        assert_eq!(out[http::header::ACCESS_CONTROL_ALLOW_METHODS], METHODS);
        assert_eq!(out["access-control-allow-private-network"], "true");
        request.insert(
            http::header::ACCESS_CONTROL_REQUEST_HEADERS,
            value("content-type, bad name"),
        );
        request.remove("access-control-request-private-network");
        let out: HeaderMap = grant.preflight_headers(&request).into_iter().collect();
        assert!(!out.contains_key(http::header::ACCESS_CONTROL_ALLOW_HEADERS));
        assert!(!out.contains_key("access-control-allow-private-network"));
    }

    #[test]
    fn cors_headers_are_told_apart() {
        assert!(is_cors_header(&http::header::ACCESS_CONTROL_ALLOW_ORIGIN));
        assert!(is_cors_header(&HeaderName::from_static(
            "access-control-allow-private-network"
        )));
        assert!(!is_cors_header(&http::header::VARY));
    }
}
