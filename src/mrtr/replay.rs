//! The replay guard: each `requestState` is accepted once per replica, so a replayed
//! retry never makes the gateway post a second answer to an upstream request.
//!
//! A state is known by a digest of its text. One sealing has exactly one text: the nonce
//! is random, and base64url decoding is canonical (non-zero trailing bits are refused), so
//! a replay cannot dodge the guard by re-encoding. Entries live until the state's own
//! expiry, after which the state is refused anyway. The table is bounded, and so is each
//! principal's share of it; when either is full of live entries, new retries are refused
//! as overload rather than let through unguarded.
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
    /// The claiming principal's share of the table is full of its live entries.
    PrincipalFull,
    /// The state expired before it was claimed (a claim that waited, as on an owner that
    /// did not answer): its entry would not outlive the claim, so none is made.
    Expired,
}

/// A used state: until when it is remembered, and whose share it counts against.
#[derive(Clone, Copy)]
struct Used {
    until: u64,
    share: Option<u64>,
}

/// Used states and their expiries (seconds since the Unix epoch).
pub struct UsedStates {
    used: HashMap<StateDigest, Used>,
    capacity: usize,
    /// Most live entries one principal's retries take (anonymous ones count only against
    /// `capacity`), so that one caller cannot fill the table for every other.
    per_principal: usize,
    /// Live entries of each principal's share, by the first 8 bytes of its digest.
    shares: HashMap<u64, usize>,
    /// No entry expires before this: a full table is swept only once something may have
    /// expired, not on every claim (a sweep walks the whole table under its lock).
    earliest: u64,
    /// Sweeps of the full table so far.
    sweeps: u64,
}

impl UsedStates {
    pub fn new(capacity: usize, per_principal: usize) -> UsedStates {
        UsedStates {
            used: HashMap::new(),
            capacity,
            per_principal,
            shares: HashMap::new(),
            earliest: u64::MAX,
            sweeps: 0,
        }
    }

    /// Records a state as used unless it already was; `principal` (`None`: anonymous)
    /// is the caller's, whose share it counts against.
    pub fn claim(
        &mut self,
        state: StateDigest,
        expires_at: u64,
        principal: Option<&[u8; 32]>,
        now: u64,
    ) -> Claim {
        if now >= expires_at {
            return Claim::Expired;
        }
        if self.used.get(&state).is_some_and(|used| used.until > now) {
            return Claim::Replayed;
        }
        let share = principal.map(|p| u64::from_le_bytes(p[..8].try_into().unwrap_or_default()));
        if let Some(refused) = self.no_room(share) {
            if now < self.earliest {
                return refused;
            }
            self.sweep(now);
            if let Some(refused) = self.no_room(share) {
                return refused;
            }
        }
        let used = Used {
            until: expires_at,
            share,
        };
        if let Some(expired) = self.used.insert(state, used) {
            self.unshare(expired.share);
        }
        if let Some(share) = share {
            *self.shares.entry(share).or_default() += 1;
        }
        self.earliest = self.earliest.min(expires_at);
        Claim::Fresh
    }

    /// Why a new entry of `share` does not fit now, if it does not.
    fn no_room(&self, share: Option<u64>) -> Option<Claim> {
        let taken = |share| self.shares.get(&share).copied().unwrap_or_default();
        if self.used.len() >= self.capacity {
            Some(Claim::Full)
        } else if share.is_some_and(|share| taken(share) >= self.per_principal) {
            Some(Claim::PrincipalFull)
        } else {
            None
        }
    }

    fn unshare(&mut self, share: Option<u64>) {
        let Some(share) = share else {
            return;
        };
        if let Some(taken) = self.shares.get_mut(&share) {
            *taken -= 1;
            if *taken == 0 {
                self.shares.remove(&share);
            }
        }
    }

    /// Drops the entries expired at `now`, and notes when the next one expires.
    fn sweep(&mut self, now: u64) {
        let mut earliest = u64::MAX;
        let mut expired = Vec::new();
        self.used.retain(|_, used| {
            let live = used.until > now;
            if live {
                earliest = earliest.min(used.until);
            } else {
                expired.push(used.share);
            }
            live
        });
        for share in expired {
            self.unshare(share);
        }
        self.earliest = earliest;
        self.sweeps += 1;
    }

