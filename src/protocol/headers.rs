//! Which HTTP headers cross the gateway. Hop-by-hop headers (RFC 9110 §7.6.1) and any
//! header a `Connection` header nominates stay on their own hop; framing and the session
//! header are rewritten by the gateway itself.

use http::header::HeaderName;
use http::HeaderMap;

pub const MCP_SESSION_ID: &str = "mcp-session-id";

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Headers the gateway sets or answers itself on either side. `Expect` is answered to
/// the client (the gateway reads a body whole before sending it on at once), so an
/// upstream never sees it and never answers it with an interim 100.
const REWRITTEN: &[&str] = &["host", "content-length", "expect", MCP_SESSION_ID];

/// The headers of `headers` that may be copied to the next hop, in order.
pub fn forwardable(headers: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &http::HeaderValue)> {
    let nominated: Vec<String> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    headers.iter().filter(move |(name, _)| {
        let n = name.as_str();
        !HOP_BY_HOP.contains(&n) && !REWRITTEN.contains(&n) && !nominated.iter().any(|t| t == n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_nominated_and_rewritten_headers_stay_behind() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, X-Secret-Hop"),
            ("x-secret-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("host", "gw"),
            ("content-length", "3"),
            ("mcp-session-id", "token"),
            ("expect", "100-continue"),
            ("authorization", "Bearer t"),
            ("accept", "application/json, text/event-stream"),
            ("last-event-id", "e1"),
        ] {
            h.append(HeaderName::from_static(k), v.parse().unwrap());
        }
        let kept: Vec<&str> = forwardable(&h).map(|(n, _)| n.as_str()).collect();
        assert_eq!(kept, ["authorization", "accept", "last-event-id"]);
    }
}
