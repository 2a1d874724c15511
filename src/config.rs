//! Configuration: the YAML file, its defaults, command-line overrides, and validation
//! that names the key path of every problem. Parsing and validation do no I/O beyond
//! reading the file, so `check-config` and unit tests share them.

use crate::principal::PrincipalSource;
use crate::protocol::cors::CorsPolicy;
use crate::protocol::forwarded::Cidr;
use crate::protocol::headers::HeaderPolicy;
use crate::protocol::host_check::HostPolicy;
use crate::protocol::oauth::PublicResource;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where MCP clients connect.
    pub listen: String,
    /// TLS on the MCP listener (HTTPS, and HTTP/2 through ALPN); unset: plain HTTP.
    pub tls: Option<ListenerTls>,
    /// Where `/healthz`, `/readyz` and `/metrics` are served.
    pub admin_listen: String,
    /// A file of `KID:BASE64URL_32_BYTES` keys; `MRTR_GATEWAY_KEYS` takes precedence.
    pub keys_file: Option<PathBuf>,
    /// How often the files the gateway reloads (the keys file, the JWKS, the listener's
    /// certificate and key) are checked for changes; all are also re-read on SIGHUP.
    pub keys_poll_ms: u64,
    /// Whom sealed tokens are bound to: `authorization`, `none`, `{header: NAME}` or
    /// `{jwt: {...}}` (a variant with data as a one-key map, as the docs write it).
    #[serde(with = "serde_yaml::with::singleton_map")]
    pub principal: PrincipalSource,
    /// Host names the MCP listener accepts in `Host` and `Origin` (DNS-rebinding
    /// protection). Empty: loopback names only on a loopback listener, any otherwise.
    pub allowed_hosts: Vec<String>,
    /// Web origins (`https://app.example.com`, or `*` for any) whose pages may use the
    /// gateway from a browser: the gateway answers their CORS preflights and grants its
    /// responses to them, and they pass the `Origin` check. Empty: CORS is the upstream's
    /// (preflights and its `Access-Control-*` headers are relayed).
    pub cors_allowed_origins: Vec<String>,
    /// The URL clients reach the MCP listener at (`https://mcp.example.com`, perhaps with a
    /// path prefix a proxy in front strips): a group's public URL is it followed by the
    /// group's path. OAuth discovery names it (`resource_metadata`, the metadata's
    /// `resource`). `None`: the scheme and `Host` of each request.
    pub public_url: Option<String>,
    /// How long a client's SSE stream may stay silent before the gateway writes a
    /// keep-alive comment, so idle timeouts in front do not cut it; 0 turns them off.
    pub sse_keepalive_ms: u64,
    /// The DNS server (`IP:PORT`) that groups with `discovery: dns` ask; `None`: the
    /// system resolver of `/etc/resolv.conf`.
    pub dns_resolver: Option<String>,
    pub limits: Limits,
    /// Whose forwarding headers (`X-Forwarded-For`, `Forwarded`, …) are believed.
    pub forwarded: ForwardedOptions,
    pub bridge: BridgeOptions,
    pub server: ServerOptions,
    /// The other gateway replicas, for flows held in hold mode.
    pub peers: PeerOptions,
    pub upstreams: Vec<UpstreamGroupConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:8080".into(),
            tls: None,
            admin_listen: "127.0.0.1:9090".into(),
            keys_file: None,
            keys_poll_ms: 2_000,
            principal: PrincipalSource::default(),
            allowed_hosts: Vec::new(),
            cors_allowed_origins: Vec::new(),
            public_url: None,
            sse_keepalive_ms: 15_000,
            dns_resolver: None,
            limits: Limits::default(),
            forwarded: ForwardedOptions::default(),
            bridge: BridgeOptions::default(),
            server: ServerOptions::default(),
            peers: PeerOptions::default(),
            upstreams: Vec::new(),
        }
    }
}

/// The MCP listener's certificate. Both files are re-read when they change and on SIGHUP;
/// new connections get the new certificate, and a pair that does not load is logged and
/// the one in use kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// PEM certificate chain, the gateway's own certificate first.
    pub cert_file: PathBuf,
    /// PEM private key of that certificate (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// Offer HTTP/2 through ALPN (`h2`, then `http/1.1`); false offers HTTP/1.1 only.
    #[serde(default = "default_true")]
    pub http2: bool,
}

fn default_true() -> bool {
    true
}

