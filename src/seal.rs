//! The sealed envelope shared by session tokens, session cookies and `requestState`:
//! XChaCha20-Poly1305 under a purpose subkey of the key ring, with the key id in the clear
//! so any replica holding that key can open it.
//!
//! Wire form, base64url without padding:
//! `version (1) | kid length (1) | kid | nonce (24) | ciphertext | tag (16)`.
//! The associated data is `purpose label | version | kid | binding`, where the binding is
//! supplied by the caller (for example a digest of the principal). A blob therefore opens
//! only for the purpose, key and binding it was sealed with.
//!
//! The version is the format of what is sealed, authenticated with it. The compatibility
//! rule: a replica opens blobs of its own version and of the one before (`VERSION - 1`),
//! so what an older replica sealed still opens after a rolling upgrade; a change to the
//! layout of any sealed payload bumps `VERSION`, and the payload's owner decodes each
//! version it opens. A blob of any other version is `Malformed`.
//!
//! A payload may be followed by extensions: values a later release seals after the
//! layout, each read only when bytes remain ([`extension`]). A replica that does not
//! know them ignores them (a layout is decoded from the front, and what follows is left),
//! and one that finds none uses their default. A field that replicas of the release
//! before may safely go without is therefore added as an extension, with no new version
//! and no two-step upgrade; one they must not go without changes the layout.
//!
//! Every failure is an [`OpenError`] whose variant says why, for the logs; callers answer
//! clients with one uniform error whatever the variant.

use crate::keys::{KeyRing, Purpose, MAX_KID_LEN};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chacha20poly1305::aead::AeadInPlace;
use chacha20poly1305::{Tag, XNonce};
use rand::RngCore;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt;

/// The format version sealed now.
pub const VERSION: u8 = 2;
/// The oldest format version still opened.
pub const OLDEST_VERSION: u8 = VERSION - 1;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;

/// Why a sealed blob did not open. Logged, never shown to clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenError {
    /// Longer than the caller allows.
    TooLong,
    /// Not base64url, too short, or an unknown envelope version.
    Malformed,
    /// Sealed under a key id this ring does not hold.
    UnknownKey,
    /// Authentication failed: tampered, another purpose, or another binding.
    Rejected,
    /// Authentic, but the payload does not decode.
    BadPayload,
    /// Authentic, but past its expiry.
    Expired,
    /// Authentic, but bound to another principal.
    Principal,
    /// Authentic and the caller's, but bound to another request (method, name, arguments).
    Binding,
}

impl OpenError {
    /// A stable, low-cardinality name for logs and metric labels.
    pub fn reason(self) -> &'static str {
        match self {
            OpenError::TooLong => "too_long",
            OpenError::Malformed => "malformed",
            OpenError::UnknownKey => "unknown_key",
            OpenError::Rejected => "tampered",
            OpenError::BadPayload => "bad_payload",
            OpenError::Expired => "expired",
            OpenError::Principal => "principal",
            OpenError::Binding => "binding",
        }
    }
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

fn associated_data(purpose: Purpose, version: u8, kid: &[u8], binding: &[u8]) -> Vec<u8> {
    let label = purpose.label();
    let mut aad = Vec::with_capacity(label.len() + 2 + kid.len() + binding.len());
    aad.extend_from_slice(label);
    aad.push(version);
    aad.extend_from_slice(kid);
    aad.extend_from_slice(binding);
    aad
}

/// Seals `plaintext` under the ring's current key, in the current format version.
/// Returns base64url text.
pub fn seal(ring: &KeyRing, purpose: Purpose, binding: &[u8], plaintext: &[u8]) -> String {
    seal_version(ring, purpose, VERSION, binding, plaintext)
}

/// Seals `plaintext` marked as format `version` (one this replica opens).
///
/// The envelope is built in one buffer and encrypted in place, so sealing allocates only
/// that buffer, the associated data and the text.
pub fn seal_version(
    ring: &KeyRing,
    purpose: Purpose,
    version: u8,
    binding: &[u8],
    plaintext: &[u8],
) -> String {
    debug_assert!((OLDEST_VERSION..=VERSION).contains(&version));
    let key = ring.current();
    let kid = key.kid().as_bytes();
    let body_at = 2 + kid.len() + NONCE_LEN;
    let mut raw = Vec::with_capacity(body_at + plaintext.len() + TAG_LEN);
    raw.push(version);
    raw.push(kid.len() as u8);
    raw.extend_from_slice(kid);
    let mut nonce = [0u8; NONCE_LEN];
    rand::thread_rng().fill_bytes(&mut nonce);
    raw.extend_from_slice(&nonce);
    raw.extend_from_slice(plaintext);
    let aad = associated_data(purpose, version, kid, binding);
    let tag = key
        .cipher(purpose)
        .encrypt_in_place_detached(XNonce::from_slice(&nonce), &aad, &mut raw[body_at..])
        .expect("XChaCha20-Poly1305 encryption of an in-memory buffer cannot fail");
    raw.extend_from_slice(&tag);
    URL_SAFE_NO_PAD.encode(raw)
}

