//! Who is calling: the principal every sealed token is bound to, as a fixed-size digest.
//!
//! The source is configurable. `authorization` (the default) hashes the `Authorization`
//! header, so a token only works with the credential it was issued under. `header: NAME`
//! hashes a header set by an authenticating ingress (for example `X-Forwarded-User`).
//! `jwt` verifies the bearer token's signature against a JWKS file and binds to its
//! `iss` and `sub` claims, so a refreshed token of the same subject keeps its flows; a
//! request whose token does not verify is refused before anything is forwarded.
//! `none` binds nothing; use it only where every caller is trusted alike.

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::str::FromStr;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrincipalSource {
    #[default]
    Authorization,
    Header(String),
    Jwt(JwtConfig),
    None,
}

/// Verifying bearer JWTs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// A JSON Web Key Set (`{"keys": [...]}`), for example a mounted Secret or ConfigMap.
    pub jwks_file: PathBuf,
    /// Accepted `iss` values; empty accepts any issuer (the issuer is still bound).
    #[serde(default)]
    pub issuers: Vec<String>,
    /// Accepted `aud` values; empty skips the audience check.
    #[serde(default)]
    pub audiences: Vec<String>,
    /// Clock skew tolerated on `exp` and `nbf`.
    #[serde(default = "default_leeway")]
    pub leeway_seconds: u64,
}

fn default_leeway() -> u64 {
    30
}

impl PrincipalSource {
    /// The header whose value names the principal, if any.
    pub fn header_name(&self) -> Option<&str> {
        match self {
            PrincipalSource::Authorization | PrincipalSource::Jwt(_) => Some("authorization"),
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
                match self {
                    PrincipalSource::Authorization => feed_authorization(&mut h, v),
                    _ => h.update(v),
                }
            }
            _ => h.update(b"0"),
        }
        h.finalize().into()
    }
}

/// The authentication schemes fed to a principal's digest as registered; another one is
/// fed in lower case.
const REGISTERED_SCHEMES: [&str; 5] = ["Basic", "Bearer", "Digest", "DPoP", "Negotiate"];

/// Feeds an `Authorization` value to `h` as one spelling of it. Its scheme is
/// case-insensitive and may be followed by several spaces (RFC 9110 §11.1, §11.4), and
/// an upstream takes every spelling alike: each would otherwise be a principal of its
/// own, with shares of its own. A registered scheme is fed as registered, so `Bearer T`,
/// what clients send, digests as it always has (states bound to it stay good).
/// A value without a space names no scheme (a bare API key, whose every byte counts):
/// it is fed as it is.
fn feed_authorization(h: &mut Sha256, value: &[u8]) {
    let Some(at) = value.iter().position(|&b| b == b' ') else {
        h.update(value);
        return;
    };
    let (scheme, credentials) = (&value[..at], value[at..].trim_ascii_start());
    let registered = REGISTERED_SCHEMES
        .iter()
        .find(|r| r.as_bytes().eq_ignore_ascii_case(scheme));
    match registered {
        Some(r) => h.update(r.as_bytes()),
        None => h.update(scheme.to_ascii_lowercase()),
    }
    h.update(b" ");
    h.update(credentials);
}

/// Why a request was not authenticated; the text is safe to show the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unauthenticated(pub String);

/// Turns a request's credentials into its principal digest.
pub struct Authenticator {
    source: PrincipalSource,
    jwt: Option<JwtVerifier>,
}

impl Authenticator {
    /// Builds the authenticator; for `jwt` this reads and checks the JWKS file.
    pub fn new(source: &PrincipalSource) -> Result<Authenticator, String> {
        let jwt = match source {
            PrincipalSource::Jwt(config) => Some(JwtVerifier::load(config)?),
            _ => None,
        };
        Ok(Authenticator {
            source: source.clone(),
            jwt,
        })
    }

    /// The principal of requests without a credential, if they have one (a verified JWT
    /// is required where one is configured): shared by every such request, so no bound
    /// per principal applies to it.
    pub fn anonymous(&self) -> Option<[u8; 32]> {
        match &self.jwt {
            Some(_) => None,
            None => Some(self.source.digest(None)),
        }
    }

    /// The principal of a request whose principal header (see
    /// [`PrincipalSource::header_name`]) holds `value`.
    pub fn principal(&self, value: Option<&[u8]>) -> Result<[u8; 32], Unauthenticated> {
        match &self.jwt {
            Some(verifier) => verifier.principal(value),
            None => Ok(self.source.digest(value)),
        }
    }
}

