//! Bearer tokens: one user token for the job API, one token per instance for its agent; and the
//! dashboard's sessions, which a browser opens by posting the user token once.
//!
//! Only SHA-256 hashes of tokens and session ids are kept (in memory and in the store), compared
//! in constant time; tokens are never logged.
//!
//! A session is a random id in an `HttpOnly`, `SameSite=Strict` cookie, so page scripts cannot
//! read it and other sites' pages cannot send it. Writes made with a session (cancel, submit)
//! must also carry the session's CSRF token in [`CSRF_HEADER`]: a custom header that a
//! cross-origin form cannot set, with a value only the dashboard's own page knows.

use super::error::ApiError;
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;

/// The dashboard's session cookie.
pub const SESSION_COOKIE: &str = "proteus_session";
/// The header that carries a session's CSRF token on writes.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// How long a session lasts after login.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most; the oldest goes first (logins need the token, so this only bounds a
/// forgetful user's memory use).
const MAX_SESSIONS: usize = 1024;

/// The shortest user token `proteus serve` accepts (generated ones have 51 characters).
pub const MIN_USER_TOKEN_CHARS: usize = 32;

/// Refuses a user token too short to resist guessing; the message names the flag and the
/// variable it came from.
pub fn check_user_token(token: &str) -> Result<(), String> {
    let n = token.trim().chars().count();
    if n < MIN_USER_TOKEN_CHARS {
        return Err(format!(
            "--token (PROTEUS_TOKEN) has {n} characters; it must have at least \
             {MIN_USER_TOKEN_CHARS} (e.g. `openssl rand -hex 24`), or leave it unset and \
             `proteus serve` generates one"
        ));
    }
    Ok(())
}

/// Failed dashboard logins a client may make before it has to wait.
pub const FREE_LOGIN_FAILURES: u32 = 5;
/// The first wait; each further failure doubles it, up to [`MAX_LOGIN_WAIT`].
pub const FIRST_LOGIN_WAIT: Duration = Duration::from_secs(1);
pub const MAX_LOGIN_WAIT: Duration = Duration::from_secs(15 * 60);
/// A client's failures are forgotten this long after its last one.
const FORGET_LOGIN_FAILURES: Duration = Duration::from_secs(3600);
/// Clients whose failures are remembered at most (the longest forgotten first).
const MAX_LOGIN_CLIENTS: usize = 4096;

/// Failed logins per client address, with an exponential wait after the first few: bounded
/// memory (the least recently failing client is forgotten first), time passed in.
#[derive(Debug, Default)]
pub struct LoginLimiter {
    clients: HashMap<IpAddr, Failures>,
}

#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
    until: Instant,
}

