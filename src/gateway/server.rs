//! Assembling a pingora `Server`: the MCP listener (its connections capped; TLS with a
//! reloaded certificate when `tls:` is set), the admin
//! listener, the peer listener (when configured), the drain watch, the reaper, the
//! kept-session and held-flow sweepers, and one health-check service per upstream group (and one for DNS
//! peer discovery). `run` blocks until a signal;
//! `spawn` runs the same server on a thread with a shutdown channel, for tests and for
//! `demo`.

use super::admin::{
    AdminApp, ConnectionBounds, DrainWatch, MakeRoom, OwnListener, ADMIN_CONNECTION_TIME,
    MAX_OWN_CONNECTIONS,
};
use super::bridge::hold::HeldSweeper;
use super::bridge::one_shot::KeptSweeper;
use super::bridge::warm::WarmSweeper;
use super::connections::{Capped, ConnectionCap};
use super::reaper::ReaperService;
use super::reload::{Reloader, WatchedFile};
use super::signals;
use super::{Arrival, Gateway, Listener};
use crate::config::{Config, ConfigError};
use crate::keys::KeyRing;
use crate::metrics::Metrics;
use crate::principal::{Authenticator, PrincipalSource};
use crate::tls::handshakes::{HandshakeGuard, Handshakes};
use crate::tls::listener::ListenerCert;
use crate::upstream::Upstreams;
use async_trait::async_trait;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};
use pingora::services::background::{background_service, GenBackgroundService};
use pingora::services::listening::Service;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::{oneshot, Mutex};

/// Extra services run in the same pingora server (the embedded demo upstream).
pub type ExtraServices = Vec<Box<dyn pingora::services::ServiceWithDependents>>;

fn server_conf(config: &Config) -> ServerConf {
    ServerConf {
        threads: config.server.threads,
        work_stealing: config.server.steals_work(),
        grace_period_seconds: Some(config.server.grace_period_seconds),
        graceful_shutdown_timeout_seconds: Some(config.server.graceful_shutdown_timeout_seconds),
        ..ServerConf::default()
    }
}

