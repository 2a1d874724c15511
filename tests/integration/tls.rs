//! TLS on both sides of the gateway, with certificates made at test time: HTTPS upstreams
//! (the Python SDK server under uvicorn) verified against a group's CA, and the MCP
//! listener serving HTTPS to the official clients, its certificate reloaded, HTTP/2 by
//! ALPN.

use crate::common::*;
use crate::pki::*;
use crate::scripted::{big_result_upstream, legacy_basics, Answer, ScriptedUpstream, Seen};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use mrtr_gateway::config::{Config, ListenerTls, UpstreamEra, UpstreamGroupConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::{rustls, TlsConnector};

const CLIENT_LIMIT: Duration = Duration::from_secs(60);

/// Which official client drives a flow.
#[derive(Clone, Copy, Debug)]
enum Sdk {
    Python,
    TypeScript,
}

/// Runs an official client script (`py_*_client.py` or `ts_*_client.mjs`, `era` legacy or
/// modern) against `url` with `scenario`, trusting `ca` when given.
fn client(sdk: Sdk, era: &str, url: &str, scenario: &str, ca: Option<&Path>) -> Vec<Value> {
    let (program, script, variable) = match sdk {
        Sdk::Python => (python(), format!("py_{era}_client.py"), "SSL_CERT_FILE"),
        Sdk::TypeScript => (
            node(),
            format!("ts_{era}_client.mjs"),
            "NODE_EXTRA_CA_CERTS",
        ),
    };
    let script = root().join("tests/clients").join(script);
    let env: Vec<(&str, &str)> = ca
        .map(|ca| (variable, ca.to_str().expect("a UTF-8 path")))
        .into_iter()
        .collect();
    let args = [script.to_str().expect("a UTF-8 path"), url, scenario];
    json_lines(&run_client_env(program, &args, &env, CLIENT_LIMIT))
}

/// The text of a client's `call` step.
fn call_text(lines: &[Value]) -> &str {
    lines
        .iter()
        .find(|l| l["step"] == "call")
        .and_then(|l| l["text"].as_str())
        .unwrap_or_else(|| panic!("no call step in {lines:#?}"))
}

/// A Python SDK server over HTTPS with a certificate `ca` issued for `names`.
struct HttpsUpstream {
    _server: Proc,
    port: u16,
}

impl HttpsUpstream {
    fn start(ca: &TestCa, names: &[&str], pems: &PemDir, label: &str) -> HttpsUpstream {
        let (cert, key) = ca.issue(names).write(pems, label);
        let (server, port) = start_python_https(&cert, &key);
        HttpsUpstream {
            _server: server,
            port,
        }
    }

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}/mcp", self.port)
    }
}

/// A Python SDK server over HTTPS with a certificate for 127.0.0.1 from a test CA, and
/// the CA's file.
fn trusted_upstream(pems: &PemDir) -> (HttpsUpstream, PathBuf) {
    let ca = TestCa::new("upstream CA");
    let ca_file = ca.write(pems);
    (
        HttpsUpstream::start(&ca, &["127.0.0.1"], pems, "server"),
        ca_file,
    )
}

/// A gateway whose one group trusts `ca_file` for its endpoint at `url`, the group
/// configured further by `tweak`.
fn gateway_trusting(
    url: &str,
    ca_file: &Path,
    tweak: impl FnOnce(&mut UpstreamGroupConfig),
) -> TestGateway {
    let ca_file = ca_file.to_path_buf();
    TestGateway::start_with(&[url], &test_keys(), move |c| {
        c.upstreams[0].tls.ca_file = Some(ca_file);
        tweak(&mut c.upstreams[0]);
    })
}

#[test]
fn bridged_and_legacy_clients_complete_flows_over_an_https_upstream() {
    let pems = PemDir::new("upstream");
    let (upstream, ca_file) = trusted_upstream(&pems);
    // TCP health checks run against the TLS endpoint while the flows do.
    let gw = gateway_trusting(&upstream.url(), &ca_file, |g| {
        g.health_check_interval_ms = 100
    });
    let modern = client(Sdk::Python, "modern", &gw.url, "elicit", None);
    assert_modern_call(&modern, "Python modern client, HTTPS upstream");
    assert_eq!(call_text(&modern), "Hello, Alice!");
    let modern = client(Sdk::TypeScript, "modern", &gw.url, "multi", None);
    assert_modern_call(&modern, "TypeScript modern client, HTTPS upstream");
    let legacy = client(Sdk::Python, "legacy", &gw.url, "elicit", None);
    assert!(
        legacy.iter().any(|l| l["step"] == "elicitation"),
        "{legacy:#?}"
    );
    assert_eq!(call_text(&legacy), "Hello, Alice!");
    println!("bridged (Python, TypeScript) and legacy (Python) flows over an HTTPS upstream: ok");
}

