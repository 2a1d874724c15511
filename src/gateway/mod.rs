//! The Pingora shell: the MCP listener's application, which routes each request to the
//! group serving its path and drives the upstream exchange itself ("handler mode"), the
//! admin listener, and the assembly of both into a pingora `Server`.

pub mod admin;
pub mod passthrough;
pub mod respond;
pub mod server;

use crate::config::Config;
use crate::keys::KeyRing;
use crate::metrics::Metrics;
use crate::principal::PrincipalSource;
use crate::protocol::host_check::HostPolicy;
use crate::protocol::jsonrpc::code;
use crate::upstream::exchange::UpstreamClient;
use crate::upstream::Upstreams;
use async_trait::async_trait;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use std::sync::Arc;
use std::time::Duration;

/// Longest wait for each read of a client's request body.
const CLIENT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything one gateway instance shares across requests.
pub struct Gateway {
    pub config: Config,
    pub keys: Arc<KeyRing>,
    pub upstreams: Upstreams,
    pub client: UpstreamClient,
    pub metrics: Arc<Metrics>,
    host_policy: HostPolicy,
}

impl Gateway {
    pub fn new(config: Config, keys: Arc<KeyRing>, upstreams: Upstreams) -> Gateway {
        let listen = config.listen.parse().expect("validated listen address");
        let host_policy = HostPolicy::for_listener(listen, &config.allowed_hosts);
        Gateway {
            host_policy,
            config,
            keys,
            upstreams,
            client: UpstreamClient::default(),
            metrics: Arc::new(Metrics::new()),
        }
    }

    pub fn principal_source(&self) -> &PrincipalSource {
        &self.config.principal
    }

    async fn handle(&self, session: &mut ServerSession) {
        let header = |name: &str| session.get_header(name).and_then(|v| v.to_str().ok());
        if let Err(why) = self.host_policy.check(header("host"), header("origin")) {
            let message = format!("Forbidden: {why} (DNS-rebinding protection; see allowed_hosts)");
            respond::error(session, 403, None, code::INVALID_REQUEST, &message).await;
            return;
        }
        let path = session.req_header().uri.path();
        let Some(group) = self.upstreams.by_path(path) else {
            let message = format!("no MCP endpoint at {path}");
            respond::error(session, 404, None, code::INVALID_REQUEST, &message).await;
            return;
        };
        let method = session.req_header().method.clone();
        if !matches!(method.as_str(), "POST" | "GET" | "DELETE") {
            let message = format!("method {method} is not allowed; use POST, GET or DELETE");
            respond::error(session, 405, None, code::INVALID_REQUEST, &message).await;
            return;
        }
        passthrough::serve(self, session, group).await;
    }
}

#[async_trait]
impl HttpServerApp for Gateway {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        match session.read_request().await {
            Ok(true) => {}
            _ => return None,
        }
        session.set_read_timeout(Some(CLIENT_BODY_READ_TIMEOUT));
        session.set_keepalive(if *shutdown.borrow() { None } else { Some(60) });
        self.handle(&mut session).await;
        let settings = HttpPersistentSettings::for_session(&session);
        match session.finish().await {
            Ok(stream) => stream.map(|s| ReusedHttpStream::from_reusable_stream(s, settings)),
            Err(_) => None,
        }
    }
}
