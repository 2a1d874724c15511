//! Data-layer sessions for 2026-07-28 clients, in front of a stateful legacy server: the
//! Python fixture keeps a notebook per upstream `Mcp-Session-Id`. Without a session each
//! modern call is independent; with `session/create` the notebook persists across calls,
//! replicas and an MRTR round; `session/delete` ends the upstream session; bad cookies and
//! missing ones get the documented errors and reach no upstream; two calls at once in one
//! session each keep their own questions; a call whose client leaves is cancelled by id.

use crate::common::*;
use crate::scripted::{
    assert_call_cancelled_in_its_session, is_cancellation, legacy_basics, Answer, FirstRefused,
    Gate, ScriptedUpstream, Seen,
};
use mrtr_gateway::config::{SessionPolicy, ToolPolicy, UpstreamEra};
use mrtr_gateway::keys::KeyRing;
use mrtr_gateway::mrtr::data_session::{DataSession, INVALID_COOKIE};
use mrtr_gateway::mrtr::state::now_secs;
use mrtr_gateway::principal::PrincipalSource;
use mrtr_gateway::protocol::session_token::SessionToken;
use serde_json::{json, Value};
use std::io::Write;
use std::time::Duration;

/// A `tools/call` with the session `cookie` (as a result's `_meta["mcp/session"]` gave
/// it) and `extra` params (a retry's answers and state); returns status and body.
fn call_status(
    raw: &Raw,
    id: u64,
    tool: &str,
    args: Value,
    cookie: Option<&Value>,
    extra: Value,
) -> (u16, Value) {
    let mut params = json!({"name": tool, "arguments": args});
    if let Some(extra) = extra.as_object() {
        params.as_object_mut().unwrap().extend(extra.clone());
    }
    if let Some(cookie) = cookie {
        params["_meta"] = json!({"mcp/session": {"id": cookie["id"]}});
    }
    let reply = raw.modern(id, "tools/call", params, json!({"elicitation": {}}));
    (reply.status, reply.json())
}

fn call(raw: &Raw, id: u64, tool: &str, args: Value, cookie: Option<&Value>) -> Value {
    call_status(raw, id, tool, args, cookie, json!({})).1
}

/// The text of a complete tool result.
fn text(response: &Value) -> String {
    assert_eq!(response["result"]["resultType"], "complete", "{response}");
    response["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text content: {response}"))
        .to_string()
}

/// The refreshed cookie a result in a session carries.
fn cookie_of(response: &Value) -> Value {
    let cookie = response["result"]["_meta"]["mcp/session"].clone();
    assert!(cookie["id"].is_string(), "no session cookie: {response}");
    assert!(cookie["expiry"].is_string(), "no cookie expiry: {response}");
    cookie
}

fn create(raw: &Raw, id: u64, hints: Value) -> Value {
    let reply = raw.modern(
        id,
        "session/create",
        json!({"hints": hints}),
        json!({"elicitation": {}}),
    );
    assert_eq!(reply.status, 200);
    let response = reply.json();
    cookie_of(&response);
    response
}

fn notebook(raw: &Raw, id: u64, cookie: Option<&Value>) -> (Vec<String>, Option<Value>) {
    let response = call(raw, id, "notebook_read", json!({}), cookie);
    let pages = serde_json::from_str(&text(&response)).expect("a JSON list");
    (pages, cookie.map(|_| cookie_of(&response)))
}

/// A request's answer in a session the upstream no longer has: `Session ended` (404),
/// the cookie revoked.
fn assert_session_ended(status: u16, response: &Value) {
    assert_eq!(status, 404, "{response}");
    assert_eq!(response["error"]["code"], -32011, "{response}");
    let message = response["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("Session ended"), "{response}");
    let revoked = json!({"mcp/session": null});
    assert_eq!(response["error"]["data"]["_meta"], revoked, "{response}");
}

/// The message of the one question an InputRequiredResult asks.
fn question(response: &Value) -> String {
    let asked = response["result"]["inputRequests"]
        .as_object()
        .unwrap_or_else(|| panic!("no inputRequests: {response}"));
    assert_eq!(asked.len(), 1, "{response}");
    let (_, request) = asked.iter().next().unwrap();
    request["params"]["message"].as_str().unwrap().to_string()
}

fn legacy_gateway(url: &str) -> TestGateway {
    TestGateway::start_with(&[url], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    })
}

#[test]
fn without_a_session_each_modern_call_gets_a_fresh_upstream_session() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = legacy_gateway(&url);
    let raw = Raw::new(&gw.url);
    let appended = call(&raw, 1, "notebook_append", json!({"text": "a"}), None);
    assert_eq!(text(&appended), "appended 'a': 1 entries");
    assert!(
        appended["result"]["_meta"].get("mcp/session").is_none(),
        "{appended}"
    );
    let (pages, _) = notebook(&raw, 2, None);
    assert!(pages.is_empty(), "a call without a session saw {pages:?}");
}