/// Builds the server. The returned metrics belong to this gateway instance.
pub fn build(
    config: Config,
    keys: Arc<KeyRing>,
    extra: ExtraServices,
) -> Result<(Server, Arc<Metrics>), crate::config::ConfigError> {
    let upstreams = Upstreams::build(&config)?;
    let mut server = Server::new_with_opt_and_conf(None, server_conf(&config));
    server.bootstrap();
    for group in &upstreams.groups {
        if group.needs_background_service() {
            let name = format!("health check {}", group.name);
            server.add_service(GenBackgroundService::new(name, group.balancer()));
        }
    }
    let listener_cert = config.tls.as_ref().map(ListenerCert::load).transpose()?;
    let listen = config.listen.clone();
    let admin_listen = config.admin_listen.clone();
    let peer_listen = config.peers.listen.clone();
    let keys_poll = Duration::from_millis(config.keys_poll_ms);
    let gateway = Arc::new(Gateway::new(config, keys, upstreams)?);
    let metrics = gateway.runtime.metrics.clone();
    if let Some(peers) = gateway.flows.peers.discovery_service() {
        server.add_service(GenBackgroundService::new("peer discovery".into(), peers));
    }
    let mut watched = watched_files(&gateway);
    watched.extend(listener_cert.as_ref().map(watched_certificate));
    let reloader = Reloader::new(watched, metrics.clone(), keys_poll);
    server.add_service(background_service("reloader", reloader));
    let max_connections = gateway.config.limits.max_client_connections;
    let cap = ConnectionCap::new(max_connections, metrics.clone());
    let listener = Listener::new(gateway.clone(), Arrival::Client, Some(cap.crowding()));
    // TLS handshakes: at most as many in progress as connections (16 at least), none
    // past the header timeout (pingora's own bound is a minute).
    let handshakes = listener_cert.as_ref().map(|_| {
        let limit = Duration::from_millis(gateway.config.limits.header_timeout_ms);
        Handshakes::new(max_connections.max(MIN_HANDSHAKES), limit)
    });
    let capped = Capped {
        app: Arc::new(listener),
        cap,
        handshakes: handshakes.clone(),
        preface_within: Duration::from_millis(gateway.config.limits.header_timeout_ms),
    };
    check_free(&listen)
        .map_err(|e| ConfigError::at("listen", format!("cannot listen on {listen}: {e}")))?;
    let mut mcp = Service::new("mcp".to_string(), capped);
    match (&listener_cert, handshakes) {
        (Some(cert), Some(handshakes)) => {
            mcp.add_tls_with_settings(&listen, None, cert.settings()?);
            mcp.endpoints()
                .set_pre_tls_callback(Arc::new(HandshakeGuard(handshakes)));
            tracing::info!(%listen, certificate = %cert.describe(), "the MCP listener serves TLS");
        }
        _ => mcp.add_tcp(&listen),
    }
    let admin_app = AdminApp {
        metrics: metrics.clone(),
        drain: gateway.runtime.drain.clone(),
        reaper: gateway.upstreams.reaper.clone(),
        held: gateway.flows.held.clone(),
    };
    let first_byte_within = Duration::from_millis(gateway.config.limits.header_timeout_ms);
    let admin_bounds = ConnectionBounds {
        max_connections: MAX_OWN_CONNECTIONS,
        connection_time: Some(ADMIN_CONNECTION_TIME),
        first_byte_within,
        make_room: MakeRoom::SilentThenOldest,
    };
    // Its connections idle at most `ADMIN_CONNECTION_TIME`, and the oldest makes room.
    let admin =
        OwnListener::bind("admin", |_| admin_app, &admin_listen, admin_bounds).map_err(|e| {
            ConfigError::at(
                "admin_listen",
                format!("cannot listen on {admin_listen}: {e}"),
            )
        })?;
    server.add_service(mcp);
    server.add_service(background_service("admin", admin));
    if let Some(addr) = &peer_listen {
        let app = |crowding| Listener::new(gateway.clone(), Arrival::Peer, Some(crowding));
        let peer_bounds = ConnectionBounds {
            max_connections: MAX_OWN_CONNECTIONS,
            connection_time: None,
            first_byte_within,
            make_room: MakeRoom::Silent,
        };
        let peer = OwnListener::bind("peer", app, addr, peer_bounds).map_err(|e| {
            ConfigError::at("peers.listen", format!("cannot listen on {addr}: {e}"))
        })?;
        server.add_service(background_service("peer listener", peer));
    }
    let drain_watch = DrainWatch {
        drain: gateway.runtime.drain.clone(),
        metrics: metrics.clone(),
    };
    server.add_service(background_service("drain watch", drain_watch));
    server.add_service(background_service(
        "abandoned-flow reaper",
        ReaperService {
            reaper: gateway.upstreams.reaper.clone(),
            metrics: metrics.clone(),
            drain: gateway.runtime.drain.clone(),
            gw: gateway.clone(),
        },
    ));
    server.add_service(background_service(
        "warm-session sweeper",
        WarmSweeper {
            gw: gateway.clone(),
        },
    ));
    server.add_service(background_service(
        "kept-session sweeper",
        KeptSweeper {
            gw: gateway.clone(),
        },
    ));
    server.add_service(background_service(
        "held-flow sweeper",
        HeldSweeper { gw: gateway },
    ));
    for service in extra {
        server.add_boxed_service(service);
    }
    Ok((server, metrics))
}

