//! DNS discovery against a DNS server the test controls: a UDP responder on loopback
//! answers one name from a list the test changes while the gateway runs, as a Kubernetes
//! headless Service's answer changes when pods come and go. The pods are real Python SDK
//! servers on 127.0.0.2 and 127.0.0.3, on one port.

use crate::common::*;
use hickory_resolver::proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_resolver::proto::rr::rdata::{A, AAAA};
use hickory_resolver::proto::rr::{Name, RData, Record, RecordType};
use mrtr_gateway::config::{Config, Discovery, ResumeMode};
use mrtr_gateway::upstream::dns::DnsDiscovery;
use pingora::lb::selection::RoundRobin;
use pingora::lb::{Backends, LoadBalancer};
use serde_json::json;
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const NAME: &str = "legacy.mcp.test.";
const POD_A: &str = "127.0.0.2";
const POD_B: &str = "127.0.0.3";

/// What the test DNS server answers for `NAME`.
#[derive(Clone, Debug)]
enum Answer {
    /// These addresses: A queries get the IPv4 ones, AAAA queries the IPv6 ones.
    Addrs(Vec<IpAddr>),
    /// SERVFAIL: the resolver failed, which says nothing about the name.
    ServFail,
    /// These IPv4 addresses to A queries, SERVFAIL to AAAA ones (some firewalls and DNS64
    /// resolvers).
    AaaaFails(Vec<IpAddr>),
}

struct DnsState {
    answer: Answer,
    /// A queries for `NAME` answered since the answer last changed.
    a_queries: usize,
}

/// A DNS server on a loopback UDP port: `NAME` per the current `Answer`, NXDOMAIN for
/// every other name. Stops when dropped.
struct TestDns {
    addr: SocketAddr,
    state: Arc<Mutex<DnsState>>,
    stop: Arc<AtomicBool>,
}

