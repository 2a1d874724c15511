//! Data-layer sessions on the bridge: `session/create` and `session/delete`, the cookie a
//! request carries (opened, checked against the group, refreshed for the response), and
//! the per-tool session policy. A request with a cookie runs in the upstream session the
//! cookie names instead of a fresh one; see `mrtr::data_session` for the cookie itself.

use super::reply::{decorate, ClientReply};
use super::streams::Streams;
use super::{client_info, upstream_failed};
use crate::config::SessionPolicy;
use crate::gateway::Gateway;
use crate::mrtr::data_session::{
    revocation, CookieField, DataSession, INVALID_COOKIE, MAX_COOKIE_LEN,
};
use crate::mrtr::modern::{gateway_code as scode, ModernRequest};
use crate::mrtr::state::{now_secs, FlowState};
use crate::outcome::{Class, Outcome, Refusal};
use crate::protocol::jsonrpc::code;
use crate::protocol::session_token::SessionToken;
use crate::upstream::legacy_session::LegacySession;
use crate::upstream::{Endpoint, UpstreamGroup};
use pingora::protocols::http::ServerSession;
use serde_json::{json, Value};

/// A request's data-layer session: its opened cookie and the endpoint that holds it.
pub(crate) struct Attached {
    pub cookie: DataSession,
    pub endpoint: Endpoint,
}

impl Attached {
    /// The upstream session, to run a request in; it is never deleted by a flow.
    pub fn upstream<'g>(
        &self,
        gw: &'g Gateway,
        group: &'g UpstreamGroup,
        request: &ModernRequest,
    ) -> LegacySession<'g> {
        let mut upstream = LegacySession::resume(
            &gw.upstreams.client,
            self.endpoint.clone(),
            &group.timeouts,
            self.cookie.upstream_session.clone(),
            self.cookie.version,
        );
        upstream.persistent = true;
        // Every exchange carries the credentials of the request it is made for.
        upstream.caller = super::caller(request);
        upstream
    }
}

