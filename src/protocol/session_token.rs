//! The client-facing `Mcp-Session-Id` of a legacy session: a sealed pointer to the
//! upstream endpoint and the upstream's own session id. Any replica holding the key opens
//! it and routes the request, so one MCP session can be served by every replica without
//! sticky balancing or a shared store.

use crate::keys::{KeyRing, Purpose};
use crate::seal::{self, OpenError};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Longest upstream session id accepted from an upstream.
pub const MAX_UPSTREAM_SESSION_LEN: usize = 256;
/// Longest client-facing token accepted before any decoding.
pub const MAX_TOKEN_LEN: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionToken {
    /// The upstream group the session was opened in.
    pub group: String,
    /// The endpoint that holds the session; must still belong to `group` to be used.
    pub endpoint: SocketAddr,
    /// The upstream's `Mcp-Session-Id`.
    pub upstream_session: String,
    /// Seconds since the Unix epoch when the session was opened.
    pub issued_at: u64,
}

/// Why an upstream session id cannot be wrapped.
#[derive(Debug, PartialEq, Eq)]
pub struct BadUpstreamSession;

impl SessionToken {
    /// Checks the upstream's id: visible ASCII (0x21..=0x7E) and bounded, as the
    /// 2025-11-25 transport requires.
    pub fn validate_upstream_session(id: &str) -> Result<(), BadUpstreamSession> {
        let visible = id.bytes().all(|b| (0x21..=0x7e).contains(&b));
        if id.is_empty() || id.len() > MAX_UPSTREAM_SESSION_LEN || !visible {
            return Err(BadUpstreamSession);
        }
        Ok(())
    }

    /// Seals the token bound to `principal` (a digest, of which the first 16 bytes are
    /// kept), which travels inside the ciphertext so that `inspect` can show it.
    pub fn seal(&self, ring: &KeyRing, principal: &[u8]) -> String {
        self.seal_as(ring, principal, seal::VERSION)
    }

    /// [`SessionToken::seal`] in format `version` (`seal::sealing_version`).
    pub fn seal_as(&self, ring: &KeyRing, principal: &[u8], version: u8) -> String {
        seal::seal_for_principal_as(ring, Purpose::Session, version, principal, self)
    }

    pub fn open(ring: &KeyRing, principal: &[u8], token: &str) -> Result<SessionToken, OpenError> {
        let (bound, token) = SessionToken::open_unbound(ring, token)?;
        seal::check_principal(&bound, principal)?;
        Ok(token)
    }

    /// Opens a token without checking whom it is bound to (for `inspect`); returns the
    /// principal digest it was sealed with.
    pub fn open_unbound(ring: &KeyRing, token: &str) -> Result<(Vec<u8>, SessionToken), OpenError> {
        let (bound, token): (Vec<u8>, SessionToken) =
            seal::open_with_principal(ring, Purpose::Session, token, MAX_TOKEN_LEN)?;
        Self::validate_upstream_session(&token.upstream_session)
            .map_err(|_| OpenError::BadPayload)?;
        Ok((bound, token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::generate_entry;

    fn sample() -> SessionToken {
        SessionToken {
            group: "default".into(),
            endpoint: "127.0.0.1:3001".parse().unwrap(),
            upstream_session: "5b0c3a1e-4d2f-4f8e-9c1a-7f6e5d4c3b2a".into(),
            issued_at: 1_795_000_000,
        }
    }

    #[test]
    fn round_trip_is_compact_and_visible_ascii() {
        let ring = KeyRing::parse(&generate_entry("k1").unwrap()).unwrap();
        let text = sample().seal(&ring, b"principal");
        assert!(text.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        assert!(text.len() < 160, "token is {} chars", text.len());
        assert_eq!(
            SessionToken::open(&ring, b"principal", &text).unwrap(),
            sample()
        );
        assert_eq!(
            SessionToken::open(&ring, b"someone else", &text),
            Err(OpenError::Principal)
        );
    }

    #[test]
    fn upstream_session_ids_are_checked() {
        assert!(SessionToken::validate_upstream_session("abc-123").is_ok());
        assert!(SessionToken::validate_upstream_session("").is_err());
        assert!(SessionToken::validate_upstream_session("has space").is_err());
        assert!(SessionToken::validate_upstream_session("é").is_err());
        let long = "a".repeat(MAX_UPSTREAM_SESSION_LEN + 1);
        assert!(SessionToken::validate_upstream_session(&long).is_err());
    }
}