#[test]
fn a_session_keeps_upstream_state_across_calls_replicas_and_a_round() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let (a, b) = (legacy_gateway(&url), legacy_gateway(&url));
    let (ra, rb) = (Raw::new(&a.url), Raw::new(&b.url));

    let discover = ra.modern(1, "server/discover", json!({}), json!({})).json();
    assert_eq!(
        discover["result"]["capabilities"]["experimental"]["session"],
        json!({"version": 1, "features": ["create", "delete"]}),
        "{discover}"
    );

    let created = create(&ra, 2, json!({"label": "nb", "data": {"title": "Notes"}}));
    let result = &created["result"];
    assert_eq!(result["data"], json!({"title": "Notes"}), "{created}");
    assert_eq!(result["id"], cookie_of(&created)["id"]);
    assert!(result["expiry"].as_str().unwrap().ends_with('Z'));

    let appended = call(
        &rb,
        3,
        "notebook_append",
        json!({"text": "first"}),
        Some(&cookie_of(&created)),
    );
    assert_eq!(text(&appended), "appended 'first': 1 entries");

    let asked = call(
        &ra,
        4,
        "notebook_ask",
        json!({"label": "second"}),
        Some(&cookie_of(&appended)),
    );
    assert_eq!(question(&asked), "Text for second?");
    let retry = answer(&asked, json!({"text": "typed"}));
    let (status, done) = call_status(
        &rb,
        5,
        "notebook_ask",
        json!({"label": "second"}),
        Some(&cookie_of(&asked)),
        retry,
    );
    assert_eq!(status, 200, "{done}");
    assert_eq!(text(&done), "second: typed");

    let (pages, _) = notebook(&ra, 6, Some(&cookie_of(&done)));
    assert_eq!(pages, ["first", "second: typed"]);
    let (fresh, _) = notebook(&rb, 7, None);
    assert!(fresh.is_empty(), "a call without the cookie saw {fresh:?}");
    assert_eq!(
        metric_with(&a.admin, "mrtr_gateway_data_sessions_total", "created"),
        Some(1.0)
    );
}

/// A retry runs in the data-layer session its call began in: one carrying another
/// session's cookie is refused with the one error for a bad state, before it is claimed
/// (the call would otherwise complete in its own session while the result carried the
/// other's cookie), as is one carrying a cookie for a call begun outside any session,
/// and one without the cookie of the session its call began in (it would run as outside
/// any session); the same state completes the call with its own cookie.
#[test]
fn a_retry_with_another_sessions_cookie_is_refused() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = legacy_gateway(&url);
    let raw = Raw::new(&gw.url);
    let (a, b) = (create(&raw, 1, json!({})), create(&raw, 2, json!({})));
    let b_cookie = Some(cookie_of(&b));
    let ask = |id: u64, label: &str, cookie: Option<&Value>, extra: Value| {
        call_status(
            &raw,
            id,
            "notebook_ask",
            json!({"label": label}),
            cookie,
            extra,
        )
    };
    let refused = |(status, refused): (u16, Value)| {
        let code = &refused["error"]["code"];
        assert_eq!((status, code), (400, &json!(-32602)), "{refused}");
        let message = &refused["error"]["message"];
        assert_eq!(message, "Invalid or expired requestState");
    };
    let (_, asked) = ask(3, "mine", Some(&cookie_of(&a)), json!({}));
    assert_eq!(question(&asked), "Text for mine?");
    let retry = answer(&asked, json!({"text": "typed"}));
    refused(ask(4, "mine", b_cookie.as_ref(), retry.clone()));
    refused(ask(40, "mine", None, retry.clone()));
    let (_, outside) = ask(5, "out", None, json!({}));
    refused(ask(
        6,
        "out",
        b_cookie.as_ref(),
        answer(&outside, json!({"text": "x"})),
    ));

    let (status, done) = ask(7, "mine", Some(&cookie_of(&asked)), retry);
    assert_eq!(status, 200, "{done}");
    assert_eq!(text(&done), "mine: typed");
    let (in_b, _) = notebook(&raw, 8, b_cookie.as_ref());
    assert!(in_b.is_empty(), "{in_b:?}");
    let rejections = "mrtr_gateway_request_state_rejections_total";
    let other_session = metric_with(&gw.admin, rejections, "other_session");
    assert_eq!(other_session, Some(3.0));
}

