//! TLS on both sides of the gateway, with certificates made at test time: HTTPS upstreams
//! (the Python SDK server under uvicorn) verified against a group's CA, and the MCP
//! listener serving HTTPS to the official clients, its certificate reloaded, HTTP/2 by
//! ALPN.

use crate::common::*;
use crate::pki::*;
use mrtr_gateway::config::{UpstreamEra, UpstreamGroupConfig};
use serde_json::{json, Value};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    let env: Vec<(&str, &OsStr)> = ca
        .map(|ca| (variable, ca.as_os_str()))
        .into_iter()
        .collect();
    let args = [script.to_str().expect("a UTF-8 path"), url, scenario];
    json_lines(&run_client_with_env(program, &args, &env, CLIENT_LIMIT))
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
