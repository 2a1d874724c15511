//! TLS to a group's `https://` endpoints. A group's settings (`upstreams[].tls`: a CA
//! bundle in place of the system roots, a client certificate, verification) are loaded
//! once, at start; each endpoint adds the name its certificate must be valid for, the URL's
//! host, which is also sent as SNI.
//!
//! The name is never empty, an IP address included: pingora's rustls connector skips every
//! certificate check for a peer whose SNI is empty. Verification is on unless the group is
//! configured `dangerously_accept_any_certificate`, which is logged as a warning at start.
//! Pingora pools connections by a peer hash that covers SNI, the client certificate and
//! the verify flags but not the CA bundle, so each group's connections also carry a pool
//! key of their own: a connection verified under one group's trust is never reused by
//! another's.

use super::{certified_key, read_certificates, read_private_key};
use crate::config::{ConfigError, UpstreamTls as UpstreamTlsConfig};
use pingora::protocols::tls::CaType;
use pingora::protocols::ALPN;
use pingora::tls::RootCertStore;
use pingora::upstreams::peer::{HttpPeer, Scheme};
use pingora::utils::tls::{parse_x509, CertKey, WrappedX509};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

/// What one group's endpoints are trusted by, and what the gateway presents to them.
pub struct GroupTls {
    /// CA certificates in place of the system roots; `None`: the system roots.
    ca: Option<Arc<CaType>>,
    /// The client certificate and key for endpoints that ask for one (mutual TLS).
    client_cert: Option<Arc<CertKey>>,
    /// Whether certificates are verified (`dangerously_accept_any_certificate` unset).
    verify: bool,
    /// Keeps the group's pooled connections apart from other groups'.
    pool_key: u64,
}

impl GroupTls {
    /// Loads `config` for the group `group` configured at `at` (`upstreams[i]`); errors
    /// name the key of the file that did not load.
    pub fn load(
        at: &str,
        group: &str,
        config: &UpstreamTlsConfig,
    ) -> Result<Arc<GroupTls>, ConfigError> {
        let ca = match &config.ca_file {
            Some(path) => Some(
                load_ca_bundle(path)
                    .map_err(|problem| ConfigError::at(format!("{at}.tls.ca_file"), problem))?,
            ),
            None => None,
        };
        let client_cert = match (&config.client_cert_file, &config.client_key_file) {
            (Some(cert), Some(key)) => Some(load_client_cert(at, cert, key)?),
            _ => None,
        };
        let verify = !config.dangerously_accept_any_certificate;
        if !verify {
            tracing::warn!(
                group,
                "dangerously_accept_any_certificate: the certificates of this group's https endpoints are NOT verified; anyone on the path can read and change its traffic"
            );
        }
        let mut pool_key = DefaultHasher::new();
        group.hash(&mut pool_key);
        Ok(Arc::new(GroupTls {
            ca,
            client_cert,
            verify,
            pool_key: pool_key.finish(),
        }))
    }
}

/// The CA certificates of a PEM bundle, each usable as a trust anchor.
fn load_ca_bundle(path: &Path) -> Result<Arc<CaType>, String> {
    let certificates = read_certificates(path)?;
    let mut store = RootCertStore::empty();
    for (i, certificate) in certificates.iter().enumerate() {
        store.add(certificate.clone()).map_err(|e| {
            format!(
                "{}: certificate {} is not usable as a CA: {e}",
                path.display(),
                i + 1
            )
        })?;
    }
    let wrapped: Vec<WrappedX509> = certificates
        .iter()
        .map(|c| WrappedX509::new(c.to_vec(), parse_x509))
        .collect();
    Ok(Arc::from(wrapped))
}

/// A client certificate chain and its key, checked to belong together.
fn load_client_cert(at: &str, cert: &Path, key: &Path) -> Result<Arc<CertKey>, ConfigError> {
    let chain = read_certificates(cert)
        .map_err(|p| ConfigError::at(format!("{at}.tls.client_cert_file"), p))?;
    let at_key = format!("{at}.tls.client_key_file");
    let private_key = read_private_key(key).map_err(|p| ConfigError::at(&at_key, p))?;
    let key_bytes = private_key.secret_der().to_vec();
    // Pingora turns the stored bytes back into a key on every handshake, and panics if
    // that fails: make sure it cannot.
    PrivateKeyDer::try_from(key_bytes.clone()).map_err(|_| {
        ConfigError::at(
            &at_key,
            format!("{}: the key's format is not recognised", key.display()),
        )
    })?;
    certified_key(chain.clone(), private_key)
        .map_err(|p| ConfigError::at(&at_key, format!("{}: {p}", key.display())))?;
    let chain = chain.iter().map(|c: &CertificateDer| c.to_vec()).collect();
    Ok(Arc::new(CertKey::new(chain, key_bytes)))
}

/// TLS to one endpoint: the name its certificate must be valid for (sent as SNI), and its
/// group's settings.
#[derive(Clone)]
pub struct EndpointTls {
    /// The endpoint URL's host: a DNS name or an IP address (without brackets).
    pub server_name: String,
    group: Arc<GroupTls>,
}