/// Seals `value` for `purpose` with a principal tag (the first 16 bytes of the
/// principal digest) next to it inside the ciphertext, where `inspect` can show it.
pub fn seal_for_principal<T: Serialize>(
    ring: &KeyRing,
    purpose: Purpose,
    principal: &[u8],
    value: &T,
) -> String {
    seal_for_principal_as(ring, purpose, VERSION, principal, value)
}

/// [`seal_for_principal`] marked as format `version` (`sealing_version`).
pub fn seal_for_principal_as<T: Serialize>(
    ring: &KeyRing,
    purpose: Purpose,
    version: u8,
    principal: &[u8],
    value: &T,
) -> String {
    let plain = postcard::to_extend(&(principal_tag(principal), value), Vec::with_capacity(128))
        .expect("sealed values always serialize");
    seal_version(ring, purpose, version, b"", &plain)
}

/// The format version a replica seals in: the previous one while `previous` (the first
/// phase of a rolling upgrade, when replicas of the release before still run and open
/// only that one), else the current. Every layout but the `requestState`'s reads the
/// same in both, bar extensions after it, which the release before skips.
pub fn sealing_version(previous: bool) -> u8 {
    match previous {
        true => OLDEST_VERSION,
        false => VERSION,
    }
}

/// Opens text produced by [`seal_for_principal`] without checking the principal; returns
/// the principal tag it was sealed with, and the value.
pub fn open_with_principal<T: DeserializeOwned>(
    ring: &KeyRing,
    purpose: Purpose,
    sealed: &str,
    max_len: usize,
) -> Result<(Vec<u8>, T), OpenError> {
    let plain = open(ring, purpose, b"", sealed, max_len)?;
    postcard::from_bytes(&plain).map_err(|_| OpenError::BadPayload)
}

/// [`open_with_principal`], also returning the extension sealed after the value, if any
/// (see [`extension`]).
pub fn open_with_principal_extended<T: DeserializeOwned, E: DeserializeOwned>(
    ring: &KeyRing,
    purpose: Purpose,
    sealed: &str,
    max_len: usize,
) -> Result<(Vec<u8>, T, Option<E>), OpenError> {
    let plain = open(ring, purpose, b"", sealed, max_len)?;
    let ((tag, value), rest): ((Vec<u8>, T), _) =
        postcard::take_from_bytes(&plain).map_err(|_| OpenError::BadPayload)?;
    Ok((tag, value, extension(rest)?))
}

/// The extension at the front of `rest`, what follows a payload's layout (later
/// extensions after it are left): `None` when there is none, as in what a release before
/// it sealed.
pub fn extension<E: DeserializeOwned>(rest: &[u8]) -> Result<Option<E>, OpenError> {
    next_extension(rest).map(|(value, _)| value)
}

/// The extension at the front of `rest`, as [`extension`], and what follows it (the
/// extensions after it).
pub fn next_extension<E: DeserializeOwned>(rest: &[u8]) -> Result<(Option<E>, &[u8]), OpenError> {
    if rest.is_empty() {
        return Ok((None, rest));
    }
    postcard::take_from_bytes(rest)
        .map(|(value, after)| (Some(value), after))
        .map_err(|_| OpenError::BadPayload)
}

/// The length of the text `seal` makes of `plaintext_len` bytes under a key id of
/// `kid_len` bytes.
pub fn sealed_len(kid_len: usize, plaintext_len: usize) -> usize {
    let raw = 2 + kid_len + NONCE_LEN + plaintext_len + TAG_LEN;
    raw.div_ceil(3) * 4 - (3 - raw % 3) % 3
}

/// The longest plaintext whose sealed text, under a key id of `kid_len` bytes, is at most
/// `limit` long: unpadded base64 of `raw` bytes is `ceil(4 raw / 3)` long, so `raw` may be
/// `floor(3 limit / 4)`.
pub fn max_plaintext_len(kid_len: usize, limit: usize) -> usize {
    (limit / 4 * 3 + limit % 4 * 3 / 4).saturating_sub(2 + kid_len + NONCE_LEN + TAG_LEN)
}

/// Equality in time independent of where the inputs differ.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether a sealed principal tag names `principal` (compared in constant time).
pub fn check_principal(tag: &[u8], principal: &[u8]) -> Result<(), OpenError> {
    if same(tag, principal_tag(principal)) {
        Ok(())
    } else {
        Err(OpenError::Principal)
    }
}

