//! Data-layer sessions for 2026-07-28 clients: the session cookie a client echoes in
//! `_meta["mcp/session"]`, which is a sealed pointer to one legacy upstream session.
//!
//! A legacy server keeps application state per `Mcp-Session-Id` (a notebook, a cart, a
//! working directory); a 2026-07-28 client has no such header, so through the bridge
//! every call would land in a fresh upstream session. `session/create` opens one upstream
//! session and hands the client a cookie naming it; calls that carry the cookie run in
//! that session, on any replica, with no shared store. The cookie is sealed with its own
//! purpose (`Purpose::DataSession`), bound to the principal inside the ciphertext, and
//! expires; each response carries a fresh one with a later expiry.

use crate::keys::{KeyRing, Purpose};
use crate::protocol::revision::Revision;
use crate::protocol::session_token::SessionToken;
use crate::seal::{self, OpenError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;

/// The `_meta` key of the session cookie.
pub const META_KEY: &str = "mcp/session";
/// What `session/*` methods the gateway serves. `list` needs a store of every session,
/// which a stateless gateway does not keep, so it is not offered.
pub const FEATURES: [&str; 2] = ["create", "delete"];
/// Longest cookie id accepted before any decoding.
pub const MAX_COOKIE_LEN: usize = 1024;

/// The one message for every cookie that does not open, whatever the reason.
pub const INVALID_COOKIE: &str = "Invalid or expired session: call session/create again";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataSession {
    /// The upstream group the session was opened in.
    pub group: String,
    /// The endpoint that holds the session; must still belong to `group` to be used.
    pub endpoint: SocketAddr,
    /// The upstream's `Mcp-Session-Id`.
    pub upstream_session: String,
    /// Seconds since the Unix epoch after which the cookie is refused.
    pub expires_at: u64,
    /// Random id that stays the same for the session's life, for logs.
    pub session_id: u64,
    /// The revision the upstream session negotiated. Sealed after the layout, as an
    /// extension (`seal`'s rule); a cookie without one (sealed by a release before it)
    /// has the revision the gateway asks for, which those releases spoke.
    #[serde(skip)]
    pub version: Revision,
}

/// What a request's `_meta["mcp/session"]` holds.
#[derive(Debug, PartialEq, Eq)]
pub enum CookieField<'a> {
    /// No cookie (absent, or `null`).
    Absent,
    /// A cookie id to open.
    Present(&'a str),
    /// Something that is not `{"id": "<string>"}`.
    Malformed,
}

impl CookieField<'_> {
    /// Reads the cookie from a request's params (`_meta["mcp/session"]`).
    pub fn of(params: &Map<String, Value>) -> CookieField<'_> {
        match params.get("_meta").and_then(|m| m.get(META_KEY)) {
            None | Some(Value::Null) => CookieField::Absent,
            Some(cookie) => match cookie.get("id").and_then(Value::as_str) {
                Some(id) => CookieField::Present(id),
                None => CookieField::Malformed,
            },
        }
    }
}

impl DataSession {
    /// Seals the cookie bound to `principal` (a digest, of which the first 16 bytes are
    /// kept).
    pub fn seal(&self, ring: &KeyRing, principal: &[u8]) -> String {
        self.seal_as(ring, principal, seal::VERSION)
    }

    /// [`DataSession::seal`] in format `version` (`seal::sealing_version`).
    pub fn seal_as(&self, ring: &KeyRing, principal: &[u8], version: u8) -> String {
        let value = &(self, self.version);
        seal::seal_for_principal_as(ring, Purpose::DataSession, version, principal, value)
    }

    /// Opens a cookie presented by `principal`; `now` is seconds since the Unix epoch.
    pub fn open(
        ring: &KeyRing,
        principal: &[u8],
        text: &str,
        now: u64,
    ) -> Result<DataSession, OpenError> {
        let session = DataSession::open_expired_too(ring, principal, text)?;
        if now >= session.expires_at {
            return Err(OpenError::Expired);
        }
        Ok(session)
    }

    /// Opens a cookie presented by `principal`, expired or not: the session it names,
    /// for ending it upstream (an expired cookie serves nothing else).
    pub fn open_expired_too(
        ring: &KeyRing,
        principal: &[u8],
        text: &str,
    ) -> Result<DataSession, OpenError> {
        let (bound, session) = DataSession::open_unbound(ring, text)?;
        seal::check_principal(&bound, principal)?;
        Ok(session)
    }