struct JwtVerifier {
    keys: Vec<(Option<String>, DecodingKey, Validation)>,
}

#[derive(Deserialize)]
struct Claims {
    iss: Option<String>,
    sub: Option<String>,
}

impl JwtVerifier {
    /// Reads the JWKS file. A key no JWT can be verified with (one for encryption, of a
    /// curve or algorithm not supported, malformed) is skipped with a warning, as identity
    /// providers publish such keys beside their signing keys; a file without one usable
    /// key is refused.
    fn load(config: &JwtConfig) -> Result<JwtVerifier, String> {
        let path = config.jwks_file.display();
        let text = std::fs::read_to_string(&config.jwks_file)
            .map_err(|e| format!("jwks_file {path}: {e}"))?;
        let set: JwksFile = serde_json::from_str(&text)
            .map_err(|e| format!("jwks_file {path}: not a JWK set: {e}"))?;
        let mut keys = Vec::new();
        for (i, jwk) in set.keys.into_iter().enumerate() {
            match verifying_key(jwk, config) {
                Ok(key) => keys.push(key),
                Err(why) => tracing::warn!(jwks_file = %path, key = i + 1, "{why}; skipped"),
            }
        }
        if keys.is_empty() {
            return Err(format!("jwks_file {path}: holds no key that verifies JWTs"));
        }
        Ok(JwtVerifier { keys })
    }

    fn principal(&self, authorization: Option<&[u8]>) -> Result<[u8; 32], Unauthenticated> {
        let refuse = |why: &str| Unauthenticated(why.to_string());
        // The scheme is case-insensitive, and one or more spaces follow it (RFC 9110
        // §11.1, RFC 6750 §2.1).
        let token = authorization
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim_start_matches(' '))
            .ok_or_else(|| refuse("a bearer token is required"))?;
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| refuse("the bearer token is not a JWT"))?;
        let (_, key, validation) = match &header.kid {
            Some(kid) => self.keys.iter().find(|(k, ..)| k.as_deref() == Some(kid)),
            None if self.keys.len() == 1 => self.keys.first(),
            None => None,
        }
        .ok_or_else(|| refuse("the bearer token names no known key"))?;
        let data = jsonwebtoken::decode::<Claims>(token, key, validation).map_err(|e| {
            use jsonwebtoken::errors::ErrorKind as K;
            refuse(match e.kind() {
                K::ExpiredSignature => "the bearer token has expired",
                K::ImmatureSignature => "the bearer token is not valid yet",
                K::InvalidIssuer => "the bearer token's issuer is not accepted",
                K::InvalidAudience => "the bearer token's audience is not accepted",
                K::MissingRequiredClaim(claim) if claim == "aud" => {
                    "the bearer token names no audience (aud)"
                }
                K::MissingRequiredClaim(_) => "the bearer token lacks exp, iss or sub",
                _ => "the bearer token did not verify",
            })
        })?;
        match (&data.claims.iss, &data.claims.sub) {
            (Some(iss), Some(sub)) => Ok(jwt_digest(iss, sub)),
            _ => Err(refuse("the bearer token lacks exp, iss or sub")),
        }
    }
}

/// A JWKS file's keys, each read on its own: a key of a kind this build cannot read (an
/// X25519 one) is skipped, not the file refused.
#[derive(Deserialize)]
struct JwksFile {
    keys: Vec<serde_json::Value>,
}

/// A JWKS entry as a key to verify JWTs with, under the configured checks; why not.
fn verifying_key(
    jwk: serde_json::Value,
    config: &JwtConfig,
) -> Result<(Option<String>, DecodingKey, Validation), String> {
    let jwk: Jwk = serde_json::from_value(jwk).map_err(|e| format!("not a usable JWK: {e}"))?;
    if matches!(jwk.common.public_key_use, Some(ref u) if *u != PublicKeyUse::Signature) {
        return Err("not a signing key (\"use\")".into());
    }
    if let AlgorithmParameters::OctetKeyPair(okp) = &jwk.algorithm {
        // jsonwebtoken takes the first 32 bytes of `x` when it verifies, unchecked.
        let x = base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, &okp.x);
        if okp.curve != EllipticCurve::Ed25519 || x.map_or(true, |x| x.len() != 32) {
            return Err("an octet key pair that is not a 32-byte Ed25519 key".into());
        }
    }
    let key = DecodingKey::from_jwk(&jwk).map_err(|e| e.to_string())?;
    let algorithms = algorithms_for(&jwk)?;
    let mut v = Validation::new(algorithms[0]);
    v.algorithms = algorithms;
    v.leeway = config.leeway_seconds;
    // jsonwebtoken checks `nbf` only when asked to.
    v.validate_nbf = true;
    if !config.issuers.is_empty() {
        v.set_issuer(&config.issuers);
    }
    // jsonwebtoken checks `aud` only in a token that has one: where audiences are set, a
    // token for no audience in particular (another service's, from the same issuer) must
    // not pass.
    if config.audiences.is_empty() {
        v.validate_aud = false;
        v.set_required_spec_claims(&["exp", "iss", "sub"]);
    } else {
        v.set_audience(&config.audiences);
        v.set_required_spec_claims(&["exp", "iss", "sub", "aud"]);
    }
    Ok((jwk.common.key_id, key, v))
}