impl TestDns {
    fn start(answer: Answer) -> TestDns {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind the test DNS server");
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("read timeout");
        let addr = socket.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(DnsState {
            answer,
            a_queries: 0,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (shared, stopped) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !stopped.load(Ordering::SeqCst) {
                let Ok((n, from)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let reply = respond(&query, &mut shared.lock().unwrap());
                let _ = socket.send_to(&reply.to_vec().expect("encodable reply"), from);
            }
        });
        TestDns { addr, state, stop }
    }

    fn answer(&self, answer: Answer) {
        let mut state = self.state.lock().unwrap();
        state.answer = answer;
        state.a_queries = 0;
    }

    /// Waits until the gateway has acted on the current answer. Its balancer resolves
    /// again only after it applied the previous lookup, so a second A query since the
    /// change proves the first one's answer is in use.
    fn wait_applied(&self) {
        wait_until(
            "the gateway to apply the DNS answer",
            Duration::from_secs(10),
            || self.state.lock().unwrap().a_queries >= 2,
        );
    }
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn respond(query: &Message, state: &mut DnsState) -> Message {
    let mut reply = Message::new();
    reply
        .set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_authoritative(true)
        .add_queries(query.queries().to_vec());
    let Some(question) = query.queries().first() else {
        reply.set_response_code(ResponseCode::FormErr);
        return reply;
    };
    let name = Name::from_ascii(NAME).expect("a DNS name");
    if *question.name() != name {
        reply.set_response_code(ResponseCode::NXDomain);
        return reply;
    }
    if question.query_type() == RecordType::A {
        state.a_queries += 1;
    }
    let addrs = match &state.answer {
        Answer::AaaaFails(_) if question.query_type() == RecordType::AAAA => {
            reply.set_response_code(ResponseCode::ServFail);
            return reply;
        }
        Answer::ServFail => {
            reply.set_response_code(ResponseCode::ServFail);
            return reply;
        }
        Answer::Addrs(addrs) | Answer::AaaaFails(addrs) => addrs,
    };
    for ip in addrs {
        let rdata = match (question.query_type(), ip) {
            (RecordType::A, IpAddr::V4(v4)) => RData::A(A(*v4)),
            (RecordType::AAAA, IpAddr::V6(v6)) => RData::AAAA(AAAA(*v6)),
            _ => continue,
        };
        reply.add_answer(Record::from_rdata(name.clone(), 0, rdata));
    }
    reply
}

fn ips(list: &[&str]) -> Answer {
    Answer::Addrs(list.iter().map(|ip| ip.parse().unwrap()).collect())
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// The DNS answer becomes the balancer's backends; a failed lookup keeps them, an answer
/// without addresses empties them, and a name that does not exist has none.
#[test]
fn dns_discovery_follows_the_answer_and_keeps_the_set_when_a_lookup_fails() {
    let dns = TestDns::start(ips(&[POD_A, "::1"]));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let discovery = DnsDiscovery::new("g", NAME, 3001, Some(dns.addr)).unwrap();
    let balancer = LoadBalancer::<RoundRobin>::from_backends(Backends::new(Box::new(discovery)));
    let current = || -> BTreeSet<SocketAddr> {
        let backends = balancer.backends().get_backend();
        backends
            .iter()
            .filter_map(|b| b.addr.as_inet().copied())
            .collect()
    };
    rt.block_on(balancer.update()).expect("a lookup");
    let expected = BTreeSet::from([addr(POD_A, 3001), addr("::1", 3001)]);
    assert_eq!(current(), expected);

    dns.answer(Answer::ServFail);
    assert!(rt.block_on(balancer.update()).is_err(), "SERVFAIL fails");
    assert_eq!(current(), expected, "a failed lookup keeps the last set");

    // One family failing does not freeze the other: the A answer is taken, and the last
    // IPv6 addresses kept.
    let b = POD_B.parse().unwrap();
    dns.answer(Answer::AaaaFails(vec![b]));
    rt.block_on(balancer.update())
        .expect("the A answer is an answer");
    let expected = BTreeSet::from([addr(POD_B, 3001), addr("::1", 3001)]);
    assert_eq!(current(), expected);

    dns.answer(ips(&[POD_A, POD_B]));
    rt.block_on(balancer.update()).expect("a lookup");
    assert_eq!(
        current(),
        BTreeSet::from([addr(POD_A, 3001), addr(POD_B, 3001)])
    );

    dns.answer(ips(&[]));
    rt.block_on(balancer.update())
        .expect("an empty answer is an answer");
    assert!(current().is_empty(), "no address, no backend");

    let unknown = DnsDiscovery::new("g", "other.mcp.test.", 3001, Some(dns.addr)).unwrap();
    let found = rt
        .block_on(unknown.resolve())
        .expect("NXDOMAIN is an answer");
    assert!(found.is_empty());
}

/// A pod of the Python SDK fixture listening on `ip:port`.
fn start_pod(ip: &str, port: u16) -> Proc {
    let fixtures = root().join("tests/fixtures");
    let child = Command::new(python())
        .arg(fixtures.join("py_legacy_server.py"))
        .arg(port.to_string())
        .args(["--host", ip])
        .current_dir(&fixtures)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the Python fixture (run tests/setup.sh): {e}"));
    let pod = Proc::adopt(child, &format!("pod {ip}"));
    wait_until(&format!("pod {ip}:{port}"), Duration::from_secs(30), || {
        TcpStream::connect((ip, port)).is_ok()
    });
    pod
}

fn call_add(raw: &Raw, session: &str) -> Reply {
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "add", "arguments": {"a": 2, "b": 3}}});
    raw.post(Some(session), &call)
}

fn unknown_endpoint_rejections(gw: &TestGateway) -> f64 {
    metric_with(
        &gw.admin,
        "mrtr_gateway_session_token_rejections_total",
        "unknown_endpoint",
    )
    .unwrap_or(0.0)
}

/// A gateway whose one group is `NAME` on `port`, found through `dns`, as `configure`
/// changes it further.
fn dns_gateway(dns: &TestDns, port: u16, configure: impl FnOnce(&mut Config)) -> TestGateway {
    let url = format!("http://legacy.mcp.test:{port}/mcp");
    TestGateway::start_with(&[&url], &test_keys(), |c| {
        c.dns_resolver = Some(dns.addr.to_string());
        c.upstreams[0].discovery = Discovery::Dns;
        c.upstreams[0].dns_refresh_ms = 150;
        configure(c);
    })
}

