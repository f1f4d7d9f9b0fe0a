//! Bearer tokens: one user token for the job API, one token per instance for its agent.
//!
//! Only SHA-256 hashes of tokens are kept (in memory and in the store), compared in constant
//! time; tokens are never logged.

use super::error::ApiError;
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// A fresh random token with a recognisable prefix (`pt_` user, `pa_` agent).
pub fn new_token(prefix: &str) -> String {
    let bytes: [u8; 24] = rand::random();
    format!("{prefix}{}", hex::encode(bytes))
}

pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Equal hashes, compared without an early exit.
pub fn hashes_match(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// The token of an `Authorization: Bearer …` header.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty()).then(|| token.trim())
}

/// The user token's hash.
#[derive(Clone)]
pub struct UserAuth {
    hash: String,
}

impl std::fmt::Debug for UserAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UserAuth(..)")
    }
}

impl UserAuth {
    pub fn from_token(token: &str) -> Self {
        UserAuth {
            hash: hash_token(token),
        }
    }
    pub fn from_hash(hash: String) -> Self {
        UserAuth { hash }
    }
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// 401 without a token or with a wrong one.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let token = bearer(headers)
            .ok_or_else(|| ApiError::unauthorized("missing `Authorization: Bearer <token>`"))?;
        if hashes_match(&hash_token(token), &self.hash) {
            Ok(())
        } else {
            Err(ApiError::unauthorized("invalid token"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_check_by_hash() {
        let t = new_token("pt_");
        assert!(t.starts_with("pt_") && t.len() == 51);
        let auth = UserAuth::from_token(&t);
        let mut h = HeaderMap::new();
        assert_eq!(auth.check(&h).unwrap_err().status, 401);
        h.insert("authorization", format!("Bearer {t}").parse().unwrap());
        assert!(auth.check(&h).is_ok());
        h.insert("authorization", "Bearer nope".parse().unwrap());
        assert_eq!(auth.check(&h).unwrap_err().status, 401);
        assert!(!hashes_match("ab", "abc"));
    }
}