/// What a raw legacy `initialize` and a raw 2026-07-28 call get from a gateway whose
/// upstream the group does not trust, each with the connections that reached the upstream
/// so far. The group is `era: legacy`, so no era probe runs: each request makes one
/// exchange.
fn refused_twice(upstream_port: u16, ca_file: &Path) -> ((Reply, usize), (Value, usize)) {
    let relay = CountingRelay::start(upstream_port);
    let url = format!("https://127.0.0.1:{}/mcp", relay.port);
    let gw = gateway_trusting(&url, ca_file, |g| g.era = UpstreamEra::Legacy);
    let raw = Raw::new(&gw.url);
    let init = json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{
        "protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"1"}}});
    let legacy = raw.post(None, &init);
    let after_legacy = relay.count();
    let modern = ask_name(&raw, 2, json!({}));
    ((legacy, after_legacy), (modern, relay.count()))
}

/// A TLS acceptor serving `issued`'s certificate.
fn acceptor_for(issued: &Issued) -> tokio_rustls::TlsAcceptor {
    let chain = CertificateDer::pem_slice_iter(issued.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("certificate PEM");
    let key = PrivateKeyDer::from_pem_slice(issued.key.as_bytes()).expect("key PEM");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("a server certificate");
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// An HTTPS upstream that completes each handshake, reads the start of the request, then
/// reads nothing more and keeps the connection open (a stuck or hostile server), its
/// receive buffer small so that a large request fills it.
struct StalledHttpsUpstream {
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StalledHttpsUpstream {
    fn start(issued: &Issued) -> StalledHttpsUpstream {
        let acceptor = acceptor_for(issued);
        let socket = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = socket.local_addr().expect("address").port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            // Dropping the runtime at the end drops every connection it holds.
            runtime().block_on(async move {
                socket.set_nonblocking(true).expect("non-blocking");
                let socket = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(
                    std::os::fd::OwnedFd::from(socket),
                ));
                socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
                let listener = socket.listen(16).expect("listen");
                let accept = async {
                    while let Ok((tcp, _)) = listener.accept().await {
                        let acceptor = acceptor.clone();
                        tokio::spawn(async move {
                            let Ok(mut tls) = acceptor.accept(tcp).await else {
                                return;
                            };
                            let _ = tls.read(&mut [0u8; 1024]).await;
                            std::future::pending::<()>().await;
                        });
                    }
                };
                tokio::select! {
                    _ = stopped => {}
                    _ = accept => {}
                }
            });
        });
        StalledHttpsUpstream {
            port,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for StalledHttpsUpstream {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|stop| stop.send(()));
        let _ = self.thread.take().map(|thread| thread.join());
    }
}

/// A TLS front for a plain-TCP `target` that, when the target closes a connection, drops
/// its TLS side without `close_notify` (as servers and balancers that cut connections
/// do): the gateway reads an unexpected end of the TLS stream, not a close.
struct AbruptTlsFront {
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AbruptTlsFront {
    fn start(issued: &Issued, target: u16) -> AbruptTlsFront {
        let acceptor = acceptor_for(issued);
        let socket = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = socket.local_addr().expect("address").port();
        socket.set_nonblocking(true).expect("non-blocking");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime().block_on(async move {
                let listener = tokio::net::TcpListener::from_std(socket).expect("listener");
                let accept = async {
                    while let Ok((tcp, _)) = listener.accept().await {
                        tokio::spawn(front(acceptor.clone(), tcp, target));
                    }
                };
                tokio::select! {
                    _ = stopped => {}
                    _ = accept => {}
                }
            });
        });
        AbruptTlsFront {
            port,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

/// Relays one TLS connection to `target` until the target closes, then drops the TLS
/// stream without shutting it down.
async fn front(acceptor: tokio_rustls::TlsAcceptor, tcp: tokio::net::TcpStream, target: u16) {
    let Ok(tls) = acceptor.accept(tcp).await else {
        return;
    };
    let Ok(backend) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    let (mut tls_read, mut tls_write) = tokio::io::split(tls);
    let (mut backend_read, mut backend_write) = backend.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut tls_read, &mut backend_write).await;
        std::future::pending::<()>().await
    };
    let down = async {
        let mut buf = [0u8; 16 << 10];
        while let Ok(n) = backend_read.read(&mut buf).await {
            if n == 0 || tls_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
            let _ = tls_write.flush().await;
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

impl Drop for AbruptTlsFront {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|stop| stop.send(()));
        let _ = self.thread.take().map(|thread| thread.join());
    }
}

/// A DELETE that meets a pooled HTTPS connection the upstream closes without TLS's
/// `close_notify` is as unanswered as one meeting a plain close: it is sent again on a
/// fresh connection (a POST never is).
#[test]
fn a_delete_on_a_pooled_https_connection_cut_without_close_notify_is_sent_again() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if seen.method == "DELETE" && seen.on_connection > 0 {
            return Answer::silent().then_close();
        }
        legacy_basics(seen, "s1").unwrap_or_else(|| Answer::status(405, &[], b""))
    });
    let pems = PemDir::new("abrupt");
    let ca = TestCa::new("upstream CA");
    let ca_file = ca.write(&pems);
    let front = AbruptTlsFront::start(&ca.issue(&["127.0.0.1"]), upstream.port);
    let url = format!("https://127.0.0.1:{}/mcp", front.port);
    let gw = gateway_trusting(&url, &ca_file, |g| g.era = UpstreamEra::Legacy);
    let raw = Raw::new(&gw.url);
    let opened = raw.post(None, &initialize());
    assert_eq!(opened.status, 200);
    let token = opened.header_values("mcp-session-id")[0].to_string();
    let headers = [
        ("mcp-session-id", token.as_str()),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    let ended = raw.request("DELETE", &headers, None);
    assert_eq!(ended.status, 200, "the DELETE was not sent again");
    let deletes: Vec<Seen> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.method == "DELETE")
        .collect();
    assert_eq!(deletes.len(), 2, "{deletes:?}");
    assert!(
        deletes[0].on_connection > 0,
        "the first met a pooled connection"
    );
    assert_eq!(deletes[1].on_connection, 0, "sent again on a fresh one");
    drop(front);
}