/// Every request in a data-layer session names the revision the session negotiated,
/// sealed in its cookie: a server that refuses any other (TypeScript SDK 1.17.5, which
/// speaks 2025-06-18) serves calls, a round and the DELETE on any replica.
#[test]
fn a_session_names_the_revision_it_negotiated_on_every_replica() {
    let (_upstream, url) = start_upstream(Upstream::TypeScriptSdk117);
    let (a, b) = (legacy_gateway(&url), legacy_gateway(&url));
    let (ra, rb) = (Raw::new(&a.url), Raw::new(&b.url));
    let created = create(&ra, 1, json!({}));
    let added = call(
        &rb,
        2,
        "add",
        json!({"a": 2, "b": 3}),
        Some(&cookie_of(&created)),
    );
    assert_eq!(text(&added), "2+3=5");
    let asked = call(&ra, 3, "ask_name", json!({}), Some(&cookie_of(&added)));
    assert_eq!(question(&asked), "What is your name?");
    let retry = answer(&asked, json!({"name": "Ada"}));
    let cookie = cookie_of(&asked);
    let (status, done) = call_status(&rb, 4, "ask_name", json!({}), Some(&cookie), retry);
    assert_eq!(status, 200, "{done}");
    assert_eq!(text(&done), "Hello, Ada!");
    let meta = json!({"_meta": {"mcp/session": {"id": cookie_of(&done)["id"]}}});
    let deleted = ra.modern(5, "session/delete", meta, json!({})).json();
    assert_eq!(deleted["result"]["deleted"], true, "{deleted}");
}

/// `session/delete` says what the upstream did: a DELETE it denies (401, with its
/// challenge) is the request's error, and the session, still open upstream, keeps
/// serving its cookie; a server that does not let clients end sessions (405) is answered
/// `deleted: false`. It used to answer `deleted: true` whatever the upstream said.
#[test]
fn session_delete_says_what_the_upstream_did() {
    let delete_answer = std::sync::Arc::new(std::sync::Mutex::new(401u16));
    let upstream = ScriptedUpstream::start({
        let delete_answer = delete_answer.clone();
        move |seen: &Seen| {
            if seen.method == "DELETE" {
                return match *delete_answer.lock().unwrap() {
                    401 => Answer::status(401, &[("www-authenticate", "Bearer realm=\"x\"")], b""),
                    status => Answer::status(status, &[], b""),
                };
            }
            if let Some(answer) = legacy_basics(seen, "s1") {
                return answer;
            }
            let result = json!({"content": [{"type": "text", "text": "still here"}]});
            Answer::json(
                200,
                &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": result}),
            )
        }
    });
    let gw = legacy_gateway(&upstream.url());
    let raw = Raw::new(&gw.url);
    let created = create(&raw, 1, json!({}));
    let meta = json!({"_meta": {"mcp/session": {"id": cookie_of(&created)["id"]}}});

    let denied = raw.modern(2, "session/delete", meta.clone(), json!({}));
    assert_eq!(denied.status, 401);
    assert!(
        denied.www_authenticate.is_some(),
        "the upstream's challenge"
    );
    let denied = denied.json();
    assert!(denied.get("result").is_none(), "{denied}");
    let alive = call(&raw, 3, "anything", json!({}), Some(&cookie_of(&created)));
    assert_eq!(text(&alive), "still here");

    *delete_answer.lock().unwrap() = 405;
    let kept = raw.modern(4, "session/delete", meta, json!({})).json();
    assert_eq!(kept["result"]["deleted"], false, "{kept}");
    assert_eq!(
        kept["result"]["_meta"]["mcp/session"],
        Value::Null,
        "{kept}"
    );
}

/// `session/delete` reaches an upstream that authenticates every request with the
/// credentials of the request that asks for it, as every other exchange of the session
/// does: its DELETE went without them, was refused 401, and the session stayed.
#[test]
fn session_delete_carries_the_callers_credentials() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if seen.header("x-api-key") != Some("k-1") {
            return Answer::status(401, &[("www-authenticate", "ApiKey")], b"");
        }
        legacy_basics(seen, "s1").unwrap_or_else(|| Answer::status(405, &[], b""))
    });
    let gw = legacy_gateway(&upstream.url());
    let raw = Raw::new(&gw.url);
    let key = [("x-api-key", "k-1")];
    let created = raw.modern_with(1, "session/create", json!({}), json!({}), &key);
    assert_eq!(created.status, 200);
    let meta = json!({"_meta": {"mcp/session": {"id": cookie_of(&created.json())["id"]}}});
    let deleted = raw.modern_with(2, "session/delete", meta, json!({}), &key);
    let deleted = deleted.json();
    assert_eq!(deleted["result"]["deleted"], true, "{deleted}");
    let delete = upstream
        .requests()
        .into_iter()
        .find(|s| s.method == "DELETE");
    assert_eq!(
        delete
            .and_then(|d| d.header("x-api-key").map(str::to_string))
            .as_deref(),
        Some("k-1")
    );
}

