//! TLS material, read once and checked before pingora sees it: PEM certificate chains, CA
//! bundles and private keys, each failure naming its file (never a key's bytes), and a
//! chain with its key as rustls signs with it. `upstream` applies a group's settings to
//! the connections to its `https://` endpoints; `listener` serves the MCP listener's
//! certificate, swapped whole on reload; `handshakes` bounds the listener's handshakes.
//!
//! Everything here but `handshakes` runs at start or on a reload, never on a request
//! path. Pingora's own
//! constructors of certificate types panic on DER they cannot parse, so every certificate
//! is parsed here first with the same parser.

pub mod handshakes;
pub mod listener;
pub mod upstream;

use pingora::tls::sign::CertifiedKey;
use pingora::tls::CryptoProvider;
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;

/// Every certificate of a PEM file, in order; at least one, each one parseable.
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let shown = path.display();
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read {shown}: {}", pem_problem(&e)))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{shown}: {}", pem_problem(&e)))?;
    if certificates.is_empty() {
        return Err(format!("{shown} holds no PEM certificate"));
    }
    for (i, certificate) in certificates.iter().enumerate() {
        x509_parser::parse_x509_certificate(certificate)
            .map_err(|e| format!("{shown}: certificate {} does not parse: {e}", i + 1))?;
    }
    Ok(certificates)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1). The error names the file
/// and the kind of problem only: nothing of the file's contents.
pub fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let shown = path.display();
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        pem::Error::Io(e) => format!("cannot read {shown}: {e}"),
        pem::Error::NoItemsFound => format!("{shown} holds no PEM private key"),
        _ => format!("{shown} is not a valid PEM private key"),
    })
}

/// A certificate chain and its private key as rustls signs with them: the key parsed by
/// the process's crypto provider, and checked to belong to the chain's first certificate.
pub fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, String> {
    let provider = crypto_provider()?;
    CertifiedKey::from_der(chain, key, &provider).map_err(|e| {
        format!("the private key is not usable with the certificate's public key ({e})")
    })
}

/// The crypto provider pingora's rustls uses (ring), installed for the process if no
/// other is.
pub fn crypto_provider() -> Result<Arc<CryptoProvider>, String> {
    pingora::tls::install_default_crypto_provider();
    CryptoProvider::get_default()
        .cloned()
        .ok_or_else(|| "no TLS crypto provider is installed".to_string())
}

/// What is wrong with a PEM file, without its contents.
fn pem_problem(e: &pem::Error) -> String {
    match e {
        pem::Error::Io(e) => e.to_string(),
        pem::Error::NoItemsFound => "no PEM item found".to_string(),
        _ => "not valid PEM".to_string(),
    }
}
