//! CSRF protection for the console's forms (the synchronizer-token pattern, stateless):
//! each browser gets a random id in a `SameSite=Strict`, `HttpOnly` cookie, and every form
//! carries `HMAC-SHA256(process key, id)`. A POST is accepted only when its form token is
//! the MAC of its cookie, so another site can neither read nor forge it.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::net::node_auth::fill_random;

/// The cookie holding the browser id.
pub const COOKIE: &str = "tidelog_console";
/// The form field holding the token.
pub const FIELD: &str = "csrf";

/// The process's token key (new at every start: tokens die with the process).
#[derive(Clone)]
pub struct CsrfKey([u8; 32]);

impl std::fmt::Debug for CsrfKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CsrfKey(..)")
    }
}

impl CsrfKey {
    /// A random key.
    pub fn random() -> Self {
        let mut key = [0u8; 32];
        fill_random(&mut key);
        Self(key)
    }

    /// The token for a browser id.
    pub fn token(&self, browser_id: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any size");
        mac.update(browser_id.as_bytes());
        hex(&mac.finalize().into_bytes())
    }

    /// Whether `token` is the token of `browser_id` (compared in constant time).
    pub fn verify(&self, browser_id: &str, token: &str) -> bool {
        if !valid_browser_id(browser_id) {
            return false;
        }
        let expected = self.token(browser_id);
        expected.len() == token.len()
            && expected
                .bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// A new random browser id (64 hex digits).
pub fn new_browser_id() -> String {
    let mut id = [0u8; 32];
    fill_random(&mut id);
    hex(&id)
}

/// Whether `id` looks like one [`new_browser_id`] made (anything else is ignored).
pub fn valid_browser_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The browser id in a `Cookie` header value, if it holds a valid one.
pub fn browser_id_from_cookies(header: &str) -> Option<&str> {
    header
        .split(';')
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim())
        .filter(|v| valid_browser_id(v))
}

/// The `Set-Cookie` value giving a browser its id.
pub fn set_cookie(browser_id: &str) -> String {
    format!("{COOKIE}={browser_id}; Path=/; HttpOnly; SameSite=Strict")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_token_verifies_only_for_its_browser_and_key() {
        let key = CsrfKey::random();
        let id = new_browser_id();
        let token = key.token(&id);
        assert!(key.verify(&id, &token));
        assert!(!key.verify(&new_browser_id(), &token));
        assert!(!CsrfKey::random().verify(&id, &token));
        assert!(!key.verify(&id, ""));
        assert!(!key.verify(&id, &token[..63]));
        assert!(!key.verify("not-an-id", &key.token("not-an-id")));
    }

    #[test]
    fn the_cookie_is_found_among_others_and_junk_is_ignored() {
        let id = new_browser_id();
        let header = format!("a=b; {COOKIE}={id}; c=d");
        assert_eq!(browser_id_from_cookies(&header), Some(id.as_str()));
        assert_eq!(browser_id_from_cookies(&format!("{COOKIE}=<script>")), None);
        assert_eq!(browser_id_from_cookies("garbage;;=;"), None);
        assert!(set_cookie(&id).contains("SameSite=Strict"));
    }

    proptest! {
        #[test]
        fn no_forged_token_verifies(id in "[0-9a-f]{64}", forged in "[0-9a-f]{0,80}") {
            let key = CsrfKey::random();
            prop_assume!(forged != key.token(&id));
            prop_assert!(!key.verify(&id, &forged));
        }
    }
}
