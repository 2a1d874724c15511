//! The key ring: named 256-bit keys, the one that seals and all that open, and the
//! per-purpose subkeys derived from each with HKDF-SHA256.
//!
//! A key is written `KID:BASE64URL_32_BYTES`; a ring is such keys separated by commas or
//! newlines (the environment variable `MRTR_GATEWAY_KEYS`, or a keys file). The first key
//! seals; every key opens. Subkeys are derived once at load so that sealing costs no KDF.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chacha20poly1305::{KeyInit, XChaCha20Poly1305};
use hkdf::Hkdf;
use rand::RngCore;
use sha2::Sha256;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, RwLock};

/// What a sealed blob is for. Each purpose has its own subkey, so a blob sealed for one
/// purpose never opens as another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The client-facing `Mcp-Session-Id` of a legacy session.
    Session,
    /// The `requestState` of a Multi Round-Trip Request.
    RequestState,
    /// The cookie of a data-layer session (`_meta["mcp/session"]`).
    DataSession,
    /// An upstream SSE event id given to a legacy client (`protocol::event_ids`).
    EventId,
}

impl Purpose {
    pub const ALL: [Purpose; 4] = [
        Purpose::Session,
        Purpose::RequestState,
        Purpose::DataSession,
        Purpose::EventId,
    ];

    pub fn label(self) -> &'static [u8] {
        match self {
            Purpose::Session => b"mrtr-gateway/v1/session",
            Purpose::RequestState => b"mrtr-gateway/v1/request-state",
            Purpose::DataSession => b"mrtr-gateway/v1/data-session",
            Purpose::EventId => b"mrtr-gateway/v1/event-id",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Longest key id accepted; ids travel inside every token, so they stay short.
pub const MAX_KID_LEN: usize = 16;

/// One named key with its derived subkeys.
pub struct Key {
    kid: String,
    ciphers: [XChaCha20Poly1305; Purpose::ALL.len()],
}

impl Key {
    pub fn new(kid: &str, secret: &[u8; 32]) -> Result<Key, KeyError> {
        validate_kid(kid)?;
        let hk = Hkdf::<Sha256>::new(Some(b"mrtr-gateway key ring"), secret);
        let derive = |p: Purpose| {
            let mut sub = [0u8; 32];
            hk.expand(p.label(), &mut sub)
                .expect("32 bytes is a valid HKDF-SHA256 output length");
            XChaCha20Poly1305::new(&sub.into())
        };
        Ok(Key {
            kid: kid.to_string(),
            ciphers: Purpose::ALL.map(derive),
        })
    }

    pub fn kid(&self) -> &str {
        &self.kid
    }

    pub fn cipher(&self, purpose: Purpose) -> &XChaCha20Poly1305 {
        &self.ciphers[purpose.index()]
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({}, <secret>)", self.kid)
    }
}

/// Keys by id: the first seals, all open.
#[derive(Debug)]
pub struct KeyRing {
    keys: Vec<Key>,
    ephemeral: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub enum KeyError {
    Empty,
    BadEntry { index: usize, why: String },
    BadKid(String),
    DuplicateKid(String),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => write!(f, "no keys given"),
            KeyError::BadEntry { index, why } => write!(f, "key #{}: {why}", index + 1),
            KeyError::BadKid(why) => write!(f, "key id {why}"),
            KeyError::DuplicateKid(kid) => write!(f, "key id '{kid}' appears twice"),
        }
    }
}

impl std::error::Error for KeyError {}

/// Whether `kid` is a key id a ring can hold: 1 to 16 letters, digits, `-` or `_`.
pub fn is_valid_kid(kid: &str) -> bool {
    validate_kid(kid).is_ok()
}

fn validate_kid(kid: &str) -> Result<(), KeyError> {
    if kid.is_empty() || kid.len() > MAX_KID_LEN {
        return Err(KeyError::BadKid(format!(
            "must be 1 to {MAX_KID_LEN} characters"
        )));
    }
    if !kid
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(KeyError::BadKid(
            "may only contain letters, digits, '-' and '_'".into(),
        ));
    }
    Ok(())
}

impl KeyRing {
    /// Parses `KID:BASE64URL_32_BYTES` entries separated by commas, newlines or both.
    /// Blank entries are skipped, and a `#` comments out the rest of its line (no key id
    /// or key holds one): every key on a line commented out is gone, and a comment may
    /// hold commas.
    pub fn parse(text: &str) -> Result<KeyRing, KeyError> {
        let mut keys: Vec<Key> = Vec::new();
        // A file saved by an editor that marks UTF-8 (a Windows one) starts with U+FEFF.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let entries = text
            .lines()
            .flat_map(|line| line.split('#').next().unwrap_or_default().split(','))
            .map(str::trim)
            .filter(|e| !e.is_empty());
        for (index, entry) in entries.enumerate() {
            let key = parse_entry(entry).map_err(|why| KeyError::BadEntry { index, why })?;
            if keys.iter().any(|k| k.kid == key.kid) {
                return Err(KeyError::DuplicateKid(key.kid));
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(KeyRing {
            keys,
            ephemeral: false,
        })
    }

    /// A ring of one random key that lives as long as the process.
    pub fn ephemeral() -> KeyRing {
        let secret = random_secret();
        KeyRing {
            keys: vec![Key::new("ephemeral", &secret).expect("valid literal kid")],
            ephemeral: true,
        }
    }

    pub fn from_keys(keys: Vec<Key>) -> Result<KeyRing, KeyError> {
        if keys.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(KeyRing {
            keys,
            ephemeral: false,
        })
    }

    pub fn is_ephemeral(&self) -> bool {
        self.ephemeral
    }

    /// The key that seals new tokens.
    pub fn current(&self) -> &Key {
        &self.keys[0]
    }

    pub fn find(&self, kid: &[u8]) -> Option<&Key> {
        self.keys.iter().find(|k| k.kid.as_bytes() == kid)
    }

    pub fn kids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|k| k.kid.as_str())
    }
}