/// The algorithms a key may verify: the one it declares, else its type's own.
fn algorithms_for(jwk: &Jwk) -> Result<Vec<Algorithm>, String> {
    if let Some(alg) = jwk.common.key_algorithm {
        let alg = Algorithm::from_str(&alg.to_string())
            .map_err(|_| format!("algorithm {alg} is not supported"))?;
        return Ok(vec![alg]);
    }
    Ok(match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => vec![
            Algorithm::RS256,
            Algorithm::RS384,
            Algorithm::RS512,
            Algorithm::PS256,
            Algorithm::PS384,
            Algorithm::PS512,
        ],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => vec![Algorithm::ES256],
            EllipticCurve::P384 => vec![Algorithm::ES384],
            _ => return Err("only P-256 and P-384 curves are supported".into()),
        },
        AlgorithmParameters::OctetKeyPair(_) => vec![Algorithm::EdDSA],
        AlgorithmParameters::OctetKey(_) => {
            vec![Algorithm::HS256, Algorithm::HS384, Algorithm::HS512]
        }
    })
}

fn jwt_digest(iss: &str, sub: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"mrtr-gateway principal v1 jwt\0");
    for part in [iss, sub] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn jwt_authenticator(issuers: &[&str]) -> (Authenticator, tempfile_path::Path) {
        jwt_authenticator_for(issuers, &[])
    }

    fn jwt_authenticator_for(
        issuers: &[&str],
        audiences: &[&str],
    ) -> (Authenticator, tempfile_path::Path) {
        jwt_authenticator_with(vec![hs_key()], issuers, audiences)
    }

    fn b64(bytes: &[u8]) -> String {
        base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, bytes)
    }

    /// The JWK of `SECRET`, kid `hs`.
    fn hs_key() -> serde_json::Value {
        json!({"kty": "oct", "kid": "hs", "alg": "HS256", "k": b64(SECRET)})
    }

    fn jwt_authenticator_with(
        keys: Vec<serde_json::Value>,
        issuers: &[&str],
        audiences: &[&str],
    ) -> (Authenticator, tempfile_path::Path) {
        let file = tempfile_path::Path::with_contents(&json!({ "keys": keys }).to_string());
        let config = JwtConfig {
            jwks_file: file.0.clone(),
            issuers: issuers.iter().map(|s| s.to_string()).collect(),
            audiences: audiences.iter().map(|s| s.to_string()).collect(),
            leeway_seconds: 0,
        };
        let auth = Authenticator::new(&PrincipalSource::Jwt(config)).unwrap();
        (auth, file)
    }

    fn token(kid: Option<&str>, claims: serde_json::Value, secret: &[u8]) -> Vec<u8> {
        let mut header = Header::new(Algorithm::HS256);
        header.kid = kid.map(str::to_string);
        let jwt = encode(&header, &claims, &EncodingKey::from_secret(secret)).unwrap();
        format!("Bearer {jwt}").into_bytes()
    }

    /// A file under the target directory, removed when dropped.
    mod tempfile_path {
        pub struct Path(pub std::path::PathBuf);
        impl Path {
            pub fn with_contents(text: &str) -> Path {
                let dir = std::env::temp_dir();
                let name = format!(
                    "mrtr-jwks-{}-{}.json",
                    std::process::id(),
                    rand::random::<u64>()
                );
                let path = dir.join(name);
                std::fs::write(&path, text).unwrap();
                Path(path)
            }
        }
        impl Drop for Path {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    #[test]
    fn a_jwt_principal_is_its_issuer_and_subject() {
        let (auth, _file) = jwt_authenticator(&["https://idp"]);
        let exp = crate::mrtr::state::now_secs() + 600;
        let alice = json!({"iss": "https://idp", "sub": "alice", "exp": exp});
        let first = auth.principal(Some(&token(Some("hs"), alice.clone(), SECRET)));
        let refreshed = json!({"iss": "https://idp", "sub": "alice", "exp": exp + 60, "jti": "2"});
        let second = auth.principal(Some(&token(Some("hs"), refreshed, SECRET)));
        assert_eq!(first, second, "a refreshed token keeps the principal");
        let bob = json!({"iss": "https://idp", "sub": "bob", "exp": exp});
        assert_ne!(first, auth.principal(Some(&token(Some("hs"), bob, SECRET))));
        // One key and no kid: that key.
        assert_eq!(
            first,
            auth.principal(Some(&token(None, alice.clone(), SECRET)))
        );
        // The scheme in any case, and more than one space after it.
        let bearer = token(Some("hs"), alice, SECRET);
        let jwt = std::str::from_utf8(&bearer["Bearer ".len()..]).unwrap();
        for written in [format!("BEARER {jwt}"), format!("bEaReR   {jwt}")] {
            assert_eq!(first, auth.principal(Some(written.as_bytes())), "{written}");
        }
    }

    #[test]
    fn a_jwt_that_does_not_verify_is_refused_with_a_reason() {
        let (auth, _file) = jwt_authenticator(&["https://idp"]);
        let now = crate::mrtr::state::now_secs();
        let ok = json!({"iss": "https://idp", "sub": "alice", "exp": now + 600});
        let cases: Vec<(Option<Vec<u8>>, &str)> = vec![
            (None, "a bearer token is required"),
            (
                Some(b"Basic YWxpY2U6cHc=".to_vec()),
                "a bearer token is required",
            ),
            (
                Some(b"Bearer not.a.jwt".to_vec()),
                "the bearer token is not a JWT",
            ),
            (
                Some(token(Some("other"), ok.clone(), SECRET)),
                "the bearer token names no known key",
            ),
            (
                Some(token(
                    Some("hs"),
                    ok.clone(),
                    b"another secret of 32 bytes......",
                )),
                "the bearer token did not verify",
            ),
            (
                Some(token(
                    Some("hs"),
                    json!({"iss": "https://idp", "sub": "a", "exp": now - 10}),
                    SECRET,
                )),
                "the bearer token has expired",
            ),
            (
                Some(token(
                    Some("hs"),
                    json!({"iss": "https://idp", "sub": "a", "exp": now + 7200, "nbf": now + 3600}),
                    SECRET,
                )),
                "the bearer token is not valid yet",
            ),
            (
                Some(token(
                    Some("hs"),
                    json!({"iss": "https://evil", "sub": "a", "exp": now + 600}),
                    SECRET,
                )),
                "the bearer token's issuer is not accepted",
            ),
            (
                Some(token(
                    Some("hs"),
                    json!({"iss": "https://idp", "exp": now + 600}),
                    SECRET,
                )),
                "the bearer token lacks exp, iss or sub",
            ),
        ];
        for (value, why) in cases {
            assert_eq!(
                auth.principal(value.as_deref()),
                Err(Unauthenticated(why.to_string())),
                "{why}"
            );
        }
        assert!(auth.principal(Some(&token(Some("hs"), ok, SECRET))).is_ok());
    }

    /// With audiences set, a token must name one of them: one naming none (another
    /// service's, from the same issuer and key) is refused like one naming another.
    #[test]
    fn a_jwt_without_an_audience_is_refused_where_audiences_are_set() {
        let (auth, _file) = jwt_authenticator_for(&["https://idp"], &["mrtr-gateway"]);
        let exp = crate::mrtr::state::now_secs() + 600;
        let claims = |aud: Option<&str>| {
            let mut claims = json!({"iss": "https://idp", "sub": "alice", "exp": exp});
            if let Some(aud) = aud {
                claims["aud"] = json!(aud);
            }
            token(Some("hs"), claims, SECRET)
        };
        let refused = |why: &str| Err(Unauthenticated(why.to_string()));
        let none = auth.principal(Some(&claims(None)));
        assert_eq!(none, refused("the bearer token names no audience (aud)"));
        let other = auth.principal(Some(&claims(Some("other-api"))));
        assert_eq!(
            other,
            refused("the bearer token's audience is not accepted")
        );
        assert!(auth.principal(Some(&claims(Some("mrtr-gateway")))).is_ok());
        // Without audiences set, none is needed.
        let (open, _file) = jwt_authenticator(&["https://idp"]);
        assert!(open.principal(Some(&claims(None))).is_ok());
    }

    #[test]
    fn a_bad_jwks_file_is_a_startup_error() {
        let file = tempfile_path::Path::with_contents("{\"keys\": []}");
        let config = JwtConfig {
            jwks_file: file.0.clone(),
            issuers: vec![],
            audiences: vec![],
            leeway_seconds: 30,
        };
        let err = Authenticator::new(&PrincipalSource::Jwt(config.clone()))
            .err()
            .unwrap();
        assert!(err.contains("holds no key that verifies JWTs"), "{err}");
        let missing = JwtConfig {
            jwks_file: "/nonexistent/jwks.json".into(),
            ..config
        };
        assert!(Authenticator::new(&PrincipalSource::Jwt(missing)).is_err());
    }

    /// Keys published beside the signing keys (for encryption, of a curve this build
    /// cannot read, malformed) are skipped, not the file refused; a token naming one is
    /// refused as naming no known key, never verified with it (a short Ed25519 key would
    /// panic the request).
    #[test]
    fn keys_no_jwt_can_be_verified_with_are_skipped() {
        let keys = vec![
            json!({"kty": "RSA", "kid": "enc", "use": "enc", "alg": "RSA-OAEP",
                "n": b64(&[0xc5; 256]), "e": "AQAB"}),
            json!({"kty": "OKP", "kid": "x", "crv": "X25519", "x": b64(&[9; 32])}),
            json!({"kty": "OKP", "kid": "short", "crv": "Ed25519", "x": b64(&[1; 8])}),
            json!({"kty": "EC", "kid": "p521", "crv": "P-521", "x": b64(&[1; 66]), "y": b64(&[2; 66])}),
            hs_key(),
        ];
        let (auth, _file) = jwt_authenticator_with(keys, &["https://idp"], &[]);
        let exp = crate::mrtr::state::now_secs() + 600;
        let alice = json!({"iss": "https://idp", "sub": "alice", "exp": exp});
        assert!(auth
            .principal(Some(&token(Some("hs"), alice.clone(), SECRET)))
            .is_ok());
        let header = b64(br#"{"alg":"EdDSA","kid":"short"}"#);
        let forged = format!(
            "Bearer {header}.{}.{}",
            b64(alice.to_string().as_bytes()),
            b64(&[0; 64])
        );
        let refused = auth.principal(Some(forged.as_bytes())).unwrap_err();
        assert_eq!(refused.0, "the bearer token names no known key");
    }

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

    /// One credential is one principal however its scheme is spelt (one user cannot take
    /// a share per spelling); the credential itself is compared exactly. `Bearer T`
    /// digests as the raw value did, so states bound to it stay good across an upgrade.
    #[test]
    fn an_authorization_scheme_spelt_otherwise_is_the_same_principal() {
        let s = PrincipalSource::Authorization;
        let bearer = s.digest(Some(b"Bearer T0k"));
        for spelling in [
            &b"bearer T0k"[..],
            b"BEARER T0k",
            b"bEaReR   T0k",
            b"Bearer \tT0k",
        ] {
            assert_eq!(s.digest(Some(spelling)), bearer, "{spelling:?}");
        }
        assert_ne!(s.digest(Some(b"Bearer t0k")), bearer, "the token is exact");
        assert_ne!(s.digest(Some(b"Basic T0k")), bearer);
        assert_eq!(s.digest(Some(b"dpop x")), s.digest(Some(b"DPoP x")));
        assert_eq!(s.digest(Some(b"Token x")), s.digest(Some(b"token  x")));
        let mut raw = Sha256::new();
        raw.update(b"mrtr-gateway principal v1\0");
        raw.update(b"1");
        raw.update(b"Bearer T0k");
        assert_eq!(bearer, <[u8; 32]>::from(raw.finalize()), "as before");
        let header = PrincipalSource::Header("x-api-key".into());
        assert_ne!(header.digest(Some(b"K")), header.digest(Some(b"k")));
    }

    /// An `Authorization` value without a space names no scheme (a bare API key): every
    /// byte of it counts, and it digests as the raw value always did.
    #[test]
    fn a_bare_authorization_value_is_compared_exactly() {
        let s = PrincipalSource::Authorization;
        assert_ne!(s.digest(Some(b"sk-AbC123")), s.digest(Some(b"sk-abc123")));
        assert_ne!(s.digest(Some(b"Bearer\tT")), s.digest(Some(b"bearer\tT")));
        let mut raw = Sha256::new();
        raw.update(b"mrtr-gateway principal v1\0");
        raw.update(b"1");
        raw.update(b"sk-AbC123");
        let raw = <[u8; 32]>::from(raw.finalize());
        assert_eq!(s.digest(Some(b"sk-AbC123")), raw, "as before");
    }
}