/// What is counted per client: an IPv4 address, an IPv6 /64 (one host usually holds a whole
/// /64), or one shared slot when the address is unknown.
fn login_client(peer: Option<IpAddr>) -> IpAddr {
    match peer.map(|ip| ip.to_canonical()) {
        Some(IpAddr::V6(v6)) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
        Some(v4) => v4,
        None => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

impl LoginLimiter {
    /// How long `peer` must wait before its next attempt, if it must.
    pub fn wait(&self, peer: Option<IpAddr>, now: Instant) -> Option<Duration> {
        let f = self.clients.get(&login_client(peer))?;
        (f.until > now).then(|| f.until - now)
    }

    /// Counts a failed attempt; from the [`FREE_LOGIN_FAILURES`]th on, the client waits 1 s,
    /// 2 s, 4 s, … before its next.
    pub fn failed(&mut self, peer: Option<IpAddr>, now: Instant) {
        let client = login_client(peer);
        if !self.clients.contains_key(&client) && self.clients.len() >= MAX_LOGIN_CLIENTS {
            self.clients
                .retain(|_, f| f.until > now || now.duration_since(f.last) < FORGET_LOGIN_FAILURES);
            if self.clients.len() >= MAX_LOGIN_CLIENTS
                && let Some(oldest) = self
                    .clients
                    .iter()
                    .min_by_key(|(_, f)| f.last)
                    .map(|(k, _)| *k)
            {
                self.clients.remove(&oldest);
            }
        }
        let f = self.clients.entry(client).or_insert(Failures {
            count: 0,
            last: now,
            until: now,
        });
        if now.duration_since(f.last) >= FORGET_LOGIN_FAILURES && f.until <= now {
            f.count = 0;
        }
        f.count = f.count.saturating_add(1);
        f.last = now;
        if let Some(over) = f.count.checked_sub(FREE_LOGIN_FAILURES) {
            let wait = FIRST_LOGIN_WAIT
                .checked_mul(1u32.checked_shl(over.min(31)).unwrap_or(u32::MAX))
                .unwrap_or(MAX_LOGIN_WAIT)
                .min(MAX_LOGIN_WAIT);
            f.until = now + wait;
        }
    }

    /// A successful login clears the client's failures.
    pub fn succeeded(&mut self, peer: Option<IpAddr>) {
        self.clients.remove(&login_client(peer));
    }

    pub fn clients(&self) -> usize {
        self.clients.len()
    }
}

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

/// What a request may do with the user's rights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    /// A change (submit, cancel): through a session it needs the CSRF header too.
    Write,
}

/// The user token's hash, and the dashboard sessions opened with it.
#[derive(Clone)]
pub struct UserAuth {
    hash: String,
    sessions: Arc<Mutex<HashMap<String, Session>>>,
    /// Failed dashboard logins per client.
    logins: Arc<Mutex<LoginLimiter>>,
    secure_cookies: bool,
}

#[derive(Debug, Clone)]
struct Session {
    csrf: String,
    expires: Instant,
}

/// A session just opened: the cookie to set and the CSRF token the page will send back.
#[derive(Debug, Clone)]
pub struct NewSession {
    pub id: String,
    pub csrf: String,
}

impl std::fmt::Debug for UserAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UserAuth(..)")
    }
}

impl UserAuth {
    pub fn from_token(token: &str) -> Self {
        Self::from_hash(hash_token(token))
    }
    pub fn from_hash(hash: String) -> Self {
        UserAuth {
            hash,
            sessions: Arc::default(),
            logins: Arc::default(),
            secure_cookies: false,
        }
    }
    /// Marks session cookies `Secure`: for a broker that serves HTTPS.
    pub fn with_secure_cookies(mut self, secure: bool) -> Self {
        self.secure_cookies = secure;
        self
    }
    pub fn hash(&self) -> &str {
        &self.hash
    }

    fn token_matches(&self, token: &str) -> bool {
        hashes_match(&hash_token(token), &self.hash)
    }

