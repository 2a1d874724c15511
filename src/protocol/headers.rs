//! Which HTTP headers cross the gateway. Hop-by-hop headers (RFC 9110 §7.6.1) and any
//! header a `Connection` header nominates stay on their own hop; framing and the session
//! header are rewritten by the gateway itself. A bridged flow's upstream exchanges carry
//! the end-to-end headers of the client request behind them ([`EndToEnd`]): credentials,
//! API keys, cookies; less what the bridge sets itself or must read back unchanged.

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use sha2::{Digest, Sha256};
use std::fmt;

pub const MCP_SESSION_ID: &str = "mcp-session-id";
pub const LAST_EVENT_ID: &str = "last-event-id";

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

/// The options of every `Connection` field of `headers`, as bytes: a value holding a
/// byte outside visible ASCII still names the options beside it.
fn connection_options(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether any `Connection` field of `headers` (not only the first) says `close`.
pub fn says_close(headers: &HeaderMap) -> bool {
    connection_options(headers).any(|option| option.eq_ignore_ascii_case(b"close"))
}

/// The headers of `headers` that may be copied to the next hop, in order.
pub fn forwardable(headers: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &http::HeaderValue)> {
    // A name itself is always ASCII.
    let nominated: Vec<String> = connection_options(headers)
        .map(|t| String::from_utf8_lossy(t).to_ascii_lowercase())
        .collect();
    headers.iter().filter(move |(name, _)| {
        let n = name.as_str();
        !HOP_BY_HOP.contains(&n) && !REWRITTEN.contains(&n) && !nominated.iter().any(|t| t == n)
    })
}

/// The request headers of `headers` that may be copied to the next hop, in order, with
/// every `cookie` field joined into one, in the first's place: the next hop is HTTP/1.1,
/// where a request carries one (RFC 6265 §5.4; servers such as Starlette read only the
/// first), and an HTTP/2 client may split its cookies over several (RFC 9113 §8.2.3:
/// joined with "; " before they go on over HTTP/1.1).
pub fn forwardable_request(
    headers: &HeaderMap,
) -> impl Iterator<Item = (HeaderName, HeaderValue)> + '_ {
    let mut joined = joined_cookies(headers);
    let several = joined.is_some();
    forwardable(headers).filter_map(move |(name, value)| {
        if *name != http::header::COOKIE || !several {
            return Some((name.clone(), value.clone()));
        }
        joined.take().map(|cookie| (name.clone(), cookie))
    })
}

/// The request's `cookie` fields joined with "; ", when it has more than one.
fn joined_cookies(headers: &HeaderMap) -> Option<HeaderValue> {
    let cookies = headers.get_all(http::header::COOKIE);
    cookies.iter().nth(1)?;
    let mut joined = Vec::new();
    for cookie in cookies {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(cookie.as_bytes());
    }
    HeaderValue::from_bytes(&joined).ok()
}

/// Headers of a 2026-07-28 request the bridge never passes to its legacy upstream: it
/// writes its own body, accept list, protocol version and stream position, and it reads
/// the upstream's responses itself, so they must come back unencoded and whole.
const BRIDGE_SETS: &[&str] = &[
    "content-type",
    "content-encoding",
    "accept",
    "accept-encoding",
    "range",
    "if-range",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
    "mcp-protocol-version",
    "mcp-method",
    "mcp-name",
    "last-event-id",
    "traceparent",
    "tracestate",
];

/// Which of a client's end-to-end headers a group's bridged exchanges carry
/// (`forward_headers`): every one (`*`, the default), or only those named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderPolicy {
    All,
    Only(Vec<HeaderName>),
}

