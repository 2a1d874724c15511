//! Protected servers behind the gateway, as they ship: the Python SDK's own OAuth
//! resource-server support (`AuthSettings` + a token verifier, tokens from an
//! authorization server built on the SDK's provider interfaces) and an API-key header.
//! The client's credentials reach the server on every exchange of a bridged flow, on
//! whichever replica serves each round; a denial reaches the client with its status and
//! challenge; OAuth discovery works through the gateway and names the gateway's URL.

use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// An OAuth-protected legacy server whose tokens come from a fresh authorization server;
/// `resource` is the resource URL it is configured with (`None`: its own address, as a
/// server set up without the gateway in mind names itself), `strict` whether it accepts
/// only tokens issued for that resource.
struct Protected {
    _auth_server: Proc,
    issuer: String,
    _server: Proc,
    url: String,
}

fn protected(resource: Option<&str>, strict: bool) -> Protected {
    let (auth_server, issuer) = start_oauth_server();
    let port = free_port();
    let own = format!("http://127.0.0.1:{port}/mcp");
    let introspect = format!("{issuer}/introspect");
    let mut flags = vec![
        "--introspect",
        introspect.as_str(),
        "--resource-url",
        resource.unwrap_or(&own),
    ];
    if strict {
        flags.push("--strict-resource");
    }
    let (server, url) = start_upstream_with(Upstream::Python, port, &flags);
    Protected {
        _auth_server: auth_server,
        issuer,
        _server: server,
        url,
    }
}

fn ask_name_call(raw: &Raw, extra: &[(&str, &str)]) -> Reply {
    raw.modern_with(
        1,
        "tools/call",
        json!({"name": "ask_name", "arguments": {}}),
        json!({"elicitation": {}}),
        extra,
    )
}

/// The `resource_metadata` URL of a challenge.
fn metadata_url(challenge: &str) -> String {
    let start = challenge
        .find("resource_metadata=\"")
        .unwrap_or_else(|| panic!("no resource_metadata in {challenge}"))
        + "resource_metadata=\"".len();
    let end = challenge[start..].find('"').expect("a quoted URL") + start;
    challenge[start..end].to_string()
}

fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").expect("an absolute URL") + 3;
    let end = url[after_scheme..]
        .find('/')
        .map_or(url.len(), |i| i + after_scheme);
    &url[..end]
}

#[test]
fn a_client_without_a_token_is_challenged_with_metadata_the_gateway_serves() {
    let server = protected(None, false);
    let gw = TestGateway::start(&[&server.url], &test_keys());
    let raw = Raw::new(&gw.url);

    let denied = ask_name_call(&raw, &[]);
    assert_eq!(denied.status, 401, "the upstream's status, not 502");
    let challenge = denied.www_authenticate.clone().expect("WWW-Authenticate");
    assert!(challenge.starts_with("Bearer"), "{challenge}");
    let metadata = metadata_url(&challenge);
    assert_eq!(
        metadata,
        format!(
            "{}/.well-known/oauth-protected-resource/mcp",
            origin(&gw.url)
        ),
        "the challenge names the gateway, not {}",
        server.url
    );
    let body = denied.json();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("requires authorization")),
        "{body}"
    );

    let document: Value = ureq::get(&metadata)
        .call()
        .expect("the metadata is served through the gateway")
        .into_json()
        .unwrap();
    assert_eq!(document["resource"], gw.url.as_str(), "{document}");
    assert_eq!(document["authorization_servers"][0], server.issuer.as_str());

    // A legacy client gets the upstream's 401 too, with the same challenge rewritten.
    let init = legacy_initialize("t");
    let legacy = raw.post(None, &init);
    assert_eq!(legacy.status, 401);
    let legacy_challenge = legacy.www_authenticate.clone().expect("WWW-Authenticate");
    assert_eq!(metadata_url(&legacy_challenge), metadata);
    // So does the root form of the discovery path, for the only group.
    let root = format!("{}/.well-known/oauth-protected-resource", origin(&gw.url));
    let root_document: Value = ureq::get(&root).call().unwrap().into_json().unwrap();
    assert_eq!(root_document["resource"], gw.url.as_str());
}

