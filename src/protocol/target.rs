//! The request target of an upstream exchange: the configured endpoint's path and query,
//! with the client's own query parameters after them. Hosted MCP servers take per-user
//! API keys and options in the URL (`/mcp?apiKey=…`), so a drop-in must carry them. A
//! parameter the endpoint's URL sets is the operator's: the client's of the same name is
//! left out (also one after a `;`, which some servers split on, and one PHP reads as
//! the same name: `api.key`, `api key`, `api_key[]` for `api_key`), so that it cannot
//! override it, whichever of two values a server reads.

use std::borrow::Cow;

/// Longest request target (path and query) a client may send, and an endpoint URL may
/// configure: 8 KiB, as nginx's default header buffers and uvicorn allow. Together they
/// stay far below the 64 KiB an upstream request's target may have (`http::Uri`), so an
/// upstream target always builds.
pub const MAX_TARGET_BYTES: usize = 8 << 10;

/// `endpoint` (a configured path and query) with the parameters of `client_query` (the
/// query of the client's request URI, without `?`) appended, less those whose name the
/// endpoint's query already has.
pub fn upstream_target<'a>(endpoint: &'a str, client_query: Option<&str>) -> Cow<'a, str> {
    let Some(client_query) = client_query.filter(|q| !q.is_empty()) else {
        return Cow::Borrowed(endpoint);
    };
    let own_query = endpoint.split_once('?').map(|(_, query)| query);
    let configured: Vec<Vec<u8>> = params(own_query.unwrap_or_default()).map(name_of).collect();
    let configured_php: Vec<Vec<u8>> = configured.iter().map(|n| php_name(n)).collect();
    let operators_name =
        |name: Vec<u8>| configured_php.contains(&php_name(&name)) || configured.contains(&name);
    // Some servers also split a query on `;` (Rack before 3, Python before 3.9.2, Go
    // before 1.17): a piece naming an operator's parameter after one is left out too.
    let operators = |param: &str| param.split(';').any(|p| operators_name(name_of(p)));
    let carried: Vec<&str> = params(client_query)
        .filter(|param| !operators(param))
        .collect();
    if carried.is_empty() {
        return Cow::Borrowed(endpoint);
    }
    let joiner = match own_query {
        None => "?",
        Some(query) if query.is_empty() || query.ends_with('&') => "",
        Some(_) => "&",
    };
    Cow::Owned(format!("{endpoint}{joiner}{}", carried.join("&")))
}

/// A query's non-empty `name=value` pieces.
fn params(query: &str) -> impl Iterator<Item = &str> {
    query.split('&').filter(|param| !param.is_empty())
}

/// A parameter's name, decoded as a form decodes it (`%XX` escapes, `+` a space), so
/// that `api%5Fkey` and `api_key` are one name.
fn name_of(param: &str) -> Vec<u8> {
    let name = param
        .split_once('=')
        .map_or(param, |(name, _)| name)
        .as_bytes();
    let hex = |digit: u8| (digit as char).to_digit(16);
    let mut decoded = Vec::with_capacity(name.len());
    let mut rest = name;
    while let Some((&byte, tail)) = rest.split_first() {
        let escaped = match (byte, tail) {
            (b'%', [high, low, ..]) => hex(*high).zip(hex(*low)),
            _ => None,
        };
        rest = match (escaped, byte) {
            (Some((high, low)), _) => {
                decoded.push((high * 16 + low) as u8);
                &tail[2..]
            }
            (None, b'+') => {
                decoded.push(b' ');
                tail
            }
            (None, byte) => {
                decoded.push(byte);
                tail
            }
        };
    }
    decoded
}

/// A decoded parameter name as PHP registers it: leading spaces dropped; an array's
/// name (`key[...]`, a `[` closed later) is its base; else a `[` is an `_`; a space or a
/// `.` in the name is an `_`.
fn php_name(name: &[u8]) -> Vec<u8> {
    let name = &name[name.iter().take_while(|b| **b == b' ').count()..];
    let open = name.iter().position(|b| *b == b'[');
    let closed = open.is_some_and(|at| name[at..].contains(&b']'));
    let base = match (open, closed) {
        (Some(at), true) => &name[..at],
        _ => name,
    };
    let underscore = |b: &u8| match b {
        b' ' | b'.' | b'[' => b'_',
        b => *b,
    };
    base.iter().map(underscore).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clients_query_follows_the_endpoints_path() {
        assert_eq!(upstream_target("/mcp", None), "/mcp");
        assert_eq!(upstream_target("/mcp", Some("")), "/mcp");
        assert_eq!(upstream_target("/mcp", Some("apiKey=k1")), "/mcp?apiKey=k1");
        assert_eq!(
            upstream_target("/mcp", Some("a=1&&b=%20x")),
            "/mcp?a=1&b=%20x",
            "empty pieces dropped, escapes kept as sent"
        );
    }

    #[test]
    fn the_endpoints_own_parameters_cannot_be_overridden() {
        let endpoint = "/mcp?tenant=a&api_key=operator";
        assert_eq!(
            upstream_target(endpoint, Some("tenant=b&x=1&api%5Fkey=mine&API_KEY=other")),
            "/mcp?tenant=a&api_key=operator&x=1&API_KEY=other",
            "same names (also escaped) left out; names keep their case"
        );
        assert_eq!(upstream_target(endpoint, Some("tenant=b")), endpoint);
        assert_eq!(upstream_target("/mcp?", Some("x=1")), "/mcp?x=1");
        assert_eq!(upstream_target("/mcp?a=1&", Some("x=1")), "/mcp?a=1&x=1");
        assert_eq!(
            upstream_target("/mcp?a+b=1", Some("a%20b=2&c")),
            "/mcp?a+b=1&c"
        );
        assert_eq!(
            upstream_target(endpoint, Some("x=1;api_key=mine&y=2;z=3")),
            "/mcp?tenant=a&api_key=operator&y=2;z=3",
            "nor after a `;`, which some servers split on"
        );
    }

    /// PHP reads `api.key`, `api key`, ` api_key` and `api_key[]` as `api_key`, and
    /// `api[key` as `api_key`: none of them overrides the operator's `api_key`.
    #[test]
    fn names_php_reads_as_the_operators_are_left_out_too() {
        let endpoint = "/mcp?api_key=operator";
        for client in [
            "api.key=mine",
            "api%20key=mine",
            "api+key=mine",
            "+api_key=mine",
            "api_key[]=mine",
            "api_key%5B0%5D=mine",
            "api[key=mine",
        ] {
            assert_eq!(
                upstream_target(endpoint, Some(client)),
                endpoint,
                "{client}"
            );
        }
        assert_eq!(
            upstream_target(endpoint, Some("api_keys=1&apikey=2")),
            "/mcp?api_key=operator&api_keys=1&apikey=2",
            "other names go on"
        );
    }

    #[test]
    fn a_broken_escape_is_a_name_of_its_own() {
        assert_eq!(name_of("a%2=1"), b"a%2".to_vec());
        assert_eq!(name_of("%zz"), b"%zz".to_vec());
        assert_eq!(name_of("%+1"), b"% 1".to_vec(), "no sign in an escape");
        assert_eq!(name_of("%41%42"), b"AB".to_vec());
    }
}
