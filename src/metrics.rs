//! Prometheus metrics, prefixed `mrtr_gateway_`, in a registry per gateway instance so
//! that several gateways in one process (tests, `demo`) never mix their counts.
//! Labels stay bounded: methods outside the MCP set are counted as `other`, reasons and
//! outcomes are fixed names, upstreams are the configured `host:port` authorities, and no
//! label ever carries a session id, a token or an argument.

use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

pub struct Metrics {
    pub registry: Registry,
    /// Client requests by era (`legacy`, `modern`, `modern_relayed`), method and outcome.
    pub requests: IntCounterVec,
    /// InputRequiredResult responses sent (one per round that asked), by method.
    pub input_required: IntCounterVec,
    /// Rounds a bridged flow took, observed when it completes.
    pub flow_rounds: Histogram,
    /// From a bridged flow's first request to its completion, across rounds and replicas.
    pub flow_duration: Histogram,
    pub session_rejections: IntCounterVec,
    pub state_rejections: IntCounterVec,
    /// Legacy clients' `Last-Event-ID` values refused, by reason.
    pub event_id_rejections: IntCounterVec,
    /// Upstream streams reopened with `Last-Event-ID`, by outcome (`ok`, `failed`).
    pub upstream_resumptions: IntCounterVec,
    /// Upstream sessions by event: `opened`, `reused` (a request in an existing one),
    /// `warm` (a call took one opened ahead of demand), `deleted`, `reaped` (deleted by the
    /// reaper: at an abandoned flow's deadline, at a held flow's end, or sent again).
    pub upstream_sessions: IntCounterVec,
    /// Data-layer sessions by event: `created`, `deleted`, `ended` (the upstream no
    /// longer had it), `rejected` (a cookie that did not open; the reason is logged).
    pub data_sessions: IntCounterVec,
    /// Calls in data-layer sessions (which outlive their calls) cancelled upstream with
    /// `notifications/cancelled` and accepted, by why: `gave_up` (the client left, or the
    /// gateway stopped waiting), `abandoned` (the client never continued the call).
    pub upstream_cancellations: IntCounterVec,
    /// Time from sending a request upstream to its response header, by upstream.
    pub upstream_duration: HistogramVec,
    pub active_client_streams: IntGauge,
    /// Client connections the MCP listener serves now (`limits.max_client_connections`).
    pub client_connections: IntGauge,
    /// Client connections refused (503) because the listener served its maximum.
    pub client_connections_refused: IntCounter,
    /// Upstream connections in use: an exchange waiting for, or reading, a response.
    pub upstream_connections: IntGauge,
    /// Upstream connections kept idle for the next exchange.
    pub upstream_idle_connections: IntGauge,
    /// Flows waiting for a client's retry that this replica opened (the reaper's table).
    pub pending_flows: IntGauge,
    /// Upstream sessions initialized ahead of demand, ready for a call.
    pub warm_sessions: IntGauge,
    /// Bridged interactive requests in progress on this replica (first calls and retries).
    pub active_rounds: IntGauge,
    /// New calls deferred by load shedding with a `requestState`-only result.
    pub shed: IntCounter,
    /// Per upstream group: 1 when its call streams carry event ids (a retry resumes them),
    /// 0 when they do not, -1 until a bridged round has shown it.
    pub upstream_resumable: IntGaugeVec,
    /// Restartable calls run again after their upstream session was lost.
    pub call_restarts: IntCounter,
    /// Retries that waited out their resumed stream's priming event, by group.
    pub resumptions_unprimed: IntCounterVec,
    /// Flows held on this replica (hold mode), and the bytes the gateway buffers for them.
    pub held_flows: IntGauge,
    pub held_bytes: IntGauge,
    /// Held flows by event: `held` (a round ended holding), `resumed` (a retry took it),
    /// `expired` (its state expired first), `lost` (a retry found it gone).
    pub held_events: IntCounterVec,
    /// Retries forwarded to the replica holding their flow, by outcome.
    pub peer_forwards: IntCounterVec,
    /// SSE keep-alive comments written to idle client streams.
    pub sse_keepalives: IntCounter,
    /// 1 once a graceful shutdown began.
    pub draining: IntGauge,
    /// Reloads of the keys file and the JWKS, by file and outcome (`ok`, `error`).
    pub reloads: IntCounterVec,
    /// Keys in the ring now.
    pub keys_loaded: IntGauge,
}