/// Behind a proxy that strips a path prefix, or on another host, a group's public URL
/// is not the gateway's path: its metadata is served where its challenge says it is
/// (`/.well-known/oauth-protected-resource` + the public path), naming the public URL.
#[test]
fn metadata_is_served_at_the_public_path_the_challenge_names() {
    let tripwire = Tripwire::start();
    let metadata = json!({"authorization_servers": ["https://idp.test"]});
    let gw = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        c.public_url = Some("https://mcp.test/prefix".into());
        c.upstreams[0].resource_metadata = Some(metadata.clone());
        for (name, public) in [
            ("other", "https://tools.test/"),
            ("third", "https://tools.test/t3"),
        ] {
            let mut group =
                mrtr_gateway::config::UpstreamGroupConfig::new(name, vec![tripwire.url()]);
            group.path = format!("/{name}");
            group.public_url = Some(public.into());
            group.resource_metadata = Some(metadata.clone());
            group.health_check_interval_ms = 0;
            c.upstreams.push(group);
        }
    });
    for (public_path, resource) in [
        ("/prefix/mcp", "https://mcp.test/prefix/mcp"),
        ("", "https://tools.test"),
        ("/t3", "https://tools.test/t3"),
    ] {
        let url = format!(
            "{}/.well-known/oauth-protected-resource{public_path}",
            origin(&gw.url)
        );
        let document: Value = ureq::get(&url)
            .call()
            .unwrap_or_else(|e| panic!("{url}: {e}"))
            .into_json()
            .unwrap();
        assert_eq!(document["resource"], resource, "{url}: {document}");
    }
    assert_eq!(tripwire.count(), 0, "nothing was fetched upstream");

    // A group whose public URL follows the request's host, listed before one configured
    // on that host with the same path: the configured one is the challenge's.
    let gw = TestGateway::start_with(&[&tripwire.url()], &test_keys(), |c| {
        c.allowed_hosts = vec!["b.test".into(), "127.0.0.1".into()];
        c.upstreams[0].resource_metadata = Some(metadata.clone());
        let mut two = mrtr_gateway::config::UpstreamGroupConfig::new("two", vec![tripwire.url()]);
        two.path = "/two".into();
        two.public_url = Some("https://b.test/mcp".into());
        two.resource_metadata = Some(metadata.clone());
        two.health_check_interval_ms = 0;
        c.upstreams.push(two);
    });
    for host in ["b.test", "B.TEST:443"] {
        let request = format!(
            "GET /.well-known/oauth-protected-resource/mcp HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
        );
        let answer = raw_exchange(gw.port, request.as_bytes(), Duration::from_secs(5));
        assert!(
            answer.contains(r#""resource":"https://b.test/mcp""#),
            "{host}: {answer}"
        );
    }
}

/// The `http` steps a client driver printed: (method, URL, status).
fn exchanges(lines: &[Value]) -> Vec<(String, String, u64)> {
    lines
        .iter()
        .filter(|l| l["step"] == "http")
        .map(|l| {
            (
                l["method"].as_str().unwrap_or_default().to_string(),
                l["url"].as_str().unwrap_or_default().to_string(),
                l["status"].as_u64().unwrap_or_default(),
            )
        })
        .collect()
}