impl ListenerTls {
    fn validate(&self) -> Result<(), ConfigError> {
        for (key, path) in [("cert_file", &self.cert_file), ("key_file", &self.key_file)] {
            if path.as_os_str().is_empty() {
                return Err(ConfigError::at(
                    format!("tls.{key}"),
                    "must name a PEM file",
                ));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body accepted (413 above it).
    pub max_body_bytes: usize,
    /// Most messages in one JSON-RPC batch.
    pub max_batch: usize,
    /// Most JSON values (each number, string, array, object and member) a 2026-07-28
    /// request body may hold (413 above it): the gateway builds the message it reads,
    /// and a body of small values costs some 60 bytes of memory per value.
    pub max_json_values: usize,
    /// Most request headers (431 above it).
    pub max_header_count: usize,
    /// Most bytes of request header names and values together (431 above it).
    pub max_header_bytes: usize,
    /// Longest wait for a request's headers (the connection is closed after it), from
    /// its first byte.
    pub header_timeout_ms: u64,
    /// How long a kept-alive client connection may wait for its next request (HTTP/1.1)
    /// or stream (HTTP/2) before the gateway closes it; longer than the 60 s load
    /// balancers keep idle connections to a backend, so that they close first.
    pub client_idle_timeout_ms: u64,
    /// Longest time a request body may take to arrive in full (408 after it).
    pub body_timeout_ms: u64,
    /// Longest one write to a client may wait for the client to read: a client that
    /// stops reading its response loses it (its connection closed, what the request
    /// started upstream cancelled) rather than pin what the gateway buffered for it.
    /// Bodies are written in pieces (`respond::write_body`), so it bounds a stall, not
    /// a whole large body.
    pub client_write_timeout_ms: u64,
    /// Longest `requestState` accepted, checked before any decoding.
    pub max_request_state_bytes: usize,
    /// Largest `inputResponses` object accepted, as serialized JSON.
    pub max_input_responses_bytes: usize,
    /// Most server requests gathered into one `InputRequiredResult`: a round ends as soon
    /// as it has this many, and the upstream's next questions go to the next round.
    pub max_input_requests_per_round: usize,
    /// Most bytes one round's input requests may take, as JSON; questions beyond it end
    /// the call with an error naming this limit.
    pub max_input_requests_bytes: usize,
    /// Most rounds one call may take.
    pub max_rounds: u16,
    /// Most client connections the MCP listener serves at once; one more is answered
    /// 503 and closed.
    pub max_client_connections: usize,
    /// Most requests one HTTP/2 connection carries at once (its
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`); clients queue the rest. Each may hold an
    /// upstream connection (a pass-through stream), so the connection cap bounds those
    /// only with this: at most the two multiplied.
    pub max_streams_per_connection: u32,
    /// Largest message a bridged call reads from its upstream (a JSON answer, one SSE
    /// event): the bridge holds it whole to rewrite it, so it is bounded; a larger one
    /// ends the call with an error naming this limit. Pass-through streams are not held.
    pub max_upstream_message_bytes: usize,
}

/// `limits.max_upstream_message_bytes` when the configuration does not set it, and the
/// bound of a reader built before it is known.
pub const DEFAULT_MAX_UPSTREAM_MESSAGE_BYTES: usize = 16 << 20;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 4 << 20,
            max_batch: 64,
            max_json_values: 250_000,
            max_header_count: 100,
            max_header_bytes: 32 << 10,
            header_timeout_ms: 10_000,
            client_idle_timeout_ms: 75_000,
            body_timeout_ms: 30_000,
            client_write_timeout_ms: 30_000,
            max_request_state_bytes: 4096,
            max_input_responses_bytes: 1 << 20,
            max_input_requests_per_round: 16,
            max_input_requests_bytes: 1 << 20,
            max_rounds: 32,
            max_client_connections: 10_000,
            max_streams_per_connection: 32,
            max_upstream_message_bytes: DEFAULT_MAX_UPSTREAM_MESSAGE_BYTES,
        }
    }
}

impl Limits {
    pub fn client_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.client_idle_timeout_ms)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let at_least = |name: &str, value: u64, min: u64| {
            if value < min {
                Err(ConfigError::at(
                    format!("limits.{name}"),
                    format!("must be at least {min}"),
                ))
            } else {
                Ok(())
            }
        };
        let at_most = |name: &str, value: u64, max: u64| {
            if value > max {
                Err(ConfigError::at(
                    format!("limits.{name}"),
                    format!("must be at most {max}"),
                ))
            } else {
                Ok(())
            }
        };
        at_least("max_body_bytes", self.max_body_bytes as u64, 1024)?;
        let message_bytes = self.max_upstream_message_bytes as u64;
        at_least("max_upstream_message_bytes", message_bytes, 64 << 10)?;
        at_least("max_batch", self.max_batch as u64, 1)?;
        at_least("max_json_values", self.max_json_values as u64, 1_000)?;
        at_least("max_header_count", self.max_header_count as u64, 8)?;
        at_least("max_header_bytes", self.max_header_bytes as u64, 1024)?;
        // Above these the HTTP/1 parser refuses a request itself, 400 rather than 431.
        at_most("max_header_count", self.max_header_count as u64, 256)?;
        at_most("max_header_bytes", self.max_header_bytes as u64, 1_048_575)?;
        at_least("header_timeout_ms", self.header_timeout_ms, 100)?;
        at_least("client_idle_timeout_ms", self.client_idle_timeout_ms, 100)?;
        at_least("body_timeout_ms", self.body_timeout_ms, 100)?;
        at_least("client_write_timeout_ms", self.client_write_timeout_ms, 100)?;
        at_least(
            "max_request_state_bytes",
            self.max_request_state_bytes as u64,
            256,
        )?;
        let state_bytes = self.max_request_state_bytes as u64;
        at_most(
            "max_request_state_bytes",
            state_bytes,
            crate::mrtr::state::MAX_STATE_LEN as u64,
        )?;
        // A state the gateway issues is one it accepts: the retry carrying it must fit.
        if self.max_body_bytes as u64 <= state_bytes + 1024 {
            return Err(ConfigError::at(
                "limits.max_body_bytes",
                format!("must be above limits.max_request_state_bytes + 1024 ({}): a retry carries its state", state_bytes + 1024),
            ));
        }
        at_least(
            "max_input_responses_bytes",
            self.max_input_responses_bytes as u64,
            2,
        )?;
        at_least(
            "max_input_requests_per_round",
            self.max_input_requests_per_round as u64,
            1,
        )?;
        at_least(
            "max_input_requests_bytes",
            self.max_input_requests_bytes as u64,
            1024,
        )?;
        at_least("max_rounds", u64::from(self.max_rounds), 1)?;
        at_least(
            "max_client_connections",
            self.max_client_connections as u64,
            1,
        )?;
        at_least(
            "max_streams_per_connection",
            u64::from(self.max_streams_per_connection),
            1,
        )
    }
}

/// The forwarding headers the gateway sends upstream: `X-Forwarded-For`, `Forwarded`,
/// `X-Forwarded-Proto` and `X-Forwarded-Host`, each ending with the client's address.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ForwardedOptions {
    /// Networks (CIDR, or single addresses) of proxies in front whose own forwarding
    /// headers are kept (the proxy's address appended). From any other peer a client's
    /// forwarding headers are dropped and replaced. Default: none.
    pub trusted_peers: Vec<String>,
}

impl ForwardedOptions {
    fn validate(&self) -> Result<(), ConfigError> {
        crate::protocol::forwarded::TrustedPeers::parse(&self.trusted_peers)
            .map(|_| ())
            .map_err(|(i, problem)| {
                ConfigError::at(format!("forwarded.trusted_peers[{i}]"), problem)
            })
    }
}

/// How 2026-07-28 calls are bridged onto legacy upstreams.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeOptions {
    /// How long each round's requestState stays valid.
    pub request_state_ttl_seconds: u64,
    /// The most a whole flow may take, across all its rounds; at this deadline the
    /// replica that opened it deletes the upstream session if it is still open.
    pub max_flow_seconds: u64,
    /// How long after the last server request a round of a call that asks several
    /// questions at once waits for more before answering (to the microsecond:
    /// `gateway::precise_sleep`). Other rounds answer as soon as the upstream has nothing
    /// more to read now (a question sent later is asked in the next round).
    pub quiet_window_ms: u64,
    /// Which rounds wait `quiet_window_ms`: those of calls seen asking several questions
    /// at once (a question that missed its round), or all.
    pub quiet_window_for: QuietWindowFor,
    /// How long a followed upstream stream may stay silent before the bridge reopens it
    /// with `Last-Event-ID` (recovers events an upstream stored but did not deliver), in
    /// a round that could resume; a held one reads its live stream on.
    pub resume_poll_ms: u64,
    /// How long a round may go without any message from its upstream (no question, no
    /// progress, no result) before it ends with an error naming the group and the call,
    /// instead of waiting (and polling) on. Tools that work silently for longer should
    /// send progress notifications.
    pub round_silence_seconds: u64,
    /// One-shot methods (lists, completion) run on an upstream session kept per shape
    /// (group, declared capabilities, client, principal), reused until it idles this long;
    /// 0 opens (and deletes) a session per request instead.
    pub one_shot_session_idle_seconds: u64,
    /// Most sessions kept for one-shot methods; beyond it the least recently used goes.
    pub max_one_shot_sessions: usize,
    /// Most of those kept for one principal's shapes in one group (requests without one
    /// count only against `max_one_shot_sessions`); beyond it the principal's own least
    /// recently used in that group goes, so that a client sending ever new capabilities
    /// cannot push the others' sessions out.
    pub max_one_shot_sessions_per_principal: usize,
    /// Upstream sessions initialized ahead of demand for interactive calls, per shape
    /// (group, declared capabilities, client, principal, credentials): a new call takes
    /// one instead of waiting for `initialize`, and starts opening its replacement. Each
    /// serves one call and is deleted after it. 0 turns them off.
    pub warm_sessions_per_shape: usize,
    /// Most warm sessions (ready or opening) on one replica, over all shapes.
    pub max_warm_sessions: usize,
    /// Most of those for one principal's shapes (requests without one count only against
    /// `max_warm_sessions`), so that a client sending ever new capabilities cannot take
    /// the warm sessions the others' calls would use.
    pub max_warm_sessions_per_principal: usize,
    /// A warm session unused this long is deleted, and never handed to a call.
    pub warm_session_idle_seconds: u64,
    /// Seal `requestState`s in the previous release's layout, and session tokens and
    /// data-layer cookies in its format version, which its replicas open: for the first
    /// phase of a rolling upgrade, until no replica of it is left. (Every release opens
    /// its own layout and the previous one.)
    pub seal_previous_version: bool,
    /// Most abandoned-flow sessions one replica watches; beyond it new interactive flows
    /// are refused rather than left unwatched.
    pub max_watched_sessions: usize,
    /// Most of those one principal's flows take (requests without one count only against
    /// `max_watched_sessions`); beyond it the principal's new flow that would wait ends
    /// with an error naming this limit, so that a client that abandons its flows cannot
    /// take every slot.
    pub max_watched_sessions_per_principal: usize,
    /// Most used `requestState`s one replica remembers (each until its expiry) to refuse
    /// replays; beyond it, retries are refused (overloaded) rather than let through
    /// unguarded.
    pub max_used_states: usize,
    /// Most of those one principal's retries take (requests without one count only
    /// against `max_used_states`); beyond it the principal's retries are refused
    /// (overloaded, naming this limit), so that one caller cannot fill the guard for
    /// every other.
    pub max_used_states_per_principal: usize,
    /// How long a data-layer session's cookie stays valid after the last response that
    /// carried it (each response refreshes it).
    pub data_session_ttl_seconds: u64,
    /// Load shedding: with more than this many interactive requests in progress on the
    /// replica, a new call is deferred with a `requestState`-only InputRequiredResult
    /// (the client retries, possibly elsewhere) instead of started; 0 turns it off.
    pub shed_above_active_rounds: usize,
    /// Load shedding: with more than this many flows held on the replica (hold mode), a
    /// new call is deferred the same way; 0 turns it off.
    pub shed_above_held_flows: usize,
    /// Most flows one replica holds in hold mode (their upstream streams open between
    /// rounds); beyond it a round that would be held ends with an error (overloaded).
    pub max_held_flows: usize,
    /// Most of those flows one principal holds (requests without one count only against
    /// `max_held_flows`); beyond it the principal's round that would be held ends with an
    /// error naming this limit, so that a client that abandons its flows cannot take every
    /// slot.
    pub max_held_flows_per_principal: usize,
    /// Most bytes a held flow may keep buffered on the gateway (its round's questions and
    /// any partial upstream event); a round above it ends with an error.
    pub max_held_bytes_per_flow: usize,
}

impl Default for BridgeOptions {
    fn default() -> Self {
        BridgeOptions {
            request_state_ttl_seconds: 600,
            max_flow_seconds: 1800,
            quiet_window_ms: 1,
            quiet_window_for: QuietWindowFor::Parallel,
            resume_poll_ms: 2000,
            round_silence_seconds: 45,
            one_shot_session_idle_seconds: 300,
            max_one_shot_sessions: 1024,
            max_one_shot_sessions_per_principal: 16,
            warm_sessions_per_shape: 2,
            max_warm_sessions: 256,
            max_warm_sessions_per_principal: 16,
            warm_session_idle_seconds: 30,
            seal_previous_version: false,
            max_watched_sessions: 100_000,
            max_watched_sessions_per_principal: 10_000,
            max_used_states: 200_000,
            max_used_states_per_principal: 100_000,
            data_session_ttl_seconds: 3600,
            shed_above_active_rounds: 0,
            shed_above_held_flows: 0,
            max_held_flows: 10_000,
            max_held_flows_per_principal: 1_000,
            max_held_bytes_per_flow: 1 << 20,
        }
    }
}

impl BridgeOptions {
    /// The format version this replica seals session tokens and cookies in
    /// (`seal_previous_version`; states follow it in their own layout).
    pub fn sealing_version(&self) -> u8 {
        crate::seal::sealing_version(self.seal_previous_version)
    }

    /// Refuses a bound of 0 where it would refuse every flow, or keep nothing of a
    /// feature left on: (field, value, the feature it bounds while that is on).
    fn check_nonzero(&self) -> Result<(), ConfigError> {
        let warm = ("warm_sessions_per_shape", self.warm_sessions_per_shape > 0);
        let one_shot = (
            "one_shot_session_idle_seconds",
            self.one_shot_session_idle_seconds > 0,
        );
        let bounds = [
            ("round_silence_seconds", self.round_silence_seconds, None),
            (
                "data_session_ttl_seconds",
                self.data_session_ttl_seconds,
                None,
            ),
            (
                "max_watched_sessions",
                self.max_watched_sessions as u64,
                None,
            ),
            (
                "max_watched_sessions_per_principal",
                self.max_watched_sessions_per_principal as u64,
                None,
            ),
            ("max_used_states", self.max_used_states as u64, None),
            (
                "max_used_states_per_principal",
                self.max_used_states_per_principal as u64,
                None,
            ),
            (
                "max_held_flows_per_principal",
                self.max_held_flows_per_principal as u64,
                None,
            ),
            (
                "warm_session_idle_seconds",
                self.warm_session_idle_seconds,
                Some(warm),
            ),
            (
                "max_warm_sessions",
                self.max_warm_sessions as u64,
                Some(warm),
            ),
            (
                "max_warm_sessions_per_principal",
                self.max_warm_sessions_per_principal as u64,
                Some(warm),
            ),
            (
                "max_one_shot_sessions",
                self.max_one_shot_sessions as u64,
                Some(one_shot),
            ),
            (
                "max_one_shot_sessions_per_principal",
                self.max_one_shot_sessions_per_principal as u64,
                Some(one_shot),
            ),
        ];
        for (name, value, feature) in bounds {
            let problem = match feature {
                _ if value > 0 => continue,
                None => "must be above 0".to_string(),
                Some((_, false)) => continue,
                Some((on, true)) => {
                    format!("must be above 0 while bridge.{on} is (0 there turns it off)")
                }
            };
            return Err(ConfigError::at(format!("bridge.{name}"), problem));
        }
        Ok(())
    }
}

/// Process options handed to Pingora.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerOptions {
    /// Worker threads per listener.
    pub threads: usize,
    /// Whether a listener's tasks may move between its threads. Unset: only with more
    /// than one thread; one thread then runs a current-thread runtime, which serves the
    /// same tasks without the multi-thread scheduler's parking and wakes.
    pub work_stealing: Option<bool>,
    /// After SIGTERM, how long in-flight requests may run.
    pub grace_period_seconds: u64,
    /// Then, how long runtimes get to stop.
    pub graceful_shutdown_timeout_seconds: u64,
}

impl ServerOptions {
    /// [`ServerOptions::work_stealing`] as set, or its default for the thread count.
    pub fn steals_work(&self) -> bool {
        self.work_stealing.unwrap_or(self.threads > 1)
    }
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            threads: 2,
            work_stealing: None,
            grace_period_seconds: 20,
            graceful_shutdown_timeout_seconds: 5,
        }
    }
}

/// The gateway replicas a retry of a held flow may be forwarded to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerOptions {
    /// Where this replica takes retries of the flows it holds, forwarded by the other
    /// replicas (IP:PORT). Unset: no peer listener, and a flow held here can be continued
    /// only by a retry that reaches this replica itself.
    pub listen: Option<String>,
    /// This replica's peer address as the others reach it (IP:PORT; an IPv4 address may
    /// be bracketed, so `[$(POD_IP)]:9091` serves either family), sealed into the
    /// `requestState` of each flow it holds. Default: `listen`, when it names one address.
    pub advertise: Option<String>,
    /// Every replica's peer address: IP:PORT entries (`discovery: static`), or one
    /// HOST:PORT whose name resolves to them (`discovery: dns`, a headless Service). A
    /// state naming an owner outside this set is never forwarded.
    pub members: Vec<String>,
    pub discovery: Discovery,
    /// With `discovery: dns`, how often the name is resolved again.
    pub dns_refresh_ms: u64,
    /// Longest wait to connect to the replica holding a flow before the flow is declared
    /// lost.
    pub connect_timeout_ms: u64,
}

impl Default for PeerOptions {
    fn default() -> Self {
        PeerOptions {
            listen: None,
            advertise: None,
            members: Vec::new(),
            discovery: Discovery::Static,
            dns_refresh_ms: default_dns_refresh_ms(),
            connect_timeout_ms: 1_000,
        }
    }
}

impl PeerOptions {
    /// The advertised address: `advertise`, else `listen` unless it is a wildcard.
    pub fn advertised(&self) -> Option<SocketAddr> {
        let addr = match (&self.advertise, &self.listen) {
            (Some(advertise), _) => peer_addr(advertise)?,
            (None, listen) => listen.as_ref()?.parse().ok()?,
        };
        (!addr.ip().is_unspecified()).then_some(addr)
    }

    fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        if let Some(listen) = &self.listen {
            check_addr("peers.listen", listen)?;
            if [&config.listen, &config.admin_listen]
                .into_iter()
                .any(|other| same_port(listen, other))
            {
                return Err(ConfigError::at(
                    "peers.listen",
                    "must differ from listen and admin_listen",
                ));
            }
        }
        if let Some(advertise) = self.advertise.as_ref().filter(|a| peer_addr(a).is_none()) {
            return Err(ConfigError::at(
                "peers.advertise",
                format!("'{advertise}' is not an IP:PORT socket address"),
            ));
        }
        if self.listen.is_some() && self.advertised().is_none() {
            return Err(ConfigError::at(
                "peers.advertise",
                "required when peers.listen is a wildcard address: give the IP:PORT other replicas reach this one at, e.g. [$(POD_IP)]:9091",
            ));
        }
        if !self.members.is_empty() && self.listen.is_none() {
            return Err(ConfigError::at(
                "peers.listen",
                "required when peers.members is set: the other replicas forward retries of the flows this one holds to it",
            ));
        }
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::at(
                "peers.connect_timeout_ms",
                "must be above 0",
            ));
        }
        match self.discovery {
            Discovery::Static => self.validate_static(),
            Discovery::Dns => self.validate_dns(),
        }
    }

    fn validate_static(&self) -> Result<(), ConfigError> {
        for (i, member) in self.members.iter().enumerate() {
            if peer_addr(member).is_none() {
                return Err(ConfigError::at(
                    format!("peers.members[{i}]"),
                    format!("'{member}' is not an IP:PORT socket address"),
                ));
            }
        }
        let advertised = self.advertised().map(|a| a.to_string());
        if let (false, Some(me)) = (self.members.is_empty(), advertised) {
            let listed = self.members.iter().filter_map(|m| peer_addr(m));
            if !listed.map(|m| m.to_string()).any(|m| m == me) {
                return Err(ConfigError::at(
                    "peers.members",
                    format!("must list this replica's own peer address {me}"),
                ));
            }
        }
        Ok(())
    }

    fn validate_dns(&self) -> Result<(), ConfigError> {
        let [member] = self.members.as_slice() else {
            return Err(ConfigError::at(
                "peers.members",
                "with discovery: dns, give exactly one HOST:PORT, whose host name is resolved",
            ));
        };
        let (host, port) = split_host_port(member).ok_or_else(|| {
            ConfigError::at("peers.members[0]", format!("'{member}' is not HOST:PORT"))
        })?;
        if host.parse::<std::net::IpAddr>().is_ok() || port == 0 {
            return Err(ConfigError::at(
                "peers.members[0]",
                format!("'{member}': with discovery: dns, give a DNS name and a port"),
            ));
        }
        if self.dns_refresh_ms == 0 {
            return Err(ConfigError::at(
                "peers.dns_refresh_ms",
                "must be above 0 with discovery: dns",
            ));
        }
        Ok(())
    }
}

/// `HOST:PORT` taken apart.
pub fn split_host_port(text: &str) -> Option<(&str, u16)> {
    let (host, port) = text.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host, port_number(port)?)).filter(|(h, _)| !h.is_empty())
}

/// A port written as digits only (`u16`'s parser also takes a leading `+`).
fn port_number(text: &str) -> Option<u16> {
    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    digits.then(|| text.parse().ok()).flatten()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamGroupConfig {
    pub name: String,
    /// The gateway path this group serves.
    #[serde(default = "default_path")]
    pub path: String,
    /// Upstream MCP endpoints, as `http://host:port/path` or `https://host:port/path`.
    pub endpoints: Vec<String>,
    /// How the group's `https://` endpoints are verified, and the client certificate the
    /// gateway presents to them.
    #[serde(default)]
    pub tls: UpstreamTls,
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Longest wait for an upstream's response header.
    #[serde(default = "default_response_timeout_ms")]
    pub response_timeout_ms: u64,
    /// Longest silence on an upstream stream before it is closed; 0 means no limit
    /// (legacy servers may wait on a user for a long time).
    #[serde(default)]
    pub stream_idle_timeout_ms: u64,
    /// TCP health checks; 0 turns them off.
    #[serde(default = "default_health_interval_ms")]
    pub health_check_interval_ms: u64,
    /// How 2026-07-28 requests reach this group.
    #[serde(default)]
    pub era: UpstreamEra,
    /// Where the group's endpoints come from.
    #[serde(default)]
    pub discovery: Discovery,
    /// With `discovery: dns`, how often the endpoint's host name is resolved again.
    #[serde(default = "default_dns_refresh_ms")]
    pub dns_refresh_ms: u64,
    /// Policies of single tools, by tool name.
    #[serde(default)]
    pub tools: BTreeMap<String, ToolPolicy>,
    /// How a bridged call waits for its client between rounds.
    #[serde(default)]
    pub resume: ResumeMode,
    /// Which end-to-end headers of a 2026-07-28 client's request (credentials, API
    /// keys, cookies) every upstream exchange of its bridged flow carries: `["*"]`, every
    /// one (the default), or the names listed. Hop-by-hop headers, and those the bridge
    /// sets itself, never go.
    #[serde(default = "default_forward_headers")]
    pub forward_headers: Vec<String>,
    /// The URL clients reach this group at, when it is not the listener's `public_url`
    /// followed by `path` (another host name in front, say).
    #[serde(default)]
    pub public_url: Option<String>,
    /// Protected-resource metadata (RFC 9728) the gateway serves for this group itself,
    /// with `resource` set to the group's public URL, instead of relaying the upstream's:
    /// `authorization_servers`, `scopes_supported`, …
    #[serde(default)]
    pub resource_metadata: Option<serde_json::Value>,
}

/// TLS to a group's `https://` endpoints. Every endpoint's certificate is verified against
/// the endpoint URL's host (a DNS name or an IP address), which is also sent as SNI.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamTls {
    /// PEM bundle of the CA certificates the endpoints' certificates must chain to, in
    /// place of the system's roots. Unset: the system's roots (`SSL_CERT_FILE` and
    /// `SSL_CERT_DIR` are honoured).
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain the gateway presents when an endpoint asks for a client
    /// certificate (mutual TLS); with `client_key_file`.
    pub client_cert_file: Option<PathBuf>,
    /// PEM private key of `client_cert_file`.
    pub client_key_file: Option<PathBuf>,
    /// Accept ANY certificate the endpoints present, without verifying who signed it or
    /// whom it names: anyone on the path can then read and change the traffic. For tests
    /// against throwaway certificates only; the gateway warns at start.
    pub dangerously_accept_any_certificate: bool,
}

impl UpstreamTls {
    /// Whether anything is configured.
    pub fn is_set(&self) -> bool {
        *self != UpstreamTls::default()
    }

    fn validate(&self, at: &str, group: &UpstreamGroupConfig) -> Result<(), ConfigError> {
        if self.client_cert_file.is_some() != self.client_key_file.is_some() {
            let missing = match self.client_cert_file {
                Some(_) => "client_key_file",
                None => "client_cert_file",
            };
            return Err(ConfigError::at(
                format!("{at}.tls.{missing}"),
                "client_cert_file and client_key_file go together",
            ));
        }
        if self.dangerously_accept_any_certificate && self.ca_file.is_some() {
            return Err(ConfigError::at(
                format!("{at}.tls.ca_file"),
                "has no effect with dangerously_accept_any_certificate: remove one",
            ));
        }
        let any_https = group
            .endpoints
            .iter()
            .any(|url| parse_endpoint_url(url).is_ok_and(|e| e.tls));
        if self.is_set() && !any_https {
            return Err(ConfigError::at(
                format!("{at}.tls"),
                "is set, but no endpoint of the group is https://",
            ));
        }
        Ok(())
    }
}

/// What the gateway enforces for one tool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ToolPolicy {
    /// Whether a 2026-07-28 call of the tool must carry a data-layer session cookie.
    pub session: SessionPolicy,
    /// Whether the tool may be run again when its upstream session is lost between
    /// rounds (the server restarted, its endpoint died): the re-run gets the answers
    /// given so far, and the client is asked only what is new. Only for tools that are
    /// safe to run twice.
    pub restartable: bool,
}

/// Whether a tool needs a data-layer session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionPolicy {
    /// Calls without a session run in a fresh upstream session each.
    #[default]
    Optional,
    /// Calls without a session are refused with `-32010`, naming `session/create`.
    Required,
}

