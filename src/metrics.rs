//! Prometheus metrics, prefixed `mrtr_gateway_`, in a registry per gateway instance so
//! that several gateways in one process (tests, `demo`) never mix their counts.
//! Labels stay bounded: methods outside the MCP set are counted as `other`.

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub session_rejections: IntCounterVec,
    pub state_rejections: IntCounterVec,
    pub active_client_streams: IntGauge,
    /// Flows waiting for a client's retry that this replica opened (the reaper's table).
    pub pending_flows: IntGauge,
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
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/progress",
    "notifications/roots/list_changed",
    "batch",
];

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

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "mrtr_gateway_requests_total",
                "Client requests by era, method and outcome",
            ),
            &["era", "method", "outcome"],
        )
        .expect("valid metric");
        let session_rejections = IntCounterVec::new(
            Opts::new(
                "mrtr_gateway_session_token_rejections_total",
                "Client Mcp-Session-Id tokens refused, by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let state_rejections = IntCounterVec::new(
            Opts::new(
                "mrtr_gateway_request_state_rejections_total",
                "requestState values refused, by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let active_client_streams = IntGauge::new(
            "mrtr_gateway_active_client_streams",
            "Client responses currently streaming",
        )
        .expect("valid metric");
        let pending_flows = IntGauge::new(
            "mrtr_gateway_pending_flows",
            "Flows waiting for input whose upstream session this replica watches",
        )
        .expect("valid metric");
        let reloads = IntCounterVec::new(
            Opts::new(
                "mrtr_gateway_reloads_total",
                "Reloads of the keys file and the JWKS, by file and outcome",
            ),
            &["file", "outcome"],
        )
        .expect("valid metric");
        let keys_loaded = IntGauge::new("mrtr_gateway_keys_loaded", "Keys in the key ring")
            .expect("valid metric");
        let build_info = IntGauge::with_opts(
            Opts::new("mrtr_gateway_build_info", "Build information")
                .const_label("version", env!("CARGO_PKG_VERSION")),
        )
        .expect("valid metric");
        build_info.set(1);
        for m in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(session_rejections.clone()),
            Box::new(state_rejections.clone()),
            Box::new(active_client_streams.clone()),
            Box::new(pending_flows.clone()),
            Box::new(reloads.clone()),
            Box::new(keys_loaded.clone()),
            Box::new(build_info),
        ] {
            registry.register(m).expect("metric names are unique");
        }
        Metrics {
            registry,
            requests,
            session_rejections,
            state_rejections,
            active_client_streams,
            pending_flows,
            reloads,
            keys_loaded,
        }
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