#[test]
fn the_official_clients_oauth_flow_runs_through_the_gateway_then_its_token_completes_a_flow_on_two_replicas(
) {
    let server = protected(None, false);
    // Replicas behind one name share its public URL: here, the first replica's.
    let port = free_port();
    let public = format!("http://127.0.0.1:{port}");
    let public_url = |config: &mut mrtr_gateway::config::Config| {
        config.public_url = Some(public.clone());
    };
    let a = TestGateway::start_on(port, &[&server.url], &test_keys(), public_url);
    let b = TestGateway::start_with(&[&server.url], &test_keys(), public_url);
    let lines = python_client(
        "py_modern_client.py",
        &[&a.url, "multi", &b.url],
        &[("MCP_TEST_OAUTH", "1")],
    );
    assert_modern_call(&lines, "oauth multi");
    let seen = exchanges(&lines);
    let discovered = |gw: &TestGateway| {
        let metadata = format!(
            "{}/.well-known/oauth-protected-resource/mcp",
            origin(&gw.url)
        );
        seen.iter()
            .any(|(m, u, s)| m == "GET" && *u == metadata && *s == 200)
    };
    assert!(
        discovered(&a) || discovered(&b),
        "discovery went through the gateway: {seen:?}"
    );
    assert!(
        lines.iter().any(|l| l["step"] == "authorize"),
        "the client authorized: {lines:?}"
    );
    assert!(
        seen.iter()
            .any(|(_, u, s)| u.starts_with(&server.issuer) && u.ends_with("/token") && *s == 200),
        "a token was issued: {seen:?}"
    );
    for replica in [&a, &b] {
        let served = seen
            .iter()
            .filter(|(m, u, s)| m == "POST" && u.starts_with(origin(&replica.url)) && *s == 200)
            .count();
        assert!(
            served >= 1,
            "{} served no authenticated round: {seen:?}",
            replica.url
        );
    }
    let elicitations = lines.iter().filter(|l| l["step"] == "elicitation").count();
    assert_eq!(elicitations, 2, "two rounds of questions: {lines:?}");
}

#[test]
fn a_strict_resource_server_accepts_tokens_issued_for_the_gateways_public_url() {
    let (gw_port, public) = {
        let port = free_port();
        (port, format!("http://127.0.0.1:{port}"))
    };
    let resource = format!("{public}/mcp");
    let server = protected(Some(&resource), true);
    let gw = TestGateway::start_on(gw_port, &[&server.url], &test_keys(), |config| {
        config.public_url = Some(public.clone());
    });
    let document: Value = ureq::get(&format!(
        "{public}/.well-known/oauth-protected-resource/mcp"
    ))
    .call()
    .unwrap()
    .into_json()
    .unwrap();
    assert_eq!(document["resource"], resource.as_str());
    let lines = python_client(
        "py_modern_client.py",
        &[&gw.url, "elicit"],
        &[("MCP_TEST_OAUTH", "1")],
    );
    assert_modern_call(&lines, "oauth elicit, strict audience");
}

#[test]
fn an_api_key_header_reaches_the_server_in_both_eras_and_the_group_can_withhold_it() {
    let (_server, url) =
        start_upstream_with(Upstream::Python, free_port(), &["--api-key", "k-3141"]);
    let gw = TestGateway::start(&[&url], &test_keys());
    let key = r#"{"X-API-Key": "k-3141"}"#;
    let modern = python_client(
        "py_modern_client.py",
        &[&gw.url, "multi"],
        &[("MCP_TEST_HEADERS", key)],
    );
    assert_modern_call(&modern, "api key, modern");
    let legacy = python_client(
        "py_legacy_client.py",
        &[&gw.url, "elicit"],
        &[("MCP_TEST_HEADERS", key)],
    );
    assert!(
        legacy.iter().any(|l| l["step"] == "initialize"),
        "{legacy:?}"
    );

    let raw = Raw::new(&gw.url);
    let without = ask_name_call(&raw, &[]);
    assert_eq!(without.status, 401);
    assert_eq!(without.www_authenticate.as_deref(), Some("ApiKey"));
    let with = ask_name_call(&raw, &[("x-api-key", "k-3141")]);
    assert_eq!(with.status, 200, "the key went upstream");

    // server/discover asks the upstream as its caller: one without the key is denied,
    // even right after one with it learnt the capabilities.
    let discover = |id: u64, headers: &[(&str, &str)]| {
        raw.modern_with(id, "server/discover", json!({}), json!({}), headers)
    };
    let known = discover(7, &[("x-api-key", "k-3141")]);
    assert_eq!(known.status, 200);
    assert!(known.json()["result"]["capabilities"]["tools"].is_object());
    let denied = discover(8, &[]);
    assert_eq!(
        denied.status, 401,
        "discover is no way around the upstream's denial"
    );
    assert_eq!(denied.www_authenticate.as_deref(), Some("ApiKey"));

    // A group that forwards only Authorization keeps the key to itself.
    let narrow = TestGateway::start_with(&[&url], &test_keys(), |config| {
        config.upstreams[0].forward_headers = vec!["authorization".into()];
    });
    let withheld = ask_name_call(&Raw::new(&narrow.url), &[("x-api-key", "k-3141")]);
    assert_eq!(withheld.status, 401, "forward_headers narrowed the list");
}

