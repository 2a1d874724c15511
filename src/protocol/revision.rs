//! The legacy protocol revision an upstream session negotiated, which every later request
//! of the session names in `MCP-Protocol-Version`. Servers refuse a revision they do not
//! support with 400 (SDK releases before 2025-11-25 support only the revisions up to
//! their own), so a session resumed on another round or replica must name the one its
//! `initialize` settled on: it travels with the session, in a `requestState`, a
//! data-layer cookie, the reaper's and the held flows' tables.
//!
//! A revision is named by a date, `YYYY-MM-DD`, kept as the number `YYYYMMDD`: four bytes
//! in a sealed state, and no upstream text is ever carried.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A legacy protocol revision, as the date that names it (`2025-06-18` is `20250618`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Revision(u32);

impl Revision {
    /// The revision the gateway asks for in `initialize`, and assumes of a session that
    /// did not say (states sealed by releases that did not record it).
    pub const REQUESTED: Revision = Revision(20251125);

    /// A revision as `initialize` names it; `None` for anything that is not a date.
    pub fn parse(text: &str) -> Option<Revision> {
        let bytes = text.as_bytes();
        let [y0, y1, y2, y3, b'-', m0, m1, b'-', d0, d1] = *bytes else {
            return None;
        };
        let digits = [y0, y1, y2, y3, m0, m1, d0, d1];
        if !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let number = digits
            .iter()
            .fold(0u32, |n, &d| n * 10 + u32::from(d - b'0'));
        Some(Revision(number))
    }

    /// The `MCP-Protocol-Version` header value naming it.
    pub fn header_value(self) -> http::HeaderValue {
        match self.date() {
            Some(date) => http::HeaderValue::from_bytes(&date),
            None => http::HeaderValue::from_str(&self.to_string()),
        }
        .expect("digits and dashes")
    }

    /// Its date, `YYYY-MM-DD`, spelled without the formatter's padding: every request of
    /// an upstream session names it. `None` past year 9999, where no parsed revision is.
    fn date(self) -> Option<[u8; 10]> {
        let n = self.0;
        if n > 99_999_999 {
            return None;
        }
        let digit = |place: u32| b'0' + (n / place % 10) as u8;
        Some([
            digit(10_000_000),
            digit(1_000_000),
            digit(100_000),
            digit(10_000),
            b'-',
            digit(1_000),
            digit(100),
            b'-',
            digit(10),
            digit(1),
        ])
    }
}

/// What a session that did not say negotiated: the revision the gateway asks for.
impl Default for Revision {
    fn default() -> Revision {
        Revision::REQUESTED
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(date) = self.date() {
            return f.write_str(std::str::from_utf8(&date).expect("digits and dashes"));
        }
        let n = self.0;
        write!(f, "{:04}-{:02}-{:02}", n / 10_000, n / 100 % 100, n % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revision_reads_and_prints_as_its_date() {
        for text in [
            "2024-11-05",
            "2025-03-26",
            "2025-06-18",
            "2025-11-25",
            "0000-00-00",
            "0001-02-03",
            "9999-99-99",
        ] {
            let revision = Revision::parse(text).expect(text);
            assert_eq!(revision.to_string(), text);
            assert_eq!(revision.header_value(), text);
        }
        assert_eq!(Revision::REQUESTED.to_string(), "2025-11-25");
    }

    /// No text `parse` reads makes one, but a number past eight digits still prints whole.
    #[test]
    fn a_revision_past_year_9999_prints_every_digit() {
        let revision = Revision(4_000_000_001);
        assert_eq!(revision.to_string(), "400000-00-01");
        assert_eq!(revision.header_value(), "400000-00-01");
    }

    #[test]
    fn anything_but_a_date_is_not_a_revision() {
        for text in [
            "",
            "2025-6-18",
            "2025-06-18 ",
            "2025/06/18",
            "20250618",
            "latest",
            "२०२५-०६-१८",
            "2025-06-1\n",
        ] {
            assert_eq!(Revision::parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn a_revision_seals_in_a_few_bytes() {
        let bytes = postcard::to_allocvec(&Revision::REQUESTED).unwrap();
        assert_eq!(bytes.len(), 4);
        assert_eq!(
            postcard::from_bytes::<Revision>(&bytes).unwrap(),
            Revision::REQUESTED
        );
    }
}
