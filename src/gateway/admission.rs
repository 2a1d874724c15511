//! Who may ask, and who is asking: the Host/Origin policy of the MCP listener, which
//! peers' forwarding headers are believed, and how a request's credentials become its
//! principal (swapped whole when the JWKS is reloaded).

use crate::config::{Config, ConfigError};
use crate::keys::Reloadable;
use crate::principal::{Authenticator, PrincipalSource, Unauthenticated};
use crate::protocol::cors::CorsPolicy;
use crate::protocol::forwarded::{self, TrustedPeers};
use crate::protocol::headers::EndToEnd;
use crate::protocol::host_check::HostPolicy;
use crate::protocol::oauth::PublicResource;
use crate::upstream::UpstreamGroup;
use pingora::protocols::http::ServerSession;
use std::sync::Arc;

pub struct Admission {
    pub host_policy: HostPolicy,
    /// Which web origins may read the gateway's answers (`cors_allowed_origins`).
    pub cors: CorsPolicy,
    /// The peers whose own forwarding headers are believed (`forwarded.trusted_peers`).
    pub trusted_peers: TrustedPeers,
    /// Where a request's principal comes from.
    pub principal_source: PrincipalSource,
    /// Turns credentials into principals; swapped whole when the JWKS is reloaded.
    pub authenticator: Arc<Reloadable<Authenticator>>,
    /// The URL clients reach the MCP listener at (`public_url`), when configured.
    pub public_url: Option<PublicResource>,
}

impl Admission {
    pub fn new(config: &Config) -> Result<Admission, ConfigError> {
        let authenticator = Authenticator::new(&config.principal)
            .map_err(|e| ConfigError::at("principal.jwt", e))?;
        let listen: std::net::SocketAddr = config.listen.parse().expect("validated listen address");
        let trusted_peers =
            TrustedPeers::parse(&config.forwarded.trusted_peers).map_err(|(i, problem)| {
                ConfigError::at(format!("forwarded.trusted_peers[{i}]"), problem)
            })?;
        let cors = config.cors_policy()?;
        if cors == CorsPolicy::AnyOrigin && listen.ip().is_loopback() {
            tracing::warn!(
                "cors_allowed_origins is *: any web page the user opens may call the MCP servers behind this loopback listener; list the origins to let in"
            );
        }
        Ok(Admission {
            host_policy: HostPolicy::for_listener(listen, &config.allowed_hosts),
            cors,
            trusted_peers,
            principal_source: config.principal.clone(),
            authenticator: Arc::new(Reloadable::new(Arc::new(authenticator))),
            public_url: config.public_url.as_deref().and_then(PublicResource::parse),
        })
    }

    /// The principal of a request; `Err` with a reason the client may see when its
    /// credentials do not verify (JWT principals).
    /// The principal header, when the request carries it more than once: which value
    /// names the caller would be anyone's guess (the upstream may read another).
    pub fn repeated_principal_header(&self, session: &ServerSession) -> Option<&str> {
        let name = self.principal_source.header_name()?;
        let values = session.req_header().headers.get_all(name).iter().count();
        (values > 1).then_some(name)
    }

    pub fn principal(&self, session: &ServerSession) -> Result<[u8; 32], Unauthenticated> {
        let value = self
            .principal_source
            .header_name()
            .and_then(|name| session.get_header(name))
            .map(|v| v.as_bytes());
        self.authenticator.load().principal(value)
    }

    /// This hop as the forwarding headers describe it: the client's address (whether its
    /// own forwarding headers are believed), the `Host` it named and the scheme.
    pub fn hop<'s>(&self, session: &'s ServerSession) -> Option<forwarded::Hop<'s>> {
        let peer = session.client_addr()?.as_inet()?.ip();
        Some(forwarded::Hop {
            peer,
            trusted: self.trusted_peers.contains(peer),
            host: super::request_host(session),
            proto: super::request_scheme(session),
        })
    }

    /// The URL clients reach `group` at: the group's `public_url`, else the listener's
    /// followed by the group's path, else this request's scheme and `Host` (which the
    /// host policy has checked) followed by it.
    pub fn public_resource(
        &self,
        session: &ServerSession,
        group: &UpstreamGroup,
    ) -> PublicResource {
        if let Some(url) = &group.public_url {
            return url.clone();
        }
        if let Some(base) = &self.public_url {
            return base.join(&group.path);
        }
        let authority = super::request_host(session)
            .map(str::to_string)
            .or_else(|| session.server_addr().map(|a| a.to_string()))
            .unwrap_or_default();
        let scheme = super::request_scheme(session);
        PublicResource::new(&format!("{scheme}://{authority}"), &group.path)
    }

    /// What a bridged request passes upstream: the client's end-to-end headers, as
    /// `group` lets them through, the forwarding headers naming the client, and the
    /// client's query string.
    pub fn end_to_end(&self, session: &ServerSession, group: &UpstreamGroup) -> EndToEnd {
        let client = &session.req_header().headers;
        let query = session.req_header().uri.query();
        let hop = self.hop(session);
        let trusted = hop.is_some_and(|hop| hop.trusted);
        let mut headers = EndToEnd::of(client, &group.forward_headers, trusted).with_query(query);
        if let Some(hop) = hop {
            for (name, value) in forwarded::forwarding_headers(client, &hop) {
                headers.push(name, value);
            }
        }
        headers
    }
}