/// The key in a client's URL (`/mcp?apiKey=…`, as hosted MCP servers take per-user keys)
/// reaches the upstream like a header does: on every exchange of a bridged flow, after
/// the endpoint's own query; and a session opened with one key never serves a call made
/// with another (warm sessions are kept per key).
#[test]
fn every_upstream_exchange_of_a_flow_carries_the_query_of_the_request_behind_it() {
    use crate::resumption::{resumable_server, Asks, Resumes};
    let upstream = resumable_server(Resumes::Primed, true, Asks::AfterPriming);
    let endpoint = format!("{}?tenant=a", upstream.url());
    let gw = TestGateway::start(&[&endpoint], &test_keys());
    let flow = |key: &str, id: u64| {
        let raw = Raw::new(&format!("{}?apiKey={key}&tenant=b", gw.url));
        let call = |id: u64, extra: Value| {
            let params = tool_params("hostile", extra);
            raw.modern_with(id, "tools/call", params, json!({"elicitation": {}}), &[])
                .json()
        };
        let first = call(id, json!({}));
        let done = call(id + 1, answer(&first, json!({"name": "x"})));
        assert_eq!(done["result"]["content"][0]["text"], "done", "{done}");
    };
    for (n, key) in ["k1", "k1", "k1", "k2"].into_iter().enumerate() {
        flow(key, 10 * n as u64);
    }
    wait_until(
        "every flow's DELETE",
        std::time::Duration::from_secs(5),
        || {
            upstream
                .requests()
                .iter()
                .filter(|s| s.method == "DELETE")
                .count()
                >= 4
        },
    );
    let mut key_of_session = std::collections::HashMap::new();
    for request in upstream.requests() {
        let what = format!("{} {} {:?}", request.method, request.path, request.json());
        let (path, query) = request.path.split_once('?').expect(&what);
        assert_eq!(path, "/mcp", "{what}");
        let key = query
            .strip_prefix("tenant=a&apiKey=")
            .unwrap_or_else(|| panic!("not the endpoint's tenant, then the key: {what}"));
        if let Some(session) = request.header("mcp-session-id") {
            let first = key_of_session
                .entry(session.to_string())
                .or_insert(key.to_string());
            assert_eq!(
                first, key,
                "a session opened with one key served another: {what}"
            );
        }
    }
}

/// A legacy server opening a session per initialize (s0, s1, …), each listing no tools.
fn listing_server() -> crate::scripted::ScriptedUpstream {
    use crate::scripted::{legacy_basics, Answer, ScriptedUpstream, Seen};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let opened = AtomicUsize::new(0);
    ScriptedUpstream::start(move |seen: &Seen| {
        if seen.jsonrpc_method().as_deref() == Some("tools/list") {
            let tools = json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"tools": []}});
            return Answer::json(200, &tools);
        }
        let sid = match seen.header("mcp-session-id") {
            Some(sid) => sid.to_string(),
            None => format!("s{}", opened.fetch_add(1, Ordering::SeqCst)),
        };
        legacy_basics(seen, &sid).unwrap_or_else(|| Answer::status(405, &[], b""))
    })
}

/// A kept session that a request of another group pushes out is deleted in its own group:
/// at its endpoint's path, not the path of the group that pushed it.
#[test]
fn a_kept_session_pushed_out_by_another_group_is_deleted_in_its_own() {
    let upstream = listing_server();
    let other_url = upstream.url().replace("/mcp", "/other-mcp");
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.bridge.max_one_shot_sessions = 1;
        let mut two = mrtr_gateway::config::UpstreamGroupConfig::new("two", vec![other_url]);
        two.path = "/two".into();
        two.health_check_interval_ms = 0;
        c.upstreams.push(two);
    });
    let list = |url: &str| {
        let listed = Raw::new(url).modern(1, "tools/list", json!({}), json!({}));
        assert_eq!(
            listed.json()["result"]["tools"],
            json!([]),
            "tools/list at {url}"
        );
    };
    list(&gw.url);
    let two = gw.url.replace("/mcp", "/two");
    list(&two);
    let deleted = || {
        let mut requests = upstream.requests().into_iter();
        requests.find(|s| s.method == "DELETE" && s.header("mcp-session-id") == Some("s0"))
    };
    wait_until("s0 deleted", Duration::from_secs(5), || deleted().is_some());
    assert_eq!(deleted().unwrap().path, "/mcp", "deleted in its own group");
}

