//! The key ring in operation: rotation without a restart (file change and SIGHUP), the
//! `inspect` command, and JWT principals, against the real Python fixture.

use crate::common::*;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use mrtr_gateway::keys::generate_entry;
use mrtr_gateway::principal::{JwtConfig, PrincipalSource};
use mrtr_gateway::seal::peek_kid;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A scratch directory for one test, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("mrtr-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn write(&self, file: &str, text: &str) -> PathBuf {
        let path = self.0.join(file);
        // Replace atomically, as a Kubernetes Secret update does.
        let tmp = self.0.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `tool` called as a 2026-07-28 client with `extra` params (answers, state).
fn call(raw: &Raw, id: u64, tool: &str, extra: Value, headers_auth: Option<&str>) -> Value {
    let params = tool_params(tool, extra);
    let reply = match headers_auth {
        None => raw.modern(id, "tools/call", params, json!({"elicitation": {}})),
        Some(auth) => raw.modern_with(
            id,
            "tools/call",
            params,
            json!({"elicitation": {}}),
            &[("authorization", auth)],
        ),
    };
    let status = reply.status;
    let body = reply.json();
    assert!(status == 200 || status == 400, "{status} {body}");
    body
}

fn state_of(first: &Value) -> String {
    first["result"]["requestState"]
        .as_str()
        .unwrap_or_else(|| panic!("no requestState in {first}"))
        .to_string()
}

fn reloads(admin: &str, file: &str, outcome: &str) -> f64 {
    let labels = format!("file=\"{file}\",outcome=\"{outcome}\"");
    metric_with(admin, "mrtr_gateway_reloads_total", &labels).unwrap_or(0.0)
}

#[test]
fn keys_rotate_without_a_restart_and_flows_in_progress_survive() {
    let (_python, url) = start_upstream(Upstream::Python);
    let scratch = Scratch::new("rotation");
    let old = generate_entry("old").unwrap();
    let new = generate_entry("new").unwrap();
    let keys_file = scratch.write("keys", &old);
    let gw = TestGateway::start_with(&[&url], &old, |c| {
        c.keys_file = Some(keys_file.clone());
        c.keys_poll_ms = 100;
    });
    let raw = Raw::new(&gw.url);
    // Before: a flow waiting for its second round, another waiting for its first, and a
    // legacy session, all sealed under `old`.
    let spans_rotation = call(&raw, 1, "plan_trip", json!({}), None);
    let outlives_old_key = call(&raw, 2, "ask_name", json!({}), None);
    assert_eq!(peek_kid(&state_of(&spans_rotation)).as_deref(), Some("old"));
    let legacy = raw.initialize(json!({}));
    assert_eq!(peek_kid(&legacy).as_deref(), Some("old"));

    // Step 1: add the new key everywhere and make it current; `old` still opens.
    scratch.write("keys", &format!("{new}\n{old}\n"));
    wait_until("reload 1", Duration::from_secs(10), || {
        reloads(&gw.admin, "keys", "ok") >= 1.0
    });
    assert_eq!(metric(&gw.admin, "mrtr_gateway_keys_loaded"), 2.0);
    let second = call(
        &raw,
        3,
        "plan_trip",
        answer(&spans_rotation, json!({"destination": "Lisbon"})),
        None,
    );
    assert_eq!(
        peek_kid(&state_of(&second)).as_deref(),
        Some("new"),
        "new rounds seal under the new key"
    );
    let done = call(
        &raw,
        4,
        "plan_trip",
        answer(&second, json!({"nights": 3})),
        None,
    );
    assert_eq!(
        done["result"]["content"][0]["text"], "Trip to Lisbon for 3 nights",
        "{done}"
    );
    let list = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/list"});
    assert_eq!(
        raw.post(Some(&legacy), &list).status,
        200,
        "an old session token still opens"
    );

    // A broken keys file is refused and the ring in use kept.
    scratch.write("keys", "new:not-a-key");
    wait_until("reload error", Duration::from_secs(10), || {
        reloads(&gw.admin, "keys", "error") >= 1.0
    });
    let during = call(&raw, 6, "ask_name", json!({}), None);
    assert_eq!(peek_kid(&state_of(&during)).as_deref(), Some("new"));

    // Step 2, after the longest TTL: remove the old key. Tokens under it fail cleanly.
    scratch.write("keys", &new);
    wait_until("reload 2", Duration::from_secs(10), || {
        reloads(&gw.admin, "keys", "ok") >= 2.0
    });
    assert_eq!(metric(&gw.admin, "mrtr_gateway_keys_loaded"), 1.0);
    let refused = call(
        &raw,
        7,
        "ask_name",
        answer(&outlives_old_key, json!({"name": "Kim"})),
        None,
    );
    assert_eq!(refused["error"]["code"], -32602, "{refused}");
    assert_eq!(
        refused["error"]["message"],
        "Invalid or expired requestState"
    );
    assert_eq!(
        raw.post(Some(&legacy), &list).status,
        404,
        "a session under a removed key"
    );
    let unknown = "reason=\"unknown_key\"";
    assert_eq!(
        metric_with(
            &gw.admin,
            "mrtr_gateway_request_state_rejections_total",
            unknown
        ),
        Some(1.0)
    );
    let finished = call(
        &raw,
        8,
        "ask_name",
        answer(&during, json!({"name": "Kim"})),
        None,
    );
    assert_eq!(
        finished["result"]["content"][0]["text"], "Hello, Kim!",
        "{finished}"
    );
    println!("rotation: old -> new,old -> (bad file kept) -> new; in-progress flows survived");
}

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mrtr-gateway"))
}