#[test]
fn session_delete_ends_the_upstream_session_and_revokes_the_cookie() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let (a, b) = (legacy_gateway(&url), legacy_gateway(&url));
    let (ra, rb) = (Raw::new(&a.url), Raw::new(&b.url));
    let created = create(&ra, 1, json!({}));
    let appended = call(
        &ra,
        2,
        "notebook_append",
        json!({"text": "x"}),
        Some(&cookie_of(&created)),
    );
    let cookie = cookie_of(&appended);

    let meta = json!({"_meta": {"mcp/session": {"id": cookie["id"]}}});
    let deleted = rb.modern(3, "session/delete", meta, json!({})).json();
    assert_eq!(deleted["result"]["deleted"], true, "{deleted}");
    assert_eq!(
        deleted["result"]["_meta"]["mcp/session"],
        Value::Null,
        "{deleted}"
    );
    assert!(deleted["result"]["_meta"]
        .as_object()
        .unwrap()
        .contains_key("mcp/session"));
    assert_eq!(
        metric_with(&b.admin, "mrtr_gateway_upstream_sessions_total", "deleted"),
        Some(1.0)
    );

    // The cookie still opens, but the upstream answers 404: the DELETE reached it.
    let (status, after) = call_status(&ra, 4, "notebook_read", json!({}), Some(&cookie), json!({}));
    assert_session_ended(status, &after);
    assert_eq!(
        metric_with(&a.admin, "mrtr_gateway_data_sessions_total", "ended"),
        Some(1.0)
    );

    // `params.id` names the session as well as `_meta` does.
    let other = create(&ra, 5, json!({}));
    let by_id = json!({"id": cookie_of(&other)["id"]});
    let deleted = ra.modern(6, "session/delete", by_id, json!({})).json();
    assert_eq!(deleted["result"]["deleted"], true, "{deleted}");
    let (status, _) = call_status(
        &ra,
        7,
        "notebook_read",
        json!({}),
        Some(&cookie_of(&other)),
        json!({}),
    );
    assert_eq!(status, 404);
}

/// A cookie, sealed for an anonymous client, naming session `sid` on the upstream at
/// `port`, whose expiry has passed.
fn expired_cookie(port: u16, sid: &str) -> Value {
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let me = PrincipalSource::Authorization.digest(None);
    let cookie = DataSession {
        group: "default".into(),
        endpoint: format!("127.0.0.1:{port}").parse().unwrap(),
        upstream_session: sid.into(),
        expires_at: now_secs() - 1,
        session_id: 1,
        version: Default::default(),
    };
    json!({"id": cookie.seal(&ring, &me)})
}

/// An expired cookie's session is deleted after the answer, in the background: the
/// client's next request on the same connection is answered while the upstream has yet
/// to take the DELETE.
#[test]
fn an_expired_cookies_delete_does_not_hold_up_the_clients_next_request() {
    let deletes = Gate::new();
    let gate = deletes.clone();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let basic = legacy_basics(seen, "s-new").unwrap_or_else(|| Answer::status(405, &[], b""));
        match seen.method.as_str() {
            "DELETE" => Answer::silent().wait(&gate).bytes(basic.pieces_bytes()),
            _ => basic,
        }
    });
    // The upstream is given longer to answer than the client waits for its next answer.
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.upstreams[0].response_timeout_ms = 60_000;
    });
    // One client, whose connection is kept alive between its requests.
    let cookie = expired_cookie(upstream.port, "s-old");
    let params = json!({"name": "notebook_read", "arguments": {},
        "_meta": {"mcp/session": {"id": cookie["id"]}}});
    let refused = raw_modern_request(1, "tools/call", params, json!({}), "");
    let mut client = raw_send(gw.port, refused.as_bytes(), READ_LIMIT);
    let (head, body) = read_response(&mut client);
    assert!(head.starts_with("http/1.1 400"), "{head}");
    assert!(body.contains(INVALID_COOKIE), "{body}");
    wait_until("the DELETE sent", Duration::from_secs(5), || {
        upstream.requests().iter().any(|s| s.method == "DELETE")
    });
    // Answered while the upstream holds the DELETE (which it does for 30 s).
    let create = raw_modern_request(2, "session/create", json!({}), json!({}), "");
    client
        .write_all(create.as_bytes())
        .expect("the second request sent");
    let (head, body) = read_response(&mut client);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(body.contains("\"result\""), "{body}");
    deletes.open();
}