    /// 401 without a token or with a wrong one.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let token = bearer(headers)
            .ok_or_else(|| ApiError::unauthorized("missing `Authorization: Bearer <token>`"))?;
        if self.token_matches(token) {
            Ok(())
        } else {
            Err(ApiError::unauthorized("invalid token"))
        }
    }

    /// The user's rights from a bearer token or, without one, from a dashboard session (plus
    /// its CSRF header for a write).
    pub fn check_user(&self, headers: &HeaderMap, access: Access) -> Result<(), ApiError> {
        if bearer(headers).is_some() {
            return self.check(headers);
        }
        let Some(session) = self.session(headers) else {
            return Err(ApiError::unauthorized(
                "missing `Authorization: Bearer <token>` (or a dashboard session)",
            ));
        };
        if access == Access::Write {
            let sent = headers
                .get(CSRF_HEADER)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if !hashes_match(sent, &session.csrf) {
                return Err(ApiError::forbidden(format!(
                    "a change made with a dashboard session needs its `{CSRF_HEADER}` header"
                )));
            }
        }
        Ok(())
    }

    /// A dashboard login from `peer`: `Err(Some(wait))` while the client must wait after too
    /// many failures (the token is not even looked at), `Err(None)` for a wrong token (which
    /// counts as a failure), the new session otherwise.
    pub fn login_from(
        &self,
        peer: Option<IpAddr>,
        token: &str,
        now: Instant,
    ) -> Result<NewSession, Option<Duration>> {
        let mut logins = self.logins.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(wait) = logins.wait(peer, now) {
            return Err(Some(wait));
        }
        match self.login(token) {
            Some(session) => {
                logins.succeeded(peer);
                Ok(session)
            }
            None => {
                logins.failed(peer, now);
                Err(None)
            }
        }
    }

    /// Opens a session for whoever presents the user token; `None` for a wrong one.
    pub fn login(&self, token: &str) -> Option<NewSession> {
        if !self.token_matches(token.trim()) {
            return None;
        }
        let new = NewSession {
            id: new_token("ps_"),
            csrf: new_token("pc_"),
        };
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| k.clone())
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            hash_token(&new.id),
            Session {
                csrf: new.csrf.clone(),
                expires: now + SESSION_LIFETIME,
            },
        );
        Some(new)
    }

    /// The CSRF token of the request's live session, if it has one.
    pub fn session_csrf(&self, headers: &HeaderMap) -> Option<String> {
        self.session(headers).map(|s| s.csrf)
    }

    /// Ends the request's session, if any.
    pub fn logout(&self, headers: &HeaderMap) {
        if let Some(id) = session_cookie(headers) {
            self.sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&hash_token(id));
        }
    }

    fn session(&self, headers: &HeaderMap) -> Option<Session> {
        let id = session_cookie(headers)?;
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions
            .get(&hash_token(id))
            .filter(|s| s.expires > Instant::now())
            .cloned()
    }

    /// The `Set-Cookie` value that opens (`Some(id)`) or clears (`None`) the session cookie.
    pub fn cookie(&self, id: Option<&str>) -> String {
        let secure = if self.secure_cookies { "; Secure" } else { "" };
        match id {
            Some(id) => format!(
                "{SESSION_COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{secure}",
                SESSION_LIFETIME.as_secs()
            ),
            None => {
                format!("{SESSION_COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0{secure}")
            }
        }
    }
}