#[test]
fn sighup_reloads_the_keys_and_inspect_reads_a_token() {
    let (_python, url) = start_upstream(Upstream::Python);
    let scratch = Scratch::new("sighup");
    let (k1, k2) = (generate_entry("k1").unwrap(), generate_entry("k2").unwrap());
    let keys_file = scratch.write("keys", &k1);
    let (port, admin) = (free_port(), free_port());
    let config = format!(
        "listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\nkeys_file: {}\nkeys_poll_ms: 3600000\nupstreams:\n  - name: default\n    endpoints: [\"{url}\"]\n    health_check_interval_ms: 0\n",
        keys_file.display()
    );
    let config_file = scratch.write("gateway.yaml", &config);
    let mut child = binary()
        .args(["run", "--config"])
        .arg(&config_file)
        .env_remove("MRTR_GATEWAY_KEYS")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let pid = child.id().to_string();
    let _proc = Proc::adopt(child, "gateway");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let await_line = |what: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match rx.recv_timeout(left) {
                Ok(line) if line.contains(what) => return line,
                Ok(_) => continue,
                Err(_) => break,
            }
        }
        panic!("the gateway never logged '{what}'");
    };
    await_line("reloader started");
    wait_until("gateway listener", Duration::from_secs(10), || {
        port_open(port)
    });
    let raw = Raw::new(&format!("http://127.0.0.1:{port}/mcp"));
    let before = call(&raw, 1, "ask_name", json!({}), None);
    let state = state_of(&before);
    assert_eq!(peek_kid(&state).as_deref(), Some("k1"));

    // inspect: with the key it lists the fields; without it, it refuses.
    let inspected = binary()
        .args(["inspect", &state, "--config"])
        .arg(&config_file)
        .env_remove("MRTR_GATEWAY_KEYS")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&inspected.stdout);
    assert!(
        inspected.status.success(),
        "{}",
        String::from_utf8_lossy(&inspected.stderr)
    );
    for field in [
        "requestState",
        "key id            k1",
        "upstream session",
        "pending",
        "round             1",
        "expires",
    ] {
        assert!(report.contains(field), "{field} in:\n{report}");
    }
    let foreign = binary()
        .args(["inspect", &state])
        .env("MRTR_GATEWAY_KEYS", &k2)
        .output()
        .unwrap();
    assert!(!foreign.status.success());
    assert!(String::from_utf8_lossy(&foreign.stderr).contains("sealed under key 'k1'"));
    let keyless = binary()
        .args(["inspect", &state])
        .env_remove("MRTR_GATEWAY_KEYS")
        .output()
        .unwrap();
    assert!(
        !keyless.status.success(),
        "inspect without keys must refuse"
    );

    // Rotate by SIGHUP alone (the poll interval is an hour).
    std::fs::write(&keys_file, format!("{k2},{k1}")).unwrap();
    let hup = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
    assert!(hup.success());
    await_line("key ring: k2, k1");
    let after = call(&raw, 2, "ask_name", json!({}), None);
    assert_eq!(peek_kid(&state_of(&after)).as_deref(), Some("k2"));
    let finished = call(
        &raw,
        3,
        "ask_name",
        answer(&before, json!({"name": "Ada"})),
        None,
    );
    assert_eq!(
        finished["result"]["content"][0]["text"], "Hello, Ada!",
        "{finished}"
    );
}

/// A JWT signed with `secret` (HS256) for `sub`, expiring in `ttl` seconds.
fn jwt(secret: &[u8], sub: &str, ttl: i64, jti: &str) -> String {
    let now = mrtr_gateway::mrtr::state::now_secs() as i64;
    let header = URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256","typ":"JWT","kid":"ingress"}"#);
    let claims = json!({"iss": "https://idp.test", "sub": sub, "exp": now + ttl, "jti": jti});
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signing_input = format!("{header}.{payload}");
    let mac = hmac_sha256(secret, signing_input.as_bytes());
    format!("Bearer {signing_input}.{}", URL_SAFE_NO_PAD.encode(mac))
}