/// New sessions go to the pods the DNS name currently answers; a session token naming a
/// pod that left the answer is refused as unknown, and nothing reaches that address.
#[test]
fn dns_discovered_pods_take_new_sessions_and_pods_that_left_are_refused() {
    let port = free_port();
    let mut pod_a = start_pod(POD_A, port);
    let _pod_b = start_pod(POD_B, port);
    let dns = TestDns::start(ips(&[POD_A]));
    let gw = dns_gateway(&dns, port, |_| {});
    let raw = Raw::new(&gw.url);

    // 1. One pod: sessions open on it, and their tokens name it.
    dns.wait_applied();
    let on_a = raw.initialize(json!({}));
    assert_eq!(endpoint_of(&on_a), addr(POD_A, port));
    let mut added = call_add(&raw, &on_a);
    assert_eq!(added.status, 200);
    let result = Raw::messages_until(&mut added, |m| m["id"] == 2)
        .pop()
        .unwrap()
        .1;
    assert!(result.to_string().contains("2+3=5"), "{result}");
    let flow_on_a = ask_name(&raw, 1, json!({}));
    let retry_on_a = answer(&flow_on_a, json!({"name": "Ada"}));

    // 2. A second pod joins: new sessions are balanced over both.
    dns.answer(ips(&[POD_A, POD_B]));
    dns.wait_applied();
    let sessions: Vec<String> = (0..4).map(|_| raw.initialize(json!({}))).collect();
    let landed: BTreeSet<SocketAddr> = sessions.iter().map(|s| endpoint_of(s)).collect();
    assert_eq!(
        landed,
        BTreeSet::from([addr(POD_A, port), addr(POD_B, port)])
    );
    let on_b = sessions
        .iter()
        .find(|s| endpoint_of(s) == addr(POD_B, port))
        .unwrap()
        .clone();

    // 3. Pod A leaves, and its address now belongs to something that must get nothing.
    pod_a.kill();
    let tripwire = Tripwire::start_on(&addr(POD_A, port).to_string());
    dns.answer(ips(&[POD_B]));
    dns.wait_applied();
    let refused = call_add(&raw, &on_a);
    assert_eq!(refused.status, 404, "a token naming a pod that left");
    let body = refused.json();
    assert!(body["error"]["code"].is_i64(), "a JSON-RPC error: {body}");
    assert_eq!(unknown_endpoint_rejections(&gw), 1.0);
    assert_eq!(
        tripwire.count(),
        0,
        "nothing was forwarded to the old address"
    );
    // A flow parked on the pod that left is lost with it, as with a pod that is down:
    // `-32012`, for the client to issue the call again (not a malformed state's -32602).
    let resumed = ask_name(&raw, 2, retry_on_a);
    assert_eq!(
        resumed["error"]["code"], -32012,
        "a state naming a pod that left: {resumed}"
    );
    let message = resumed["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("left the group"), "{resumed}");
    let state_rejections = "mrtr_gateway_request_state_rejections_total";
    for reason in [
        "malformed",
        "tampered",
        "bad_payload",
        "other_group",
        "binding",
    ] {
        let rejected = metric_with(&gw.admin, state_rejections, reason);
        assert_eq!(rejected, Some(0.0), "the state itself was good: {reason}");
    }
    assert_eq!(
        tripwire.count(),
        0,
        "nothing was forwarded for the state either"
    );
    assert_eq!(call_add(&raw, &on_b).status, 200, "pod B's session goes on");
    assert_eq!(endpoint_of(&raw.initialize(json!({}))), addr(POD_B, port));

    // 4. The resolver fails: the group keeps the pods it knew.
    dns.answer(Answer::ServFail);
    dns.wait_applied();
    assert_eq!(endpoint_of(&raw.initialize(json!({}))), addr(POD_B, port));

    // 5. Every pod is gone: no endpoint for new sessions, and old tokens are refused.
    dns.answer(ips(&[]));
    dns.wait_applied();
    let init = legacy_initialize("dns-test");
    assert_eq!(
        raw.post(None, &init).status,
        503,
        "no endpoint to open a session on"
    );
    assert_eq!(call_add(&raw, &on_b).status, 404);
    assert_eq!(unknown_endpoint_rejections(&gw), 2.0);
    assert_eq!(tripwire.count(), 0);
}

/// A flow held on this replica (`resume: hold`, as `configure` changes the gateway
/// further) whose session is on pod A, the only pod the DNS name answers: the pod, the
/// DNS server, the gateway, and the round's answer.
fn flow_held_on_pod_a(
    configure: impl FnOnce(&mut Config),
) -> (
    crate::scripted::ScriptedUpstream,
    TestDns,
    TestGateway,
    serde_json::Value,
) {
    use crate::resumption::{call_hostile, resumable_script, Asks, Resumes};
    let port = free_port();
    let script = resumable_script(Resumes::Primed, true, Asks::AfterPriming);
    let pod = crate::scripted::ScriptedUpstream::start_on(&addr(POD_A, port).to_string(), script);
    let dns = TestDns::start(ips(&[POD_A]));
    let gw = dns_gateway(&dns, port, |c| {
        c.upstreams[0].resume = ResumeMode::Hold;
        configure(c);
    });
    dns.wait_applied();
    let (status, first) = call_hostile(&Raw::new(&gw.url), 1, json!({}));
    assert_eq!(status, 200, "{first}");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 1.0, "{first}");
    (pod, dns, gw, first)
}