impl HeaderPolicy {
    /// From the configured list: `["*"]` is every header; names are matched without case.
    pub fn parse(names: &[String]) -> Result<HeaderPolicy, String> {
        if names.iter().any(|n| n == "*") {
            if names.len() > 1 {
                return Err("'*' already names every header; list names or '*', not both".into());
            }
            return Ok(HeaderPolicy::All);
        }
        let parsed = names
            .iter()
            .map(|n| {
                HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes())
                    .map_err(|_| format!("'{n}' is not a header name"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HeaderPolicy::Only(parsed))
    }

    fn allows(&self, name: &HeaderName) -> bool {
        match self {
            HeaderPolicy::All => true,
            HeaderPolicy::Only(names) => names.contains(name),
        }
    }
}

/// The end-to-end headers a client request passes to every upstream exchange it causes
/// in a bridged flow, in order, and its query string (`protocol::target`). Their values
/// are credentials: `Debug` shows header names only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EndToEnd {
    headers: Vec<(HeaderName, HeaderValue)>,
    query: Option<String>,
}

impl EndToEnd {
    /// The client's headers that `policy` lets through, less hop-by-hop ones, those the
    /// gateway rewrites, those the bridge sets, and forwarding headers (the gateway
    /// writes its own: `push` them) or, from a peer not `trusted`, claims of the kind
    /// (`forwarded::passes`).
    pub fn of(client: &HeaderMap, policy: &HeaderPolicy, trusted: bool) -> EndToEnd {
        let kept = forwardable_request(client).filter(|(name, _)| {
            let n = name.as_str();
            !BRIDGE_SETS.contains(&n) && super::forwarded::passes(n, trusted) && policy.allows(name)
        });
        EndToEnd {
            headers: kept.collect(),
            query: None,
        }
    }

    /// With the client's query string (without `?`; none if empty).
    pub fn with_query(mut self, query: Option<&str>) -> EndToEnd {
        self.query = query.filter(|q| !q.is_empty()).map(str::to_string);
        self
    }

    pub fn push(&mut self, name: HeaderName, value: HeaderValue) {
        self.headers.push((name, value));
    }

    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.headers.iter().map(|(n, v)| (n, v))
    }

    /// The client's query string, for `protocol::target::upstream_target`.
    pub fn query(&self) -> Option<&str> {
        self.query.as_deref()
    }

    /// The same without the forwarding headers: what a request the gateway makes on its
    /// own behalf for the caller carries (reaping its abandoned session), which names no
    /// client address.
    pub fn without_forwarding(&self) -> EndToEnd {
        let own = |(name, _): &&(HeaderName, HeaderValue)| {
            !super::forwarded::NAMES.contains(&name.as_str())
        };
        EndToEnd {
            headers: self.headers.iter().filter(own).cloned().collect(),
            query: self.query.clone(),
        }
    }

    /// A digest of what decides who the upstream serves (the headers but the forwarding
    /// ones, which name the client's address, and the query, which may hold a key):
    /// requests whose digests differ never share an upstream session.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        if let Some(query) = &self.query {
            h.update(b"?");
            h.update((query.len() as u32).to_be_bytes());
            h.update(query);
        }
        for (name, value) in &self.headers {
            if super::forwarded::NAMES.contains(&name.as_str()) {
                continue;
            }
            h.update((name.as_str().len() as u32).to_be_bytes());
            h.update(name.as_str());
            h.update((value.len() as u32).to_be_bytes());
            h.update(value.as_bytes());
        }
        h.finalize().into()
    }
}

