//! The command line: `run`, `demo`, `check-config`, `inspect` and `keygen`, and loading
//! the key ring from the environment or a keys file.

use crate::config::{Config, ConfigError};
use crate::gateway::server;
use crate::keys::{self, KeyRing};
use clap::{Parser, Subcommand, ValueEnum};
use std::process::ExitCode;
use std::sync::Arc;

pub const KEYS_ENV: &str = "MRTR_GATEWAY_KEYS";

#[derive(Parser)]
#[command(
    name = "mrtr-gateway",
    version,
    about = "MCP gateway: legacy servers, stateless clients"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log line format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
struct Listeners {
    /// Where MCP clients connect (IP:PORT).
    #[arg(long)]
    listen: Option<String>,
    /// Where /healthz, /readyz and /metrics are served (IP:PORT).
    #[arg(long)]
    admin_listen: Option<String>,
    /// Where the other replicas forward retries of flows this one holds (IP:PORT).
    #[arg(long, env = "MRTR_GATEWAY_PEER_LISTEN")]
    peer_listen: Option<String>,
    /// This replica's peer address as the other replicas reach it (IP:PORT), e.g. the
    /// pod IP.
    #[arg(long, env = "MRTR_GATEWAY_PEER_ADVERTISE")]
    peer_advertise: Option<String>,
}

