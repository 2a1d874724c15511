//! Who is calling: the principal every sealed token is bound to, as a fixed-size digest.
//!
//! The source is configurable. `authorization` (the default) hashes the `Authorization`
//! header, so a token only works with the credential it was issued under. `header: NAME`
//! hashes a header set by an authenticating ingress (for example `X-Forwarded-User`).
//! `none` binds nothing; use it only where every caller is trusted alike.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrincipalSource {
    #[default]
    Authorization,
    Header(String),
    None,
}

impl PrincipalSource {
    /// The header whose value names the principal, if any.
    pub fn header_name(&self) -> Option<&str> {
        match self {
            PrincipalSource::Authorization => Some("authorization"),
            PrincipalSource::Header(name) => Some(name),
            PrincipalSource::None => None,
        }
    }

    /// The binding digest for a request whose principal header holds `value`.
    /// An absent header is the anonymous principal, distinct from every present value.
    pub fn digest(&self, value: Option<&[u8]>) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"mrtr-gateway principal v1\0");
        match (self.header_name(), value) {
            (Some(_), Some(v)) => {
                h.update(b"1");
                h.update(v);
            }
            _ => h.update(b"0"),
        }
        h.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_credentials_give_distinct_digests() {
        let s = PrincipalSource::Authorization;
        let a = s.digest(Some(b"Bearer a"));
        assert_eq!(a, s.digest(Some(b"Bearer a")));
        assert_ne!(a, s.digest(Some(b"Bearer b")));
        assert_ne!(s.digest(None), s.digest(Some(b"")));
        assert_eq!(
            PrincipalSource::None.digest(Some(b"x")),
            PrincipalSource::None.digest(None)
        );
    }
}