/// A request larger than the kernel holds for an HTTPS upstream that stopped reading: its
/// write fails at the response timeout, and the connection's close cannot send TLS's
/// `close_notify` into the full socket. The client gets its error and the connection
/// is let go, rather than both waiting on that close for ever.
#[test]
fn an_https_upstream_that_stops_reading_a_request_neither_holds_the_client_nor_the_connection() {
    let pems = PemDir::new("stalled");
    let ca = TestCa::new("upstream CA");
    let ca_file = ca.write(&pems);
    let upstream = StalledHttpsUpstream::start(&ca.issue(&["127.0.0.1"]));
    let url = format!("https://127.0.0.1:{}/mcp", upstream.port);
    let gw = gateway_trusting(&url, &ca_file, |g| {
        g.era = UpstreamEra::Legacy;
        g.response_timeout_ms = 500;
    });
    let raw = Raw::new(&gw.url);
    let blob = "x".repeat(3 << 20);
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "store", "arguments": {"blob": blob}}});
    let reply = raw.post(None, &call);
    let status = reply.status;
    let body = reply.json();
    assert_eq!(
        (status, &body["id"]),
        (504, &json!(7)),
        "the client is told its upstream did not answer: {body}"
    );
    let admin = gw.admin.clone();
    wait_until(
        "the upstream connection let go",
        Duration::from_secs(10),
        || metric(&admin, "mrtr_gateway_upstream_connections") == 0.0,
    );
    drop(upstream);
}

#[test]
fn an_upstream_certificate_the_group_does_not_trust_is_refused_naming_the_group() {
    let pems = PemDir::new("untrusted");
    let trusted = TestCa::new("the group's CA");
    let ca_file = trusted.write(&pems);
    let rogue = TestCa::new("a CA the group does not know");
    let impostor = HttpsUpstream::start(&rogue, &["127.0.0.1"], &pems, "impostor");
    let misnamed = HttpsUpstream::start(&trusted, &["mcp.example.com"], &pems, "misnamed");
    let group = "upstream group 'default'";
    let untrusted = "presented a certificate the gateway does not trust";
    let names_both = |m: &str| m.contains(group) && m.contains(untrusted);
    for (what, upstream) in [("unknown issuer", &impostor), ("another name", &misnamed)] {
        let ((legacy, after_legacy), (modern, after_modern)) =
            refused_twice(upstream.port, &ca_file);
        assert_eq!(legacy.status, 502, "{what}");
        let body = legacy.json();
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(names_both(message), "{what}: {body}");
        let message = modern["error"]["message"].as_str().unwrap_or_default();
        assert!(names_both(message), "{what}: {modern}");
        // One handshake per request, none made again.
        assert_eq!(
            after_legacy, 1,
            "{what}: connections for the legacy request"
        );
        assert_eq!(
            after_modern, 2,
            "{what}: connections after the bridged call"
        );
        println!("a certificate with {what}: refused once per request, naming the group");
    }
}

#[test]
fn an_upstream_that_requires_a_client_certificate_gets_the_groups() {
    let pems = PemDir::new("mutual");
    let server_ca = TestCa::new("upstream CA");
    let ca_file = server_ca.write(&pems);
    let (cert, key) = server_ca.issue(&["127.0.0.1"]).write(&pems, "server");
    let client_ca = TestCa::new("the upstream's client CA");
    let client_ca_file = pems.write("client-ca.pem", &client_ca.pem);
    let (client_cert, client_key) = client_ca.issue(&["mrtr-gateway"]).write(&pems, "gateway");
    let flags = [OsStr::new("--tls-client-ca"), client_ca_file.as_os_str()];
    let (_server, port) = start_python_https_with(&cert, &key, &flags);
    let url = format!("https://127.0.0.1:{port}/mcp");
    // With the group's client certificate, bridged and legacy flows complete.
    let gw = gateway_trusting(&url, &ca_file, |g| {
        g.tls.client_cert_file = Some(client_cert);
        g.tls.client_key_file = Some(client_key);
    });
    let modern = client(Sdk::Python, "modern", &gw.url, "elicit", None);
    assert_modern_call(
        &modern,
        "Python modern client, upstream wanting a client certificate",
    );
    assert_eq!(call_text(&modern), "Hello, Alice!");
    let legacy = client(Sdk::Python, "legacy", &gw.url, "elicit", None);
    assert_eq!(call_text(&legacy), "Hello, Alice!");
    // Without one, the server closes the connection (uvicorn sends no alert), and the
    // client is told which group failed.
    let bare = gateway_trusting(&url, &ca_file, |g| g.era = UpstreamEra::Legacy);
    let refused = ask_name(&Raw::new(&bare.url), 1, json!({}));
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("upstream group 'default' failed: "),
        "{refused}"
    );
    println!("mutual TLS upstream: served with the group's client certificate, refused without: {message}");
}