/// Why a request's data-layer session cannot be used; nothing went upstream.
pub(super) enum Refused {
    /// The tool (named) needs a session and the request carried no cookie.
    Required(String),
    /// The cookie did not open or does not belong here, for the logged reason.
    Invalid(&'static str),
    /// The cookie expired: refused as one that did not open, and its session ended
    /// upstream (a client sends the latest cookie it was given). A retry of a call begun
    /// in the session is not refused (`retries_call_in`).
    Expired(Box<Attached>),
}

/// Opens the request's cookie, if it carries one, and applies the tool's session policy.
/// `session/delete` may name its session in `params.id` instead of `_meta`.
pub(super) fn attach(
    gw: &Gateway,
    group: &UpstreamGroup,
    request: &ModernRequest,
    principal: &[u8; 32],
) -> Result<Option<Attached>, Refused> {
    let text = match CookieField::of(&request.params) {
        CookieField::Present(text) => Some(text),
        CookieField::Malformed => return Err(Refused::Invalid("malformed")),
        CookieField::Absent if request.method == "session/delete" => {
            request.params.get("id").and_then(Value::as_str)
        }
        CookieField::Absent => None,
    };
    let Some(text) = text else {
        return match required_by(group, request) {
            Some(tool) => Err(Refused::Required(tool)),
            None => Ok(None),
        };
    };
    if text.len() > MAX_COOKIE_LEN {
        return Err(Refused::Invalid("too_long"));
    }
    let cookie = DataSession::open_expired_too(&gw.sealing.keys.load(), principal, text)
        .map_err(|e| Refused::Invalid(e.reason()))?;
    if cookie.group != group.name {
        return Err(Refused::Invalid("other_group"));
    }
    let endpoint = group
        .endpoint(cookie.endpoint)
        .ok_or(Refused::Invalid("unknown_endpoint"))?;
    let attached = Attached { cookie, endpoint };
    // `session/delete` ends what its cookie names, expired or not; the retry of a call
    // begun in the session goes on in it.
    let expired = now_secs() >= attached.cookie.expires_at;
    if expired && request.method != "session/delete" && !retries_call_in(gw, request, &attached) {
        return Err(Refused::Expired(Box::new(attached)));
    }
    Ok(Some(attached))
}

/// Whether `request` retries a call begun in the session `attached` names (its
/// `requestState` says so; `call::open_state` checks the rest of it). A retry carries
/// the params of the round it answers, cookie included, and a cookie refreshed since
/// (every result carries one) keeps the session alive: that the retry's has expired
/// says nothing of the session, which the call still runs in.
fn retries_call_in(gw: &Gateway, request: &ModernRequest, attached: &Attached) -> bool {
    let interactive = matches!(
        super::Kind::of(&request.method),
        Some(super::Kind::Interactive)
    );
    let state = request.params.get("requestState").and_then(Value::as_str);
    let Some(text) = state.filter(|_| interactive) else {
        return false;
    };
    let Ok((_, state)) = FlowState::open_unbound(&gw.sealing.keys.load(), text) else {
        return false;
    };
    let session = attached.cookie.upstream_session.as_str();
    let began_in = state.waiting.call().filter(|call| call.data_session);
    began_in.is_some_and(|call| call.session == session)
}

/// The tool a cookie-less request calls, if its policy requires a session. A retry is
/// let through: its sealed state already names the upstream session.
fn required_by(group: &UpstreamGroup, request: &ModernRequest) -> Option<String> {
    if request.method != "tools/call" || request.params.contains_key("requestState") {
        return None;
    }
    let tool = request.target.as_deref()?;
    let required = group.tools.get(tool)?.session == SessionPolicy::Required;
    required.then(|| tool.to_string())
}

/// The cookie for the response: the same session with a later expiry, sealed anew.
pub(super) fn refreshed(gw: &Gateway, attached: &mut Attached, principal: &[u8; 32]) -> Value {
    attached.cookie.expires_at = now_secs() + gw.config.bridge.data_session_ttl_seconds;
    let version = gw.config.bridge.sealing_version();
    attached
        .cookie
        .cookie(&gw.sealing.keys.load(), principal, version)
}

/// Answers a request whose session was refused; a bad cookie gets one uniform error
/// with the revocation, whatever the reason, which goes to the logs and the metric.
pub(super) async fn refuse(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    reply: ClientReply,
    refused: Refused,
) -> Outcome {
    match refused {
        Refused::Expired(attached) => {
            let outcome = invalid_cookie(gw, session, reply, "expired").await;
            let mut upstream = attached.upstream(gw, group, request);
            // Its session ends here, in the background: the client's next request on
            // this connection does not wait for the upstream's DELETE.
            upstream.persistent = false;
            super::end_session_later(gw, upstream, Streams::new(None, None)).await;
            outcome
        }
        Refused::Required(tool) => {
            let text = format!("Session required: tool '{tool}' runs only in a data-layer session; call session/create and send the cookie it returns in _meta[\"mcp/session\"]");
            let data = json!({"method": "session/create"});
            let refusal = Refusal::new(Class::SessionRequired, scode::SESSION_REQUIRED, text);
            reply.refuse(session, refusal.with_data(data)).await
        }
        Refused::Invalid(reason) => invalid_cookie(gw, session, reply, reason).await,
    }
}

/// Answers a request whose cookie was refused for `reason` (logged and counted).
async fn invalid_cookie(
    gw: &Gateway,
    session: &mut ServerSession,
    reply: ClientReply,
    reason: &'static str,
) -> Outcome {
    gw.runtime
        .metrics
        .data_sessions
        .with_label_values(&["rejected"])
        .inc();
    tracing::info!(reason, "session cookie refused");
    let data = json!({"_meta": revocation()});
    let refusal = Refusal::new(Class::CookieRejected, scode::SESSION_ENDED, INVALID_COOKIE);
    reply.refuse(session, refusal.with_data(data)).await
}

/// Answers a request whose upstream session is gone: the session ended, and the client
/// is told to drop its cookie.
pub(super) async fn ended(
    gw: &Gateway,
    session: &mut ServerSession,
    reply: ClientReply,
) -> Outcome {
    gw.runtime
        .metrics
        .data_sessions
        .with_label_values(&["ended"])
        .inc();
    tracing::info!("data-layer session ended upstream");
    let text = "Session ended: the upstream no longer has it; call session/create again";
    let data = json!({"_meta": revocation()});
    let refusal = Refusal::new(Class::SessionEnded, scode::SESSION_ENDED, text);
    reply.refuse(session, refusal.with_data(data)).await
}

/// `session/create`: opens an upstream session with the request's capabilities and
/// returns the session object, its cookie in `_meta["mcp/session"]`.
pub(super) async fn create(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    mut reply: ClientReply,
    principal: &[u8; 32],
) -> Outcome {
    let caps = Value::Object(request.client_capabilities.clone());
    let (info, caller) = (client_info(request), super::caller(request));
    let opening = gw.upstreams.open_upstream(group, &caps, &info, &caller);
    let (opened, client_left) = open_watching_client(session, opening).await;
    let (upstream, init) = match opened {
        Ok(opened) => opened,
        Err(e) => return upstream_failed(gw, reply, session, group, &e).await,
    };
    if client_left {
        // Nobody will hold its cookie: ended now, not left to the upstream's timer.
        upstream.abandon().await;
        return Outcome::ClientGone;
    }
    let sid = upstream.session_id.clone().unwrap_or_default();
    if SessionToken::validate_upstream_session(&sid).is_err() {
        // The session just opened serves nobody: ended, not left to the upstream's timer.
        upstream.abandon().await;
        let text = format!(
            "upstream group '{}' keeps no usable sessions (no valid Mcp-Session-Id), so it cannot hold a data-layer session",
            group.name
        );
        return reply
            .refuse(session, Refusal::internal(Class::UpstreamError, text))
            .await;
    }
    let mut attached = Attached {
        cookie: DataSession {
            group: group.name.clone(),
            endpoint: upstream.endpoint.addr,
            upstream_session: sid,
            expires_at: 0,
            session_id: rand::random(),
            version: upstream.version,
        },
        endpoint: upstream.endpoint.clone(),
    };
    let cookie = refreshed(gw, &mut attached, principal);
    gw.runtime
        .metrics
        .data_sessions
        .with_label_values(&["created"])
        .inc();
    tracing::info!(
        session = attached.cookie.log_id(),
        "data-layer session created"
    );
    let data = request.params.get("hints").and_then(|h| h.get("data"));
    let result = json!({"id": cookie["id"], "expiry": cookie["expiry"], "data": data.cloned().unwrap_or(json!({}))});
    reply.cookie = Some(cookie);
    let result = decorate(result, &init["serverInfo"], false);
    let answered = reply.result(session, result).await;
    if !answered {
        // The client left before it had the cookie: nobody can reach the session.
        upstream.abandon().await;
    }
    Outcome::answered(answered)
}

/// Runs `opening` (a session's initialize, which is never cut short: the session it
/// opens must be known to be ended) while watching the client's connection; true with
/// the result when the client left meanwhile.
async fn open_watching_client<T>(
    session: &mut ServerSession,
    opening: impl std::future::Future<Output = T>,
) -> (T, bool) {
    tokio::pin!(opening);
    let mut client_left = false;
    loop {
        // The client first: a close that came before the session opened is seen.
        tokio::select! {
            biased;
            _ = session.read_body_or_idle(true), if !client_left => client_left = true,
            opened = &mut opening => return (opened, client_left),
        }
    }
}

/// `session/delete`: DELETEs the upstream session and revokes the cookie.
pub(super) async fn delete(
    gw: &Gateway,
    session: &mut ServerSession,
    group: &UpstreamGroup,
    request: &ModernRequest,
    attached: Option<&Attached>,
    reply: ClientReply,
) -> Outcome {
    let Some(attached) = attached else {
        let text = "session/delete needs the session: its cookie in _meta[\"mcp/session\"] or its id in params.id";
        let refusal = Refusal::new(Class::BadRequest, code::INVALID_PARAMS, text);
        return reply.refuse(session, refusal).await;
    };
    // A session the upstream did not end (a denied DELETE, an upstream down) lives on,
    // and so does its cookie: the client is told why.
    let deleted = match attached.upstream(gw, group, request).end().await {
        Ok(deleted) => deleted,
        Err(e) => return super::upstream_failed(gw, reply, session, group, &e).await,
    };
    let log_id = attached.cookie.log_id();
    if deleted {
        let counter = gw
            .runtime
            .metrics
            .data_sessions
            .with_label_values(&["deleted"]);
        counter.inc();
        tracing::info!(session = log_id, "data-layer session deleted");
    } else {
        tracing::info!(
            session = log_id,
            "data-layer session left to the upstream, which ends sessions itself (DELETE 405)"
        );
    }
    let result = json!({"deleted": deleted, "_meta": revocation()});
    reply
        .result(
            session,
            decorate(result, &gw.upstreams.server_info(group, request), false),
        )
        .await;
    Outcome::Ok
}