impl KeyRing {
    /// Reads and parses a keys file; errors name the file.
    pub fn load_file(path: &Path) -> Result<KeyRing, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("keys_file {}: {e}", path.display()))?;
        KeyRing::parse(&text).map_err(|e| format!("keys_file {}: {e}", path.display()))
    }
}

/// A value in use that a reload replaces whole (the key ring, the JWT verifier). A
/// request takes it once (`load`) and uses that snapshot throughout.
#[derive(Debug)]
pub struct Reloadable<T>(RwLock<Arc<T>>);

impl<T> Reloadable<T> {
    pub fn new(value: Arc<T>) -> Reloadable<T> {
        Reloadable(RwLock::new(value))
    }

    pub fn load(&self) -> Arc<T> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn store(&self, value: T) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(value);
    }
}

/// The key ring in use.
pub type SharedKeyRing = Reloadable<KeyRing>;

fn parse_entry(entry: &str) -> Result<Key, String> {
    let (kid, b64) = entry
        .split_once(':')
        .ok_or("expected KID:BASE64URL_32_BYTES")?;
    let raw = URL_SAFE_NO_PAD
        .decode(b64.trim().trim_end_matches('='))
        .map_err(|_| "the secret is not base64url")?;
    let secret: [u8; 32] = raw
        .as_slice()
        .try_into()
        .map_err(|_| format!("the secret is {} bytes, not 32", raw.len()))?;
    Key::new(kid.trim(), &secret).map_err(|e| e.to_string())
}

fn random_secret() -> [u8; 32] {
    let mut secret = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    secret
}

/// A new key entry `KID:BASE64URL_32_BYTES`, for `mrtr-gateway keygen`.
pub fn generate_entry(kid: &str) -> Result<String, KeyError> {
    validate_kid(kid)?;
    Ok(format!("{kid}:{}", URL_SAFE_NO_PAD.encode(random_secret())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_key_seals_and_all_are_found() {
        let a = generate_entry("a").unwrap();
        let b = generate_entry("b").unwrap();
        let ring = KeyRing::parse(&format!("{a}, {b}\n")).unwrap();
        assert_eq!(ring.current().kid(), "a");
        assert!(ring.find(b"b").is_some());
        assert!(ring.find(b"c").is_none());
        assert_eq!(ring.kids().collect::<Vec<_>>(), ["a", "b"]);
        // As a Windows editor saves it: a byte-order mark, CRLF line ends.
        let ring = KeyRing::parse(&format!("\u{feff}{a}\r\n{b}\r\n")).unwrap();
        assert_eq!(ring.kids().collect::<Vec<_>>(), ["a", "b"]);
    }

    #[test]
    fn bad_entries_name_the_entry_and_the_problem() {
        let good = generate_entry("k1").unwrap();
        let err = KeyRing::parse(&format!("{good},k2:AAAA")).unwrap_err();
        assert_eq!(
            err,
            KeyError::BadEntry {
                index: 1,
                why: "the secret is 3 bytes, not 32".into()
            }
        );
        assert!(matches!(
            KeyRing::parse("nocolon").unwrap_err(),
            KeyError::BadEntry { index: 0, .. }
        ));
        assert_eq!(KeyRing::parse(" , \n").unwrap_err(), KeyError::Empty);
        let dup = KeyRing::parse(&format!("{good},{good}")).unwrap_err();
        assert_eq!(dup, KeyError::DuplicateKid("k1".into()));
        assert!(generate_entry("bad kid").is_err());
        assert!(generate_entry("x".repeat(17).as_str()).is_err());
    }

    /// A key commented out is gone, also one after a comma on the line, and a comment may
    /// hold commas: a key meant to be retired must not stay in the ring (or seal).
    #[test]
    fn a_comment_runs_to_the_end_of_its_line() {
        let (k0, k1, k2) = ["k0", "k1", "k2"]
            .map(|k| generate_entry(k).unwrap())
            .into();
        let text =
            format!("# rotated 2026-01-05, k0 removed\n# {k0},{k1}\n{k2} # the new one, first\n");
        let ring = KeyRing::parse(&text).unwrap();
        assert_eq!(ring.kids().collect::<Vec<_>>(), ["k2"]);
    }

    #[test]
    fn debug_output_never_shows_secrets() {
        let ring = KeyRing::parse(&generate_entry("k").unwrap()).unwrap();
        let shown = format!("{ring:?}");
        assert!(shown.contains("<secret>"));
        assert!(!shown.contains("ciphers"));
    }
}