    /// Opens a cookie without checking whom it is bound to or its expiry (for
    /// `inspect`); returns the principal digest it was sealed with.
    pub fn open_unbound(ring: &KeyRing, text: &str) -> Result<(Vec<u8>, DataSession), OpenError> {
        let (bound, mut session, version): (Vec<u8>, DataSession, Option<Revision>) =
            seal::open_with_principal_extended(ring, Purpose::DataSession, text, MAX_COOKIE_LEN)?;
        session.version = version.unwrap_or_default();
        SessionToken::validate_upstream_session(&session.upstream_session)
            .map_err(|_| OpenError::BadPayload)?;
        Ok((bound, session))
    }

    /// The cookie as it goes in `_meta["mcp/session"]` of a result: the sealed id and
    /// its expiry.
    pub fn cookie(&self, ring: &KeyRing, principal: &[u8], version: u8) -> Value {
        let id = self.seal_as(ring, principal, version);
        json!({"id": id, "expiry": rfc3339(self.expires_at)})
    }

    /// The session's log name.
    pub fn log_id(&self) -> String {
        format!("{:016x}", self.session_id)
    }
}

/// The `_meta` of a result or error that revokes the client's cookie.
pub fn revocation() -> Value {
    json!({ META_KEY: null })
}

/// An RFC 3339 UTC timestamp, as the cookie's `expiry` is written.
pub fn rfc3339(secs: u64) -> String {
    let at = i64::try_from(secs)
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0));
    at.unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring() -> KeyRing {
        KeyRing::parse("k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap()
    }

    fn sample() -> DataSession {
        DataSession {
            group: "default".into(),
            endpoint: "10.0.0.7:3001".parse().unwrap(),
            upstream_session: "5b0c3a1e4d2f4f8e9c1a7f6e5d4c3b2a".into(),
            expires_at: 2_000_000_000,
            session_id: 0x0123_4567_89ab_cdef,
            version: Revision::parse("2025-06-18").unwrap(),
        }
    }

    #[test]
    fn a_cookie_sealed_without_the_revision_opens_with_the_one_asked_for() {
        // What a release before the extension sealed: the layout alone.
        let theirs = seal::seal_for_principal(&ring(), Purpose::DataSession, b"p", &sample());
        let opened = DataSession::open(&ring(), b"p", &theirs, 0).unwrap();
        assert_eq!(opened.version, Revision::REQUESTED);
        assert_eq!(opened.upstream_session, sample().upstream_session);
        // And what this one seals, that release reads as the layout, the rest left.
        let ours = sample().seal(&ring(), b"p");
        let (_, read): (Vec<u8>, DataSession) =
            seal::open_with_principal(&ring(), Purpose::DataSession, &ours, MAX_COOKIE_LEN)
                .unwrap();
        assert_eq!(read.session_id, sample().session_id);
    }

    #[test]
    fn a_cookie_round_trips_for_its_principal_until_it_expires() {
        let sealed = sample().seal(&ring(), b"alice's digest..");
        assert!(sealed.len() < 200, "cookie is {} chars", sealed.len());
        assert!(sealed.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        let open = |who: &[u8], now| DataSession::open(&ring(), who, &sealed, now);
        assert_eq!(open(b"alice's digest..", 1_999_999_999), Ok(sample()));
        assert_eq!(
            open(b"bob's digest....", 1_999_999_999),
            Err(OpenError::Principal)
        );
        assert_eq!(
            open(b"alice's digest..", 2_000_000_000),
            Err(OpenError::Expired)
        );
    }

    #[test]
    fn a_cookie_is_not_a_session_token_or_a_state() {
        let sealed = sample().seal(&ring(), b"p");
        assert!(SessionToken::open(&ring(), b"p", &sealed).is_err());
        let token = SessionToken {
            group: "default".into(),
            endpoint: "10.0.0.7:3001".parse().unwrap(),
            upstream_session: "abc".into(),
            issued_at: 1,
        }
        .seal(&ring(), b"p");
        assert!(DataSession::open(&ring(), b"p", &token, 0).is_err());
    }

    #[test]
    fn the_cookie_field_is_read_from_meta() {
        let params = |meta: Value| json!({"_meta": meta}).as_object().unwrap().clone();
        let p = params(json!({"mcp/session": {"id": "abc"}}));
        assert_eq!(CookieField::of(&p), CookieField::Present("abc"));
        let p = params(json!({"mcp/session": null}));
        assert_eq!(CookieField::of(&p), CookieField::Absent);
        let p = params(json!({}));
        assert_eq!(CookieField::of(&p), CookieField::Absent);
        let p = params(json!({"mcp/session": {"id": 7}}));
        assert_eq!(CookieField::of(&p), CookieField::Malformed);
        let p = params(json!({"mcp/session": "abc"}));
        assert_eq!(CookieField::of(&p), CookieField::Malformed);
    }

    #[test]
    fn expiry_is_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_000_000), "2026-11-18T11:06:40Z");
    }
}