/// The part of a principal digest a sealed value carries.
fn principal_tag(principal: &[u8]) -> &[u8] {
    principal.get(..16).unwrap_or(principal)
}

/// Opens text produced by [`seal`] with the same purpose and binding.
/// `max_len` bounds the encoded length before any work is done.
pub fn open(
    ring: &KeyRing,
    purpose: Purpose,
    binding: &[u8],
    sealed: &str,
    max_len: usize,
) -> Result<Vec<u8>, OpenError> {
    open_version(ring, purpose, binding, sealed, max_len).map(|(_, plain)| plain)
}

/// [`open`], also returning the format version the blob was sealed in.
pub fn open_version(
    ring: &KeyRing,
    purpose: Purpose,
    binding: &[u8],
    sealed: &str,
    max_len: usize,
) -> Result<(u8, Vec<u8>), OpenError> {
    if sealed.len() > max_len {
        return Err(OpenError::TooLong);
    }
    let mut raw = URL_SAFE_NO_PAD
        .decode(sealed)
        .map_err(|_| OpenError::Malformed)?;
    let (version, kid, _) = split_header(&raw)?;
    let key = ring.find(kid).ok_or(OpenError::UnknownKey)?;
    let aad = associated_data(purpose, version, kid, binding);
    let body_at = 2 + kid.len() + NONCE_LEN;
    let tag_at = raw.len() - TAG_LEN;
    let (head, rest) = raw.split_at_mut(body_at);
    let (body, tag) = rest.split_at_mut(tag_at - body_at);
    key.cipher(purpose)
        .decrypt_in_place_detached(
            XNonce::from_slice(&head[body_at - NONCE_LEN..]),
            &aad,
            body,
            Tag::from_slice(tag),
        )
        .map_err(|_| OpenError::Rejected)?;
    raw.truncate(tag_at);
    raw.drain(..body_at);
    Ok((version, raw))
}

/// Splits `version | kid len | kid | rest`, checking the version is one this replica
/// opens and that `rest` holds a nonce and a tag.
fn split_header(raw: &[u8]) -> Result<(u8, &[u8], &[u8]), OpenError> {
    let [version, kid_len, rest @ ..] = raw else {
        return Err(OpenError::Malformed);
    };
    let kid_len = *kid_len as usize;
    let known = (OLDEST_VERSION..=VERSION).contains(version);
    if !known || kid_len == 0 || kid_len > MAX_KID_LEN || rest.len() < kid_len {
        return Err(OpenError::Malformed);
    }
    let (kid, rest) = rest.split_at(kid_len);
    if rest.len() < NONCE_LEN + TAG_LEN {
        return Err(OpenError::Malformed);
    }
    Ok((*version, kid, rest))
}

