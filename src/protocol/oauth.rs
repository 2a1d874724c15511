//! OAuth 2.0 protected-resource discovery (RFC 9728, the MCP authorization spec) as seen
//! through the gateway. A client learns where a server's resource metadata is from the
//! `resource_metadata` parameter of a 401's `WWW-Authenticate`, and checks the metadata's
//! `resource` against the URL it connected to: both must name the gateway's public URL,
//! not the upstream's internal one. This module computes those URLs and rewrites a
//! challenge and a metadata document; which well-known paths the gateway answers is
//! [`WellKnown`].

use serde_json::Value;

/// The well-known prefix of protected-resource metadata (RFC 9728 §3).
pub const PROTECTED_RESOURCE: &str = "/.well-known/oauth-protected-resource";
/// Authorization-server metadata (RFC 8414 §3).
pub const AUTHORIZATION_SERVER: &str = "/.well-known/oauth-authorization-server";
/// OpenID Connect discovery.
pub const OPENID_CONFIGURATION: &str = "/.well-known/openid-configuration";

/// A resource as its clients name it: `origin` is `scheme://authority`, `path` the rest
/// (empty for a resource at the root).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicResource {
    origin: String,
    path: String,
}

impl PublicResource {
    /// `origin` (`scheme://authority`, any trailing `/` ignored) and the resource's path.
    pub fn new(origin: &str, path: &str) -> PublicResource {
        let path = path.trim_end_matches('/');
        PublicResource {
            origin: origin.trim_end_matches('/').to_string(),
            path: path.to_string(),
        }
    }

    /// From a whole URL (`https://mcp.example.com/tools`); `None` if it is not an absolute
    /// http(s) URL, or it has a query or credentials (`user:password@`, which every
    /// challenge would publish).
    pub fn parse(url: &str) -> Option<PublicResource> {
        let uri: http::Uri = url.parse().ok()?;
        let scheme = uri.scheme_str().filter(|s| *s == "http" || *s == "https")?;
        let authority = uri.authority()?.as_str();
        if uri.query().is_some() || authority.contains('@') {
            return None;
        }
        Some(PublicResource::new(
            &format!("{scheme}://{authority}"),
            uri.path(),
        ))
    }

    /// The resource at `path` under this one.
    pub fn join(&self, path: &str) -> PublicResource {
        PublicResource::new(&self.origin, &format!("{}{path}", self.path))
    }

    /// The resource identifier.
    pub fn url(&self) -> String {
        format!("{}{}", self.origin, self.path)
    }

    /// The resource's path (no trailing `/`; empty for the root).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `scheme://authority`.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Where its metadata is: the well-known prefix inserted between the origin and the
    /// path (RFC 9728 §3.1).
    pub fn metadata_url(&self) -> String {
        format!("{}{PROTECTED_RESOURCE}{}", self.origin, self.path)
    }
}

/// A challenge (`WWW-Authenticate` value) whose `resource_metadata` parameter names the
/// public resource's metadata instead of whatever the upstream named; a challenge
/// without one is returned unchanged.
pub fn rewrite_challenge(challenge: &str, resource: &PublicResource) -> String {
    // Every challenge in the value (a field may list several) names its own.
    let url = format!("\"{}\"", resource.metadata_url());
    let mut out = String::with_capacity(challenge.len() + url.len());
    let mut at = 0;
    while let Some((start, end)) = param_value(challenge, at, "resource_metadata") {
        out.push_str(&challenge[at..start]);
        out.push_str(&url);
        at = end;
    }
    out.push_str(&challenge[at..]);
    out
}

/// Whitespace around an auth-param's `=` (RFC 9110's BWS: spaces and tabs).
fn is_blank(byte: Option<&u8>) -> bool {
    matches!(byte, Some(b' ' | b'\t'))
}

/// The byte range of the value (quoted string or token) of the first auth-param `name`
/// at or after `from`.
fn param_value(challenge: &str, from: usize, name: &str) -> Option<(usize, usize)> {
    let bytes = challenge.as_bytes();
    let mut i = from;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => i = skip_quoted(bytes, i),
            _ if starts_param(bytes, i, name) => {
                let mut v = i + name.len();
                while is_blank(bytes.get(v)) {
                    v += 1;
                }
                if bytes.get(v) != Some(&b'=') {
                    i += 1;
                    continue;
                }
                v += 1;
                while is_blank(bytes.get(v)) {
                    v += 1;
                }
                let end = if bytes.get(v) == Some(&b'"') {
                    skip_quoted(bytes, v)
                } else {
                    v + bytes[v..]
                        .iter()
                        .position(|b| matches!(b, b',' | b' ' | b'\t'))
                        .unwrap_or(bytes.len() - v)
                };
                return Some((v, end));
            }
            _ => i += 1,
        }
    }
    None
}

/// Whether auth-param `name` starts at `i` (after a separator, case-insensitively).
fn starts_param(bytes: &[u8], i: usize, name: &str) -> bool {
    let after_separator = i == 0 || matches!(bytes[i - 1], b' ' | b',' | b'\t');
    after_separator
        && bytes
            .get(i..i + name.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(name.as_bytes()))
}