#[test]
fn connections_to_an_https_upstream_are_pooled() {
    let pems = PemDir::new("pooled");
    let (upstream, ca_file) = trusted_upstream(&pems);
    let relay = CountingRelay::start(upstream.port);
    let url = format!("https://127.0.0.1:{}/mcp", relay.port);
    let gw = gateway_trusting(&url, &ca_file, |_| {});
    let raw = Raw::new(&gw.url);
    let session = raw.initialize(json!({}));
    let calls = 4;
    for id in 0..calls {
        let add = json!({"jsonrpc":"2.0","id":10 + id,"method":"tools/call",
            "params":{"name":"add","arguments":{"a":id,"b":1}}});
        let mut reply = raw.post(Some(&session), &add);
        assert_eq!(reply.status, 200);
        Raw::messages_until(&mut reply, |m| m.get("result").is_some());
    }
    let exchanges = 2 + calls as usize;
    let connections = relay.count();
    println!("{exchanges} exchanges over {connections} TLS connection(s)");
    assert!(
        connections < exchanges,
        "{connections} connections for {exchanges} exchanges"
    );
}

/// A gateway whose MCP listener serves TLS with a certificate for 127.0.0.1 from a test
/// CA, the files it reads, and the CA's.
struct TlsGateway {
    gw: TestGateway,
    url: String,
    pems: PemDir,
    ca: TestCa,
    ca_file: PathBuf,
    cert: PathBuf,
}

impl TlsGateway {
    fn start(upstream: &str, tweak: impl FnOnce(&mut Config)) -> TlsGateway {
        let pems = PemDir::new("listener");
        let ca = TestCa::new("listener CA");
        let ca_file = ca.write(&pems);
        let (cert, key) = ca
            .issue(&["127.0.0.1", "localhost"])
            .write(&pems, "listener");
        let files = ListenerTls {
            cert_file: cert.clone(),
            key_file: key.clone(),
            http2: true,
        };
        let gw = TestGateway::start_with(&[upstream], &test_keys(), move |c| {
            c.tls = Some(files);
            c.keys_poll_ms = 100;
            tweak(c);
        });
        let url = gw.url.replacen("http://", "https://", 1);
        TlsGateway {
            gw,
            url,
            pems,
            ca,
            ca_file,
            cert,
        }
    }

    /// A TLS client that trusts the test CA only and offers `alpn`.
    fn client(&self, alpn: &[&str]) -> TlsConnector {
        tls_client(&self.ca.pem, alpn)
    }
}

fn tls_client(ca_pem: &str, alpn: &[&str]) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(certificate.expect("CA PEM")).expect("a CA");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
    TlsConnector::from(Arc::new(config))
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

async fn tls_connect(connector: &TlsConnector, port: u16) -> Tls {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the gateway");
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    connector.connect(name, tcp).await.expect("a TLS handshake")
}

/// The protocol the handshake settled on by ALPN, if any.
fn alpn_of(stream: &Tls) -> Option<String> {
    let protocol = stream.get_ref().1.alpn_protocol()?;
    Some(String::from_utf8_lossy(protocol).into_owned())
}

/// The DER of the first certificate in `pem`.
fn der_of(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .expect("a certificate")
        .to_vec()
}

/// The certificate a new connection to `port` is presented.
fn presented(connector: &TlsConnector, port: u16) -> Vec<u8> {
    runtime().block_on(async {
        let stream = tls_connect(connector, port).await;
        let chain = stream.get_ref().1.peer_certificates().expect("a chain");
        chain[0].to_vec()
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// `wait_until` (10 s) from async code, on a blocking thread, so that the runtime's
/// connections go on meanwhile.
async fn wait_off_runtime(what: &'static str, cond: impl FnMut() -> bool + Send + 'static) {
    tokio::task::spawn_blocking(move || wait_until(what, Duration::from_secs(10), cond))
        .await
        .expect("the wait");
}

type H2 = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// An HTTP/2 connection over TLS (ALPN `h2`).
async fn h2_connect(connector: &TlsConnector, port: u16) -> H2 {
    let stream = tls_connect(connector, port).await;
    assert_eq!(alpn_of(&stream).as_deref(), Some("h2"), "ALPN chose HTTP/2");
    let io = hyper_util::rt::TokioIo::new(stream);
    let executor = hyper_util::rt::TokioExecutor::new();
    let (sender, connection) = hyper::client::conn::http2::handshake(executor, io)
        .await
        .expect("an HTTP/2 handshake");
    tokio::spawn(connection);
    sender
}

/// A POST of `body` to `url` with `headers`, for an HTTP/2 connection.
fn h2_request(url: &str, headers: &[(&str, String)], body: &Value) -> http::Request<Full<Bytes>> {
    let mut request = http::Request::post(url);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    request
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a request")
}

/// Posts `body` with `headers` over HTTP/2; the status, headers and JSON-RPC messages
/// (the JSON body, or every SSE event's data).
async fn h2_post(
    h2: &mut H2,
    url: &str,
    headers: &[(&str, String)],
    body: &Value,
) -> (u16, http::HeaderMap, Vec<Value>) {
    let response = h2
        .send_request(h2_request(url, headers, body))
        .await
        .expect("a response");
    assert_eq!(response.version(), http::Version::HTTP_2);
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.expect("the body").to_bytes();
    let text = String::from_utf8_lossy(&bytes);
    let messages = match serde_json::from_str(&text) {
        Ok(json) => vec![json],
        Err(_) => text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|data| serde_json::from_str(data.trim()).ok())
            .collect(),
    };
    (parts.status.as_u16(), parts.headers, messages)
}

fn legacy_headers(session: Option<&str>) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("content-type", "application/json".to_string()),
        ("accept", "application/json, text/event-stream".to_string()),
        ("mcp-protocol-version", "2025-11-25".to_string()),
    ];
    headers.extend(session.map(|s| ("mcp-session-id", s.to_string())));
    headers
}

