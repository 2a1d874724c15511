//! The replay guard: each `requestState` is accepted once per replica, so a replayed
//! retry never makes the gateway post a second answer to an upstream request.
//!
//! A state is known by a digest of its text. One sealing has exactly one text: the nonce
//! is random, and base64url decoding is canonical (non-zero trailing bits are refused), so
//! a replay cannot dodge the guard by re-encoding. Entries live until the state's own
//! expiry, after which the state is refused anyway. The table is bounded; when it is full
//! of live entries, new retries are refused as overload rather than let through
//! unguarded.
//!
//! What it does not cover: a replay that reaches another replica. Replicas share no
//! store, so there the answers are posted a second time, for the same upstream request
//! id; the legacy SDKs drop a response whose request id has already been answered. The
//! README's security section states this boundary.

use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// A state's identity in the table.
pub type StateDigest = [u8; 16];

pub fn digest(state_text: &str) -> StateDigest {
    let full = Sha256::digest(state_text.as_bytes());
    let mut d = [0u8; 16];
    d.copy_from_slice(&full[..16]);
    d
}

/// What claiming a state found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// First use on this replica: go ahead.
    Fresh,
    /// Already used on this replica.
    Replayed,
    /// The table is full of live entries.
    Full,
}

/// Used states and their expiries (seconds since the Unix epoch).
pub struct UsedStates {
    used: HashMap<StateDigest, u64>,
    capacity: usize,
    /// No entry expires before this: a full table is swept only once something may have
    /// expired, not on every claim (a sweep walks the whole table under its lock).
    earliest: u64,
    /// Sweeps of the full table so far.
    sweeps: u64,
}

impl UsedStates {
    pub fn new(capacity: usize) -> UsedStates {
        UsedStates {
            used: HashMap::new(),
            capacity,
            earliest: u64::MAX,
            sweeps: 0,
        }
    }

    /// Records a state as used unless it already was.
    pub fn claim(&mut self, state: StateDigest, expires_at: u64, now: u64) -> Claim {
        if let Some(&until) = self.used.get(&state) {
            if until > now {
                return Claim::Replayed;
            }
        }
        if self.used.len() >= self.capacity {
            if now >= self.earliest {
                self.sweep(now);
            }
            if self.used.len() >= self.capacity {
                return Claim::Full;
            }
        }
        self.used.insert(state, expires_at);
        self.earliest = self.earliest.min(expires_at);
        Claim::Fresh
    }

    /// Drops the entries expired at `now`, and notes when the next one expires.
    fn sweep(&mut self, now: u64) {
        let mut earliest = u64::MAX;
        self.used.retain(|_, until| {
            let live = *until > now;
            if live {
                earliest = earliest.min(*until);
            }
            live
        });
        self.earliest = earliest;
        self.sweeps += 1;
    }

    /// Forgets a claim whose answers provably never reached the upstream, so the client
    /// may retry with the same state.
    pub fn release(&mut self, state: &StateDigest) {
        self.used.remove(state);
    }

    pub fn len(&self) -> usize {
        self.used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_is_accepted_once_until_it_expires() {
        let mut used = UsedStates::new(10);
        let s = digest("state-a");
        assert_eq!(used.claim(s, 100, 50), Claim::Fresh);
        assert_eq!(used.claim(s, 100, 60), Claim::Replayed);
        assert_eq!(used.claim(digest("state-b"), 100, 60), Claim::Fresh);
        // Past its expiry the state itself is refused; the entry may be reused.
        assert_eq!(used.claim(s, 200, 100), Claim::Fresh);
    }

    #[test]
    fn a_released_claim_may_be_made_again() {
        let mut used = UsedStates::new(10);
        let s = digest("state");
        assert_eq!(used.claim(s, 100, 0), Claim::Fresh);
        used.release(&s);
        assert_eq!(used.claim(s, 100, 0), Claim::Fresh);
    }

    #[test]
    fn a_state_has_one_text() {
        use crate::keys::KeyRing;
        use crate::keys::Purpose;
        let ring = KeyRing::parse("k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8").unwrap();
        let text = crate::seal::seal(&ring, Purpose::RequestState, b"", b"payload!");
        // Re-encode the same bytes with the unused low bits of the last character set.
        let alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let last = text.chars().last().unwrap();
        let index = alphabet.find(last).unwrap();
        let spare_bits = match text.len() % 4 {
            2 => 4,
            3 => 2,
            _ => 0,
        };
        for low in 1..(1usize << spare_bits) {
            let mut other = text[..text.len() - 1].to_string();
            other.push(alphabet.as_bytes()[index | low] as char);
            assert_ne!(other, text);
            let opened = crate::seal::open(&ring, Purpose::RequestState, b"", &other, 4096);
            assert!(opened.is_err(), "a second text opened: {other}");
        }
    }

    #[test]
    fn a_full_table_sheds_expired_entries_then_refuses() {
        let mut used = UsedStates::new(2);
        assert_eq!(used.claim(digest("a"), 10, 0), Claim::Fresh);
        assert_eq!(used.claim(digest("b"), 100, 0), Claim::Fresh);
        assert_eq!(used.claim(digest("c"), 100, 5), Claim::Full);
        assert_eq!(used.sweeps, 0, "nothing could have expired yet");
        for n in 0..100 {
            assert_eq!(used.claim(digest(&format!("d{n}")), 100, 9), Claim::Full);
        }
        assert_eq!(used.sweeps, 0, "a full table is not walked on every claim");
        assert_eq!(used.claim(digest("c"), 100, 20), Claim::Fresh, "a expired");
        assert_eq!(used.sweeps, 1);
        assert_eq!(used.len(), 2);
        assert_eq!(used.claim(digest("b"), 100, 20), Claim::Replayed);
    }
}