/// The keys file and the JWKS file, when configured, each with how to put it in use.
fn watched_files(gateway: &Gateway) -> Vec<WatchedFile> {
    let mut files = Vec::new();
    if let Some(path) = &gateway.config.keys_file {
        let (keys, metrics) = (
            gateway.sealing.keys.clone(),
            gateway.runtime.metrics.clone(),
        );
        let apply = move |path: &std::path::Path| {
            let ring = KeyRing::load_file(path)?;
            let kids: Vec<String> = ring.kids().map(str::to_string).collect();
            metrics.keys_loaded.set(kids.len() as i64);
            keys.store(ring);
            Ok(format!("key ring: {} (the first seals)", kids.join(", ")))
        };
        files.push(WatchedFile::new("keys", path.clone(), Box::new(apply)));
    }
    if let PrincipalSource::Jwt(jwt) = &gateway.config.principal {
        let source = gateway.config.principal.clone();
        let authenticator = gateway.admission.authenticator.clone();
        let apply = move |_: &std::path::Path| {
            let fresh = Authenticator::new(&source)?;
            authenticator.store(fresh);
            Ok("JWKS".to_string())
        };
        files.push(WatchedFile::new(
            "jwks",
            jwt.jwks_file.clone(),
            Box::new(apply),
        ));
    }
    files
}

/// The listener's certificate and key, watched as one: new connections get the new pair.
fn watched_certificate(cert: &Arc<ListenerCert>) -> WatchedFile {
    let files = [&cert.files().cert_file, &cert.files().key_file];
    let paths = files.into_iter().cloned().collect();
    let cert = cert.clone();
    let apply = move |_: &std::path::Path| cert.reload();
    WatchedFile::together("tls", paths, Box::new(apply))
}

/// Fails unless a listener could bind `addr` now (the first address it names, with
/// `SO_REUSEADDR`, as pingora binds it). Pingora binds the MCP listener only once its
/// service starts, retries an address in use for half a minute, then ends that service
/// alone: the process would stay up, its admin listener ready, with nothing listening.
pub fn check_free(addr: &str) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    use std::net::ToSocketAddrs;
    let resolved = addr.to_socket_addrs()?.next();
    let resolved = resolved.ok_or_else(|| Error::new(ErrorKind::InvalidInput, "no address"))?;
    let socket = match resolved {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(resolved)
}

/// Runs until SIGTERM or SIGQUIT (graceful) or SIGINT (fast), caught from before the
/// listeners open.
pub fn run(server: Server) {
    if let Err(e) = signals::catch_early() {
        tracing::warn!(error = %e, "cannot catch signals before the gateway starts; one that comes then ends it without a drain");
    }
    server.run(RunArgs {
        shutdown_signal: Box::new(signals::Signals),
    });
}

struct ChannelShutdown(Mutex<Option<oneshot::Receiver<ShutdownSignal>>>);

#[async_trait]
impl ShutdownSignalWatch for ChannelShutdown {
    async fn recv(&self) -> ShutdownSignal {
        let rx = self.0.lock().await.take();
        match rx {
            Some(rx) => rx.await.unwrap_or(ShutdownSignal::FastShutdown),
            None => std::future::pending().await,
        }
    }
}

/// The fewest TLS handshakes the MCP listener lets run at once, however small its
/// connection cap: a client whose handshake failed is noted until its socket is seen
/// closed, which a cap of one would make everyone else wait for.
const MIN_HANDSHAKES: usize = 16;

/// A server running on its own thread until told to stop.
pub struct Running {
    stop: Option<oneshot::Sender<ShutdownSignal>>,
    thread: Option<JoinHandle<()>>,
    pub metrics: Arc<Metrics>,
}

impl Running {
    /// Starts `server`; returns at once (poll the listeners to know they are up).
    pub fn spawn(server: Server, metrics: Arc<Metrics>) -> Running {
        let (tx, rx) = oneshot::channel();
        let watch = ChannelShutdown(Mutex::new(Some(rx)));
        let thread = std::thread::spawn(move || {
            server.run(RunArgs {
                shutdown_signal: Box::new(watch),
            })
        });
        Running {
            stop: Some(tx),
            thread: Some(thread),
            metrics,
        }
    }

    /// Stops with the given kind of shutdown and waits for the thread to end.
    pub fn stop_with(mut self, signal: ShutdownSignal) {
        self.shutdown(signal);
    }

    fn shutdown(&mut self, signal: ShutdownSignal) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(signal);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.shutdown(ShutdownSignal::FastShutdown);
    }
}