/// The key id a sealed blob names, without opening it (for `inspect` and logs); `None`
/// when it is not one a key ring can hold (letters, digits, `-`, `_`), so that what an
/// untrusted token carries there (terminal escapes, say) is never printed.
pub fn peek_kid(sealed: &str) -> Option<String> {
    let raw = URL_SAFE_NO_PAD.decode(sealed).ok()?;
    let (_, kid, _) = split_header(&raw).ok()?;
    let kid = String::from_utf8(kid.to_vec()).ok()?;
    crate::keys::is_valid_kid(&kid).then_some(kid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::generate_entry;

    fn ring(kids: &[&str]) -> KeyRing {
        let entries: Vec<String> = kids.iter().map(|k| generate_entry(k).unwrap()).collect();
        KeyRing::parse(&entries.join(",")).unwrap()
    }

    const MAX: usize = 4096;

    #[test]
    fn round_trip_and_kid_is_visible() {
        let r = ring(&["k1"]);
        let s = seal(&r, Purpose::Session, b"alice", b"payload");
        assert_eq!(
            open(&r, Purpose::Session, b"alice", &s, MAX).unwrap(),
            b"payload"
        );
        assert_eq!(peek_kid(&s).as_deref(), Some("k1"));
        // The same envelope naming a key id no ring can hold: an escape sequence.
        let mut raw = URL_SAFE_NO_PAD.decode(&s).unwrap();
        raw[1] = 4;
        raw.splice(2..4, *b"\x1b[2J");
        let hostile = URL_SAFE_NO_PAD.encode(&raw);
        assert!(split_header(&raw).is_ok(), "the envelope itself parses");
        assert_eq!(peek_kid(&hostile), None);
        assert!(!s.contains("payload"));
    }

    #[test]
    fn wrong_purpose_binding_or_key_is_rejected() {
        let r = ring(&["k1"]);
        let s = seal(&r, Purpose::Session, b"alice", b"payload");
        assert_eq!(
            open(&r, Purpose::RequestState, b"alice", &s, MAX),
            Err(OpenError::Rejected)
        );
        assert_eq!(
            open(&r, Purpose::Session, b"bob", &s, MAX),
            Err(OpenError::Rejected)
        );
        let other = ring(&["k2"]);
        assert_eq!(
            open(&other, Purpose::Session, b"alice", &s, MAX),
            Err(OpenError::UnknownKey)
        );
        let same_kid_other_secret = ring(&["k1"]);
        assert_eq!(
            open(&same_kid_other_secret, Purpose::Session, b"alice", &s, MAX),
            Err(OpenError::Rejected)
        );
    }

    #[test]
    fn every_bit_flip_is_caught() {
        let r = ring(&["k1"]);
        let s = seal(&r, Purpose::Session, b"", b"some payload bytes");
        let raw = URL_SAFE_NO_PAD.decode(&s).unwrap();
        for i in 0..raw.len() * 8 {
            let mut flipped = raw.clone();
            flipped[i / 8] ^= 1 << (i % 8);
            let text = URL_SAFE_NO_PAD.encode(&flipped);
            assert!(
                open(&r, Purpose::Session, b"", &text, MAX).is_err(),
                "bit {i}"
            );
        }
    }

    #[test]
    fn truncation_garbage_and_length_are_caught() {
        let r = ring(&["k1"]);
        let s = seal(&r, Purpose::Session, b"", b"x");
        for cut in 0..s.len() {
            assert!(open(&r, Purpose::Session, b"", &s[..cut], MAX).is_err());
        }
        assert_eq!(
            open(&r, Purpose::Session, b"", "!!not base64!!", MAX),
            Err(OpenError::Malformed)
        );
        assert_eq!(
            open(&r, Purpose::Session, b"", &s, s.len() - 1),
            Err(OpenError::TooLong)
        );
    }

    #[test]
    fn rotation_keeps_old_tokens_open_until_their_key_is_removed() {
        use crate::keys::Key;
        let before = KeyRing::from_keys(vec![Key::new("old", &[1u8; 32]).unwrap()]).unwrap();
        let during = KeyRing::from_keys(vec![
            Key::new("new", &[2u8; 32]).unwrap(),
            Key::new("old", &[1u8; 32]).unwrap(),
        ])
        .unwrap();
        let after = KeyRing::from_keys(vec![Key::new("new", &[2u8; 32]).unwrap()]).unwrap();
        let old_token = seal(&before, Purpose::Session, b"", b"flow");
        let new_token = seal(&during, Purpose::Session, b"", b"flow");
        assert_eq!(peek_kid(&new_token).as_deref(), Some("new"));
        assert!(open(&during, Purpose::Session, b"", &old_token, MAX).is_ok());
        assert!(open(&after, Purpose::Session, b"", &new_token, MAX).is_ok());
        assert_eq!(
            open(&after, Purpose::Session, b"", &old_token, MAX),
            Err(OpenError::UnknownKey)
        );
    }

    #[test]
    fn the_previous_version_opens_and_others_do_not() {
        let r = ring(&["k1"]);
        let old = seal_version(&r, Purpose::Session, OLDEST_VERSION, b"", b"flow");
        assert_eq!(
            open_version(&r, Purpose::Session, b"", &old, MAX),
            Ok((OLDEST_VERSION, b"flow".to_vec()))
        );
        let mut raw = URL_SAFE_NO_PAD.decode(&old).unwrap();
        for version in [0, VERSION + 1, 255] {
            raw[0] = version;
            let text = URL_SAFE_NO_PAD.encode(&raw);
            assert_eq!(
                open(&r, Purpose::Session, b"", &text, MAX),
                Err(OpenError::Malformed)
            );
        }
        // The version is authenticated: relabelling an old blob as new fails.
        let mut relabelled = URL_SAFE_NO_PAD.decode(&old).unwrap();
        relabelled[0] = VERSION;
        let text = URL_SAFE_NO_PAD.encode(&relabelled);
        assert_eq!(
            open(&r, Purpose::Session, b"", &text, MAX),
            Err(OpenError::Rejected)
        );
    }

    #[test]
    fn sealed_len_is_exact() {
        let r = ring(&["k1", "a-longer-kid"]);
        for len in 0..100 {
            let plain = vec![7u8; len];
            let text = seal(&r, Purpose::Session, b"", &plain);
            assert_eq!(sealed_len(2, len), text.len(), "{len}");
        }
    }

    #[test]
    fn max_plaintext_len_is_the_longest_that_fits() {
        for kid_len in [0, 2, 40] {
            for limit in 0..600 {
                let longest = (0..=limit).rev().find(|&n| sealed_len(kid_len, n) <= limit);
                let want = longest.unwrap_or(0);
                assert_eq!(max_plaintext_len(kid_len, limit), want, "{kid_len} {limit}");
            }
        }
    }
}
