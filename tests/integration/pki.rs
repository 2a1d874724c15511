//! Certificates made at test time (rcgen): a test CA that issues server certificates for
//! loopback names, written as PEM files into a directory removed when the test ends; and
//! a TCP relay that counts the connections made through it.

#![allow(dead_code)]

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A directory of PEM files, removed when dropped.
pub struct PemDir(pub PathBuf);

impl PemDir {
    pub fn new(label: &str) -> PemDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("mrtr-tls-{label}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        PemDir(dir)
    }

    /// Writes `text` to `name` in the directory (replacing it atomically, as a Secret
    /// update does); returns its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        let partial = self.0.join(format!(".{name}.partial"));
        std::fs::write(&partial, text).expect("write a PEM file");
        std::fs::rename(&partial, &path).expect("move a PEM file in place");
        path
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for PemDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A certificate authority that exists only for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
}

/// A certificate and its private key, PEM.
pub struct Issued {
    pub cert: String,
    pub key: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("a CA key");
        let cert = params.self_signed(&key).expect("a self-signed CA");
        TestCa {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn issue(&self, names: &[&str]) -> Issued {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names.clone()).expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, names[0].as_str());
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("a signed leaf");
        Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// Writes the CA certificate as `ca.pem` into `dir`; returns its path.
    pub fn write(&self, dir: &PemDir) -> PathBuf {
        dir.write("ca.pem", &self.pem)
    }
}

impl Issued {
    /// Writes `NAME.crt` and `NAME.key` into `dir`; returns their paths.
    pub fn write(&self, dir: &PemDir, name: &str) -> (PathBuf, PathBuf) {
        (
            dir.write(&format!("{name}.crt"), &self.cert),
            dir.write(&format!("{name}.key"), &self.key),
        )
    }
}

/// A TCP relay on a loopback port to `target`, counting the connections it relays.
pub struct CountingRelay {
    pub port: u16,
    connections: Arc<AtomicUsize>,
}

impl CountingRelay {
    pub fn start(target: u16) -> CountingRelay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                counter.fetch_add(1, Ordering::SeqCst);
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                relay_both_ways(client, upstream);
            }
        });
        CountingRelay { port, connections }
    }

    pub fn count(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

fn relay_both_ways(client: TcpStream, upstream: TcpStream) {
    let (Ok(client_reader), Ok(upstream_reader)) = (client.try_clone(), upstream.try_clone())
    else {
        return;
    };
    std::thread::spawn(move || copy_then_close(client_reader, upstream));
    std::thread::spawn(move || copy_then_close(upstream_reader, client));
}

fn copy_then_close(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