/// HMAC-SHA256 (RFC 2104) over sha2, so the test signs its tokens independently of the
/// library the gateway verifies them with.
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut block = [0u8; 64];
    block[..key.len()].copy_from_slice(key);
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

#[test]
fn a_jwt_principal_survives_token_refresh_and_refuses_others() {
    let (_python, url) = start_upstream(Upstream::Python);
    let tripwire = Tripwire::start();
    let scratch = Scratch::new("jwt");
    let secret = b"a shared secret of the ingress!!";
    let jwks = json!({"keys": [{"kty": "oct", "kid": "ingress", "alg": "HS256", "k": URL_SAFE_NO_PAD.encode(secret)}]});
    let jwks_file = scratch.write("jwks.json", &jwks.to_string());
    let jwt_config = JwtConfig {
        jwks_file,
        issuers: vec!["https://idp.test".into()],
        audiences: vec![],
        leeway_seconds: 0,
    };
    let principal = PrincipalSource::Jwt(jwt_config);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.principal = principal.clone();
        c.keys_poll_ms = 100;
    });
    let raw = Raw::new(&gw.url);
    let alice = jwt(secret, "alice", 600, "1");
    let first = call(&raw, 1, "ask_name", json!({}), Some(&alice));
    // Alice's token is refreshed between rounds: same subject, new token.
    let refreshed = jwt(secret, "alice", 900, "2");
    assert_ne!(alice, refreshed);
    let bob = jwt(secret, "bob", 600, "3");
    let stolen = call(
        &raw,
        2,
        "ask_name",
        answer(&first, json!({"name": "Bob"})),
        Some(&bob),
    );
    assert_eq!(
        stolen["error"]["message"], "Invalid or expired requestState",
        "{stolen}"
    );
    let done = call(
        &raw,
        3,
        "ask_name",
        answer(&first, json!({"name": "Alice"})),
        Some(&refreshed),
    );
    assert_eq!(
        done["result"]["content"][0]["text"], "Hello, Alice!",
        "{done}"
    );

    // The identity provider rotates its signing key: the JWKS file is reloaded in place.
    let rotated_secret = b"the ingress's next signing secret";
    let rotated = json!({"keys": [{"kty": "oct", "kid": "ingress", "alg": "HS256", "k": URL_SAFE_NO_PAD.encode(rotated_secret)}]});
    scratch.write("jwks.json", &rotated.to_string());
    wait_until("JWKS reload", Duration::from_secs(10), || {
        reloads(&gw.admin, "jwks", "ok") >= 1.0
    });
    let next = jwt(rotated_secret, "alice", 600, "6");
    let after = call(&raw, 4, "ask_name", json!({}), Some(&next));
    assert_eq!(after["result"]["resultType"], "input_required", "{after}");
    let list = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/list"});
    let old_key = raw.request(
        "POST",
        &[
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("authorization", &refreshed),
        ],
        Some(&list.to_string()),
    );
    assert_eq!(old_key.status, 401, "a token under the retired JWK");

    // Requests whose token does not verify get 401 and reach no upstream.
    let guarded = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        c.principal = principal.clone()
    });
    let raw = Raw::new(&guarded.url);
    let forged = jwt(b"not the ingress secret, forged!!", "alice", 600, "4");
    let expired = jwt(secret, "alice", -120, "5");
    let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    for (case, auth) in [
        ("none", None),
        ("forged", Some(forged.as_str())),
        ("expired", Some(expired.as_str())),
        ("basic", Some("Basic YTpi")),
    ] {
        let mut headers = vec![
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
        ];
        if let Some(a) = auth {
            headers.push(("authorization", a));
        }
        let reply = raw.request("POST", &headers, Some(&list.to_string()));
        assert_eq!(reply.status, 401, "{case}");
        let challenge = reply.www_authenticate.clone().unwrap_or_default();
        let body = reply.json();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("Unauthorized: "),
            "{case}: {body}"
        );
        // The challenge names where a client learns how to get a token (RFC 9728 §5.1);
        // one to a request without credentials says nothing of an error (RFC 6750 §3.1).
        let metadata = guarded
            .url
            .replace("/mcp", "/.well-known/oauth-protected-resource/mcp");
        let named = format!("resource_metadata=\"{metadata}\"");
        match auth {
            None => assert_eq!(challenge, format!("Bearer {named}"), "{case}"),
            Some(_) => assert!(
                challenge.starts_with("Bearer error=\"invalid_token\"")
                    && challenge.ends_with(&format!(", {named}")),
                "{case}: {challenge}"
            ),
        }
    }
    assert_eq!(
        tripwire.count(),
        0,
        "an unauthenticated request reached the upstream"
    );
}