/// An expired cookie gets the one error every refused cookie gets, and the session it
/// names, which no cookie reaches any more, is deleted upstream (the SDK servers keep a
/// session until it is); nothing else is sent. `session/delete` ends what an expired
/// cookie names.
#[test]
fn an_expired_cookie_is_refused_and_its_session_deleted() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        legacy_basics(seen, "s1").unwrap_or_else(|| Answer::status(200, &[], b""))
    });
    let gw = legacy_gateway(&upstream.url());
    let raw = Raw::new(&gw.url);
    let expired = |sid: &str| expired_cookie(upstream.port, sid);
    let (status, body) = call_status(
        &raw,
        1,
        "notebook_read",
        json!({}),
        Some(&expired("s1")),
        json!({}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["message"], INVALID_COOKIE, "{body}");
    let deleted = |sid: &str| {
        upstream
            .requests()
            .iter()
            .any(|s| s.method == "DELETE" && s.header("mcp-session-id") == Some(sid))
    };
    wait_until(
        "the expired session deleted",
        Duration::from_secs(5),
        || deleted("s1"),
    );
    let meta = json!({"_meta": {"mcp/session": expired("s2")}});
    let ended = raw.modern(2, "session/delete", meta, json!({})).json();
    assert_eq!(ended["result"]["deleted"], true, "{ended}");
    assert!(deleted("s2"), "session/delete sent no DELETE");
    let methods: Vec<String> = upstream
        .requests()
        .iter()
        .map(|s| s.method.clone())
        .collect();
    assert_eq!(
        methods,
        ["DELETE", "DELETE"],
        "nothing but the ends went up"
    );
}

/// A retry carries the params of the round it answers, cookie included; that cookie may
/// have expired while the user answered, though every result since carried a fresh one.
/// The retry of a call begun in the session goes on in it: its session is neither
/// refused nor deleted, and the result carries a fresh cookie. Another request with the
/// expired cookie is still refused (above).
#[test]
fn a_retry_whose_cookie_expired_while_the_user_answered_goes_on_in_its_session() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = legacy_gateway(&url);
    let raw = Raw::new(&gw.url);
    let created = create(&raw, 1, json!({}));
    let appended = call(
        &raw,
        2,
        "notebook_append",
        json!({"text": "kept"}),
        Some(&cookie_of(&created)),
    );
    let asked = call(&raw, 3, "ask_name", json!({}), Some(&cookie_of(&appended)));
    assert_eq!(question(&asked), "What is your name?");
    // The cookie the round was sent with, as it is once its expiry has passed.
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let sent = cookie_of(&appended);
    let (_, mut cookie) = DataSession::open_unbound(&ring, sent["id"].as_str().unwrap()).unwrap();
    cookie.expires_at = now_secs() - 1;
    let me = PrincipalSource::Authorization.digest(None);
    let expired = json!({"id": cookie.seal(&ring, &me)});
    let retry = answer(&asked, json!({"name": "Ada"}));
    let (status, done) = call_status(&raw, 4, "ask_name", json!({}), Some(&expired), retry);
    assert_eq!(status, 200, "{done}");
    assert_eq!(text(&done), "Hello, Ada!");
    let (pages, _) = notebook(&raw, 5, Some(&cookie_of(&done)));
    assert_eq!(pages, ["kept"], "the session lives on");
}

#[test]
fn foreign_and_tampered_cookies_get_one_error_and_reach_no_upstream() {
    let tripwire = Tripwire::start();
    let gw = legacy_gateway(&tripwire.url());
    let raw = Raw::new(&gw.url);
    let ring = KeyRing::parse(&test_keys()).unwrap();
    let me = PrincipalSource::Authorization.digest(None);
    let someone = PrincipalSource::Authorization.digest(Some(b"Bearer someone-else"));
    let good = DataSession {
        group: "default".into(),
        endpoint: format!("127.0.0.1:{}", tripwire.port).parse().unwrap(),
        upstream_session: "s1".into(),
        expires_at: now_secs() + 600,
        session_id: 1,
        version: Default::default(),
    };
    let with = |change: &dyn Fn(&mut DataSession)| {
        let mut cookie = good.clone();
        change(&mut cookie);
        cookie.seal(&ring, &me)
    };
    let sealed = good.seal(&ring, &me);
    let mut tampered = sealed.clone().into_bytes();
    let middle = tampered.len() / 2;
    tampered[middle] = if tampered[middle] == b'A' { b'B' } else { b'A' };
    let other_secret = KeyRing::parse("test1:AQECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap();
    let token = SessionToken {
        group: "default".into(),
        endpoint: good.endpoint,
        upstream_session: "s1".into(),
        issued_at: 0,
    };
    let cases: Vec<(&str, Value)> = vec![
        ("other principal", json!(good.seal(&ring, &someone))),
        ("tampered", json!(String::from_utf8(tampered).unwrap())),
        ("other secret", json!(good.seal(&other_secret, &me))),
        ("other group", json!(with(&|c| c.group = "other".into()))),
        (
            "unknown endpoint",
            json!(with(&|c| c.endpoint = "127.0.0.1:1".parse().unwrap())),
        ),
        ("a session token", json!(token.seal(&ring, &me))),
        ("not a string", json!(7)),
        ("oversized", json!("A".repeat(4096))),
    ];
    for (i, (name, id)) in cases.iter().enumerate() {
        let cookie = json!({"id": id});
        let (status, body) = call_status(
            &raw,
            i as u64,
            "notebook_read",
            json!({}),
            Some(&cookie),
            json!({}),
        );
        assert_eq!(status, 400, "{name}: {body}");
        assert_eq!(body["error"]["code"], -32011, "{name}: {body}");
        assert_eq!(body["error"]["message"], INVALID_COOKIE, "{name}: {body}");
        assert_eq!(
            body["error"]["data"]["_meta"],
            json!({"mcp/session": null}),
            "{name}"
        );
    }
    assert_eq!(tripwire.count(), 0, "a refused cookie reached the upstream");
    assert_eq!(
        metric_with(&gw.admin, "mrtr_gateway_data_sessions_total", "rejected"),
        Some(cases.len() as f64)
    );
    // The control: the same cookie, untouched, is forwarded to the endpoint it names.
    let (status, _) = call_status(
        &raw,
        99,
        "notebook_read",
        json!({}),
        Some(&json!({"id": sealed})),
        json!({}),
    );
    assert_ne!(status, 400);
    assert!(
        tripwire.count() > 0,
        "the untouched cookie was not forwarded"
    );
}

#[test]
fn a_required_tool_without_a_session_gets_the_documented_error() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.upstreams[0].tools.insert(
            "notebook_append".into(),
            ToolPolicy {
                session: SessionPolicy::Required,
                ..ToolPolicy::default()
            },
        );
    });
    let raw = Raw::new(&gw.url);
    let (status, refused) = call_status(
        &raw,
        1,
        "notebook_append",
        json!({"text": "x"}),
        None,
        json!({}),
    );
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["code"], -32010, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("notebook_append") && message.contains("session/create"),
        "{message}"
    );
    // A tool without the policy runs without a session.
    let (pages, _) = notebook(&raw, 2, None);
    assert!(pages.is_empty());
    let created = create(&raw, 3, json!({}));
    let appended = call(
        &raw,
        4,
        "notebook_append",
        json!({"text": "x"}),
        Some(&cookie_of(&created)),
    );
    assert_eq!(text(&appended), "appended 'x': 1 entries");
}