/// Methods a label may name; anything else is `other`.
const KNOWN_METHODS: &[&str] = &[
    "initialize",
    "ping",
    "tools/list",
    "tools/call",
    "prompts/list",
    "prompts/get",
    "resources/list",
    "resources/read",
    "resources/templates/list",
    "resources/subscribe",
    "resources/unsubscribe",
    "completion/complete",
    "logging/setLevel",
    "server/discover",
    "session/create",
    "session/delete",
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/progress",
    "notifications/roots/list_changed",
    "batch",
];

/// The `method` label of a POSTed JSON-RPC message: its method, or `response` for a
/// response (an answer to a server request).
pub fn method_label(method: Option<&str>) -> &'static str {
    match method {
        None => "response",
        Some(m) => KNOWN_METHODS
            .iter()
            .find(|k| **k == m)
            .copied()
            .unwrap_or("other"),
    }
}

/// The `method` label of a request: a POST's JSON-RPC method (`method_label`), or for a
/// bodyless request its HTTP method (`GET`, a stream; `DELETE`, a session's end).
pub fn request_label(http: &http::Method, method: Option<&str>, posted: bool) -> &'static str {
    if posted {
        return method_label(method);
    }
    match *http {
        http::Method::GET => "GET",
        http::Method::DELETE => "DELETE",
        _ => "other",
    }
}

/// Why anything sealed is refused before it opens (`seal::OpenError`): every rejection
/// metric has these.
const SEAL_REASONS: &[&str] = &[
    "too_long",
    "malformed",
    "unknown_key",
    "tampered",
    "bad_payload",
];
/// Why a `requestState` is refused once open.
const STATE_REASONS: &[&str] = &[
    "expired",
    "principal",
    "binding",
    "other_group",
    "other_session",
    "replayed",
];
/// Why a session token is refused once open. (A data-layer session's cookie refused
/// counts in `data_sessions_total{event="rejected"}`.)
const SESSION_REASONS: &[&str] = &["principal", "other_group", "unknown_endpoint"];

/// Latency buckets for upstream exchanges, in seconds: 1 ms to 30 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Flow durations, in seconds: a flow waits for people, so up to the 30-minute default
/// flow deadline.
const FLOW_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0,
];
const ROUND_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 16.0, 32.0];

/// Registers `metric` and hands it back.
fn register<M: Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique");
    metric
}

