//! OAuth discovery through the gateway: the well-known documents a client fetches before
//! it authenticates (`protocol::oauth::WellKnown`). A group's protected-resource metadata
//! is the group's own (`resource_metadata` in its configuration) or its upstream's, and
//! either way names the group's public URL as `resource`; authorization-server metadata
//! an upstream serves itself is relayed unchanged. These documents are public: requests
//! for them carry no credentials upstream.

use super::{respond, Gateway};
use crate::outcome::{Class, Outcome, Refusal};
use crate::protocol::jsonrpc::code;
use crate::protocol::oauth::{self, WellKnown, PROTECTED_RESOURCE};
use crate::upstream::exchange::ExchangeFailure;
use crate::upstream::{Endpoint, UpstreamGroup};
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::ServerSession;
use std::time::Instant;

/// Largest discovery document relayed.
const MAX_DOCUMENT: usize = 64 << 10;

/// A discovery document fetched from an upstream.
struct Fetched {
    status: u16,
    body: Bytes,
    cache_control: Option<String>,
}

/// Answers a request for a well-known discovery document (`WellKnown::of` its path).
pub async fn serve(gw: &Gateway, session: &mut ServerSession) {
    let started = Instant::now();
    let path = session.req_header().uri.path().to_string();
    let Some(wanted) = WellKnown::of(&path) else {
        return;
    };
    let outcome = answer(gw, session, wanted).await;
    gw.record("discovery", "GET", &outcome, started);
}

async fn answer(gw: &Gateway, session: &mut ServerSession, wanted: WellKnown<'_>) -> Outcome {
    let method = &session.req_header().method;
    if method != http::Method::GET && method != http::Method::HEAD {
        let text = format!("method {method} is not allowed on a discovery document; use GET");
        respond::method_not_allowed(session, "GET, HEAD", &text).await;
        return Outcome::Refused(Refusal::new(Class::BadRequest, code::INVALID_REQUEST, text));
    }
    let (WellKnown::ProtectedResource { for_path } | WellKnown::AuthorizationServer { for_path }) =
        wanted;
    let Some(group) = group_for(gw, session, for_path) else {
        let text = format!("no MCP endpoint at '{for_path}' to describe");
        return not_found(session, text).await;
    };
    match wanted {
        WellKnown::ProtectedResource { .. } => protected_resource(gw, session, group).await,
        WellKnown::AuthorizationServer { .. } => {
            let path = session.req_header().uri.path().to_string();
            authorization_server(gw, session, group, &path, for_path).await
        }
    }
}

/// The group a discovery path is for: the one whose public URL has that path, as the
/// challenges name it (behind a proxy that strips a prefix, or on another host, it is
/// not the gateway's path); of several, one whose configured public URL is on the
/// request's host, then one whose public URL is the request's own; else the one serving
/// that path; for the root, the group at `/` or else the only group.
fn group_for<'g>(
    gw: &'g Gateway,
    session: &ServerSession,
    for_path: &str,
) -> Option<&'g UpstreamGroup> {
    let groups = &gw.upstreams.groups;
    let host = super::request_host(session).unwrap_or_default();
    let configured =
        |g: &UpstreamGroup| g.public_url.is_some() || gw.admission.public_url.is_some();
    let ranked: Vec<((bool, bool), &UpstreamGroup)> = (groups.groups.iter())
        .map(|g| (g, gw.admission.public_resource(session, g)))
        .filter(|(_, public)| public.path() == for_path.trim_end_matches('/'))
        .map(|(g, public)| {
            let on_host = same_authority(public.origin(), host);
            ((configured(g) && on_host, on_host), g)
        })
        .collect();
    // The first of the best (ties keep the configuration's order); of several on other
    // hosts, none.
    let best = ranked.iter().rev().max_by_key(|(rank, _)| *rank);
    match (best, ranked.len()) {
        (Some((_, group)), 1) | (Some(((_, true), group)), _) => return Some(group),
        _ => {}
    }
    if !for_path.is_empty() {
        return groups.by_path(for_path);
    }
    groups
        .by_path("/")
        .or_else(|| (groups.groups.len() == 1).then(|| &groups.groups[0]))
}