#[test]
fn two_calls_at_once_in_one_session_keep_their_own_questions() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = legacy_gateway(&url);
    let raw = Raw::new(&gw.url);
    let cookie = cookie_of(&create(&raw, 1, json!({})));
    let ask = |id: u64, label: &'static str| {
        let (url, cookie) = (gw.url.clone(), cookie.clone());
        std::thread::spawn(move || {
            let asked = call(
                &Raw::new(&url),
                id,
                "notebook_ask",
                json!({"label": label}),
                Some(&cookie),
            );
            (label, asked)
        })
    };
    let (left, right) = (ask(2, "left"), ask(3, "right"));
    let asked: Vec<(&str, Value)> = [left, right].map(|t| t.join().unwrap()).into();
    for (label, response) in &asked {
        assert_eq!(question(response), format!("Text for {label}?"));
    }
    // Answer in the other order, each with its own text.
    for (id, (label, response)) in asked.iter().enumerate().rev() {
        let retry = answer(response, json!({"text": format!("{label}-text")}));
        let (status, done) = call_status(
            &raw,
            10 + id as u64,
            "notebook_ask",
            json!({"label": label}),
            Some(&cookie_of(response)),
            retry,
        );
        assert_eq!(status, 200, "{done}");
        assert_eq!(text(&done), format!("{label}: {label}-text"));
    }
    let (pages, _) = notebook(&raw, 20, Some(&cookie));
    assert_eq!(pages, ["right: right-text", "left: left-text"]);
}

/// A call in a data-layer session whose client leaves is cancelled upstream by its id, as
/// a legacy client cancels one: the session outlives its calls, so it is not deleted, and
/// closing the call's stream alone leaves the tool running in the server.
#[test]
fn a_call_whose_client_leaves_is_cancelled_by_id_in_its_session() {
    let upstream = ScriptedUpstream::start(tool_running_on);
    let gw = legacy_gateway(&upstream.url());
    call_left_by_its_client(&gw, &upstream);
    assert_call_cancelled_in_its_session(&upstream, &gw.admin, "gave_up");
}

/// That cancellation, when the upstream cannot take it (it is restarting: a 503), is sent
/// again later, the same: the tool would otherwise run on until the session ends.
#[test]
fn a_cancellation_of_a_call_whose_client_left_that_failed_is_sent_again() {
    let (upstream, cancellations) = FirstRefused::cancellations_in_front_of(tool_running_on);
    let gw = legacy_gateway(&upstream.url());
    call_left_by_its_client(&gw, &upstream);
    cancellations.assert_cancelled_again_the_same(&upstream);
    assert_call_cancelled_in_its_session(&upstream, &gw.admin, "gave_up");
}

/// A legacy server in session `s1` whose calls run on: their streams are primed and stay
/// open.
fn tool_running_on(seen: &Seen) -> Answer {
    if let Some(answer) = legacy_basics(seen, "s1") {
        return answer;
    }
    Answer::sse(&[]).event(Some("c1"), &json!(""))
}

