//! The MCP listener's certificate (`tls:`): loaded at start, where a pair that does not
//! load is a configuration error naming its key, and swapped whole on reload, where it is
//! logged and the pair in use kept. The listener's rustls configuration asks
//! `ListenerCert` for the certificate at every handshake, so a reload reaches new
//! connections without restarting the listener; connections already open keep theirs.
//! ALPN offers `h2` then `http/1.1`, or `http/1.1` alone with `http2: false`.

use super::{certified_key, read_certificates, read_private_key};
use crate::config::{ConfigError, ListenerTls};
use crate::keys::Reloadable;
use pingora::listeners::tls::TlsSettings;
use pingora::protocols::ALPN;
use pingora::tls::sign::CertifiedKey;
use pingora::tls::{ClientHello, ResolvesServerCert};
use std::fmt;
use std::sync::Arc;

/// The certificate the listener presents, swapped whole on reload.
pub struct ListenerCert {
    files: ListenerTls,
    current: Reloadable<CertifiedKey>,
}

/// Why a certificate and key did not load: the configuration key of the file at fault,
/// and what is wrong (naming the file, never the key's contents).
#[derive(Debug)]
pub struct LoadError {
    pub key: &'static str,
    pub problem: String,
}

impl ListenerCert {
    /// Loads the configured pair; the error names `tls.cert_file` or `tls.key_file`.
    pub fn load(files: &ListenerTls) -> Result<Arc<ListenerCert>, ConfigError> {
        let pair =
            load_pair(files).map_err(|e| ConfigError::at(format!("tls.{}", e.key), e.problem))?;
        Ok(Arc::new(ListenerCert {
            files: files.clone(),
            current: Reloadable::new(Arc::new(pair)),
        }))
    }

    /// Reads the pair again and puts it in use; on error the pair in use stays. `Ok` is a
    /// summary for the log.
    pub fn reload(&self) -> Result<String, String> {
        let pair = load_pair(&self.files).map_err(|e| format!("tls.{}: {}", e.key, e.problem))?;
        let summary = describe(&pair);
        self.current.store(pair);
        Ok(summary)
    }

    /// The listener's TLS settings: this certificate, and the ALPN protocols offered.
    pub fn settings(self: &Arc<Self>) -> Result<TlsSettings, ConfigError> {
        let mut settings = TlsSettings::intermediate("", "")
            .map_err(|e| ConfigError::at("tls", format!("cannot set up TLS: {e}")))?;
        settings.set_cert_resolver(self.clone());
        if self.files.http2 {
            settings.enable_h2();
        } else {
            settings.set_alpn(ALPN::H1);
        }
        Ok(settings)
    }

    /// The configured files.
    pub fn files(&self) -> &ListenerTls {
        &self.files
    }

    /// A summary of the certificate in use, for the log.
    pub fn describe(&self) -> String {
        describe(&self.current.load())
    }
}

/// The chain and key the files hold, checked to belong together.
fn load_pair(files: &ListenerTls) -> Result<CertifiedKey, LoadError> {
    let chain = read_certificates(&files.cert_file).map_err(|problem| LoadError {
        key: "cert_file",
        problem,
    })?;
    let key = read_private_key(&files.key_file).map_err(|problem| LoadError {
        key: "key_file",
        problem,
    })?;
    certified_key(chain, key).map_err(|problem| LoadError {
        key: "key_file",
        problem: format!("{}: {problem}", files.key_file.display()),
    })
}

/// The leaf certificate's names, subject and expiry.
fn describe(pair: &CertifiedKey) -> String {
    let Some(leaf) = pair.cert.first() else {
        return "a certificate without a leaf".to_string();
    };
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(leaf) else {
        return "a certificate".to_string();
    };
    let names: Vec<String> = match parsed.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .map(|n| n.to_string())
            .collect(),
        _ => Vec::new(),
    };
    format!(
        "certificate for [{}] ({}, valid until {})",
        names.join(", "),
        parsed.subject(),
        parsed.validity().not_after
    )
}

impl ResolvesServerCert for ListenerCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load())
    }
}

impl fmt::Debug for ListenerCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenerCert")
            .field("cert_file", &self.files.cert_file)
            .field("key_file", &self.files.key_file)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    /// A self-signed certificate for `name` and its key, written into `dir` as
    /// `name.crt` and `name.key`.
    fn write_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let certified = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        let (cert, key) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&cert, certified.cert.pem()).unwrap();
        std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
        (cert, key)
    }

    fn scratch(label: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("mrtr-listener-{label}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn files(cert: &Path, key: &Path) -> ListenerTls {
        ListenerTls {
            cert_file: cert.to_path_buf(),
            key_file: key.to_path_buf(),
            http2: true,
        }
    }

    #[test]
    fn a_pair_that_does_not_load_at_start_names_its_key() {
        let dir = scratch("start");
        let (cert, key) = write_pair(&dir, "a.example");
        let (_, other_key) = write_pair(&dir, "b.example");
        let missing = ListenerCert::load(&files(&dir.join("none.crt"), &key)).unwrap_err();
        assert_eq!(missing.path, "tls.cert_file");
        assert!(missing.problem.contains("none.crt"), "{missing}");
        let not_a_key = ListenerCert::load(&files(&cert, &cert)).unwrap_err();
        assert_eq!(not_a_key.path, "tls.key_file");
        let mismatched = ListenerCert::load(&files(&cert, &other_key)).unwrap_err();
        assert_eq!(mismatched.path, "tls.key_file");
        assert!(mismatched.problem.contains("not usable"), "{mismatched}");
        assert!(
            !mismatched.problem.contains("PRIVATE"),
            "no key material: {mismatched}"
        );
        assert!(ListenerCert::load(&files(&cert, &key)).is_ok());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_reload_swaps_the_pair_whole_or_keeps_the_one_in_use() {
        let dir = scratch("reload");
        let (cert, key) = write_pair(&dir, "first.example");
        let listener = ListenerCert::load(&files(&cert, &key)).unwrap();
        assert!(
            listener.describe().contains("first.example"),
            "{}",
            listener.describe()
        );
        let (next_cert, next_key) = write_pair(&dir, "next.example");
        std::fs::copy(&next_cert, &cert).unwrap();
        let half_done = listener.reload().unwrap_err();
        assert!(half_done.starts_with("tls.key_file"), "{half_done}");
        assert!(listener.describe().contains("first.example"), "kept");
        std::fs::copy(&next_key, &key).unwrap();
        let summary = listener.reload().unwrap();
        assert!(summary.contains("next.example"), "{summary}");
        assert!(listener.describe().contains("next.example"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