/// Where an upstream group's endpoints come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Discovery {
    /// Each endpoint's host is resolved once, at start.
    #[default]
    Static,
    /// The one endpoint's host name (a Kubernetes headless Service) is resolved every
    /// `dns_refresh_ms`; its addresses, with the URL's port and path, are the endpoints.
    Dns,
}

/// Which bridged rounds wait the quiet window after a question.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuietWindowFor {
    /// The rounds of a call (group, method, tool or resource) this replica saw ask a
    /// question before the answers to its previous round went up: it asks several at
    /// once. Every other round answers as soon as the upstream has nothing more to send.
    #[default]
    Parallel,
    /// Every round.
    All,
}

/// How a bridged call waits for its client between rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Decide from what the upstream does: a round whose call stream carries event ids is
    /// resumed with `Last-Event-ID`, one without (or on a group whose upstream refused a
    /// resumption) is held.
    #[default]
    Auto,
    /// Always resume with `Last-Event-ID`; a round the upstream gives no event ids fails.
    Resumable,
    /// Always hold: the replica that ran the round keeps the upstream streams open, and
    /// retries that land elsewhere are forwarded to it.
    Hold,
}

/// How 2026-07-28 requests reach an upstream group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamEra {
    /// Bridge while the upstream speaks the 2025 transport (so push-style tools keep
    /// working even on servers that also speak 2026-07-28); relay when it refuses
    /// `initialize` but answers `server/discover`.
    #[default]
    Auto,
    /// Always bridge.
    Legacy,
    /// Always relay unchanged: the upstream's tools answer MRTR themselves.
    Modern,
}

