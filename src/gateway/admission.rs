//! Who may ask, and who is asking: the Host/Origin policy of the MCP listener, which
//! peers' forwarding headers are believed, and how a request's credentials become its
//! principal (swapped whole when the JWKS is reloaded).

use crate::config::{Config, ConfigError};
use crate::keys::Reloadable;
use crate::principal::{Authenticator, PrincipalSource, Unauthenticated};
use crate::protocol::forwarded::TrustedPeers;
use crate::protocol::host_check::HostPolicy;
use pingora::protocols::http::ServerSession;
use std::sync::Arc;

pub struct Admission {
    pub host_policy: HostPolicy,
    /// The peers whose own forwarding headers are believed (`forwarded.trusted_peers`).
    pub trusted_peers: TrustedPeers,
    /// Where a request's principal comes from.
    pub principal_source: PrincipalSource,
    /// Turns credentials into principals; swapped whole when the JWKS is reloaded.
    pub authenticator: Arc<Reloadable<Authenticator>>,
}

impl Admission {
    pub fn new(config: &Config) -> Result<Admission, ConfigError> {
        let authenticator = Authenticator::new(&config.principal)
            .map_err(|e| ConfigError::at("principal.jwt", e))?;
        let listen = config.listen.parse().expect("validated listen address");
        let trusted_peers =
            TrustedPeers::parse(&config.forwarded.trusted_peers).map_err(|(i, problem)| {
                ConfigError::at(format!("forwarded.trusted_peers[{i}]"), problem)
            })?;
        Ok(Admission {
            host_policy: HostPolicy::for_listener(listen, &config.allowed_hosts),
            trusted_peers,
            principal_source: config.principal.clone(),
            authenticator: Arc::new(Reloadable::new(Arc::new(authenticator))),
        })
    }

    /// The principal of a request; `Err` with a reason the client may see when its
    /// credentials do not verify (JWT principals).
    pub fn principal(&self, session: &ServerSession) -> Result<[u8; 32], Unauthenticated> {
        let value = self
            .principal_source
            .header_name()
            .and_then(|name| session.get_header(name))
            .map(|v| v.as_bytes());
        self.authenticator.load().principal(value)
    }
}