/// Sends call `slow` in a new data-layer session of `gw`, and leaves once it is upstream.
fn call_left_by_its_client(gw: &TestGateway, upstream: &ScriptedUpstream) {
    let raw = Raw::new(&gw.url);
    let cookie = cookie_of(&create(&raw, 1, json!({})));
    let params = json!({"name": "slow", "arguments": {},
        "_meta": {"mcp/session": {"id": cookie["id"]}}});
    // The client leaves once the call is upstream (before, nothing would be cancelled).
    let client = send_and_stay(gw.port, 2, params, json!({"elicitation": {}}));
    let is_call = |s: &Seen| s.jsonrpc_method().as_deref() == Some("tools/call");
    wait_until("the call posted", Duration::from_secs(10), || {
        upstream.requests().iter().any(is_call)
    });
    drop(client);
}

/// A call in a data-layer session that asks, and whose client never continues it, is
/// cancelled by id at the flow's deadline by the replica that posted it: the session
/// outlives the call, so without it the tool would wait in the server for answers until
/// the session ends.
#[test]
fn a_call_its_client_never_continues_is_cancelled_at_the_flows_deadline() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if let Some(answer) = legacy_basics(seen, "s1") {
            return answer;
        }
        // The call asks under event ids, so its round waits resumable.
        let question = json!({"jsonrpc": "2.0", "id": 0, "method": "elicitation/create",
            "params": {"mode": "form", "message": "Name?", "requestedSchema": {"type": "object"}}});
        Answer::sse(&[])
            .event(Some("c1"), &json!(""))
            .event(Some("c2"), &question)
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.bridge.request_state_ttl_seconds = 1;
        c.bridge.max_flow_seconds = 2;
    });
    let raw = Raw::new(&gw.url);
    let cookie = cookie_of(&create(&raw, 1, json!({})));
    let asked = call(&raw, 2, "ask", json!({}), Some(&cookie));
    assert_eq!(question(&asked), "Name?");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_pending_flows"), 1.0);
    assert_call_cancelled_in_its_session(&upstream, &gw.admin, "abandoned");
    let cancelled = "mrtr_gateway_upstream_calls_cancelled_total";
    assert_eq!(metric_with(&gw.admin, cancelled, "gave_up"), Some(0.0));
}

/// A waiting call that its retry completes on the replica that posted it is no longer
/// watched: nothing is left to cancel, and the reaper's table does not fill with calls
/// that ended.
#[test]
fn a_call_its_retry_completes_is_no_longer_watched() {
    let (_upstream, url) = start_upstream(Upstream::Python);
    let gw = legacy_gateway(&url);
    let raw = Raw::new(&gw.url);
    let cookie = cookie_of(&create(&raw, 1, json!({})));
    let asked = call(&raw, 2, "ask_name", json!({}), Some(&cookie));
    assert_eq!(question(&asked), "What is your name?");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_pending_flows"), 1.0);
    let retry = answer(&asked, json!({"name": "Ada"}));
    let (status, done) = call_status(&raw, 3, "ask_name", json!({}), Some(&cookie), retry);
    assert_eq!(status, 200, "{done}");
    assert_eq!(text(&done), "Hello, Ada!");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_pending_flows"), 0.0);
}

/// A session deleted while a call runs in it (by its client on another connection or
/// replica) ends that call as any request in an ended session ends: `Session ended`
/// (404) with the cookie revoked, not as an upstream failure.
#[test]
fn a_call_whose_session_is_deleted_meanwhile_is_told_the_session_ended() {
    session_deleted_during_a_call(Upstream::Python);
}

/// The same on a server without an event store, whose call stream cannot be resumed: the
/// stream that ends with the session does not make the call look broken upstream.
#[test]
fn a_call_whose_unresumable_session_is_deleted_meanwhile_is_told_the_session_ended() {
    session_deleted_during_a_call(Upstream::PythonWithoutEventStore);
}

/// The cancellation that asks whether a failed call's session ended is bounded: an
/// upstream that never answers it does not hold the client's error for the response
/// timeout (60 s here).
#[test]
fn a_failed_call_is_answered_though_its_cancellation_goes_unanswered() {
    let upstream = ScriptedUpstream::start(|seen: &Seen| {
        if is_cancellation(seen) {
            return Answer::silent();
        }
        stream_ending_at_once(seen)
    });
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
        c.upstreams[0].response_timeout_ms = 60_000;
    });
    let raw = Raw::new(&gw.url);
    let cookie = cookie_of(&create(&raw, 1, json!({})));
    let answered = std::thread::spawn({
        let raw = Raw::new(&gw.url);
        move || call_status(&raw, 2, "broken", json!({}), Some(&cookie), json!({}))
    });
    wait_until("the client answered", Duration::from_secs(15), || {
        answered.is_finished()
    });
    let (status, failed) = answered.join().expect("the call's thread");
    assert_eq!(status, 200, "{failed}");
    assert_eq!(failed["error"]["code"], -32603, "{failed}");
    assert_eq!(
        upstream
            .requests()
            .iter()
            .filter(|s| is_cancellation(s))
            .count(),
        1
    );
}