fn default_path() -> String {
    "/mcp".into()
}
fn default_connect_timeout_ms() -> u64 {
    2_000
}
fn default_response_timeout_ms() -> u64 {
    60_000
}
fn default_health_interval_ms() -> u64 {
    5_000
}
fn default_dns_refresh_ms() -> u64 {
    5_000
}
fn default_forward_headers() -> Vec<String> {
    vec!["*".into()]
}

impl UpstreamGroupConfig {
    pub fn new(name: &str, endpoints: Vec<String>) -> Self {
        UpstreamGroupConfig {
            name: name.into(),
            path: default_path(),
            endpoints,
            tls: UpstreamTls::default(),
            connect_timeout_ms: default_connect_timeout_ms(),
            response_timeout_ms: default_response_timeout_ms(),
            stream_idle_timeout_ms: 0,
            health_check_interval_ms: default_health_interval_ms(),
            era: UpstreamEra::Auto,
            discovery: Discovery::Static,
            dns_refresh_ms: default_dns_refresh_ms(),
            tools: BTreeMap::new(),
            resume: ResumeMode::Auto,
            forward_headers: default_forward_headers(),
            public_url: None,
            resource_metadata: None,
        }
    }
}

/// A configuration problem, with the key path it concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub problem: String,
}

impl ConfigError {
    pub fn at(path: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError {
            path: path.into(),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.path, self.problem)
        }
    }
}

impl std::error::Error for ConfigError {}

/// An upstream endpoint URL taken apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointUrl {
    /// `host:port`, for resolution and the `Host` header.
    pub authority: String,
    /// The host name or IP address, without brackets.
    pub host: String,
    pub port: u16,
    pub path: String,
    /// Whether the URL is `https://`.
    pub tls: bool,
}

/// Takes an endpoint URL apart. Errors show the URL without its query or userinfo, which
/// may carry credentials (`?apiKey=`).
pub fn parse_endpoint_url(url: &str) -> Result<EndpointUrl, String> {
    let shown = shown_url(url);
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("'{shown}' is not a URL: {e}"))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(format!("'{shown}' must start with http:// or https://")),
    };
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(format!(
            "'{shown}' has credentials before its host (user:password@), which the gateway does not send; give them in the client's requests or the URL's query"
        ));
    }
    let authority = uri.authority().map_or("", |a| a.as_str());
    let bracketed = uri
        .host()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("'{shown}' has no host"))?;
    let host = bracketed
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    // What follows the host: the port as written (`Uri::port` is `None` for one that is
    // not a `u16`).
    let port_text = authority
        .get(bracketed.len()..)
        .and_then(|p| p.strip_prefix(':'));
    // An empty port is the scheme's (RFC 3986 §3.2.3). What is not a port is not shown:
    // it may be part of a password.
    let port = match port_text.filter(|p| !p.is_empty()).map(port_number) {
        None if tls => 443,
        None => 80,
        Some(Some(port)) if port > 0 => port,
        Some(_) => return Err(format!("'{shown}' has a port that is not 1-65535")),
    };
    // An empty path is `/`, also before a query (RFC 9112 §3.2.1): `http::Uri` keeps
    // `?q` as the path and query of `http://h?q`, no request target.
    let path = match uri.path_and_query().map(|p| p.as_str()) {
        None | Some("") => "/".to_string(),
        Some(p) if p.starts_with('?') => format!("/{p}"),
        Some(p) => p.to_string(),
    };
    let most = crate::protocol::target::MAX_TARGET_BYTES;
    if path.len() > most {
        return Err(format!(
            "'{shown}' has a path and query of {} bytes, above the {most} a request target may have",
            path.len()
        ));
    }
    Ok(EndpointUrl {
        // An empty port is dropped, as the scheme's is.
        authority: authority.strip_suffix(':').unwrap_or(authority).to_string(),
        host,
        port,
        path,
        tls,
    })
}

/// `url` as messages show it: without its query, fragment or userinfo.
fn shown_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        let rest = url.rsplit_once('@').map_or(url, |(_, after)| after);
        return rest
            .split(['?', '#'])
            .next()
            .unwrap_or_default()
            .to_string();
    };
    // Anything before an `@` may be userinfo, with a password that holds `/`, `?` or `#`.
    let rest = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    format!("{scheme}://{rest}")
}