    /// Forgets a claim whose answers provably never reached the upstream, so the client
    /// may retry with the same state.
    pub fn release(&mut self, state: &StateDigest) {
        if let Some(used) = self.used.remove(state) {
            self.unshare(used.share);
        }
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
        let mut used = UsedStates::new(10, 10);
        let s = digest("state-a");
        assert_eq!(used.claim(s, 100, None, 50), Claim::Fresh);
        assert_eq!(used.claim(s, 100, None, 60), Claim::Replayed);
        assert_eq!(used.claim(digest("state-b"), 100, None, 60), Claim::Fresh);
        // Past its expiry the state itself is refused; the entry may be reused.
        assert_eq!(used.claim(s, 200, None, 100), Claim::Fresh);
        // A claim made once the state expired (it waited) is refused, not remembered.
        let late = digest("state-c");
        assert_eq!(used.claim(late, 100, None, 100), Claim::Expired);
        assert_eq!(used.claim(late, 100, None, 101), Claim::Expired);
    }

    #[test]
    fn a_released_claim_may_be_made_again() {
        let mut used = UsedStates::new(10, 10);
        let s = digest("state");
        assert_eq!(used.claim(s, 100, None, 0), Claim::Fresh);
        used.release(&s);
        assert_eq!(used.claim(s, 100, None, 0), Claim::Fresh);
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
        let mut used = UsedStates::new(2, 2);
        assert_eq!(used.claim(digest("a"), 10, None, 0), Claim::Fresh);
        assert_eq!(used.claim(digest("b"), 100, None, 0), Claim::Fresh);
        assert_eq!(used.claim(digest("c"), 100, None, 5), Claim::Full);
        assert_eq!(used.sweeps, 0, "nothing could have expired yet");
        for n in 0..100 {
            assert_eq!(
                used.claim(digest(&format!("d{n}")), 100, None, 9),
                Claim::Full
            );
        }
        assert_eq!(used.sweeps, 0, "a full table is not walked on every claim");
        assert_eq!(
            used.claim(digest("c"), 100, None, 20),
            Claim::Fresh,
            "a expired"
        );
        assert_eq!(used.sweeps, 1);
        assert_eq!(used.len(), 2);
        assert_eq!(used.claim(digest("b"), 100, None, 20), Claim::Replayed);
    }

    /// One principal's retries take at most its share of the table; another principal's,
    /// and anonymous ones, still fit; its expired and released entries give room back.
    #[test]
    fn one_principal_takes_at_most_its_share() {
        let (alice, bob) = ([1; 32], [2; 32]);
        let mut used = UsedStates::new(5, 2);
        assert_eq!(used.claim(digest("a1"), 10, Some(&alice), 0), Claim::Fresh);
        assert_eq!(used.claim(digest("a2"), 100, Some(&alice), 0), Claim::Fresh);
        let a3 = digest("a3");
        assert_eq!(used.claim(a3, 100, Some(&alice), 0), Claim::PrincipalFull);
        assert_eq!(used.claim(digest("b1"), 100, Some(&bob), 0), Claim::Fresh);
        assert_eq!(used.claim(digest("n1"), 100, None, 0), Claim::Fresh);
        assert_eq!(used.claim(digest("n2"), 100, None, 0), Claim::Fresh);
        assert_eq!(
            used.claim(a3, 100, Some(&alice), 0),
            Claim::Full,
            "the whole table"
        );
        used.release(&digest("n2"));
        assert_eq!(used.claim(a3, 100, Some(&alice), 5), Claim::PrincipalFull);
        assert_eq!(
            used.claim(a3, 100, Some(&alice), 10),
            Claim::Fresh,
            "a1 expired"
        );
        used.release(&digest("a2"));
        assert_eq!(
            used.claim(digest("a4"), 100, Some(&alice), 10),
            Claim::Fresh
        );
        assert_eq!(
            used.claim(digest("a5"), 100, Some(&alice), 10),
            Claim::PrincipalFull
        );
        assert_eq!(used.shares.get(&u64::from_le_bytes([1; 8])), Some(&2));
    }
}