/// Whether `origin` (`scheme://authority`) is on `host` (a `Host` header): case aside,
/// and a scheme's default port written or not.
fn same_authority(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default = if scheme == "https" { ":443" } else { ":80" };
    let bare = |a: &str| a.strip_suffix(default).unwrap_or(a).to_ascii_lowercase();
    bare(authority) == bare(host)
}

/// The group's protected-resource metadata, naming its public URL as `resource`.
async fn protected_resource(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
) -> Outcome {
    let public = gw.admission.public_resource(session, group);
    if let Some(configured) = &group.resource_metadata {
        let mut metadata = configured.clone();
        metadata["resource"] = public.url().into();
        let body = Bytes::from(metadata.to_string());
        return document(session, 200, body, None).await;
    }
    let Some(endpoint) = group.pick() else {
        let text = format!("upstream group '{}' has no healthy endpoint", group.name);
        return refuse(session, Refusal::internal(Class::NoUpstream, text)).await;
    };
    // RFC 9728 §3.1: the metadata of the upstream's resource sits under its path, and
    // servers at a path often serve it at the root too.
    let suffixed = format!(
        "{PROTECTED_RESOURCE}{}",
        endpoint.path.trim_end_matches('/')
    );
    let mut fetched = fetch(gw, group, &endpoint, &suffixed).await;
    if matches!(&fetched, Ok(f) if f.status == 404) && suffixed != PROTECTED_RESOURCE {
        fetched = fetch(gw, group, &endpoint, PROTECTED_RESOURCE).await;
    }
    match fetched {
        Ok(f) if f.status == 200 => match oauth::rewrite_metadata(&f.body, &public) {
            Some(body) => document(session, 200, body.into(), f.cache_control).await,
            None => {
                let text = format!(
                    "upstream group '{}' served protected-resource metadata that is not a JSON object",
                    group.name
                );
                refuse(session, Refusal::internal(Class::UpstreamError, text)).await
            }
        },
        Ok(f) if f.status == 404 => {
            let text = format!(
                "upstream group '{}' publishes no protected-resource metadata",
                group.name
            );
            not_found(session, text).await
        }
        Ok(f) => relayed(session, f).await,
        Err(refusal) => refuse(session, refusal).await,
    }
}

/// Authorization-server metadata (or OpenID configuration) the group's upstream serves
/// itself, relayed unchanged: `path` asked for the group's `for_path`, which upstream is
/// the endpoint's path.
async fn authorization_server(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    path: &str,
    for_path: &str,
) -> Outcome {
    let Some(endpoint) = group.pick() else {
        let text = format!("upstream group '{}' has no healthy endpoint", group.name);
        return refuse(session, Refusal::internal(Class::NoUpstream, text)).await;
    };
    let upstream_path = upstream_document_path(path, for_path, &endpoint.path);
    match fetch(gw, group, &endpoint, &upstream_path).await {
        Ok(f) => relayed(session, f).await,
        Err(refusal) => refuse(session, refusal).await,
    }
}

/// Where the upstream serves the document `path` asks for the group at `for_path`: the
/// group's path is the document path's suffix (RFC 8414 §3.1), replaced by the
/// endpoint's; it may also occur inside the well-known name (`/oauth` in
/// `/.well-known/oauth-authorization-server/oauth`), which stays as it is.
/// OpenID Connect's form names it first (`/mcp/.well-known/openid-configuration`), and
/// is replaced so too.
fn upstream_document_path(path: &str, for_path: &str, endpoint_path: &str) -> String {
    let endpoint = endpoint_path.trim_end_matches('/');
    if for_path.is_empty() {
        return path.to_string();
    }
    if let Some(prefix) = path.strip_suffix(for_path) {
        return format!("{prefix}{endpoint}");
    }
    match path.strip_prefix(for_path) {
        Some(document) => format!("{endpoint}{document}"),
        None => path.to_string(),
    }
}