/// One principal's one-shot requests keep at most its share of sessions: a client that
/// sends ever new capabilities pushes out its own kept sessions, never another
/// principal's, which goes on serving it without a new `initialize`.
#[test]
fn one_principal_pushes_out_only_its_own_kept_sessions() {
    let upstream = listing_server();
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.bridge.max_one_shot_sessions_per_principal = 2;
    });
    let raw = Raw::new(&gw.url);
    let list = |id: u64, key: &str, capabilities: Value| {
        let bearer = format!("Bearer {key}");
        let headers = [("authorization", bearer.as_str())];
        let listed = raw.modern_with(id, "tools/list", json!({}), capabilities, &headers);
        assert_eq!(listed.status, 200, "tools/list as {key}");
        assert_eq!(
            listed.json()["result"]["tools"],
            json!([]),
            "tools/list as {key}"
        );
    };
    let initialized_as = |key: &str| {
        let bearer = format!("Bearer {key}");
        let requests = upstream.requests().into_iter();
        requests
            .filter(|s| {
                s.json()
                    .is_some_and(|m| m["method"] == "notifications/initialized")
            })
            .filter(|s| s.header("authorization") == Some(bearer.as_str()))
            .filter_map(|s| s.header("mcp-session-id").map(str::to_string))
            .collect::<Vec<String>>()
    };
    let deleted = || {
        let requests = upstream.requests().into_iter();
        let deletes = requests.filter(|s| s.method == "DELETE");
        deletes
            .filter_map(|s| s.header("mcp-session-id").map(str::to_string))
            .collect::<Vec<String>>()
    };
    list(1, "other", json!({}));
    let others = initialized_as("other");
    assert_eq!(others.len(), 1);
    for n in 0..4 {
        list(2 + n, "many", json!({"experimental": {"n": n}}));
    }
    let many = initialized_as("many");
    assert_eq!(many.len(), 4, "one session per shape");
    wait_until(
        "the first two of many's deleted",
        Duration::from_secs(5),
        || {
            let deleted = deleted();
            many[..2].iter().all(|sid| deleted.contains(sid))
        },
    );
    assert!(
        !deleted().contains(&others[0]),
        "another principal's kept session went"
    );
    list(9, "other", json!({}));
    assert_eq!(
        initialized_as("other"),
        others,
        "its kept session served it again"
    );
}