fn counters(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let vec = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    register(registry, vec)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(name, help).expect("valid metric"))
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    register(registry, Histogram::with_opts(opts).expect("valid metric"))
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        let build_info = IntGauge::with_opts(
            Opts::new("mrtr_gateway_build_info", "Build information")
                .const_label("version", env!("CARGO_PKG_VERSION")),
        )
        .expect("valid metric");
        register(&r, build_info).set(1);
        let upstream_duration = HistogramVec::new(
            HistogramOpts::new(
                "mrtr_gateway_upstream_request_duration_seconds",
                "Time from sending a request upstream to its response header, by upstream",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["upstream"],
        )
        .expect("valid metric");
        let metrics = Metrics {
            requests: counters(
                &r,
                "mrtr_gateway_requests_total",
                "Client requests by era, method and outcome",
                &["era", "method", "outcome"],
            ),
            input_required: counters(
                &r,
                "mrtr_gateway_input_required_total",
                "InputRequiredResult responses sent (rounds that asked the client), by method",
                &["method"],
            ),
            flow_rounds: histogram(
                &r,
                "mrtr_gateway_flow_rounds",
                "Rounds per completed bridged flow",
                ROUND_BUCKETS,
            ),
            flow_duration: histogram(
                &r,
                "mrtr_gateway_flow_duration_seconds",
                "Duration of completed bridged flows, from the first request to the result",
                FLOW_BUCKETS,
            ),
            session_rejections: counters(
                &r,
                "mrtr_gateway_session_token_rejections_total",
                "Client Mcp-Session-Id tokens refused, by reason",
                &["reason"],
            ),
            event_id_rejections: counters(
                &r,
                "mrtr_gateway_last_event_id_rejections_total",
                "Legacy clients' Last-Event-ID values refused (not sealed by the gateway for the request's principal and session), by reason",
                &["reason"],
            ),
            state_rejections: counters(
                &r,
                "mrtr_gateway_request_state_rejections_total",
                "requestState values refused, by reason",
                &["reason"],
            ),
            upstream_resumptions: counters(
                &r,
                "mrtr_gateway_upstream_resumptions_total",
                "Upstream streams reopened with Last-Event-ID, by outcome",
                &["outcome"],
            ),
            upstream_sessions: counters(
                &r,
                "mrtr_gateway_upstream_sessions_total",
                "Upstream sessions opened, reused, taken warm, deleted and reaped",
                &["event"],
            ),
            data_sessions: counters(
                &r,
                "mrtr_gateway_data_sessions_total",
                "Data-layer sessions created, deleted, ended upstream, and cookies rejected",
                &["event"],
            ),
            upstream_cancellations: counters(
                &r,
                "mrtr_gateway_upstream_calls_cancelled_total",
                "Calls in data-layer sessions cancelled upstream (accepted), by why: gave_up, abandoned",
                &["why"],
            ),
            upstream_duration: register(&r, upstream_duration),
            active_client_streams: gauge(
                &r,
                "mrtr_gateway_active_client_streams",
                "Client responses currently streaming",
            ),
            client_connections: gauge(
                &r,
                "mrtr_gateway_client_connections",
                "Client connections the MCP listener serves now",
            ),
            client_connections_refused: register(
                &r,
                IntCounter::new(
                    "mrtr_gateway_client_connections_refused_total",
                    "Client connections refused with 503 at limits.max_client_connections",
                )
                .expect("valid metric"),
            ),
            upstream_connections: gauge(
                &r,
                "mrtr_gateway_upstream_connections",
                "Upstream connections in use (a response awaited or being read)",
            ),
            upstream_idle_connections: gauge(
                &r,
                "mrtr_gateway_upstream_idle_connections",
                "Upstream connections kept idle for the next exchange",
            ),
            pending_flows: gauge(
                &r,
                "mrtr_gateway_pending_flows",
                "Flows waiting for input whose upstream session this replica watches",
            ),
            warm_sessions: gauge(
                &r,
                "mrtr_gateway_warm_sessions",
                "Upstream sessions initialized ahead of demand, ready for an interactive call",
            ),
            sse_keepalives: register(
                &r,
                IntCounter::new(
                    "mrtr_gateway_sse_keepalives_total",
                    "SSE keep-alive comments written to idle client streams",
                )
                .expect("valid metric"),
            ),
            draining: gauge(
                &r,
                "mrtr_gateway_draining",
                "1 once a graceful shutdown began",
            ),
            reloads: counters(
                &r,
                "mrtr_gateway_reloads_total",
                "Reloads of the keys file, the JWKS and the listener's certificate, by file and outcome",
                &["file", "outcome"],
            ),
            active_rounds: gauge(
                &r,
                "mrtr_gateway_active_rounds",
                "Bridged interactive requests in progress on this replica",
            ),
            shed: register(
                &r,
                IntCounter::new(
                    "mrtr_gateway_shed_total",
                    "New calls deferred by load shedding with a requestState-only result",
                )
                .expect("valid metric"),
            ),
            upstream_resumable: register(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "mrtr_gateway_upstream_resumable",
                        "How the group's bridged calls wait between rounds: 1 resumed with Last-Event-ID, 0 held, -1 not yet seen",
                    ),
                    &["group"],
                )
                .expect("valid metric"),
            ),
            call_restarts: register(
                &r,
                IntCounter::new(
                    "mrtr_gateway_call_restarts_total",
                    "Restartable calls run again after their upstream session was lost",
                )
                .expect("valid metric"),
            ),
            resumptions_unprimed: counters(
                &r,
                "mrtr_gateway_resumptions_unprimed_total",
                "Retries whose resumed call stream sent no priming event within the wait for one (300 ms while not known whether the group primes, 2 s once known that it does); the answers went up after it",
                &["group"],
            ),
            keys_loaded: gauge(&r, "mrtr_gateway_keys_loaded", "Keys in the key ring"),
            held_flows: gauge(
                &r,
                "mrtr_gateway_held_flows",
                "Flows held on this replica with their upstream streams open (hold mode)",
            ),
            held_bytes: gauge(
                &r,
                "mrtr_gateway_held_bytes",
                "Bytes the gateway buffers for held flows (questions, partial upstream events)",
            ),
            held_events: counters(
                &r,
                "mrtr_gateway_held_flow_events_total",
                "Held flows: held, resumed, expired, lost (a retry found it gone)",
                &["event"],
            ),
            peer_forwards: counters(
                &r,
                "mrtr_gateway_peer_forwards_total",
                "Retries forwarded to the replica holding their flow, by outcome",
                &["outcome"],
            ),
            registry: r,
        };
        metrics.zero_known_series();
        metrics
    }

    /// Creates every fixed-label series at 0, so a dashboard or an alert sees "none yet"
    /// rather than "no data".
    fn zero_known_series(&self) {
        for event in ["opened", "reused", "warm", "deleted", "reaped"] {
            self.upstream_sessions.with_label_values(&[event]);
        }
        for event in ["created", "deleted", "ended", "rejected"] {
            self.data_sessions.with_label_values(&[event]);
        }
        for why in ["gave_up", "abandoned"] {
            self.upstream_cancellations.with_label_values(&[why]);
        }
        for outcome in ["ok", "failed"] {
            self.upstream_resumptions.with_label_values(&[outcome]);
        }
        for event in [
            "held",
            "resumed",
            "abandoned",
            "expired",
            "lost",
            "shutdown",
            "endpoint_left",
        ] {
            self.held_events.with_label_values(&[event]);
        }
        for outcome in ["ok", "owner_gone", "shutting_down"] {
            self.peer_forwards.with_label_values(&[outcome]);
        }
        for method in ["tools/call", "prompts/get", "resources/read"] {
            self.input_required.with_label_values(&[method]);
        }
        for file in ["keys", "jwks", "tls"] {
            for outcome in ["ok", "error"] {
                self.reloads.with_label_values(&[file, outcome]);
            }
        }
        // Each counter has the reasons it can count, and no other.
        for (counter, once_open) in [
            (&self.state_rejections, STATE_REASONS),
            (&self.session_rejections, SESSION_REASONS),
            (&self.event_id_rejections, &[][..]),
        ] {
            for reason in SEAL_REASONS.iter().chain(once_open) {
                counter.with_label_values(&[reason]);
            }
        }
    }

    /// Counts an upstream session event (`opened`, `reused`, `deleted`, `reaped`).
    pub fn upstream_session(&self, event: &'static str) {
        self.upstream_sessions.with_label_values(&[event]).inc();
    }

    /// Counts a call cancelled upstream (`gave_up`, `abandoned`).
    pub fn upstream_cancelled(&self, why: &'static str) {
        self.upstream_cancellations.with_label_values(&[why]).inc();
    }

    /// Counts a held-flow event (`held`, `resumed`, `expired`, `lost`).
    pub fn held_event(&self, event: &'static str) {
        self.held_events.with_label_values(&[event]).inc();
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus::TextEncoder::new()
            .encode_utf8(&self.registry.gather(), &mut out)
            .expect("text encoding of gathered metrics cannot fail");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Holds a gauge one higher while alive: an upstream connection in use, a client stream.
pub struct InUse(IntGauge);

impl InUse {
    pub fn new(gauge: &IntGauge) -> InUse {
        gauge.inc();
        InUse(gauge.clone())
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.dec();
    }
}