impl Config {
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let config: Config = serde_yaml::from_str(text).map_err(yaml_error)?;
        config.validate()?;
        Ok(config)
    }

    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let config = Config::load_unvalidated(path)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and parses a file without validating it, for command-line overrides to
    /// complete it first (`--peer-advertise` from the Pod IP, say); validate afterwards.
    pub fn load_unvalidated(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::at("", format!("cannot read {}: {e}", path.display())))?;
        serde_yaml::from_str(&text).map_err(yaml_error)
    }

    /// Applies command-line overrides; `--upstream` URLs replace the first group's
    /// endpoints, or create a group `default` serving `/mcp`.
    pub fn apply_overrides(
        &mut self,
        listen: Option<String>,
        admin_listen: Option<String>,
        upstreams: Vec<String>,
    ) {
        if let Some(listen) = listen {
            self.listen = listen;
        }
        if let Some(admin) = admin_listen {
            self.admin_listen = admin;
        }
        if !upstreams.is_empty() {
            match self.upstreams.first_mut() {
                Some(first) => first.endpoints = upstreams,
                None => self
                    .upstreams
                    .push(UpstreamGroupConfig::new("default", upstreams)),
            }
        }
    }

    /// The scheme the MCP listener serves: `https` with `tls`, `http` without.
    pub fn listener_scheme(&self) -> crate::protocol::scheme::Scheme {
        crate::protocol::scheme::Scheme::over_tls(self.tls.is_some())
    }

    /// Applies the peer listener's command-line overrides.
    pub fn apply_peer_overrides(&mut self, listen: Option<String>, advertise: Option<String>) {
        if listen.is_some() {
            self.peers.listen = listen;
        }
        if advertise.is_some() {
            self.peers.advertise = advertise;
        }
    }

    /// The CORS policy `cors_allowed_origins` describes.
    pub fn cors_policy(&self) -> Result<CorsPolicy, ConfigError> {
        CorsPolicy::parse(&self.cors_allowed_origins)
            .map_err(|(i, problem)| ConfigError::at(format!("cors_allowed_origins[{i}]"), problem))
    }

    /// What the configuration leaves open that a careful operator would close, each as a
    /// warning that says what and how: a listener off loopback that accepts any `Host`
    /// and `Origin` (DNS-rebinding protection off: a web page whose name resolves to the
    /// gateway's address could drive the servers behind it), and trusted peers that
    /// take in every address (any client's forwarding headers believed).
    pub fn exposures(&self) -> Vec<String> {
        let mut exposures = Vec::new();
        let any_host = self.listen.parse().is_ok_and(|listen| {
            HostPolicy::for_listener(listen, &self.allowed_hosts) == HostPolicy::Any
        });
        if any_host {
            exposures.push(format!(
                "listen {} accepts any Host and Origin: DNS-rebinding protection is off, and a web page whose name resolves to this address can call the MCP servers behind it; list the names clients use in allowed_hosts",
                self.listen
            ));
        }
        for (i, peer) in self.forwarded.trusted_peers.iter().enumerate() {
            if Cidr::parse(peer).is_ok_and(|net| net.prefix() == 0) {
                exposures.push(format!(
                    "forwarded.trusted_peers[{i}] ({peer}) takes in every address: any client's X-Forwarded-For, Forwarded and the like are believed; list the proxies in front"
                ));
            }
        }
        exposures
    }

    /// The per-principal shares set so that one principal may take all of the whole
    /// they divide, as (share, whole) key names: none when every request is one
    /// principal (`principal: none`), nor for a feature that is off. A one-shot share is
    /// per group, so it is taken once per group.
    pub fn shares_taking_the_whole(&self) -> Vec<(&'static str, &'static str)> {
        if self.principal == PrincipalSource::None {
            return Vec::new();
        }
        let b = &self.bridge;
        let one_shot = b.one_shot_session_idle_seconds > 0;
        let groups = self.upstreams.len().max(1);
        [
            (
                ("max_watched_sessions_per_principal", "max_watched_sessions"),
                b.max_watched_sessions_per_principal >= b.max_watched_sessions,
            ),
            (
                ("max_used_states_per_principal", "max_used_states"),
                b.max_used_states_per_principal >= b.max_used_states,
            ),
            (
                ("max_held_flows_per_principal", "max_held_flows"),
                b.max_held_flows_per_principal >= b.max_held_flows,
            ),
            (
                (
                    "max_one_shot_sessions_per_principal",
                    "max_one_shot_sessions",
                ),
                one_shot
                    && b.max_one_shot_sessions_per_principal.saturating_mul(groups)
                        >= b.max_one_shot_sessions,
            ),
        ]
        .into_iter()
        .filter_map(|(names, whole)| whole.then_some(names))
        .collect()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        check_durations("", &serde_json::to_value(self).unwrap_or_default())?;
        check_addr("listen", &self.listen)?;
        check_addr("admin_listen", &self.admin_listen)?;
        if same_port(&self.listen, &self.admin_listen) {
            return Err(ConfigError::at(
                "admin_listen",
                "must differ from listen (another port, or another address than a wildcard one)",
            ));
        }
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        self.limits.validate()?;
        self.forwarded.validate()?;
        self.cors_policy()?;
        for (i, entry) in self.allowed_hosts.iter().enumerate() {
            crate::protocol::host_check::allowed_host(entry)
                .map_err(|problem| ConfigError::at(format!("allowed_hosts[{i}]"), problem))?;
        }
        if let Some(url) = &self.public_url {
            check_public_url("public_url", url)?;
        }
        if self.keys_poll_ms < 100 {
            return Err(ConfigError::at("keys_poll_ms", "must be at least 100"));
        }
        if self.sse_keepalive_ms != 0 && self.sse_keepalive_ms < 100 {
            return Err(ConfigError::at(
                "sse_keepalive_ms",
                "must be 0 (off) or at least 100",
            ));
        }
        let b = &self.bridge;
        if b.request_state_ttl_seconds == 0 || b.max_flow_seconds < b.request_state_ttl_seconds {
            return Err(ConfigError::at(
                "bridge.max_flow_seconds",
                "must be at least bridge.request_state_ttl_seconds, which must be above 0",
            ));
        }
        if b.resume_poll_ms < 100 {
            return Err(ConfigError::at(
                "bridge.resume_poll_ms",
                "must be at least 100",
            ));
        }
        if b.quiet_window_ms > 10_000 {
            return Err(ConfigError::at(
                "bridge.quiet_window_ms",
                "must be 0 to 10000",
            ));
        }
        if let Some(resolver) = &self.dns_resolver {
            check_addr("dns_resolver", resolver)?;
        }
        b.check_nonzero()?;
        if b.max_held_flows == 0 || b.max_held_bytes_per_flow < 1024 {
            return Err(ConfigError::at(
                "bridge.max_held_flows",
                "must be above 0, and bridge.max_held_bytes_per_flow at least 1024",
            ));
        }
        self.peers.validate(self)?;
        if self.server.threads == 0 {
            return Err(ConfigError::at("server.threads", "must be at least 1"));
        }
        if let PrincipalSource::Header(name) = &self.principal {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(ConfigError::at(
                    "principal.header",
                    format!("'{name}' is not a header name"),
                ));
            }
        }
        if self.upstreams.is_empty() {
            return Err(ConfigError::at(
                "upstreams",
                "no upstream configured: give at least one group, or pass --upstream URL",
            ));
        }
        for (i, group) in self.upstreams.iter().enumerate() {
            validate_group(&format!("upstreams[{i}]"), group)?;
            self.check_not_own_listener(&format!("upstreams[{i}]"), group)?;
            let earlier = &self.upstreams[..i];
            if earlier.iter().any(|g| g.name == group.name) {
                return Err(ConfigError::at(
                    format!("upstreams[{i}].name"),
                    format!("'{}' is used twice", group.name),
                ));
            }
            if earlier.iter().any(|g| g.path == group.path) {
                return Err(ConfigError::at(
                    format!("upstreams[{i}].path"),
                    format!("'{}' is served by another group", group.path),
                ));
            }
        }
        Ok(())
    }
}