fn initialize() -> Value {
    json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{
        "protocolVersion":"2025-11-25","capabilities":{"elicitation":{}},
        "clientInfo":{"name":"h2-test","version":"1"}}})
}

#[test]
fn official_clients_connect_to_the_tls_listener_trusting_a_test_ca() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let tls = TlsGateway::start(&url, |_| {});
    let ca = Some(tls.ca_file.as_path());
    for sdk in [Sdk::Python, Sdk::TypeScript] {
        let legacy = client(sdk, "legacy", &tls.url, "elicit", ca);
        assert_eq!(call_text(&legacy), "Hello, Alice!", "{sdk:?} legacy");
        let modern = client(sdk, "modern", &tls.url, "elicit", ca);
        assert_modern_call(&modern, &format!("{sdk:?} modern client over TLS"));
        println!("{sdk:?} client over TLS: a legacy session and a 2026-07-28 MRTR flow ok");
    }
}

/// HTTP/2 connections that finish TLS and then send nothing, or only part of the client
/// preface, are closed at the header timeout, as an HTTP/1.1 request's header is: they
/// cannot hold every slot under `limits.max_client_connections` and lock clients out.
#[test]
fn an_http2_connection_without_its_preface_is_closed_at_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tripwire = Tripwire::start();
    let tls = TlsGateway::start(&tripwire.url(), |c| {
        c.limits.header_timeout_ms = 300;
        c.limits.max_client_connections = 4;
    });
    let connector = tls.client(&["h2"]);
    let admin = tls.gw.admin.clone();
    runtime().block_on(async {
        let mut silent = Vec::new();
        for partial in [
            &b""[..],
            b"PRI * HTTP/2.0\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ] {
            let mut stream = tls_connect(&connector, tls.gw.port).await;
            assert_eq!(alpn_of(&stream).as_deref(), Some("h2"));
            stream.write_all(partial).await.expect("sent");
            silent.push(stream);
        }
        for mut stream in silent {
            let mut rest = Vec::new();
            // Closed (a GOAWAY or nothing, then the end), not left open.
            let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest));
            assert!(
                read.await.is_ok(),
                "an HTTP/2 connection without its preface stayed open"
            );
        }
        let connections = move || metric(&admin, "mrtr_gateway_client_connections") == 0.0;
        wait_off_runtime("every slot freed", connections).await;
        // A client with its preface is served (by a tripwire upstream: 502, not the
        // connection cap's 503).
        let mut h2 = h2_connect(&connector, tls.gw.port).await;
        let url = format!("https://127.0.0.1:{}/mcp", tls.gw.port);
        let (status, _, _) = h2_post(&mut h2, &url, &legacy_headers(None), &initialize()).await;
        assert_eq!(status, 502);
    });
}

/// Connections that stall in their TLS handshake (a ClientHello's first bytes, then
/// nothing) are closed at the header timeout, not pingora's minute: a flood of them
/// cannot hold the descriptors real clients need, and a real client is served beside
/// them.
#[test]
fn a_stalled_tls_handshake_is_closed_at_the_header_timeout() {
    use std::io::{Read, Write};
    let tripwire = Tripwire::start();
    let tls = TlsGateway::start(&tripwire.url(), |c| {
        c.limits.header_timeout_ms = 300;
        c.limits.max_client_connections = 4;
    });
    let started = Instant::now();
    let stalled: Vec<std::net::TcpStream> = (0..8)
        .map(|_| {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", tls.gw.port)).unwrap();
            // A TLS record header and the start of a ClientHello.
            stream
                .write_all(&[
                    0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
                ])
                .unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            stream
        })
        .collect();
    for mut stream in stalled {
        let mut byte = [0u8; 64];
        // Closed (0 bytes, or a reset), not left to time out the read.
        let read = stream.read(&mut byte);
        assert!(
            !matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut),
            "still open after {:?}",
            started.elapsed()
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let connector = tls.client(&["http/1.1"]);
    assert!(
        !presented(&connector, tls.gw.port).is_empty(),
        "a real client is served"
    );
}

#[test]
fn a_reloaded_listener_certificate_reaches_new_connections_and_a_bad_one_is_not_used() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let tls = TlsGateway::start(&url, |_| {});
    let connector = tls.client(&["http/1.1"]);
    let first = std::fs::read_to_string(&tls.cert).expect("the first certificate");
    assert_eq!(presented(&connector, tls.gw.port), der_of(&first));
    let renewed = tls.ca.issue(&["127.0.0.1"]);
    renewed.write(&tls.pems, "listener");
    wait_until("the renewed certificate", Duration::from_secs(10), || {
        presented(&connector, tls.gw.port) == der_of(&renewed.cert)
    });
    let ca = Some(tls.ca_file.as_path());
    let legacy = client(Sdk::Python, "legacy", &tls.url, "basic", ca);
    assert!(legacy.iter().any(|l| l["step"] == "call"), "{legacy:#?}");
    let failed = |gw: &TestGateway| {
        metric_with(
            &gw.admin,
            "mrtr_gateway_reloads_total",
            "file=\"tls\",outcome=\"error\"",
        )
    };
    assert_eq!(failed(&tls.gw), Some(0.0));
    tls.pems.write(
        "listener.key",
        "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n",
    );
    wait_until(
        "the bad key's reload to fail",
        Duration::from_secs(10),
        || failed(&tls.gw) == Some(1.0),
    );
    assert_eq!(presented(&connector, tls.gw.port), der_of(&renewed.cert));
    println!("a renewed certificate reached new connections; a bad key was refused and the renewed pair kept");
}