/// The index just past the quoted string opening at `open` (escapes honoured).
fn skip_quoted(bytes: &[u8], open: usize) -> usize {
    let mut i = open + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// Protected-resource metadata that names the public resource: `document` with its
/// `resource` replaced. `None` if `document` is not a JSON object.
pub fn rewrite_metadata(document: &[u8], resource: &PublicResource) -> Option<Vec<u8>> {
    let mut metadata: Value = serde_json::from_slice(document).ok()?;
    metadata
        .as_object_mut()?
        .insert("resource".into(), Value::String(resource.url()));
    serde_json::to_vec(&metadata).ok()
}

/// A well-known discovery path the gateway answers, with the path it is for (the part
/// after the well-known prefix; empty for the root).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WellKnown<'p> {
    /// Protected-resource metadata: served for the group at `for_path`, with its
    /// `resource` made public.
    ProtectedResource { for_path: &'p str },
    /// Authorization-server metadata or OpenID configuration: relayed from the group at
    /// `for_path`, unchanged.
    AuthorizationServer { for_path: &'p str },
}

impl<'p> WellKnown<'p> {
    /// The discovery document a request path asks for, if any.
    pub fn of(path: &'p str) -> Option<WellKnown<'p>> {
        let suffix = |prefix: &str| {
            let rest = path.strip_prefix(prefix)?;
            (rest.is_empty() || rest.starts_with('/')).then_some(rest)
        };
        if let Some(for_path) = suffix(PROTECTED_RESOURCE) {
            return Some(WellKnown::ProtectedResource { for_path });
        }
        if let Some(for_path) =
            suffix(AUTHORIZATION_SERVER).or_else(|| suffix(OPENID_CONFIGURATION))
        {
            return Some(WellKnown::AuthorizationServer { for_path });
        }
        // OpenID Connect's own form appends the well-known part to the issuer's path.
        let for_path = path.strip_suffix(OPENID_CONFIGURATION)?;
        Some(WellKnown::AuthorizationServer { for_path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gateway() -> PublicResource {
        PublicResource::parse("https://mcp.example.com/tools").unwrap()
    }

    #[test]
    fn the_metadata_url_inserts_the_well_known_prefix() {
        assert_eq!(gateway().url(), "https://mcp.example.com/tools");
        assert_eq!(
            gateway().metadata_url(),
            "https://mcp.example.com/.well-known/oauth-protected-resource/tools"
        );
        let root = PublicResource::new("http://127.0.0.1:8080/", "/");
        assert_eq!(root.url(), "http://127.0.0.1:8080");
        assert_eq!(
            root.metadata_url(),
            "http://127.0.0.1:8080/.well-known/oauth-protected-resource"
        );
        assert_eq!(PublicResource::parse("ftp://x/y"), None);
        assert_eq!(PublicResource::parse("/relative"), None);
        assert_eq!(
            PublicResource::parse("https://u:pw@mcp.example.com/m"),
            None
        );
    }

    #[test]
    fn a_challenge_names_the_public_metadata_and_keeps_everything_else() {
        let upstream = r#"Bearer error="invalid_token", error_description="Authentication required", resource_metadata="http://10.0.0.7:8001/.well-known/oauth-protected-resource/mcp""#;
        assert_eq!(
            rewrite_challenge(upstream, &gateway()),
            r#"Bearer error="invalid_token", error_description="Authentication required", resource_metadata="https://mcp.example.com/.well-known/oauth-protected-resource/tools""#
        );
        let token_form = "Bearer resource_metadata=http://10.0.0.7/x, scope=\"a b\"";
        assert_eq!(
            rewrite_challenge(token_form, &gateway()),
            "Bearer resource_metadata=\"https://mcp.example.com/.well-known/oauth-protected-resource/tools\", scope=\"a b\""
        );
        let quoted_lookalike = r#"Bearer error_description="resource_metadata=evil", realm="r""#;
        assert_eq!(
            rewrite_challenge(quoted_lookalike, &gateway()),
            quoted_lookalike
        );
        let none = r#"Bearer realm="mcp""#;
        assert_eq!(rewrite_challenge(none, &gateway()), none);
        let public = "\"https://mcp.example.com/.well-known/oauth-protected-resource/tools\"";
        let tabs = "Bearer resource_metadata\t=\t\"http://10.9.9.9/x\"";
        assert_eq!(
            rewrite_challenge(tabs, &gateway()),
            format!("Bearer resource_metadata\t=\t{public}")
        );
        let two = r#"Bearer resource_metadata="http://10.9.9.9/a", DPoP resource_metadata="http://10.9.9.9/b""#;
        assert_eq!(
            rewrite_challenge(two, &gateway()),
            format!("Bearer resource_metadata={public}, DPoP resource_metadata={public}")
        );
    }

    #[test]
    fn metadata_names_the_public_resource() {
        let upstream = br#"{"resource":"http://10.0.0.7:8001/mcp","authorization_servers":["https://as.example.com"]}"#;
        let rewritten: Value =
            serde_json::from_slice(&rewrite_metadata(upstream, &gateway()).unwrap()).unwrap();
        assert_eq!(rewritten["resource"], "https://mcp.example.com/tools");
        assert_eq!(
            rewritten["authorization_servers"][0],
            "https://as.example.com"
        );
        assert_eq!(rewrite_metadata(b"[1]", &gateway()), None);
    }

    #[test]
    fn well_known_paths_name_what_they_are_for() {
        use WellKnown::*;
        let of = WellKnown::of;
        assert_eq!(
            of("/.well-known/oauth-protected-resource/mcp"),
            Some(ProtectedResource { for_path: "/mcp" })
        );
        assert_eq!(
            of("/.well-known/oauth-protected-resource"),
            Some(ProtectedResource { for_path: "" })
        );
        assert_eq!(of("/.well-known/oauth-protected-resourceX"), None);
        assert_eq!(
            of("/.well-known/oauth-authorization-server"),
            Some(AuthorizationServer { for_path: "" })
        );
        assert_eq!(
            of("/.well-known/openid-configuration/mcp"),
            Some(AuthorizationServer { for_path: "/mcp" })
        );
        assert_eq!(
            of("/mcp/.well-known/openid-configuration"),
            Some(AuthorizationServer { for_path: "/mcp" })
        );
        assert_eq!(of("/mcp"), None);
    }
}