/// A held flow whose pod leaves the DNS answer, then expires: its streams close, but its
/// session is not deleted at the address, which may be another server's by then (a pod's
/// IP is given to the next pod): neither the session id nor the caller's credentials go
/// there.
#[test]
fn a_held_flow_whose_pod_left_expires_without_a_request_to_its_address() {
    let (pod, dns, gw, _) = flow_held_on_pod_a(|c| c.bridge.request_state_ttl_seconds = 1);
    dns.answer(ips(&[]));
    dns.wait_applied();
    let events = "mrtr_gateway_held_flow_events_total";
    wait_until("the held flow ended", Duration::from_secs(10), || {
        metric_with(&gw.admin, events, "endpoint_left") == Some(1.0)
    });
    assert_eq!(metric_with(&gw.admin, events, "expired"), Some(1.0));
    let deleted = pod.requests().iter().any(|s| s.method == "DELETE");
    assert!(!deleted, "a DELETE went to the address that left");
}

/// A held flow whose pod leaves the DNS answer, then is retried: the call is lost with
/// the pod (-32012, as a resumable flow's is), and neither the answers nor the session id
/// and credentials go to the address, which may be another server's by then.
#[test]
fn a_held_flow_whose_pod_left_is_lost_on_its_retry_without_a_request_to_its_address() {
    use crate::resumption::call_hostile;
    let (pod, dns, gw, first) = flow_held_on_pod_a(|_| {});
    let raw = Raw::new(&gw.url);
    let sent_before = pod.requests().len();
    dns.answer(ips(&[]));
    dns.wait_applied();
    let (_, resumed) = call_hostile(&raw, 2, answer(&first, json!({"name": "Ada"})));
    assert_eq!(resumed["error"]["code"], -32012, "{resumed}");
    let sent: Vec<String> = pod.requests()[sent_before..]
        .iter()
        .map(|s| format!("{} {}", s.method, String::from_utf8_lossy(&s.body)))
        .collect();
    assert!(sent.is_empty(), "sent to the address that left: {sent:?}");
    assert_eq!(metric(&gw.admin, "mrtr_gateway_held_flows"), 0.0);
}