impl Config {
    /// Refuses an endpoint that is one of the gateway's own listeners (the same address,
    /// or a loopback one under a wildcard listener, on its port): every request sent there
    /// would come back to the gateway, hop after hop.
    fn check_not_own_listener(
        &self,
        at: &str,
        group: &UpstreamGroupConfig,
    ) -> Result<(), ConfigError> {
        let own = [
            Some(&self.listen),
            Some(&self.admin_listen),
            self.peers.listen.as_ref(),
        ];
        let listeners: Vec<SocketAddr> = own
            .into_iter()
            .flatten()
            .filter_map(|addr| addr.parse().ok().map(canonical))
            .collect();
        for (j, url) in group.endpoints.iter().enumerate() {
            let Ok(endpoint) = parse_endpoint_url(url) else {
                continue;
            };
            let ips: Vec<IpAddr> = match endpoint.host.as_str() {
                "localhost" => vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()],
                host => host
                    .parse::<IpAddr>()
                    .map(|ip| ip.to_canonical())
                    .into_iter()
                    .collect(),
            };
            let reaches = |l: &SocketAddr, ip: &IpAddr| {
                let wildcard = l.ip().is_unspecified() && (l.is_ipv6() || ip.is_ipv4());
                l.port() == endpoint.port && (l.ip() == *ip || (wildcard && ip.is_loopback()))
            };
            if let Some(l) = listeners
                .iter()
                .find(|l| ips.iter().any(|ip| reaches(l, ip)))
            {
                return Err(ConfigError::at(
                    format!("{at}.endpoints[{j}]"),
                    format!(
                        "'{}' is the gateway's own listener {l}: its requests would come back to the gateway",
                        shown_url(url)
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The longest duration any setting may name: ten years. A time added to the clock must
/// stay on it (`Instant + Duration` panics past its end), and nothing the gateway waits
/// for is longer.
const MAX_DURATION_SECONDS: u64 = 10 * 365 * 24 * 3600;

/// Checks every `*_ms` and `*_seconds` setting in `tree` (the configuration as JSON, at
/// key path `at`) against `MAX_DURATION_SECONDS`.
fn check_durations(at: &str, tree: &serde_json::Value) -> Result<(), ConfigError> {
    let child = |key: &str| match at {
        "" => key.to_string(),
        _ => format!("{at}.{key}"),
    };
    match tree {
        serde_json::Value::Object(fields) => {
            for (key, value) in fields {
                let max = if key.ends_with("_ms") {
                    MAX_DURATION_SECONDS * 1000
                } else if key.ends_with("_seconds") {
                    MAX_DURATION_SECONDS
                } else {
                    check_durations(&child(key), value)?;
                    continue;
                };
                if value.as_u64().is_some_and(|v| v > max) {
                    let problem = format!("must be at most {max} (ten years)");
                    return Err(ConfigError::at(child(key), problem));
                }
            }
            Ok(())
        }
        serde_json::Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| check_durations(&format!("{at}[{i}]"), item)),
        _ => Ok(()),
    }
}

fn validate_group(at: &str, group: &UpstreamGroupConfig) -> Result<(), ConfigError> {
    let name_ok = !group.name.is_empty()
        && group.name.len() <= 64
        && group
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !name_ok {
        return Err(ConfigError::at(
            format!("{at}.name"),
            "must be 1 to 64 letters, digits, '-' or '_'",
        ));
    }
    if !group.path.starts_with('/') || group.path.contains(['?', '#']) {
        return Err(ConfigError::at(
            format!("{at}.path"),
            "must be an absolute path like /mcp",
        ));
    }
    if group.endpoints.is_empty() {
        return Err(ConfigError::at(
            format!("{at}.endpoints"),
            "needs at least one endpoint URL",
        ));
    }
    for (j, url) in group.endpoints.iter().enumerate() {
        parse_endpoint_url(url).map_err(|p| ConfigError::at(format!("{at}.endpoints[{j}]"), p))?;
    }
    group.tls.validate(at, group)?;
    if group.discovery == Discovery::Dns {
        validate_dns_discovery(at, group)?;
    }
    if group.connect_timeout_ms == 0 {
        return Err(ConfigError::at(
            format!("{at}.connect_timeout_ms"),
            "must be above 0",
        ));
    }
    if group.response_timeout_ms == 0 {
        return Err(ConfigError::at(
            format!("{at}.response_timeout_ms"),
            "must be above 0",
        ));
    }
    HeaderPolicy::parse(&group.forward_headers)
        .map_err(|p| ConfigError::at(format!("{at}.forward_headers"), p))?;
    if let Some(url) = &group.public_url {
        check_public_url(&format!("{at}.public_url"), url)?;
    }
    if group
        .resource_metadata
        .as_ref()
        .is_some_and(|m| !m.is_object())
    {
        return Err(ConfigError::at(
            format!("{at}.resource_metadata"),
            "must be a mapping of metadata fields (authorization_servers, scopes_supported, …)",
        ));
    }
    Ok(())
}

/// A public URL: absolute, http or https, without a query or credentials.
fn check_public_url(path: &str, url: &str) -> Result<(), ConfigError> {
    match PublicResource::parse(url) {
        Some(_) => Ok(()),
        None => Err(ConfigError::at(
            path,
            format!(
                "'{}' must be an absolute http:// or https:// URL without a query or credentials",
                shown_url(url)
            ),
        )),
    }
}

/// A `discovery: dns` group names one endpoint whose host is a DNS name: its addresses
/// become the endpoints, so a list or an IP address would say something else.
fn validate_dns_discovery(at: &str, group: &UpstreamGroupConfig) -> Result<(), ConfigError> {
    if group.endpoints.len() != 1 {
        return Err(ConfigError::at(
            format!("{at}.endpoints"),
            "with discovery: dns, give exactly one endpoint URL, whose host name is resolved",
        ));
    }
    let url = &group.endpoints[0];
    let host = parse_endpoint_url(url)
        .map(|parsed| parsed.host)
        .map_err(|p| ConfigError::at(format!("{at}.endpoints[0]"), p))?;
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Err(ConfigError::at(
            format!("{at}.endpoints[0]"),
            format!(
                "'{}': with discovery: dns, the host must be a DNS name, not an IP address",
                shown_url(url)
            ),
        ));
    }
    if group.dns_refresh_ms == 0 {
        return Err(ConfigError::at(
            format!("{at}.dns_refresh_ms"),
            "must be above 0 with discovery: dns",
        ));
    }
    Ok(())
}

/// A peer address (advertised, or a member): IP:PORT, where an IPv4 address may be
/// bracketed as an IPv6 one must (`[10.0.0.5]:9091`), so that one template,
/// `[$(POD_IP)]:9091`, serves pods of either family.
pub fn peer_addr(text: &str) -> Option<SocketAddr> {
    text.parse().ok().or_else(|| {
        let (host, port) = text.rsplit_once(':')?;
        let v4: std::net::Ipv4Addr = host.strip_prefix('[')?.strip_suffix(']')?.parse().ok()?;
        Some(SocketAddr::new(v4.into(), port_number(port)?))
    })
}

/// Whether two listen addresses would take one port: the same address, or one a wildcard
/// that covers the other (`0.0.0.0` covers IPv4 addresses, `[::]` every address, as
/// dual-stack). Port 0 (any free port) takes no port of another.
pub fn same_port(a: &str, b: &str) -> bool {
    let (Ok(a), Ok(b)) = (a.parse::<SocketAddr>(), b.parse::<SocketAddr>()) else {
        return a == b;
    };
    // An IPv4-mapped IPv6 address binds its IPv4 address.
    let (a, b) = (canonical(a), canonical(b));
    let covers = |wide: &SocketAddr, other: &SocketAddr| {
        wide.ip().is_unspecified() && (wide.is_ipv6() || other.is_ipv4())
    };
    a.port() == b.port() && a.port() != 0 && (a.ip() == b.ip() || covers(&a, &b) || covers(&b, &a))
}

fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn check_addr(path: &str, addr: &str) -> Result<(), ConfigError> {
    addr.parse::<SocketAddr>()
        .map(|_| ())
        .map_err(|_| ConfigError::at(path, format!("'{addr}' is not an IP:PORT socket address")))
}

/// serde_yaml reports the key path first ("upstreams[0]: unknown field ..."); split it off.
fn yaml_error(e: serde_yaml::Error) -> ConfigError {
    let text = e.to_string();
    match text.split_once(": ") {
        Some((path, problem)) if !path.contains(' ') => ConfigError::at(path, problem),
        _ => ConfigError::at("", text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str =
        "upstreams:\n  - name: default\n    endpoints: [\"http://127.0.0.1:3001/mcp\"]\n";

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.listen, "127.0.0.1:8080");
        assert_eq!(c.upstreams[0].path, "/mcp");
        assert_eq!(c.principal, PrincipalSource::Authorization);
    }

    #[test]
    fn every_principal_form_the_docs_write_loads() {
        let principal =
            |yaml: &str| Config::from_yaml(&format!("{yaml}\n{MINIMAL}")).map(|c| c.principal);
        assert_eq!(principal("principal: none").unwrap(), PrincipalSource::None);
        assert_eq!(
            principal("principal: authorization").unwrap(),
            PrincipalSource::Authorization
        );
        let header = PrincipalSource::Header("X-Forwarded-User".into());
        assert_eq!(
            principal("principal: {header: X-Forwarded-User}").unwrap(),
            header
        );
        assert_eq!(
            principal("principal:\n  header: X-Forwarded-User").unwrap(),
            header
        );
        let jwt = "principal:\n  jwt:\n    jwks_file: /etc/jwks.json\n    issuers: [https://idp]";
        let Ok(PrincipalSource::Jwt(config)) = principal(jwt) else {
            panic!("{:?}", principal(jwt));
        };
        assert_eq!(config.issuers, ["https://idp"]);
        let flow = "principal: {jwt: {jwks_file: /etc/jwks.json}}";
        assert!(matches!(principal(flow), Ok(PrincipalSource::Jwt(_))));
        assert!(principal("principal: {cookie: x}").is_err());
    }

    /// A listener off loopback that accepts any host, and trusted peers that take in
    /// every address, are named with what to do.
    #[test]
    fn settings_that_leave_the_gateway_open_are_named() {
        let load = |yaml: &str| Config::from_yaml(&format!("{yaml}\n{MINIMAL}")).unwrap();
        let exposures = |yaml: &str| load(yaml).exposures();
        assert!(exposures("listen: 127.0.0.1:8080").is_empty());
        let wildcard = exposures("listen: 0.0.0.0:8080");
        assert_eq!(wildcard.len(), 1, "{wildcard:?}");
        assert!(wildcard[0].contains("allowed_hosts"), "{wildcard:?}");
        assert!(exposures("listen: 0.0.0.0:8080\nallowed_hosts: [mcp.example.com]").is_empty());
        let everyone =
            "listen: 127.0.0.1:8080\nforwarded:\n  trusted_peers: [\"10.0.0.0/8\", \"::/0\"]";
        let everyone = exposures(everyone);
        assert_eq!(everyone.len(), 1, "{everyone:?}");
        assert!(
            everyone[0].contains("trusted_peers[1] (::/0)"),
            "{everyone:?}"
        );
    }

    /// A share that lets one principal take its whole is named, so that the gateway can
    /// say it divides nothing; the defaults divide every whole, and nothing is named
    /// where no share applies.
    #[test]
    fn shares_taking_their_whole_are_named() {
        let load = |yaml: &str| Config::from_yaml(&format!("{yaml}\n{MINIMAL}")).unwrap();
        assert!(load("").shares_taking_the_whole().is_empty());
        let used = "bridge:\n  max_used_states: 1000\n  max_used_states_per_principal: 1000";
        let named = [("max_used_states_per_principal", "max_used_states")];
        assert_eq!(load(used).shares_taking_the_whole(), named);
        let anonymous = load(&format!("principal: none\n{used}"));
        assert!(
            anonymous.shares_taking_the_whole().is_empty(),
            "one principal"
        );
        let one_shot =
            "bridge:\n  max_one_shot_sessions: 32\n  max_one_shot_sessions_per_principal: 16";
        let one_shot_named = [(
            "max_one_shot_sessions_per_principal",
            "max_one_shot_sessions",
        )];
        assert!(
            load(one_shot).shares_taking_the_whole().is_empty(),
            "one group"
        );
        let off = "bridge:\n  max_one_shot_sessions: 0\n  one_shot_session_idle_seconds: 0";
        assert!(load(off).shares_taking_the_whole().is_empty(), "off");
        let mut two_groups = load(one_shot);
        two_groups.upstreams.push(two_groups.upstreams[0].clone());
        assert_eq!(
            two_groups.shares_taking_the_whole(),
            one_shot_named,
            "16 in each of 2"
        );
    }

    /// A bound of zero places that would refuse every flow, or turn a feature into churn,
    /// is refused by name; a zero that means "off" is not.
    #[test]
    fn bounds_that_would_refuse_everything_are_refused_by_key_path() {
        let load = |yaml: &str| Config::from_yaml(&format!("bridge:\n  {yaml}\n{MINIMAL}"));
        for key in [
            "max_watched_sessions",
            "max_watched_sessions_per_principal",
            "max_used_states",
            "max_used_states_per_principal",
            "max_one_shot_sessions",
            "max_one_shot_sessions_per_principal",
            "max_warm_sessions",
            "max_warm_sessions_per_principal",
            "warm_session_idle_seconds",
            "round_silence_seconds",
            "data_session_ttl_seconds",
            "max_held_flows_per_principal",
        ] {
            let refused = load(&format!("{key}: 0")).unwrap_err();
            assert_eq!(refused.path, format!("bridge.{key}"));
        }
        let refused = load("max_warm_sessions: 0").unwrap_err();
        assert!(
            refused.problem.contains("bridge.warm_sessions_per_shape"),
            "{refused}"
        );
        assert!(load("one_shot_session_idle_seconds: 0\n  max_one_shot_sessions: 0").is_ok());
        assert!(load("warm_sessions_per_shape: 0\n  max_warm_sessions: 0").is_ok());
        assert!(load("warm_sessions_per_shape: 0\n  warm_session_idle_seconds: 0").is_ok());
    }

    #[test]
    fn durations_past_ten_years_are_refused_by_key_path() {
        let e = Config::from_yaml(&format!(
            "bridge:\n  round_silence_seconds: 18446744073709551615\n{MINIMAL}"
        ))
        .unwrap_err();
        assert_eq!(e.path, "bridge.round_silence_seconds");
        assert!(e.problem.contains("at most 315360000"), "{e}");
        let e = Config::from_yaml(&format!(
            "server:\n  grace_period_seconds: 315360001\n{MINIMAL}"
        ))
        .unwrap_err();
        assert_eq!(e.path, "server.grace_period_seconds");
        let group = "upstreams:\n  - name: a\n    endpoints: [\"http://127.0.0.1:1/mcp\"]\n    response_timeout_ms: 315360000001\n";
        let e = Config::from_yaml(group).unwrap_err();
        assert_eq!(e.path, "upstreams[0].response_timeout_ms");
        let ten_years = format!("bridge:\n  max_flow_seconds: 315360000\n{MINIMAL}");
        assert!(Config::from_yaml(&ten_years).is_ok());
    }

    #[test]
    fn the_example_config_is_valid() {
        let text = include_str!("../config/gateway.yaml");
        let config = Config::from_yaml(text).unwrap();
        assert!(
            serde_json::to_value(&config).is_ok(),
            "its durations are checked"
        );
    }

    #[test]
    fn work_stealing_defaults_to_more_than_one_thread_and_can_be_set() {
        let steals = |server: &str| {
            let c = Config::from_yaml(&format!("server:\n{server}{MINIMAL}")).unwrap();
            c.server.steals_work()
        };
        assert!(!steals("  threads: 1\n"));
        assert!(steals("  threads: 2\n"));
        assert!(steals("  threads: 1\n  work_stealing: true\n"));
        assert!(!steals("  threads: 4\n  work_stealing: false\n"));
    }

    #[test]
    fn errors_name_the_key_path() {
        let e = Config::from_yaml("upstreams:\n  - name: a\n    endpoint: []\n").unwrap_err();
        assert_eq!(e.path, "upstreams[0]");
        assert!(e.problem.contains("unknown field `endpoint`"), "{e}");
        let e = Config::from_yaml("listen: nowhere\nupstreams: []\n").unwrap_err();
        assert_eq!(e.path, "listen");
        let bad_url = MINIMAL.replace("http://127.0.0.1:3001/mcp", "ftp://x");
        let e = Config::from_yaml(&bad_url).unwrap_err();
        assert_eq!(e.path, "upstreams[0].endpoints[0]");
        let e = Config::from_yaml("limits:\n  max_body_bytes: many\n").unwrap_err();
        assert_eq!(e.path, "limits.max_body_bytes");
        let e = Config::from_yaml("").unwrap_err();
        assert_eq!(e.path, "upstreams");
        let unbounded = format!("{MINIMAL}bridge:\n  max_held_flows_per_principal: 0\n");
        let e = Config::from_yaml(&unbounded).unwrap_err();
        assert_eq!(e.path, "bridge.max_held_flows_per_principal");
        let two = format!("{MINIMAL}{}", MINIMAL.trim_start_matches("upstreams:\n"));
        assert_eq!(
            Config::from_yaml(&two).unwrap_err().path,
            "upstreams[1].name"
        );
    }

    #[test]
    fn dns_discovery_needs_one_named_endpoint_and_a_refresh() {
        let dns = "upstreams:\n  - name: legacy\n    discovery: dns\n    endpoints: [\"http://legacy.ns.svc:3001/mcp\"]\n";
        let c = Config::from_yaml(dns).unwrap();
        assert_eq!(c.upstreams[0].discovery, Discovery::Dns);
        assert_eq!(c.upstreams[0].dns_refresh_ms, 5000);
        assert_eq!(c.dns_resolver, None);
        assert_eq!(
            Config::from_yaml(MINIMAL).unwrap().upstreams[0].discovery,
            Discovery::Static
        );
        let path_of = |text: &str| Config::from_yaml(text).unwrap_err().path;
        let two = dns.replace(
            "[\"http://legacy.ns.svc:3001/mcp\"]",
            "[\"http://a:1/mcp\", \"http://b:1/mcp\"]",
        );
        assert_eq!(path_of(&two), "upstreams[0].endpoints");
        let ip = dns.replace("legacy.ns.svc", "10.0.0.7");
        assert_eq!(path_of(&ip), "upstreams[0].endpoints[0]");
        assert_eq!(
            path_of(&dns.replace("legacy.ns.svc", "[::1]")),
            "upstreams[0].endpoints[0]"
        );
        let never = format!("{dns}    dns_refresh_ms: 0\n");
        assert_eq!(path_of(&never), "upstreams[0].dns_refresh_ms");
        let resolver = format!("dns_resolver: 127.0.0.1:5353\n{dns}");
        let c = Config::from_yaml(&resolver).unwrap();
        assert_eq!(c.dns_resolver.as_deref(), Some("127.0.0.1:5353"));
        let bad = format!("dns_resolver: kube-dns\n{dns}");
        assert_eq!(path_of(&bad), "dns_resolver");
        let typo = dns.replace("discovery: dns", "discovery: srv");
        assert_eq!(path_of(&typo), "upstreams[0].discovery");
    }

    #[test]
    fn peers_need_a_reachable_advertised_address_in_their_own_set() {
        let with = |peers: &str| Config::from_yaml(&format!("peers:\n{peers}{MINIMAL}"));
        let path_of = |peers: &str| with(peers).unwrap_err().path;
        let c = with("  listen: 127.0.0.1:9091\n  members: [127.0.0.1:9091, 127.0.0.1:9092]\n")
            .unwrap();
        assert_eq!(
            c.peers.advertised(),
            Some("127.0.0.1:9091".parse().unwrap())
        );
        assert_eq!(path_of("  listen: 0.0.0.0:9091\n"), "peers.advertise");
        let advertised = with("  listen: 0.0.0.0:9091\n  advertise: 10.0.0.5:9091\n").unwrap();
        assert_eq!(
            advertised.peers.advertised(),
            Some("10.0.0.5:9091".parse().unwrap())
        );
        assert_eq!(path_of("  members: [127.0.0.1:9091]\n"), "peers.listen");
        let not_me = "  listen: 127.0.0.1:9093\n  members: [127.0.0.1:9091]\n";
        assert_eq!(path_of(not_me), "peers.members");
        assert_eq!(path_of("  listen: 127.0.0.1:8080\n"), "peers.listen");
        let dns = "  listen: 0.0.0.0:9091\n  advertise: 10.0.0.5:9091\n  discovery: dns\n";
        assert!(with(&format!("{dns}  members: [gw-peers.ns.svc:9091]\n")).is_ok());
        assert_eq!(
            path_of(&format!("{dns}  members: [10.0.0.5:9091]\n")),
            "peers.members[0]"
        );
        assert_eq!(
            path_of(&format!("{dns}  members: [a:1, b:1]\n")),
            "peers.members"
        );
        let hold = MINIMAL.replace("    endpoints", "    resume: hold\n    endpoints");
        let c = Config::from_yaml(&hold).unwrap();
        assert_eq!(c.upstreams[0].resume, ResumeMode::Hold);
        let typo = MINIMAL.replace("    endpoints", "    resume: keep\n    endpoints");
        assert_eq!(
            Config::from_yaml(&typo).unwrap_err().path,
            "upstreams[0].resume"
        );
    }

    #[test]
    fn trusted_peers_are_networks() {
        let with = |list: &str| {
            Config::from_yaml(&format!("forwarded:\n  trusted_peers: {list}\n{MINIMAL}"))
        };
        let c = with("[10.0.0.0/8, \"fd00::/8\", 192.0.2.1]").unwrap();
        assert_eq!(c.forwarded.trusted_peers.len(), 3);
        assert!(Config::from_yaml(MINIMAL)
            .unwrap()
            .forwarded
            .trusted_peers
            .is_empty());
        let e = with("[10.0.0.0/8, 10.0.0.0/40]").unwrap_err();
        assert_eq!(e.path, "forwarded.trusted_peers[1]");
        assert_eq!(
            with("[proxy.local]").unwrap_err().path,
            "forwarded.trusted_peers[0]"
        );
    }

    #[test]
    fn overrides_replace_the_first_group_or_create_one() {
        let mut c = Config::default();
        c.apply_overrides(
            Some("127.0.0.1:1".into()),
            None,
            vec!["http://h:1/x".into()],
        );
        assert_eq!(c.listen, "127.0.0.1:1");
        assert_eq!(c.upstreams[0].name, "default");
        c.validate().unwrap();
        c.apply_overrides(None, None, vec!["http://h:2/y".into()]);
        assert_eq!(c.upstreams.len(), 1);
        assert_eq!(c.upstreams[0].endpoints, ["http://h:2/y"]);
    }

    #[test]
    fn https_endpoints_and_their_tls_options_name_their_key_paths() {
        let https = MINIMAL.replace("http://127.0.0.1:3001/mcp", "https://127.0.0.1:3443/mcp");
        let c = Config::from_yaml(&https).unwrap();
        assert!(!c.upstreams[0].tls.is_set());
        let with = |base: &str, tls: &str| Config::from_yaml(&format!("{base}    tls:\n{tls}"));
        let path_of = |base: &str, tls: &str| with(base, tls).unwrap_err().path;
        let ca = with(&https, "      ca_file: /etc/mrtr/ca.pem\n").unwrap();
        assert_eq!(
            ca.upstreams[0].tls.ca_file.as_deref(),
            Some(Path::new("/etc/mrtr/ca.pem"))
        );
        let pair = "      client_cert_file: /c.pem\n      client_key_file: /k.pem\n";
        assert!(with(&https, pair).unwrap().upstreams[0].tls.is_set());
        assert_eq!(
            path_of(&https, "      client_cert_file: /c.pem\n"),
            "upstreams[0].tls.client_key_file"
        );
        assert_eq!(
            path_of(&https, "      client_key_file: /k.pem\n"),
            "upstreams[0].tls.client_cert_file"
        );
        let both = "      dangerously_accept_any_certificate: true\n      ca_file: /ca.pem\n";
        assert_eq!(path_of(&https, both), "upstreams[0].tls.ca_file");
        let plain_only = path_of(MINIMAL, "      ca_file: /ca.pem\n");
        assert_eq!(plain_only, "upstreams[0].tls");
        let typo = with(&https, "      ca: /ca.pem\n").unwrap_err();
        assert_eq!(typo.path, "upstreams[0].tls");
        assert!(typo.problem.contains("unknown field `ca`"), "{typo}");
        let dns = "upstreams:\n  - name: remote\n    discovery: dns\n    endpoints: [\"https://legacy.ns.svc/mcp\"]\n";
        assert!(with(dns, "      ca_file: /ca.pem\n").is_ok());
    }

    #[test]
    fn the_listener_tls_block_names_its_key_paths() {
        let with = |tls: &str| Config::from_yaml(&format!("tls:\n{tls}{MINIMAL}"));
        let c = with("  cert_file: /tls/cert.pem\n  key_file: /tls/key.pem\n").unwrap();
        let tls = c.tls.expect("a TLS listener");
        assert!(tls.http2, "HTTP/2 is offered by default");
        assert_eq!(tls.key_file, Path::new("/tls/key.pem"));
        assert!(Config::from_yaml(MINIMAL).unwrap().tls.is_none());
        let h1 = with("  cert_file: /c\n  key_file: /k\n  http2: false\n").unwrap();
        assert!(!h1.tls.unwrap().http2);
        let missing = with("  cert_file: /tls/cert.pem\n").unwrap_err();
        assert_eq!(missing.path, "tls");
        assert!(missing.problem.contains("key_file"), "{missing}");
        let empty = with("  cert_file: ''\n  key_file: /k\n").unwrap_err();
        assert_eq!(empty.path, "tls.cert_file");
        let typo = with("  cert: /c\n  key_file: /k\n").unwrap_err();
        assert_eq!(typo.path, "tls");
    }

    /// Limits that cannot hold as set are refused: a body limit a retry carrying a state
    /// at its limit would not fit, header bounds above those the HTTP parser applies.
    #[test]
    fn limits_that_could_not_hold_are_refused() {
        let mut tight = Config::default();
        tight.apply_overrides(None, None, vec!["http://127.0.0.1:3001/mcp".into()]);
        tight.limits.max_body_bytes = 2048;
        let refused = tight.validate().unwrap_err();
        assert_eq!(
            refused.path, "limits.max_body_bytes",
            "under the state's 4096"
        );
        tight.limits.max_body_bytes = 8192;
        tight.limits.max_header_count = 300;
        assert_eq!(
            tight.validate().unwrap_err().path,
            "limits.max_header_count"
        );
        tight.limits.max_header_count = 256;
        tight.limits.max_header_bytes = 2 << 20;
        assert_eq!(
            tight.validate().unwrap_err().path,
            "limits.max_header_bytes"
        );
    }

    /// An endpoint at one of the gateway's own listeners is refused (its requests would
    /// loop); another host on the same port is not.
    #[test]
    fn an_endpoint_at_the_gateways_own_listener_is_refused() {
        let checked = |listen: &str, upstream: &str| {
            let mut config = Config::default();
            let upstream = vec![upstream.to_string()];
            config.apply_overrides(Some(listen.into()), None, upstream);
            config.validate().map_err(|e| e.path)
        };
        for (listen, upstream) in [
            ("127.0.0.1:8080", "http://127.0.0.1:8080/mcp"),
            ("0.0.0.0:8080", "http://localhost:8080/mcp"),
            ("[::]:8080", "http://[::1]:8080/mcp"),
            ("127.0.0.1:8080", "http://127.0.0.1:9090/mcp"),
        ] {
            let refused = checked(listen, upstream).unwrap_err();
            assert_eq!(refused, "upstreams[0].endpoints[0]", "{listen} {upstream}");
        }
        for (listen, upstream) in [
            ("0.0.0.0:8080", "http://10.1.2.3:8080/mcp"),
            ("127.0.0.1:8080", "http://127.0.0.2:8080/mcp"),
            ("127.0.0.1:8080", "http://localhost:3001/mcp"),
        ] {
            assert_eq!(checked(listen, upstream), Ok(()), "{listen} {upstream}");
        }
    }

    #[test]
    fn endpoint_urls_are_taken_apart() {
        let e = parse_endpoint_url("http://127.0.0.1:3001/mcp").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.path.as_str()),
            ("127.0.0.1", 3001, "/mcp")
        );
        assert_eq!(parse_endpoint_url("http://svc").unwrap().path, "/");
        let keyed = parse_endpoint_url("https://mcp.example.com?apiKey=K").unwrap();
        assert_eq!(keyed.path, "/?apiKey=K", "a request target");
        assert_eq!(
            parse_endpoint_url("http://h:3001?t=a").unwrap().path,
            "/?t=a"
        );
        assert_eq!(parse_endpoint_url("http://[::1]:9/m").unwrap().host, "::1");
        let https = parse_endpoint_url("https://mcp.example.com/mcp").unwrap();
        assert!(https.tls);
        assert_eq!(
            (https.port, https.authority.as_str()),
            (443, "mcp.example.com")
        );
        assert!(!e.tls);
        assert!(parse_endpoint_url("ftp://x/mcp")
            .unwrap_err()
            .contains("https://"));
        assert!(parse_endpoint_url("not a url").is_err());
        let long = format!("http://svc/mcp?apiKey=k3y&pad={}", "a".repeat(8 << 10));
        let refused = parse_endpoint_url(&long).unwrap_err();
        assert!(
            refused.contains("8192") && !refused.contains("k3y"),
            "{refused}"
        );
    }

    #[test]
    fn a_peer_address_of_either_family_may_be_bracketed() {
        let advertised = |advertise: &str| {
            let peers = PeerOptions {
                listen: Some("0.0.0.0:9091".into()),
                advertise: Some(advertise.into()),
                ..PeerOptions::default()
            };
            let config = Config {
                peers: peers.clone(),
                ..Config::default()
            };
            peers.validate(&config).map(|()| peers.advertised())
        };
        for (text, addr) in [
            ("[10.0.0.5]:9091", "10.0.0.5:9091"),
            ("10.0.0.5:9091", "10.0.0.5:9091"),
            ("[fd00::5]:9091", "[fd00::5]:9091"),
        ] {
            assert_eq!(advertised(text).unwrap(), Some(addr.parse().unwrap()));
        }
        let members = PeerOptions {
            listen: Some("0.0.0.0:9091".into()),
            advertise: Some("[10.0.0.5]:9091".into()),
            members: vec!["[10.0.0.5]:9091".into(), "10.0.0.6:9091".into()],
            ..PeerOptions::default()
        };
        let config = Config {
            peers: members.clone(),
            ..Config::default()
        };
        assert!(members.validate(&config).is_ok());
        for bad in [
            "fd00::5:9091",
            "[10.0.0.5:9091",
            "[host]:9091",
            "[10.0.0.5]:x",
        ] {
            assert_eq!(
                advertised(bad).unwrap_err().path,
                "peers.advertise",
                "{bad}"
            );
        }
    }

    #[test]
    fn listeners_on_one_port_are_refused_however_spelt() {
        for (a, b) in [
            ("127.0.0.1:9", "127.0.0.1:9"),
            ("127.0.0.1:9", "0.0.0.0:9"),
            ("0.0.0.0:9", "127.0.0.1:9"),
            ("[::]:9", "127.0.0.1:9"),
            ("[::1]:9", "[::]:9"),
            ("[::]:9", "0.0.0.0:9"),
            ("[::ffff:127.0.0.1]:9", "127.0.0.1:9"),
        ] {
            assert!(same_port(a, b), "{a} {b}");
            let config = Config {
                listen: a.into(),
                admin_listen: b.into(),
                ..Config::default()
            };
            assert_eq!(config.validate().unwrap_err().path, "admin_listen");
        }
        for (a, b) in [
            ("127.0.0.1:9", "127.0.0.1:10"),
            ("127.0.0.1:9", "127.0.0.2:9"),
            ("0.0.0.0:9", "[::1]:9"),
            ("127.0.0.1:0", "0.0.0.0:0"),
        ] {
            assert!(!same_port(a, b), "{a} {b}");
        }
    }

    /// An endpoint refused shows no credentials: not its query, not its userinfo (which
    /// is refused: the gateway would send it as part of `Host`).
    #[test]
    fn endpoint_errors_show_no_credentials() {
        for (url, shown) in [
            (
                "http://127.0.0.1:1/m cp?apiKey=s3cret",
                "'http://127.0.0.1:1/m cp'",
            ),
            ("ftp://svc/mcp?apiKey=s3cret", "'ftp://svc/mcp'"),
            ("http://user:s3cret@svc/mcp", "'http://svc/mcp'"),
            (
                "http://svc:99999/mcp?token=s3cret",
                "'http://svc:99999/mcp'",
            ),
        ] {
            let refused = parse_endpoint_url(url).unwrap_err();
            assert!(refused.contains(shown), "{refused}");
            assert!(!refused.contains("s3cret"), "{refused}");
        }
        let ports = parse_endpoint_url("http://svc:99999/mcp").unwrap_err();
        assert!(ports.contains("not 1-65535"), "{ports}");
        // A password holding a character that ends the authority.
        for url in [
            "http://us:pa/ss@svc/mcp",
            "http://us:p?ss@svc/mcp",
            "http://us:p#ss@svc/",
        ] {
            let refused = parse_endpoint_url(url).unwrap_err();
            assert!(
                !refused.contains("pa") && !refused.contains("ss"),
                "{refused}"
            );
        }
        let empty = parse_endpoint_url("http://svc:/mcp").unwrap();
        assert_eq!((empty.port, empty.authority.as_str()), (80, "svc"));
        assert_eq!(parse_endpoint_url("https://[::1]:/mcp").unwrap().port, 443);
        assert!(parse_endpoint_url("http://svc:0/mcp").is_err());
        assert!(parse_endpoint_url("http://svc:+80/mcp").is_err());
        assert_eq!(split_host_port("svc:+9091"), None);
        assert_eq!(peer_addr("[10.0.0.5]:+9091"), None);
        let schemeless = parse_endpoint_url("admin:s3cret@svc:8080/mcp").unwrap_err();
        assert!(!schemeless.contains("s3cret"), "{schemeless}");
        let query = parse_endpoint_url("http://svc:8/mcp?apiKey=k").unwrap();
        assert_eq!((query.port, query.path.as_str()), (8, "/mcp?apiKey=k"));
    }
}