/// GETs `path` from `endpoint`, without the client's headers (the document is public).
async fn fetch(
    gw: &Gateway,
    group: &UpstreamGroup,
    endpoint: &Endpoint,
    path: &str,
) -> Result<Fetched, Refusal> {
    let unreachable = |failure: ExchangeFailure| {
        let text = format!("upstream group '{}' {failure}", group.name);
        Refusal::internal(Class::from(failure), text)
    };
    let mut request = RequestHeader::build("GET", path.as_bytes(), Some(3)).map_err(|_| {
        let text = format!(
            "upstream group '{}' cannot be asked for '{path}'",
            group.name
        );
        Refusal::internal(Class::UpstreamError, text)
    })?;
    let _ = request.insert_header("host", endpoint.authority.as_str());
    let _ = request.insert_header("accept", "application/json");
    // Read, and relayed without the upstream's headers: uncoded.
    let _ = request.insert_header("accept-encoding", "identity");
    let client = &gw.upstreams.client;
    let mut response = client
        .send(endpoint, &group.timeouts, request, Bytes::new())
        .await
        .map_err(|e| {
            tracing::info!(group = %group.name, error = %crate::outcome::Report(&e), "discovery document not fetched");
            unreachable(e.failure())
        })?;
    let status = response.header().status.as_u16();
    let cache_control = response
        .header()
        .headers
        .get(http::header::CACHE_CONTROL)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = response.read_all(MAX_DOCUMENT).await;
    client.finish(response).await;
    let body = body.map_err(|e| unreachable(e.failure()))?;
    Ok(Fetched {
        status,
        body,
        cache_control,
    })
}

/// Relays a fetched document with its status.
async fn relayed(session: &mut ServerSession, fetched: Fetched) -> Outcome {
    let Fetched {
        status,
        body,
        cache_control,
    } = fetched;
    document(session, status, body, cache_control).await
}

async fn document(
    session: &mut ServerSession,
    status: u16,
    body: Bytes,
    cache_control: Option<String>,
) -> Outcome {
    let Ok(mut header) = ResponseHeader::build(status, Some(4)) else {
        return Outcome::ClientGone;
    };
    if let Some(cache_control) = cache_control {
        let _ = header.insert_header(http::header::CACHE_CONTROL, cache_control);
    }
    respond::write_with(session, header, "application/json", body).await;
    if status < 400 {
        Outcome::Ok
    } else {
        let class = if status >= 500 {
            Class::UpstreamError
        } else {
            Class::BadRequest
        };
        let text = format!("the upstream answered HTTP {status}");
        Outcome::Refused(Refusal::internal(class, text))
    }
}

async fn not_found(session: &mut ServerSession, text: String) -> Outcome {
    respond::error(session, 404, None, code::INVALID_REQUEST, &text).await;
    Outcome::Refused(Refusal::new(Class::BadRequest, code::INVALID_REQUEST, text))
}

async fn refuse(session: &mut ServerSession, refusal: Refusal) -> Outcome {
    let status = refusal.class.status();
    respond::error(session, status, None, refusal.code, &refusal.message).await;
    Outcome::Refused(refusal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_path_keeps_its_name_and_takes_the_endpoints_path() {
        let asked = [
            (
                "/.well-known/oauth-authorization-server/oauth",
                "/oauth",
                "/mcp",
            ),
            ("/.well-known/openid-configuration/open", "/open", "/tools/"),
            (
                "/.well-known/oauth-authorization-server/a/b",
                "/a/b",
                "/mcp",
            ),
            ("/.well-known/oauth-authorization-server", "", "/mcp"),
            ("/mcp/.well-known/openid-configuration", "/mcp", "/internal"),
        ];
        let upstream: Vec<String> = asked
            .iter()
            .map(|(path, for_path, endpoint)| upstream_document_path(path, for_path, endpoint))
            .collect();
        assert_eq!(
            upstream,
            [
                "/.well-known/oauth-authorization-server/mcp",
                "/.well-known/openid-configuration/tools",
                "/.well-known/oauth-authorization-server/mcp",
                "/.well-known/oauth-authorization-server",
                "/internal/.well-known/openid-configuration",
            ]
        );
    }
}
