//! The gateway's side of CORS (the policy is `protocol::cors`): a client request's grant,
//! kept in the request's extensions from the `Origin` check on, so that every response
//! header written for the request (`respond`, the pass-through relay, a bridged reply)
//! carries it; and the gateway's own answer to a preflight.

use super::respond;
use crate::protocol::cors::{self, CorsGrant, CorsPolicy};
use crate::protocol::jsonrpc::code;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;

/// Records the grant `policy` gives the request's `Origin`; true when it gives one. A
/// granted `Origin` has then been checked by the gateway and is taken off the request,
/// as `Host` is rewritten: an upstream's own check, written for browsers reaching it
/// directly (the Python SDK's on a loopback address allows only local origins), would
/// refuse what the operator let in.
pub fn grant(policy: &CorsPolicy, session: &mut ServerSession) -> bool {
    let request = session.req_header_mut();
    let Some(grant) = policy.grant(request.headers.get(http::header::ORIGIN)) else {
        return false;
    };
    request.extensions_mut().insert(grant);
    request.remove_header(&http::header::ORIGIN);
    true
}

/// Adds the request's grant, if it has one, to a response header written for it.
pub fn decorate(session: &ServerSession, header: &mut ResponseHeader) {
    let Some(grant) = session.req_header().extensions.get::<CorsGrant>() else {
        return;
    };
    for (name, value) in grant.response_headers() {
        let _ = header.append_header(name, value);
    }
}

/// Drops the CORS headers of a relayed upstream response (under the gateway's policy,
/// the gateway's are the only ones the client sees).
pub fn strip_upstreams(header: &mut ResponseHeader) {
    let names: Vec<_> = header
        .headers
        .keys()
        .filter(|name| cors::is_cors_header(name))
        .cloned()
        .collect();
    for name in names {
        header.remove_header(&name);
    }
}

/// Answers an `OPTIONS` under the gateway's policy, before any credential is checked: a
/// preflight from an allowed origin gets 204 and what it asked for; one from another
/// origin 403, saying so; a plain `OPTIONS` the methods the endpoint serves.
pub async fn answer_options(session: &mut ServerSession) {
    let request = session.req_header();
    let preflight = request
        .headers
        .contains_key(http::header::ACCESS_CONTROL_REQUEST_METHOD);
    let granted = request.extensions.get::<CorsGrant>();
    let origin = super::header(session, "origin");
    match (preflight, granted, origin) {
        (true, Some(grant), _) => {
            let headers = grant.preflight_headers(&request.headers);
            write_no_content(session, headers).await
        }
        (true, None, Some(origin)) => {
            let message = format!("Forbidden: Origin '{origin}' is not in cors_allowed_origins");
            respond::error(session, 403, None, code::INVALID_REQUEST, &message).await
        }
        _ => {
            let allow = HeaderValue::from_static("GET, POST, DELETE, OPTIONS");
            write_no_content(session, [(http::header::ALLOW, allow)]).await
        }
    }
}

/// Writes a 204 with `headers`.
async fn write_no_content(
    session: &mut ServerSession,
    headers: impl IntoIterator<Item = (HeaderName, HeaderValue)>,
) {
    let Ok(mut header) = ResponseHeader::build(204, Some(8)) else {
        return;
    };
    for (name, value) in headers {
        let _ = header.append_header(name, value);
    }
    if respond::write_header(session, header).await.is_ok() {
        let _ = respond::write_body(session, Bytes::new(), true).await;
    }
}