/// That cancellation, when the upstream cannot take it at once (a 503 while it
/// restarts), is sent again later, the same: the client's error says the call failed,
/// and the tool, if it runs on, is told to stop.
#[test]
fn a_failed_calls_cancellation_that_failed_is_sent_again() {
    let (upstream, cancellations) = FirstRefused::cancellations_in_front_of(stream_ending_at_once);
    let gw = TestGateway::start_with(&[&upstream.url()], &test_keys(), |c| {
        c.upstreams[0].era = UpstreamEra::Legacy;
    });
    let raw = Raw::new(&gw.url);
    let cookie = cookie_of(&create(&raw, 1, json!({})));
    let (status, failed) = call_status(&raw, 2, "broken", json!({}), Some(&cookie), json!({}));
    assert_eq!(status, 200, "{failed}");
    assert_eq!(failed["error"]["code"], -32603, "{failed}");
    cancellations.assert_cancelled_again_the_same(&upstream);
}

/// A legacy server in session `s1` whose calls' streams end at once, without a result and
/// without event ids.
fn stream_ending_at_once(seen: &Seen) -> Answer {
    legacy_basics(seen, "s1").unwrap_or_else(|| Answer::sse(&[]).end())
}

fn session_deleted_during_a_call(server: Upstream) {
    let (_upstream, url) = start_upstream(server);
    let gw = legacy_gateway(&url);
    let raw = Raw::new(&gw.url);
    let cookie = cookie_of(&create(&raw, 1, json!({})));
    let running = std::thread::spawn({
        let (raw, cookie) = (Raw::new(&gw.url), cookie.clone());
        move || {
            let args = json!({"text": "x", "ms": 5000});
            call_status(&raw, 2, "slow_echo", args, Some(&cookie), json!({}))
        }
    });
    wait_until("the call running", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_active_rounds") == 1.0
    });
    let meta = json!({"_meta": {"mcp/session": {"id": cookie["id"]}}});
    let deleted = raw.modern(3, "session/delete", meta, json!({})).json();
    assert_eq!(deleted["result"]["deleted"], true, "{deleted}");
    let (status, ended) = running.join().expect("the call's thread");
    assert_session_ended(status, &ended);
}

/// A client that leaves while its `session/create` opens the upstream session will never
/// hold the cookie: the session opened for it is deleted, not left to the upstream's
/// idle timer.
#[test]
fn a_session_create_whose_client_left_deletes_the_session_it_opened() {
    let initialized = Gate::new();
    let gate = initialized.clone();
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        let basic = legacy_basics(seen, "s-left").unwrap_or_else(|| Answer::status(405, &[], b""));
        match seen.jsonrpc_method().as_deref() {
            Some("initialize") => Answer::silent().wait(&gate).bytes(basic.pieces_bytes()),
            _ => basic,
        }
    });
    let gw = legacy_gateway(&upstream.url());
    let request = raw_modern_request(1, "session/create", json!({}), json!({}), "");
    let client = raw_send(gw.port, request.as_bytes(), Duration::from_secs(5));
    wait_until("the initialize sent", Duration::from_secs(5), || {
        upstream
            .requests()
            .iter()
            .any(|s| s.jsonrpc_method().as_deref() == Some("initialize"))
    });
    drop(client);
    initialized.open();
    let deleted = |s: &Seen| s.method == "DELETE" && s.header("mcp-session-id") == Some("s-left");
    wait_until("the session opened deleted", Duration::from_secs(5), || {
        upstream.requests().iter().any(deleted)
    });
}

/// An upstream session whose id the gateway cannot carry in a cookie (over 256 bytes)
/// cannot back a data-layer session: `session/create` is refused, and the session it
/// opened is deleted rather than left to the upstream's idle timer.
#[test]
fn a_session_create_refused_for_its_upstream_id_deletes_that_session() {
    let long_id = "s".repeat(300);
    let upstream = ScriptedUpstream::start(move |seen: &Seen| {
        legacy_basics(seen, &long_id).unwrap_or_else(|| Answer::status(405, &[], b""))
    });
    let gw = legacy_gateway(&upstream.url());
    let created = Raw::new(&gw.url).modern(1, "session/create", json!({}), json!({}));
    let refused = created.json();
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Mcp-Session-Id the gateway cannot carry"),
        "{refused}"
    );
    let deleted = |s: &Seen| {
        s.method == "DELETE" && s.header("mcp-session-id").is_some_and(|id| id.len() == 300)
    };
    wait_until("the session opened deleted", Duration::from_secs(5), || {
        upstream.requests().iter().any(deleted)
    });
}