impl fmt::Debug for EndToEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let query = self.query.as_ref().map(|_| "?query");
        f.debug_list()
            .entries(self.headers.iter().map(|(n, _)| n.as_str()).chain(query))
            .finish()
    }
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
        // A byte outside visible ASCII in the value does not hide the names beside it.
        let mut h = HeaderMap::new();
        let value = http::HeaderValue::from_bytes(b"x-internal, caf\xE9").unwrap();
        h.append(http::header::CONNECTION, value);
        h.append(HeaderName::from_static("x-internal"), "v".parse().unwrap());
        h.append(HeaderName::from_static("accept"), "*/*".parse().unwrap());
        let kept: Vec<&str> = forwardable(&h).map(|(n, _)| n.as_str()).collect();
        assert_eq!(kept, ["accept"]);
    }

    #[test]
    fn cookie_fields_go_on_joined_in_the_first_ones_place() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "Bearer t"),
            ("cookie", "a=1"),
            ("accept", "*/*"),
            ("cookie", "b=2"),
            ("cookie", "c=3"),
        ] {
            h.append(HeaderName::from_static(k), v.parse().unwrap());
        }
        let kept: Vec<(String, String)> = forwardable_request(&h)
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
            .collect();
        let pairs: Vec<(&str, &str)> = kept.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(
            pairs,
            [
                ("authorization", "Bearer t"),
                ("cookie", "a=1; b=2; c=3"),
                ("accept", "*/*")
            ]
        );
        // One is left as it is; one the connection nominates stays on its hop.
        let mut h = HeaderMap::new();
        h.append(http::header::COOKIE, "a=1".parse().unwrap());
        assert_eq!(forwardable_request(&h).count(), 1);
        h.append(http::header::COOKIE, "b=2".parse().unwrap());
        h.append(http::header::CONNECTION, "cookie".parse().unwrap());
        assert_eq!(forwardable_request(&h).count(), 0);
    }

    fn client_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "Bearer secret-token"),
            ("x-api-key", "k-123"),
            ("cookie", "sid=1"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("accept-encoding", "gzip"),
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("x-forwarded-for", "6.6.6.6"),
            ("x-real-ip", "6.6.6.6"),
            ("x-original-url", "/admin"),
            ("host", "gw"),
            ("content-length", "10"),
        ] {
            h.append(HeaderName::from_static(k), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_bridged_exchange_carries_credentials_and_nothing_the_bridge_sets() {
        let every = HeaderPolicy::parse(&["*".into()]).unwrap();
        let all = EndToEnd::of(&client_headers(), &every, false);
        let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["authorization", "x-api-key", "cookie"]);
        // A proxy in front, trusted, may say where the request came from.
        let from_proxy = EndToEnd::of(&client_headers(), &every, true);
        let names: Vec<&str> = from_proxy.iter().map(|(n, _)| n.as_str()).collect();
        let claims = ["x-real-ip", "x-original-url"];
        assert_eq!(
            names,
            [&["authorization", "x-api-key", "cookie"][..], &claims].concat()
        );
        let only = HeaderPolicy::parse(&["X-Api-Key".into()]).unwrap();
        let narrowed = EndToEnd::of(&client_headers(), &only, false);
        let names: Vec<&str> = narrowed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-api-key"]);
        assert!(HeaderPolicy::parse(&["*".into(), "cookie".into()]).is_err());
        assert!(HeaderPolicy::parse(&["bad header".into()]).is_err());
    }

    #[test]
    fn credentials_never_show_in_debug_and_decide_the_digest() {
        let policy = HeaderPolicy::All;
        let mut alice = EndToEnd::of(&client_headers(), &policy, false);
        let shown = format!("{alice:?}");
        assert!(!shown.contains("secret-token") && shown.contains("authorization"));
        let before = alice.digest();
        alice.push(
            HeaderName::from_static("x-forwarded-for"),
            HeaderValue::from_static("10.0.0.1"),
        );
        assert_eq!(
            alice.digest(),
            before,
            "the client's address is not who it is"
        );
        let mut other = client_headers();
        other.insert("authorization", "Bearer another".parse().unwrap());
        assert_ne!(EndToEnd::of(&other, &policy, false).digest(), before);
        let keyed = EndToEnd::of(&client_headers(), &policy, false).with_query(Some("apiKey=k1"));
        assert!(!format!("{keyed:?}").contains("k1"), "{keyed:?}");
        assert_ne!(keyed.digest(), before, "a key in the URL is who it is");
        let other_key =
            EndToEnd::of(&client_headers(), &policy, false).with_query(Some("apiKey=k2"));
        assert_ne!(keyed.digest(), other_key.digest());
        assert_eq!(
            EndToEnd::of(&client_headers(), &policy, false)
                .with_query(Some(""))
                .digest(),
            before,
            "an empty query is none"
        );
    }
}