impl EndpointTls {
    pub fn new(server_name: &str, group: Arc<GroupTls>) -> EndpointTls {
        EndpointTls {
            server_name: server_name.to_string(),
            group,
        }
    }

    /// Whether the endpoint's certificate is verified.
    pub fn verifies(&self) -> bool {
        self.group.verify
    }

    /// Makes `peer` a TLS peer with these settings, speaking HTTP/1.1 only.
    pub fn configure(&self, peer: &mut HttpPeer) {
        peer.scheme = Scheme::HTTPS;
        peer.sni = self.server_name.clone();
        peer.client_cert_key = self.group.client_cert.clone();
        peer.group_key = self.group.pool_key;
        peer.options.ca = self.group.ca.clone();
        peer.options.verify_cert = self.group.verify;
        peer.options.verify_hostname = self.group.verify;
        peer.options.alpn = ALPN::H1;
    }
}

impl PartialEq for EndpointTls {
    fn eq(&self, other: &Self) -> bool {
        self.server_name == other.server_name && Arc::ptr_eq(&self.group, &other.group)
    }
}

impl Eq for EndpointTls {}

impl fmt::Debug for EndpointTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EndpointTls")
            .field("server_name", &self.server_name)
            .field("verify", &self.group.verify)
            .field("own_ca", &self.group.ca.is_some())
            .field("client_cert", &self.group.client_cert.is_some())
            .finish()
    }
}

/// What a failed TLS handshake says about the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// Its certificate did not verify: an unknown issuer, expired, or not valid for the
    /// endpoint's name.
    Untrusted,
    /// Anything else: it does not speak TLS, refused the gateway's certificate or
    /// protocol versions, broke off.
    Failed,
}

/// Whether pingora's error is a failed TLS handshake, and which kind. Pingora keeps
/// rustls's error only as text: a certificate that did not verify reads
/// "invalid peer certificate".
pub fn handshake_failure(e: &pingora::Error) -> Option<HandshakeFailure> {
    if *e.etype() != pingora::ErrorType::TLSHandshakeFailure {
        return None;
    }
    let context = e.context.as_ref().map(|c| c.as_str()).unwrap_or_default();
    Some(if context.contains("invalid peer certificate") {
        HandshakeFailure::Untrusted
    } else {
        HandshakeFailure::Failed
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tls_peer_names_its_server_and_verifies_by_default() {
        let system_roots = UpstreamTlsConfig::default();
        let group = GroupTls::load("upstreams[0]", "remote", &system_roots).unwrap();
        let tls = EndpointTls::new("127.0.0.1", group.clone());
        let mut peer = HttpPeer::new(
            "127.0.0.1:443".parse::<std::net::SocketAddr>().unwrap(),
            false,
            String::new(),
        );
        tls.configure(&mut peer);
        assert!(peer.is_tls());
        assert_eq!(
            peer.sni, "127.0.0.1",
            "an empty SNI would skip verification"
        );
        assert!(peer.options.verify_cert && peer.options.verify_hostname);
        assert_eq!(peer.options.alpn, ALPN::H1);
        let other = GroupTls::load("upstreams[1]", "other", &system_roots).unwrap();
        let mut elsewhere = peer.clone();
        EndpointTls::new("127.0.0.1", other).configure(&mut elsewhere);
        use pingora::upstreams::peer::Peer;
        assert_ne!(
            peer.reuse_hash(),
            elsewhere.reuse_hash(),
            "groups never share pooled connections"
        );
        let insecure = UpstreamTlsConfig {
            dangerously_accept_any_certificate: true,
            ..UpstreamTlsConfig::default()
        };
        let skipping = GroupTls::load("upstreams[0]", "g", &insecure).unwrap();
        assert!(!EndpointTls::new("h", skipping).verifies());
    }

    #[test]
    fn files_that_do_not_load_name_their_key() {
        let missing = UpstreamTlsConfig {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..UpstreamTlsConfig::default()
        };
        let e = GroupTls::load("upstreams[1]", "g", &missing).err().unwrap();
        assert_eq!(e.path, "upstreams[1].tls.ca_file");
        assert!(e.problem.contains("/nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn handshake_failures_are_told_apart() {
        use pingora::ErrorType::{ConnectRefused, TLSHandshakeFailure};
        let untrusted = pingora::Error::explain(
            TLSHandshakeFailure,
            "TLS connect() failed: invalid peer certificate: UnknownIssuer, SNI: 127.0.0.1",
        );
        assert_eq!(
            handshake_failure(&untrusted),
            Some(HandshakeFailure::Untrusted)
        );
        let alert = pingora::Error::explain(
            TLSHandshakeFailure,
            "TLS connect() failed: received fatal alert: HandshakeFailure, SNI: h",
        );
        assert_eq!(handshake_failure(&alert), Some(HandshakeFailure::Failed));
        assert_eq!(
            handshake_failure(&pingora::Error::new(ConnectRefused)),
            None
        );
    }
}