/// A warm session (opened ahead of a call of a recurring shape) whose pod leaves the DNS
/// answer idles out without a DELETE to the address, which may be another server's by
/// then: neither its session id nor the credentials it was opened with go there.
#[test]
fn a_warm_session_whose_pod_left_idles_out_without_a_request_to_its_address() {
    use crate::scripted::{legacy_basics, Answer, ScriptedUpstream, Seen};
    let port = free_port();
    let sessions = std::sync::atomic::AtomicUsize::new(0);
    let pod =
        ScriptedUpstream::start_on(&addr(POD_A, port).to_string(), move |seen: &Seen| {
            match (seen.method.as_str(), seen.jsonrpc_method().as_deref()) {
                ("GET", _) => Answer::sse(&[]),
                (_, Some("initialize")) => {
                    let n = sessions.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    legacy_basics(seen, &format!("s{n}")).expect("an initialize answer")
                }
                (_, Some("tools/call")) => Answer::json(
                    200,
                    &json!({"jsonrpc": "2.0", "id": seen.jsonrpc_id(), "result": {"content": []}}),
                ),
                _ => legacy_basics(seen, "s").unwrap_or_else(|| Answer::status(405, &[], b"")),
            }
        });
    let dns = TestDns::start(ips(&[POD_A]));
    let gw = dns_gateway(&dns, port, |c| {
        c.upstreams[0].era = mrtr_gateway::config::UpstreamEra::Legacy;
        c.bridge.warm_session_idle_seconds = 1;
    });
    dns.wait_applied();
    let raw = Raw::new(&gw.url);
    for id in [1, 2] {
        let params = json!({"name": "work", "arguments": {}});
        let done = raw.modern(id, "tools/call", params, json!({})).json();
        assert!(done["result"]["content"].is_array(), "{done}");
    }
    wait_until("a warm session ready", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_warm_sessions") == 1.0
    });
    let sent_before = pod.requests().len();
    dns.answer(ips(&[]));
    dns.wait_applied();
    wait_until("the warm session let go", Duration::from_secs(10), || {
        metric(&gw.admin, "mrtr_gateway_warm_sessions") == 0.0
    });
    let sent: Vec<String> = pod.requests()[sent_before..]
        .iter()
        .map(|s| format!("{} {:?}", s.method, s.header("mcp-session-id")))
        .collect();
    assert!(sent.is_empty(), "sent to the address that left: {sent:?}");
}

/// Whether an event store keeps sessions apart is each endpoint's own: once pod A's (one
/// store per session) was probed, a flow on pod B, whose store is shared by its sessions,
/// does not have its GET stream resumed after its position on A's word (B's replay would
/// carry other sessions' events); B's store is probed itself.
#[test]
fn whether_a_store_keeps_sessions_apart_is_learnt_per_endpoint() {
    use crate::resumption::{
        foreign_probes, get_stream_positions, resumable_script, round_then_retry, Asks, Resumes,
    };
    use crate::scripted::ScriptedUpstream;
    let port = free_port();
    let pod = |ip: &str, scoped: bool| {
        let script = resumable_script(Resumes::Primed, scoped, Asks::OnGetStreamAfterEvent);
        ScriptedUpstream::start_on(&addr(ip, port).to_string(), script)
    };
    let (a, b) = (pod(POD_A, true), pod(POD_B, false));
    let dns = TestDns::start(ips(&[POD_A]));
    let gw = dns_gateway(&dns, port, |_| {});
    dns.wait_applied();
    let raw = Raw::new(&gw.url);
    let done = |status: u16, reply: &serde_json::Value| {
        let text = &reply["result"]["content"][0]["text"];
        assert_eq!((status, text), (200, &json!("done")), "{reply}");
    };
    let (sid, before, status, reply) = round_then_retry(&a, &raw, &raw, 1);
    done(status, &reply);
    assert_eq!(foreign_probes(&a), 1, "A's store probed");
    let resumed_on_a = get_stream_positions(&a, &sid, before);
    assert_eq!(resumed_on_a, [Some(format!("{sid}-g0"))]);
    dns.answer(ips(&[POD_B]));
    dns.wait_applied();
    let (sid, before, status, reply) = round_then_retry(&b, &raw, &raw, 3);
    done(status, &reply);
    assert_eq!(foreign_probes(&b), 1, "B's store probed");
    let resumed_on_b = get_stream_positions(&b, &sid, before);
    assert_eq!(resumed_on_b, [None], "B's GET stream resumed on A's word");
}