#[test]
fn http2_over_tls_serves_pass_through_and_the_bridge() {
    let (_upstream, upstream_url) = start_upstream(Upstream::Python);
    let tls = TlsGateway::start(&upstream_url, |_| {});
    let connector = tls.client(&["h2", "http/1.1"]);
    let url = tls.url.clone();
    runtime().block_on(async move {
        let mut h2 = h2_connect(&connector, tls.gw.port).await;
        let (status, headers, messages) = h2_post(&mut h2, &url, &legacy_headers(None), &initialize()).await;
        assert_eq!(status, 200, "{messages:?}");
        assert!(messages[0]["result"]["protocolVersion"].is_string(), "{messages:?}");
        let session = headers["mcp-session-id"].to_str().expect("a session id").to_string();
        let initialized = json!({"jsonrpc":"2.0","method":"notifications/initialized"});
        let with_session = legacy_headers(Some(&session));
        let (status, _, _) = h2_post(&mut h2, &url, &with_session, &initialized).await;
        assert_eq!(status, 202);
        let add = json!({"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"add","arguments":{"a":2,"b":3}}});
        let (status, _, messages) = h2_post(&mut h2, &url, &with_session, &add).await;
        assert_eq!(status, 200);
        let result = messages.iter().find(|m| m["id"] == 2).expect("the call's result");
        assert_eq!(result["result"]["content"][0]["text"], "2+3=5", "{result}");
        println!("HTTP/2 over TLS: legacy pass-through ok");
        let call = json!({"name": "ask_name", "arguments": {}});
        let caps = json!({"elicitation": {}});
        let (headers, body) = modern_request(3, "tools/call", call.clone(), caps.clone());
        let (status, _, first) = h2_post(&mut h2, &url, &headers, &body).await;
        assert_eq!(status, 200, "{first:?}");
        let answered = answer(&first[0], json!({"name": "Alice"}));
        let retry = tool_params("ask_name", answered);
        let (headers, body) = modern_request(4, "tools/call", retry, caps);
        let (status, _, last) = h2_post(&mut h2, &url, &headers, &body).await;
        assert_eq!(status, 200, "{last:?}");
        assert_eq!(last[0]["result"]["content"][0]["text"], "Hello, Alice!", "{last:?}");
        println!("HTTP/2 over TLS: a bridged call with an elicitation ok");
    });
}

/// The answer to a HEAD over HTTP/2 is its header alone: a body there is a protocol
/// error to the client's HTTP/2 library, which would see no answer at all.
#[test]
fn a_head_request_over_http2_gets_the_header_alone() {
    let (_upstream, upstream_url) = start_upstream(Upstream::Python);
    let tls = TlsGateway::start(&upstream_url, |_| {});
    let connector = tls.client(&["h2"]);
    let url = tls.url.clone();
    runtime().block_on(async move {
        let mut h2 = h2_connect(&connector, tls.gw.port).await;
        let head = http::Request::head(&url)
            .body(Full::new(Bytes::new()))
            .expect("a request");
        let response = h2.send_request(head).await.expect("an answer");
        assert_eq!(response.status(), 405);
        let body = response.into_body().collect().await;
        let body = body.expect("no protocol error").to_bytes();
        assert!(body.is_empty(), "{body:?}");
    });
}

/// An HTTP/2 connection carries at most `limits.max_streams_per_connection` requests at
/// once (its SETTINGS_MAX_CONCURRENT_STREAMS), 32 unless configured: each may hold an
/// upstream connection, so the connection cap bounds those only with it.
#[test]
fn an_http2_connection_carries_at_most_the_configured_streams_at_once() {
    let tripwire = Tripwire::start();
    for (configured, advertised) in [(None, 32), (Some(3), 3)] {
        let tls = TlsGateway::start(&tripwire.url(), |c| {
            if let Some(streams) = configured {
                c.limits.max_streams_per_connection = streams;
            }
        });
        let connector = tls.client(&["h2"]);
        let (port, url) = (tls.gw.port, tls.url.clone());
        let streams = runtime().block_on(async move {
            let stream = tls_connect(&connector, port).await;
            let (mut h2, connection) = h2::client::handshake(stream).await.expect("a handshake");
            tokio::spawn(connection);
            // Once a request was answered, the server's SETTINGS are in.
            let head = http::Request::head(url.as_str())
                .body(())
                .expect("a request");
            let (response, _) = h2.send_request(head, true).expect("a stream");
            assert_eq!(response.await.expect("an answer").status(), 405);
            h2.current_max_send_streams()
        });
        assert_eq!(streams, advertised, "configured {configured:?}");
    }
    assert_eq!(tripwire.count(), 0);
}

/// An HTTP/2 client may split its cookies over several `cookie` fields (browsers do);
/// the upstream, over HTTP/1.1, gets them joined in one `Cookie` header (RFC 9113
/// §8.2.3), through pass-through and the bridge alike: servers such as Starlette read
/// only the first.
#[test]
fn an_http2_clients_cookie_pieces_reach_the_upstream_as_one_header() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(reply) = legacy_basics(seen, "s1") {
            return reply;
        }
        let tools = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
        Answer::json(200, &tools)
    });
    let tls = TlsGateway::start(&upstream.url(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let connector = tls.client(&["h2"]);
    let url = tls.url.clone();
    let cookies = [("cookie", "a=1".to_string()), ("cookie", "b=2".to_string())];
    runtime().block_on(async move {
        let mut h2 = h2_connect(&connector, tls.gw.port).await;
        let mut headers = legacy_headers(None);
        headers.extend(cookies.iter().cloned());
        let (status, _, messages) = h2_post(&mut h2, &url, &headers, &initialize()).await;
        assert_eq!(status, 200, "{messages:?}");
        let (mut headers, body) = modern_request(2, "tools/list", json!({}), json!({}));
        headers.extend(cookies.iter().cloned());
        let (status, _, messages) = h2_post(&mut h2, &url, &headers, &body).await;
        assert_eq!(status, 200, "{messages:?}");
    });
    let initializes: Vec<Seen> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
        .collect();
    assert_eq!(initializes.len(), 2, "pass-through's and the bridge's");
    for seen in initializes {
        assert_eq!(
            seen.headers_named("cookie"),
            ["a=1; b=2"],
            "{:?}",
            seen.headers
        );
    }
}

/// An HTTP/2 client that resets its stream before its answer (RST_STREAM, as an aborted
/// fetch does) cancels the bridged call as closing an HTTP/1.1 connection does: the
/// round ends and the call's upstream session is deleted, which ends the tool; the
/// connection serves on.
#[test]
fn an_http2_client_that_resets_its_stream_cancels_the_call() {
    let sessions = std::sync::atomic::AtomicUsize::new(0);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let body = seen.json().unwrap_or_default();
        if body["method"] == "initialize" {
            let n = sessions.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return legacy_basics(seen, &format!("s{n}")).expect("initialize");
        }
        if let Some(answer) = legacy_basics(seen, "unused") {
            return answer;
        }
        match body["params"]["name"].as_str() {
            Some("add") => Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": body["id"],
                "result": {"content": [{"type": "text", "text": "5"}]}}),
            ),
            // The tool runs on: its stream is primed and stays open.
            _ => Answer::sse(&[]).event(Some("c1"), &json!("")),
        }
    });
    let tls = TlsGateway::start(&upstream.url(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let connector = tls.client(&["h2", "http/1.1"]);
    let (url, admin) = (tls.url.clone(), tls.gw.admin.clone());
    let rounds = move || metric(&admin, "mrtr_gateway_active_rounds");
    let seen = || upstream.requests();
    let call_session = || {
        let calls = seen();
        let call = calls
            .iter()
            .find(|s| s.jsonrpc_method().as_deref() == Some("tools/call"));
        call.and_then(|s| s.header("mcp-session-id").map(str::to_string))
    };
    runtime().block_on(async {
        let mut h2 = h2_connect(&connector, tls.gw.port).await;
        let slow = json!({"name": "slow", "arguments": {}});
        let (headers, body) = modern_request(1, "tools/call", slow, json!({}));
        let mut request = http::Request::post(&url);
        for (name, value) in &headers {
            request = request.header(*name, value);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("a request");
        let pending = tokio::spawn(h2.send_request(request));
        let running = rounds.clone();
        wait_off_runtime("the call running", move || running() == 1.0).await;
        pending.abort();
        wait_off_runtime("the round ended", move || rounds() == 0.0).await;
        let add = json!({"name": "add", "arguments": {"a": 2, "b": 3}});
        let (headers, body) = modern_request(2, "tools/call", add, json!({}));
        let (status, _, messages) = h2_post(&mut h2, &url, &headers, &body).await;
        assert_eq!(status, 200, "{messages:?}");
        assert_eq!(
            messages[0]["result"]["content"][0]["text"], "5",
            "{messages:?}"
        );
    });
    let session = call_session().expect("the call went up in a session");
    wait_until(
        "the call's session deleted",
        Duration::from_secs(10),
        || {
            let deleted =
                |s: &Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some(&session);
            seen().iter().any(deleted)
        },
    );
}

#[test]
fn requests_over_tls_are_forwarded_as_https_and_checked_by_their_authority() {
    let upstream = ScriptedUpstream::start(|seen| {
        legacy_basics(seen, "s-1").unwrap_or_else(|| Answer::status(400, &[], b""))
    });
    let tls = TlsGateway::start(&upstream.url(), |_| {});
    let connector = tls.client(&["h2", "http/1.1"]);
    let (port, url) = (tls.gw.port, tls.url.clone());
    let seen = runtime().block_on(async move {
        let mut h2 = h2_connect(&connector, port).await;
        let (status, _, _) = h2_post(&mut h2, &url, &legacy_headers(None), &initialize()).await;
        assert_eq!(status, 200);
        let mut foreign = legacy_headers(None);
        foreign.push(("origin", "https://evil.example".to_string()));
        let (status, _, _) = h2_post(&mut h2, &url, &foreign, &initialize()).await;
        assert_eq!(status, 403, "a foreign Origin over HTTP/2");
        upstream.requests()
    });
    assert_eq!(seen.len(), 1, "only the first request went upstream");
    let authority = format!("127.0.0.1:{}", tls.gw.port);
    let expected = [
        ("x-forwarded-proto", "https".to_string()),
        (
            "forwarded",
            format!("for=127.0.0.1;host=\"{authority}\";proto=https"),
        ),
        ("x-forwarded-host", authority.clone()),
    ];
    for (name, value) in expected {
        assert_eq!(seen[0].headers_named(name), [value.as_str()], "{name}");
    }
}

#[test]
fn http2_false_offers_http1_only() {
    let tripwire = Tripwire::start();
    let tls = TlsGateway::start(&tripwire.url(), |c| {
        if let Some(files) = c.tls.as_mut() {
            files.http2 = false;
        }
    });
    let connector = tls.client(&["h2", "http/1.1"]);
    let alpn = runtime().block_on(async { alpn_of(&tls_connect(&connector, tls.gw.port).await) });
    assert_eq!(alpn.as_deref(), Some("http/1.1"));
}

#[test]
fn the_connection_cap_counts_tls_connections_and_answers_http2_ones_503() {
    let tripwire = Tripwire::start();
    let tls = TlsGateway::start(&tripwire.url(), |c| c.limits.max_client_connections = 1);
    let (h1, h2) = (tls.client(&["http/1.1"]), tls.client(&["h2"]));
    let (port, url, admin) = (tls.gw.port, tls.url.clone(), tls.gw.admin.clone());
    runtime().block_on(async move {
        let _held = tls_connect(&h1, port).await;
        wait_until(
            "the first TLS connection to hold the slot",
            Duration::from_secs(10),
            || metric(&admin, "mrtr_gateway_client_connections") == 1.0,
        );
        let mut refused = h2_connect(&h2, port).await;
        let (status, _, messages) =
            h2_post(&mut refused, &url, &legacy_headers(None), &initialize()).await;
        assert_eq!(status, 503, "{messages:?}");
        let message = messages[0]["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("maximum number of client connections"),
            "{message}"
        );
        let mut plain = tls_connect(&h1, port).await;
        plain
            .write_all(b"GET /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            .await
            .expect("a request");
        let mut head = [0u8; 12];
        plain.read_exact(&mut head).await.expect("a status line");
        assert_eq!(&head, b"HTTP/1.1 503");
    });
    assert_eq!(tripwire.count(), 0);
}

/// An HTTP/2 connection over the cap whose client opens no flow-control window: the 503's
/// body can never go out, and the connection is closed anyway, not held uncounted.
#[test]
fn an_http2_connection_over_the_cap_that_takes_no_data_is_closed() {
    let tripwire = Tripwire::start();
    let tls = TlsGateway::start(&tripwire.url(), |c| c.limits.max_client_connections = 1);
    let (h1, h2) = (tls.client(&["http/1.1"]), tls.client(&["h2"]));
    let (port, url, admin) = (tls.gw.port, tls.url.clone(), tls.gw.admin.clone());
    runtime().block_on(async move {
        let _held = tls_connect(&h1, port).await;
        wait_off_runtime("the first TLS connection to hold the slot", move || {
            metric(&admin, "mrtr_gateway_client_connections") == 1.0
        })
        .await;
        let io = hyper_util::rt::TokioIo::new(tls_connect(&h2, port).await);
        let (mut sender, connection) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .initial_stream_window_size(0)
                .handshake::<_, Full<Bytes>>(io)
                .await
                .expect("an HTTP/2 handshake");
        let connection = tokio::spawn(connection);
        let request = h2_request(&url, &legacy_headers(None), &initialize());
        let response = sender.send_request(request).await.expect("a response");
        assert_eq!(response.status(), 503);
        // Its body is never read: no window is ever opened.
        let closed = tokio::time::timeout(Duration::from_secs(10), connection).await;
        assert!(closed.is_ok(), "the refused connection is still open");
        drop(response);
    });
    assert_eq!(tripwire.count(), 0);
}

/// A TLS client that stops reading loses its response at the write timeout as a plain
/// one does: closing the connection must not wait for ever to write its close_notify
/// behind the queued bytes it will never read.
#[test]
fn a_tls_client_that_stops_reading_loses_its_response_at_the_write_timeout() {
    let upstream = big_result_upstream(8 << 20);
    let tls = TlsGateway::start(&upstream.url(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.limits.client_write_timeout_ms = 500;
    });
    let connector = tls.client(&["http/1.1"]);
    let admin = tls.gw.admin.clone();
    runtime().block_on(async {
        let mut stream = tls_connect(&connector, tls.gw.port).await;
        let params = json!({"name": "big"});
        let request = raw_modern_request(1, "tools/call", params, json!({}), "");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("the request sent");
        let mut first = [0u8; 4096];
        let _ = stream.read(&mut first).await;
        // The client reads no more, and keeps its connection.
        let rounds = move || metric(&admin, "mrtr_gateway_active_rounds");
        wait_off_runtime("the round freed", move || rounds() == 0.0).await;
        drop(stream);
    });
}