impl Listeners {
    fn apply(self, config: &mut Config, upstreams: Vec<String>) {
        config.apply_overrides(self.listen, self.admin_listen, upstreams);
        config.apply_peer_overrides(self.peer_listen, self.peer_advertise);
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Run {
        /// Configuration file (see config/gateway.yaml).
        #[arg(long, short)]
        config: Option<std::path::PathBuf>,
        #[command(flatten)]
        listeners: Listeners,
        /// Upstream MCP endpoint URL; repeat for several. Replaces the first group's endpoints.
        #[arg(long = "upstream")]
        upstreams: Vec<String>,
    },
    /// Run the gateway in front of an embedded legacy demo MCP server, and print a walkthrough.
    Demo {
        #[command(flatten)]
        listeners: Listeners,
        /// Where the embedded demo server listens (IP:PORT).
        #[arg(long, default_value = "127.0.0.1:3001")]
        demo_listen: String,
    },
    /// Run only the embedded legacy demo MCP server (the benchmarks' backend).
    DemoServer {
        /// Where it listens (IP:PORT).
        #[arg(long, default_value = "127.0.0.1:3001")]
        listen: String,
        /// Worker threads.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Most sessions held at once (the benchmarks park a million flows).
        #[arg(long, default_value_t = crate::demo::DemoOptions::default().max_sessions)]
        max_sessions: usize,
        /// How long a tool waits for the client's answer to a question, in seconds (the
        /// benchmarks park flows for longer than the default).
        #[arg(long, default_value_t = crate::demo::DemoOptions::default().answer_timeout.as_secs())]
        answer_timeout_seconds: u64,
    },
    /// Validate a configuration file as `run` would take it, with the same flags and
    /// environment; exits non-zero on the first problem.
    CheckConfig {
        file: std::path::PathBuf,
        #[command(flatten)]
        listeners: Listeners,
        /// Upstream MCP endpoint URL, as `run` takes it; repeat for several.
        #[arg(long = "upstream")]
        upstreams: Vec<String>,
    },
    /// Decode a requestState or Mcp-Session-Id with the configured keys and print its
    /// fields; refuses without the key that sealed it.
    Inspect {
        /// The token, as the client sent it.
        token: String,
        /// Configuration file naming the keys file (MRTR_GATEWAY_KEYS takes precedence).
        #[arg(long, short)]
        config: Option<std::path::PathBuf>,
    },
    /// Print a new key entry KID:BASE64URL_32_BYTES.
    Keygen {
        /// The key id.
        #[arg(long, default_value = "k1")]
        kid: String,
    },
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match cli.command {
        Command::Run {
            config,
            listeners,
            upstreams,
        } => run(config, listeners, upstreams),
        Command::Demo {
            listeners,
            demo_listen,
        } => demo(listeners, demo_listen),
        Command::DemoServer {
            listen,
            threads,
            max_sessions,
            answer_timeout_seconds,
        } => {
            let options = crate::demo::DemoOptions {
                max_sessions,
                answer_timeout: std::time::Duration::from_secs(answer_timeout_seconds),
            };
            demo_server(&listen, threads, options)
        }
        Command::CheckConfig {
            file,
            listeners,
            upstreams,
        } => check_config(&file, listeners, upstreams),
        Command::Inspect { token, config } => inspect(&token, config.as_deref()),
        Command::Keygen { kid } => keys::generate_entry(&kid)
            .map(|entry| println!("{entry}"))
            .map_err(|e| e.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("mrtr-gateway: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Whether a line may be logged, whatever `RUST_LOG` asks: the gateway's own up to DEBUG
/// (none names a secret), other crates' up to INFO. Below that, pingora dumps request and
/// response headers (`Authorization`, session ids) and body bytes (`requestState`s,
/// answers, upstream event ids): every chunk at TRACE, and at DEBUG the whole read buffer
/// of a malformed chunked body, with whatever the client pipelined after it.
/// Whatever the level, pingora's HTTP app (the admin listener's server) is not: on a
/// request header it cannot parse, it logs up to 2 KB of it raw, at ERROR.
pub fn loggable(line: &tracing::Metadata<'_>) -> bool {
    use tracing::Level;
    let own = line.target().starts_with(env!("CARGO_CRATE_NAME"));
    let most_verbose = if own { Level::DEBUG } else { Level::INFO };
    *line.level() <= most_verbose && line.target() != QUOTES_REQUESTS
}

/// The target of pingora's lines that quote a request's bytes at ERROR.
const QUOTES_REQUESTS: &str = "pingora_core::apps::http_app";

fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let registry = tracing_subscriber::registry()
        .with(tracing_subscriber::filter::filter_fn(loggable))
        .with(filter);
    // Colour only for a person at a terminal: a log collector (a file, a pipe, `kubectl
    // logs`) would keep the escape codes as text.
    // NO_COLOR counts when set and not empty (no-color.org).
    let no_colour = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let colour = std::io::stderr().is_terminal() && !no_colour;
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    match format {
        LogFormat::Text => registry.with(lines).init(),
        LogFormat::Json => registry.with(lines.json()).init(),
    }
}

/// The key ring: `MRTR_GATEWAY_KEYS`, else the config's keys file (which is then watched
/// for changes), else an ephemeral key. Keys from the environment cannot be reloaded, so
/// they clear `keys_file`.
pub fn load_keys(config: &mut Config) -> Result<KeyRing, String> {
    if let Ok(text) = std::env::var(KEYS_ENV) {
        if config.keys_file.take().is_some() {
            tracing::warn!("{KEYS_ENV} is set: keys_file is ignored and not watched");
        }
        return KeyRing::parse(&text).map_err(|e| format!("{KEYS_ENV}: {e}"));
    }
    if let Some(path) = &config.keys_file {
        return KeyRing::load_file(path);
    }
    tracing::warn!(
        "no keys configured ({KEYS_ENV} or keys_file): using an ephemeral key; other replicas and restarts will not accept this replica's tokens"
    );
    Ok(KeyRing::ephemeral())
}

/// A valid configuration may still set a per-principal share that divides nothing.
/// Warns of settings that leave something open (`Config::exposures`) or divide nothing
/// (`Config::shares_taking_the_whole`).
fn warn_of_risky_settings(config: &Config) {
    for exposure in config.exposures() {
        tracing::warn!("{exposure}");
    }
    for (share, whole) in config.shares_taking_the_whole() {
        tracing::warn!("bridge.{share} lets one principal take all of bridge.{whole}");
    }
}

fn config_error(e: ConfigError) -> String {
    format!("invalid configuration: {e}")
}

fn run(
    file: Option<std::path::PathBuf>,
    listeners: Listeners,
    upstreams: Vec<String>,
) -> Result<(), String> {
    let mut config = match &file {
        Some(path) => Config::load_unvalidated(path).map_err(config_error)?,
        None => Config::default(),
    };
    listeners.apply(&mut config, upstreams);
    config.validate().map_err(config_error)?;
    warn_of_risky_settings(&config);
    let keys = Arc::new(load_keys(&mut config)?);
    let (listen, admin) = (config.listen.clone(), config.admin_listen.clone());
    let scheme = config.listener_scheme();
    let (server, _metrics) = server::build(config, keys, Vec::new()).map_err(config_error)?;
    tracing::info!(%listen, %scheme, %admin, "mrtr-gateway serving");
    server::run(server);
    Ok(())
}

fn demo(listeners: Listeners, demo_listen: String) -> Result<(), String> {
    let mut config = Config::default();
    let upstream = format!("http://{demo_listen}/mcp");
    listeners.apply(&mut config, vec![upstream.clone()]);
    config.upstreams[0].health_check_interval_ms = 0;
    config.validate().map_err(config_error)?;
    let keys = Arc::new(load_keys(&mut config)?);
    let gateway_url = format!("http://{}/mcp", config.listen);
    let admin = config.admin_listen.clone();
    if let Some(taken) = [&config.listen, &admin]
        .into_iter()
        .find(|l| crate::config::same_port(&demo_listen, l))
    {
        return Err(format!(
            "the demo server cannot listen on {demo_listen}: the gateway listens on {taken}"
        ));
    }
    server::check_free(&demo_listen)
        .map_err(|e| format!("the demo server cannot listen on {demo_listen}: {e}"))?;
    let extra: server::ExtraServices = vec![Box::new(crate::demo::service(
        &demo_listen,
        crate::demo::DemoOptions::default(),
    ))];
    let (server, _metrics) = server::build(config, keys, extra).map_err(config_error)?;
    println!("{}", walkthrough(&gateway_url, &upstream, &admin));
    server::run(server);
    Ok(())
}

fn demo_server(
    listen: &str,
    threads: usize,
    options: crate::demo::DemoOptions,
) -> Result<(), String> {
    server::check_free(listen)
        .map_err(|e| format!("the demo server cannot listen on {listen}: {e}"))?;
    crate::demo::serve(listen, threads, options);
    Ok(())
}

/// The walkthrough `demo` prints: commands a newcomer can paste into another shell.
/// Part 1 is the gateway's main job (a 2026-07-28 client, MRTR); part 2 a legacy client.
pub fn walkthrough(gateway: &str, upstream: &str, admin: &str) -> String {
    const H: &str =
        "-H 'content-type: application/json' -H 'accept: application/json, text/event-stream'";
    format!(
        r#"mrtr-gateway demo
  gateway:        {gateway}
  legacy server:  {upstream}  (embedded; 2025-11-25 Streamable HTTP with an event store)
  metrics:        http://{admin}/metrics

Paste into another shell (bash):

GW={gateway}
# Part 1. A 2026-07-28 client and Multi Round-Trip Requests. `mcp TOOL ID EXTRA` posts a
# modern tools/call (headers and _meta as the 2026-07-28 revision requires).
mcp() {{ curl -s {H} -H 'mcp-protocol-version: 2026-07-28' -H 'mcp-method: tools/call' -H "mcp-name: $1" $GW -d "{{\"jsonrpc\":\"2.0\",\"id\":$2,\"method\":\"tools/call\",\"params\":{{\"name\":\"$1\",\"arguments\":{{}},$3\"_meta\":{{\"io.modelcontextprotocol/protocolVersion\":\"2026-07-28\",\"io.modelcontextprotocol/clientCapabilities\":{{\"elicitation\":{{}}}}}}}}}}"; }}
state() {{ sed -n 's/.*"requestState":"\([^"]*\)".*/\1/p'; }}
# 1. plan_trip asks the user twice. The legacy server pushes its first question; the
#    gateway answers with an InputRequiredResult and a sealed requestState, and keeps no
#    connection open.
R1=$(mcp plan_trip 1 ''); echo "$R1"
# 2. Retry with the answer and the state (any replica with the same keys could take it):
#    the gateway posts the answer upstream, resumes the server's stream, and returns the
#    second question.
R2=$(mcp plan_trip 2 "\"inputResponses\":{{\"elicitation_0\":{{\"action\":\"accept\",\"content\":{{\"destination\":\"Lisbon\"}}}}}},\"requestState\":\"$(echo "$R1" | state)\","); echo "$R2"
# 3. Answer the second question: the result.
mcp plan_trip 3 "\"inputResponses\":{{\"elicitation_1\":{{\"action\":\"accept\",\"content\":{{\"nights\":3}}}}}},\"requestState\":\"$(echo "$R2" | state)\","; echo

# Part 2. A 2025-era client passes through; its session id is sealed so any replica
# routes it.
# 4. Open a session. The Mcp-Session-Id you get back names the upstream endpoint and session.
SID=$(curl -si {H} $GW -d '{{"jsonrpc":"2.0","id":1,"method":"initialize","params":{{"protocolVersion":"2025-11-25","capabilities":{{"elicitation":{{}}}},"clientInfo":{{"name":"curl","version":"1"}}}}}}' | tr -d '\r' | sed -n 's/^mcp-session-id: //Ip')
curl -s {H} -H "mcp-session-id: $SID" $GW -d '{{"jsonrpc":"2.0","method":"notifications/initialized"}}'
# 5. Call a tool that asks a question on the SSE stream. The server waits for the answer;
#    curl stops listening after 2 seconds.
S5=$(curl -sN --max-time 2 {H} -H "mcp-session-id: $SID" $GW -d '{{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{{"name":"ask_name","arguments":{{}}}}}}'); echo "$S5"
# 6. Answer the question (its JSON-RPC id is 0): the gateway answers 202.
curl -s -o /dev/null -w '%{{http_code}}\n' {H} -H "mcp-session-id: $SID" $GW -d '{{"jsonrpc":"2.0","id":0,"result":{{"action":"accept","content":{{"name":"Ada"}}}}}}'
# 7. Resume the stream after the question's event id (the last `id:` it showed, sealed by
#    the gateway to this session): the result arrives.
curl -sN -H 'accept: text/event-stream' -H "mcp-session-id: $SID" -H "last-event-id: $(echo "$S5" | sed -n 's/^id: //p' | tail -n 1)" $GW
# 8. End the session.
curl -s -o /dev/null -w '%{{http_code}}\n' -X DELETE -H "mcp-session-id: $SID" $GW
"#
    )
}

fn inspect(token: &str, file: Option<&std::path::Path>) -> Result<(), String> {
    let mut config = match file {
        Some(path) => Config::load(path).map_err(config_error)?,
        None => Config::default(),
    };
    if std::env::var(KEYS_ENV).is_err() && config.keys_file.is_none() {
        return Err(format!(
            "no keys configured: set {KEYS_ENV} or pass --config with a keys_file"
        ));
    }
    let ring = load_keys(&mut config)?;
    let report = crate::inspect::inspect(&ring, token.trim(), crate::mrtr::state::now_secs())?;
    println!("{report}");
    Ok(())
}

fn check_config(
    file: &std::path::Path,
    listeners: Listeners,
    upstreams: Vec<String>,
) -> Result<(), String> {
    let mut config = Config::load_unvalidated(file).map_err(config_error)?;
    listeners.apply(&mut config, upstreams);
    config.validate().map_err(config_error)?;
    warn_of_risky_settings(&config);
    crate::upstream::Upstreams::build(&config).map_err(config_error)?;
    if let Some(tls) = &config.tls {
        crate::tls::listener::ListenerCert::load(tls).map_err(config_error)?;
    }
    let resolver = config.dns_resolver.as_ref().and_then(|r| r.parse().ok());
    crate::gateway::peers::Peers::build(&config.peers, resolver).map_err(config_error)?;
    if let Some(path) = &config.keys_file {
        KeyRing::load_file(path)?;
    }
    crate::principal::Authenticator::new(&config.principal)
        .map_err(|e| format!("principal.jwt: {e}"))?;
    println!("{}: ok", file.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tracing_subscriber::layer::{Context, SubscriberExt};

    /// Counts the lines that get through.
    struct Lines(Arc<AtomicUsize>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Lines {
        fn on_event(&self, _: &tracing::Event<'_>, _: Context<'_, S>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// pingora's admin-listener errors quote the header they could not parse (credentials
    /// included): not logged; its other errors are, and the gateway's own debug lines.
    #[test]
    fn lines_quoting_a_requests_bytes_are_not_logged() {
        let lines = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::filter_fn(loggable))
            .with(Lines(lines.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!(target: "pingora_core::apps::http_app", "buf: Authorization: Bearer s3cret");
            assert_eq!(lines.load(Ordering::SeqCst), 0);
            tracing::error!(target: "pingora_core::connectors", "connect failed");
            tracing::debug!(target: "pingora_core::connectors", "below info");
            tracing::debug!("the gateway's own");
            assert_eq!(lines.load(Ordering::SeqCst), 2);
        });
    }
}