/// The session id of the request's `Cookie` header(s).
fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, value)| *name == SESSION_COOKIE && !value.is_empty())
        .map(|(_, value)| value)
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
        // Only the hash is kept, and not even that is printed.
        assert_eq!(auth.hash(), hash_token(&t));
        assert_eq!(UserAuth::from_hash(hash_token(&t)).hash(), auth.hash());
        assert_eq!(format!("{auth:?}"), "UserAuth(..)");
    }

    fn with(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(*name, value.parse().unwrap());
        }
        h
    }

    #[test]
    fn short_user_tokens_are_refused_naming_the_flag() {
        assert!(check_user_token(&new_token("pt_")).is_ok());
        assert!(check_user_token(&"x".repeat(MIN_USER_TOKEN_CHARS)).is_ok());
        let e = check_user_token(&"x".repeat(MIN_USER_TOKEN_CHARS - 1)).unwrap_err();
        assert!(
            e.contains("--token") && e.contains("PROTEUS_TOKEN") && e.contains("at least 32"),
            "{e}"
        );
        // Blanks around it do not count (the login form trims what it is given).
        assert!(check_user_token(&format!("  {}  ", "x".repeat(31))).is_err());
    }

    #[test]
    fn failed_logins_back_off_per_client_exponentially_with_bounded_memory() {
        let t0 = Instant::now();
        let secs = |s: u64| t0 + Duration::from_secs(s);
        let a: Option<IpAddr> = Some("192.0.2.1".parse().unwrap());
        let b: Option<IpAddr> = Some("192.0.2.2".parse().unwrap());
        let mut l = LoginLimiter::default();
        for _ in 0..FREE_LOGIN_FAILURES - 1 {
            l.failed(a, t0);
            assert_eq!(l.wait(a, t0), None, "the first failures are free");
        }
        l.failed(a, t0);
        assert_eq!(l.wait(a, t0), Some(Duration::from_secs(1)));
        assert_eq!(l.wait(b, t0), None, "another client is not held back");
        assert_eq!(l.wait(a, secs(1)), None, "the wait ends");
        // Each further failure doubles the wait, up to the bound.
        let mut now = secs(1);
        for expected in [2, 4, 8, 16] {
            l.failed(a, now);
            assert_eq!(l.wait(a, now), Some(Duration::from_secs(expected)));
            now += Duration::from_secs(expected);
        }
        for _ in 0..40 {
            l.failed(a, now);
            now += l.wait(a, now).unwrap();
        }
        l.failed(a, now);
        assert_eq!(l.wait(a, now), Some(MAX_LOGIN_WAIT));
        // A success clears the record; so does an hour without failures.
        l.succeeded(a);
        assert_eq!(l.wait(a, now), None);
        for _ in 0..FREE_LOGIN_FAILURES {
            l.failed(b, t0);
        }
        let later = secs(2 * 3600);
        l.failed(b, later);
        assert_eq!(l.wait(b, later), None, "old failures are forgotten");
        // IPv6 clients are counted per /64, IPv4-mapped addresses as IPv4.
        let v6 = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let mut l = LoginLimiter::default();
        for i in 0..FREE_LOGIN_FAILURES {
            l.failed(v6(&format!("2001:db8:1:2::{i}")), t0);
        }
        assert!(l.wait(v6("2001:db8:1:2:ffff::1"), t0).is_some());
        assert!(l.wait(v6("2001:db8:1:3::1"), t0).is_none());
        for _ in 0..FREE_LOGIN_FAILURES {
            l.failed(v6("::ffff:192.0.2.9"), t0);
        }
        assert!(l.wait(Some("192.0.2.9".parse().unwrap()), t0).is_some());
        // Memory is bounded: the least recently failing client goes first.
        let mut l = LoginLimiter::default();
        for i in 0..MAX_LOGIN_CLIENTS as u32 + 10 {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            for _ in 0..FREE_LOGIN_FAILURES {
                l.failed(Some(ip), t0 + Duration::from_millis(u64::from(i)));
            }
        }
        assert_eq!(l.clients(), MAX_LOGIN_CLIENTS);
        let newest = IpAddr::from(std::net::Ipv4Addr::from(
            0x0a00_0000 + MAX_LOGIN_CLIENTS as u32 + 9,
        ));
        assert!(
            l.wait(
                Some(newest),
                t0 + Duration::from_secs(1) - Duration::from_millis(1)
            )
            .is_some()
        );
    }

    #[test]
    fn logins_wait_after_failures_even_with_the_right_token() {
        let auth = UserAuth::from_token("pt_right");
        let peer = Some("198.51.100.7".parse().unwrap());
        let now = Instant::now();
        for _ in 0..FREE_LOGIN_FAILURES {
            assert_eq!(auth.login_from(peer, "pt_wrong", now).unwrap_err(), None);
        }
        assert_eq!(
            auth.login_from(peer, "pt_right", now).unwrap_err(),
            Some(FIRST_LOGIN_WAIT),
            "not even the right token is looked at while the client waits"
        );
        let later = now + FIRST_LOGIN_WAIT;
        assert!(auth.login_from(peer, "pt_right", later).is_ok());
        assert!(
            auth.login_from(peer, "pt_wrong", later)
                .unwrap_err()
                .is_none(),
            "the success cleared the failures"
        );
    }

    #[test]
    fn bearer_takes_the_scheme_in_any_case_and_nothing_else() {
        let auth = |v: &str| bearer(&with(&[("authorization", v)])).map(str::to_string);
        assert_eq!(auth("Bearer pt_a"), Some("pt_a".into()));
        assert_eq!(auth("bearer  pt_a "), Some("pt_a".into()));
        assert_eq!(auth("Basic pt_a"), None);
        assert_eq!(auth("Bearer   "), None);
        assert_eq!(auth("Bearerpt_a"), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
        assert!(hashes_match(&hash_token("a"), &hash_token("a")));
        assert!(!hashes_match(&hash_token("a"), &hash_token("b")));
    }

    #[test]
    fn sessions_are_separate_and_the_oldest_goes_past_the_limit() {
        let auth = UserAuth::from_token("pt_right");
        let cookie = |s: &NewSession| with(&[("cookie", &format!("{SESSION_COOKIE}={}", s.id))]);
        let first = auth
            .login(" pt_right ")
            .expect("the token, trimmed, opens a session");
        let second = auth.login("pt_right").unwrap();
        assert_ne!(first.id, second.id);
        assert_eq!(auth.session_csrf(&cookie(&first)), Some(first.csrf.clone()));
        assert_eq!(
            auth.session_csrf(&cookie(&second)),
            Some(second.csrf.clone())
        );
        assert_eq!(auth.session_csrf(&HeaderMap::new()), None);
        // One session's CSRF token does not open another's writes.
        let mut h = cookie(&first);
        h.insert(CSRF_HEADER, second.csrf.parse().unwrap());
        assert_eq!(auth.check_user(&h, Access::Write).unwrap_err().status, 403);
        // Logging one out leaves the other.
        auth.logout(&cookie(&first));
        assert!(auth.check_user(&cookie(&first), Access::Read).is_err());
        assert!(auth.check_user(&cookie(&second), Access::Read).is_ok());
        // An empty cookie of the same name is skipped, not taken for the session.
        let h = with(&[
            ("cookie", &format!("{SESSION_COOKIE}=")),
            ("cookie", &format!("{SESSION_COOKIE}={}", second.id)),
        ]);
        assert!(auth.check_user(&h, Access::Read).is_ok());

        let later: Vec<NewSession> = (0..MAX_SESSIONS)
            .map(|_| auth.login("pt_right").unwrap())
            .collect();
        assert_eq!(auth.sessions.lock().unwrap().len(), MAX_SESSIONS);
        assert!(
            auth.check_user(&cookie(&second), Access::Read).is_err(),
            "the oldest session made room"
        );
        for s in [&later[0], &later[MAX_SESSIONS - 1]] {
            assert!(auth.check_user(&cookie(s), Access::Read).is_ok());
        }
        let cleared = auth.cookie(None);
        assert!(
            cleared.starts_with(&format!("{SESSION_COOKIE}=;")) && cleared.contains("Max-Age=0"),
            "{cleared}"
        );
        assert!(
            auth.cookie(Some("ps_x")).contains("Max-Age=43200"),
            "a session lasts twelve hours"
        );
    }

    #[test]
    fn sessions_open_with_the_token_and_writes_need_the_csrf_header() {
        let auth = UserAuth::from_token("pt_right");
        assert!(auth.login("pt_wrong").is_none());
        let s = auth.login("pt_right").unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(auth.check_user(&h, Access::Read).unwrap_err().status, 401);
        h.insert(
            "cookie",
            format!("theme=dark; {SESSION_COOKIE}={}", s.id)
                .parse()
                .unwrap(),
        );
        assert!(auth.check_user(&h, Access::Read).is_ok());
        assert_eq!(auth.check_user(&h, Access::Write).unwrap_err().status, 403);
        h.insert(CSRF_HEADER, "pc_guess".parse().unwrap());
        assert_eq!(auth.check_user(&h, Access::Write).unwrap_err().status, 403);
        h.insert(CSRF_HEADER, s.csrf.parse().unwrap());
        assert!(auth.check_user(&h, Access::Write).is_ok());
        // A bearer header is judged on its own, never rescued by a cookie.
        h.insert("authorization", "Bearer nope".parse().unwrap());
        assert_eq!(auth.check_user(&h, Access::Read).unwrap_err().status, 401);
        h.remove("authorization");
        auth.logout(&h);
        assert_eq!(auth.check_user(&h, Access::Read).unwrap_err().status, 401);

        let cookie = auth.cookie(Some("ps_x"));
        for part in ["HttpOnly", "SameSite=Strict", "Path=/"] {
            assert!(cookie.contains(part), "{cookie}");
        }
        assert!(!cookie.contains("Secure"));
        assert!(
            auth.with_secure_cookies(true)
                .cookie(Some("ps_x"))
                .ends_with("; Secure")
        );
    }
}