/// A session kept for one-shot requests is deleted with the credentials it was opened
/// with, when it is let go: an upstream that authenticates every request refuses a
/// DELETE without them, and the session stays.
#[test]
fn a_kept_session_is_deleted_with_the_credentials_it_was_opened_with() {
    use crate::resumption::{resumable_server, Asks, Resumes};
    use crate::scripted::Seen;
    let upstream = resumable_server(Resumes::Primed, true, Asks::AfterPriming);
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.bridge.max_one_shot_sessions = 1;
    });
    for (id, key) in [(1, "k1"), (2, "k2")] {
        let raw = Raw::new(&format!("{}?apiKey={key}", gw.url));
        let bearer = format!("Bearer {key}");
        let headers = [("authorization", bearer.as_str())];
        let discovered = raw.modern_with(id, "server/discover", json!({}), json!({}), &headers);
        assert_eq!(discovered.status, 200, "discover as {key}");
    }
    // k2's session took the only place: k1's are deleted, each as the key it was opened
    // with.
    let opened_with = || -> std::collections::HashMap<String, String> {
        let requests = upstream.requests().into_iter();
        let opened = requests.filter(|s| {
            s.json()
                .is_some_and(|m| m["method"] == "notifications/initialized")
        });
        opened
            .filter_map(|s| Some((s.header("mcp-session-id")?.to_string(), s.path.clone())))
            .collect()
    };
    let deletes = || -> Vec<Seen> {
        upstream
            .requests()
            .into_iter()
            .filter(|s| s.method == "DELETE")
            .collect()
    };
    let k1_all_deleted = || {
        let deleted: Vec<Seen> = deletes();
        let is_deleted = |sid: &String| {
            deleted
                .iter()
                .any(|d| d.header("mcp-session-id") == Some(sid))
        };
        let k1: Vec<String> = opened_with()
            .into_iter()
            .filter(|(_, p)| p.ends_with("=k1"))
            .map(|(sid, _)| sid)
            .collect();
        !k1.is_empty() && k1.iter().all(is_deleted)
    };
    wait_until(
        "every session opened as k1 deleted",
        Duration::from_secs(5),
        k1_all_deleted,
    );
    let opened = opened_with();
    for delete in deletes() {
        let sid = delete.header("mcp-session-id").expect("a session's DELETE");
        let path = &opened[sid];
        assert_eq!(&delete.path, path, "the DELETE of {sid} carries its query");
        let key = path.rsplit('=').next().unwrap();
        let bearer = format!("Bearer {key}");
        assert_eq!(
            delete.header("authorization"),
            Some(bearer.as_str()),
            "{sid}"
        );
    }
}

#[test]
fn every_upstream_exchange_of_a_flow_carries_the_headers_of_the_request_behind_it() {
    use crate::resumption::{resumable_server, Asks, Resumes};
    let upstream = resumable_server(Resumes::Primed, true, Asks::AfterPriming);
    let gw = TestGateway::start(&[&upstream.url()], &test_keys());
    let raw = Raw::new(&gw.url);
    let call = |id: u64, tag: &str, extra: Value| {
        let params = tool_params("hostile", extra);
        let headers = [
            ("authorization", "Bearer t-1"),
            ("x-tag", tag),
            ("accept-encoding", "gzip"),
        ];
        let reply = raw.modern_with(
            id,
            "tools/call",
            params,
            json!({"elicitation": {}}),
            &headers,
        );
        (reply.status, reply.json())
    };
    let (_, first) = call(1, "round-1", json!({}));
    let asked = upstream.requests().len();
    let (status, done) = call(2, "round-2", answer(&first, json!({"name": "x"})));
    assert_eq!(status, 200, "{done}");
    wait_until(
        "the flow's DELETE",
        std::time::Duration::from_secs(5),
        || upstream.requests().iter().any(|s| s.method == "DELETE"),
    );
    let seen = upstream.requests();
    for (i, request) in seen.iter().enumerate() {
        let what = format!("{} {:?}", request.method, request.json());
        assert_eq!(
            request.header("authorization"),
            Some("Bearer t-1"),
            "{what}"
        );
        let tag = if i < asked { "round-1" } else { "round-2" };
        assert_eq!(
            request.header("x-tag"),
            Some(tag),
            "each retry's own: {what}"
        );
        assert_eq!(
            request.header("accept-encoding"),
            Some("identity"),
            "the bridge reads bodies uncoded: {what}"
        );
        assert_eq!(request.header("mcp-method"), None, "{what}");
        assert!(request.header("x-forwarded-for").is_some(), "{what}");
    }
}

#[test]
fn a_browser_client_of_a_protected_server_can_read_its_challenge_and_discovery_document() {
    let server = protected(None, false);
    let app = "https://app.example";
    let gw = TestGateway::start_with(&[&server.url], &test_keys(), |c| {
        c.cors_allowed_origins = vec![app.into()];
    });
    let raw = Raw::new(&gw.url);
    let asks = [
        ("origin", app),
        ("access-control-request-method", "POST"),
        (
            "access-control-request-headers",
            "authorization, content-type",
        ),
    ];

    // The preflight carries no token: the gateway answers it, the server never sees it.
    let preflight = raw.request("OPTIONS", &asks, None);
    assert_eq!(preflight.status, 204);
    assert_eq!(
        preflight.header_values("access-control-allow-origin"),
        [app]
    );

    let denied = ask_name_call(&raw, &[("origin", app)]);
    assert_eq!(denied.status, 401);
    assert_eq!(denied.header_values("access-control-allow-origin"), [app]);
    let exposed = denied
        .header_values("access-control-expose-headers")
        .join(",");
    assert!(exposed.contains("WWW-Authenticate"), "{exposed}");
    let metadata = metadata_url(&denied.www_authenticate.clone().expect("a challenge"));

    // OAuth discovery from the page: the metadata's own preflight and GET.
    let discovery = Raw::new(&metadata);
    let preflight = discovery.request("OPTIONS", &asks, None);
    assert_eq!(preflight.status, 204);
    let document = discovery.request("GET", &[("origin", app)], None);
    assert_eq!(document.status, 200);
    assert_eq!(document.header_values("access-control-allow-origin"), [app]);
    assert_eq!(
        document.json()["authorization_servers"][0],
        server.issuer.as_str()
    );
}

/// A server that checks credentials on every request (an API-key middleware, as the
/// SDKs' OAuth resource servers do too) refuses a DELETE without them: the session of a
/// flow its client abandoned is deleted at the flow's deadline with the credentials of
/// the round that left it, not kept by the server for good.
#[test]
fn an_abandoned_flow_on_a_server_that_wants_credentials_is_deleted_with_them() {
    use mrtr_gateway::keys::KeyRing;
    use mrtr_gateway::mrtr::state::{binding, FlowState};
    use mrtr_gateway::principal::PrincipalSource;

    let (_server, url) =
        start_upstream_with(Upstream::Python, free_port(), &["--api-key", "k-2718"]);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.bridge.request_state_ttl_seconds = 1;
        c.bridge.max_flow_seconds = 2;
    });
    let first = ask_name_call(&Raw::new(&gw.url), &[("x-api-key", "k-2718")]).json();
    let sealed = first["result"]["requestState"]
        .as_str()
        .expect("a requestState");
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let principal = PrincipalSource::Authorization.digest(None);
    let bind = binding(&principal, "tools/call", Some("ask_name"), Some(&json!({})));
    let flow = FlowState::open(&ring, &bind, sealed, 0).expect("the gateway's own state");
    let session = flow.waiting.call().map(|c| c.session.clone());

    let upstream = Raw::new(&url);
    let alive = || {
        let list = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/list"}).to_string();
        let mut headers = vec![
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("x-api-key", "k-2718"),
        ];
        if let Some(session) = &session {
            headers.push(("mcp-session-id", session.as_str()));
        }
        upstream.request("POST", &headers, Some(&list)).status == 200
    };
    assert!(
        alive(),
        "the pending flow's session is open until its deadline"
    );
    wait_until(
        "the reaper to delete the abandoned session",
        Duration::from_secs(15),
        || !alive(),
    );
    let reaped = metric_with(&gw.admin, "mrtr_gateway_upstream_sessions_total", "reaped");
    assert_eq!(reaped, Some(1.0), "counted once the server deleted it");
}

/// A discovery document the upstream does not send in time is the upstream's timeout
/// (504), as for any request; a method other than GET on a discovery path is 405 with
/// the methods served there.
#[test]
fn a_discovery_document_late_upstream_is_a_timeout_and_a_post_is_not_allowed() {
    use crate::scripted::{Answer, ScriptedUpstream};
    let upstream = ScriptedUpstream::start(|_| Answer::silent());
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].response_timeout_ms = 300;
        c.upstreams[0].health_check_interval_ms = 0;
    });
    let raw = Raw::new(&format!(
        "{}/.well-known/oauth-protected-resource/mcp",
        origin(&gw.url)
    ));
    let late = raw.request("GET", &[], None);
    assert_eq!(late.status, 504, "{:?}", late.headers);
    let posted = raw.request("POST", &[("content-type", "application/json")], Some("{}"));
    assert_eq!(posted.status, 405);
    assert_eq!(posted.header_values("allow"), ["GET, HEAD"]);
}
