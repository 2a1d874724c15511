//! Server-Sent Events: an incremental parser that takes chunks as they arrive (split
//! anywhere, lines ending in LF, CRLF or CR) and yields whole events, and an encoder.
//!
//! Unlike a browser, the parser yields every event that set any field, including an
//! empty `data` (an MCP priming event is `id` plus empty `data`), because the gateway
//! must track the last event id a stream delivered. Events are bounded in size.

use std::fmt;

/// One event. `data` lines are joined with `\n` as the SSE standard says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Event {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
    pub retry: Option<u64>,
}

impl Event {
    /// Whether it is a `message` event (no `event:` field, or an empty one, names that
    /// type), the only type MCP sends JSON-RPC messages in.
    pub fn is_message(&self) -> bool {
        self.event
            .as_deref()
            .is_none_or(|kind| kind.is_empty() || kind == "message")
    }

    pub fn message(id: Option<String>, data: String) -> Event {
        Event {
            id,
            event: Some("message".into()),
            data,
            retry: None,
        }
    }

    /// Wire form, ending in the blank line that dispatches it.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(self.data.len() + 64);
        if let Some(id) = &self.id {
            push_field(&mut out, "id", id);
        }
        if let Some(event) = &self.event {
            push_field(&mut out, "event", event);
        }
        if let Some(retry) = self.retry {
            push_field(&mut out, "retry", &retry.to_string());
        }
        for line in self.data.split('\n') {
            push_field(&mut out, "data", line);
        }
        out.push('\n');
        out
    }
}

fn push_field(out: &mut String, name: &str, value: &str) {
    out.push_str(name);
    out.push_str(": ");
    out.push_str(value);
    out.push('\n');
}

/// The stream broke the size bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooLarge {
    pub limit: usize,
}

impl fmt::Display for TooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an SSE event exceeds {} bytes", self.limit)
    }
}

impl std::error::Error for TooLarge {}

/// The most room the line buffer keeps between lines.
const LINE_ROOM_KEPT: usize = 16 << 10;

/// UTF-8's byte order mark, which a stream may begin with (and a reader ignores).
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Incremental SSE parser.
#[derive(Debug)]
pub struct Parser {
    line: Vec<u8>,
    after_cr: bool,
    /// No line has ended yet: the first may begin with a byte order mark, which is not
    /// part of it.
    first_line: bool,
    current: Event,
    fields: usize,
    data_lines: usize,
    event_bytes: usize,
    max_event_bytes: usize,
}

impl Parser {
    pub fn new(max_event_bytes: usize) -> Parser {
        Parser {
            line: Vec::new(),
            after_cr: false,
            first_line: true,
            current: Event::default(),
            fields: 0,
            data_lines: 0,
            event_bytes: 0,
            max_event_bytes,
        }
    }

    /// Bytes held for an event not yet complete: its fields so far (the line being read
    /// among them) and the line buffer's room.
    pub fn buffered(&self) -> usize {
        self.event_bytes.saturating_sub(self.line.len()) + self.line.capacity()
    }

    /// Feeds one chunk, appending every completed event to `out`.
    pub fn push(&mut self, chunk: &[u8], out: &mut Vec<Event>) -> Result<(), TooLarge> {
        // An empty chunk (pingora hands one over for a read that ended in a chunked
        // body's framing) must not end the wait for the LF of a CR LF.
        if chunk.is_empty() {
            return Ok(());
        }
        let mut rest = chunk;
        if std::mem::take(&mut self.after_cr) {
            rest = rest.strip_prefix(b"\n").unwrap_or(rest);
        }
        while let Some(pos) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.take(&rest[..pos])?;
            self.end_line(out);
            let is_cr = rest[pos] == b'\r';
            let mut next = pos + 1;
            if is_cr && rest.get(next) == Some(&b'\n') {
                next += 1;
            } else if is_cr && next == rest.len() {
                self.after_cr = true;
            }
            rest = &rest[next..];
        }
        self.take(rest)
    }

    fn take(&mut self, bytes: &[u8]) -> Result<(), TooLarge> {
        self.event_bytes += bytes.len();
        if self.event_bytes > self.max_event_bytes {
            return Err(TooLarge {
                limit: self.max_event_bytes,
            });
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn end_line(&mut self, out: &mut Vec<Event>) {
        if std::mem::take(&mut self.first_line) && self.line.starts_with(BOM) {
            self.line.drain(..BOM.len());
        }
        if self.line.is_empty() {
            if self.fields > 0 {
                out.push(std::mem::take(&mut self.current));
            }
            self.fields = 0;
            self.data_lines = 0;
            self.event_bytes = 0;
            return;
        }
        let line = std::mem::take(&mut self.line);
        self.field(&line);
        // The buffer is reused for the next line, unless a long one grew it: a parser
        // kept for long (a held flow's) does not hold an event's worth of room for good.
        if line.capacity() <= LINE_ROOM_KEPT {
            self.line = line;
            self.line.clear();
        }
    }

    fn field(&mut self, line: &[u8]) {
        if line[0] == b':' {
            return;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        let value = String::from_utf8_lossy(value);
        match name {
            b"data" => {
                if self.data_lines > 0 {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(&value);
                self.data_lines += 1;
            }
            b"id" if !value.contains('\0') => self.current.id = Some(value.into_owned()),
            b"event" => self.current.event = Some(value.into_owned()),
            // ASCII digits only (no sign); a number past u64 is as long a wait as any.
            b"retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                self.current.retry = Some(value.parse().unwrap_or(u64::MAX))
            }
            _ => return,
        }
        self.fields += 1;
    }
}

/// The comment a gateway writes into an idle SSE stream; clients ignore comments.
pub const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";

/// Follows the tail of a relayed SSE byte stream to tell whether it stands between two
/// events, where a keep-alive comment can be inserted without corrupting an event.
#[derive(Clone, Copy, Debug, Default)]
pub struct BoundaryTracker {
    tail: [u8; 4],
    len: usize,
}

impl BoundaryTracker {
    pub fn push(&mut self, chunk: &[u8]) {
        for &b in &chunk[chunk.len().saturating_sub(4)..] {
            self.tail.rotate_left(1);
            self.tail[3] = b;
        }
        self.len = (self.len + chunk.len()).min(4);
    }

    /// True at the start of the stream, or after an empty line (two line ends in a row,
    /// in any of LF, CRLF and CR).
    pub fn between_events(&self) -> bool {
        let tail = &self.tail[4 - self.len..];
        let rest = match tail {
            [] => return true,
            [.., b'\r', b'\n'] => &tail[..tail.len() - 2],
            [.., b'\n'] | [.., b'\r'] => &tail[..tail.len() - 1],
            _ => return false,
        };
        matches!(rest, [.., b'\n'] | [.., b'\r'])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<Event> {
        let mut p = Parser::new(1 << 16);
        let mut out = Vec::new();
        for chunk in input.chunks(piece) {
            p.push(chunk, &mut out).unwrap();
            // As pingora hands over for a read that ended in a chunked body's framing.
            p.push(b"", &mut out).unwrap();
        }
        out
    }

    const STREAM: &str = "id: a1\ndata: \nretry: 1000\n\n: keep-alive\n\nid: a2\nevent: message\ndata: {\"x\":1}\n\ndata: one\ndata: two\n\n";

    fn expected() -> Vec<Event> {
        vec![
            Event {
                id: Some("a1".into()),
                event: None,
                data: String::new(),
                retry: Some(1000),
            },
            Event::message(Some("a2".into()), "{\"x\":1}".into()),
            Event {
                data: "one\ntwo".into(),
                ..Event::default()
            },
        ]
    }

    #[test]
    fn lf_crlf_and_cr_streams_split_anywhere_give_the_same_events() {
        let crlf = STREAM.replace('\n', "\r\n");
        let cr = STREAM.replace('\n', "\r");
        for input in [STREAM.to_string(), crlf, cr] {
            for piece in 1..=input.len() {
                assert_eq!(
                    parse_in_pieces(input.as_bytes(), piece),
                    expected(),
                    "piece {piece}"
                );
            }
        }
    }

    #[test]
    fn a_byte_order_mark_opening_the_stream_is_dropped_wherever_it_is_split() {
        let input = [BOM, STREAM.as_bytes()].concat();
        for piece in 1..=8 {
            assert_eq!(parse_in_pieces(&input, piece), expected(), "piece {piece}");
        }
        let blank_first = [BOM, b"\ndata: x\n\n"].concat();
        assert_eq!(parse_in_pieces(&blank_first, 1)[0].data, "x");
        let later = [&b"data: x\n\n"[..], BOM, b"data: y\n\n"].concat();
        assert_eq!(parse_in_pieces(&later, 64).len(), 1, "only at the start");
    }

    #[test]
    fn events_of_other_types_than_message_are_told_apart() {
        assert!(Event::message(None, "{}".into()).is_message());
        assert!(Event::default().is_message());
        let ping = Event {
            event: Some("ping".into()),
            ..Event::default()
        };
        assert!(!ping.is_message());
    }

    #[test]
    fn boundaries_are_found_in_every_line_ending_and_across_chunks() {
        let at = |chunks: &[&[u8]]| {
            let mut t = BoundaryTracker::default();
            for c in chunks {
                t.push(c);
            }
            t.between_events()
        };
        assert!(at(&[]));
        for done in [
            &b"data: x\n\n"[..],
            b"data: x\r\n\r\n",
            b"data: x\r\r",
            b": c\n\r\n",
        ] {
            assert!(at(&[done]), "{:?}", String::from_utf8_lossy(done));
            for split in 1..done.len() {
                assert!(at(&[&done[..split], &done[split..]]));
            }
        }
        for open in [
            &b"data: x"[..],
            b"data: x\n",
            b"data: x\r\n",
            b"data: x\r",
            b"id: 1\r\n",
        ] {
            assert!(!at(&[open]), "{:?}", String::from_utf8_lossy(open));
        }
        assert!(!at(&[b"data: x\n\n", b"data: y\n"]));
    }

    #[test]
    fn encode_round_trips() {
        let events = expected();
        let wire: String = events.iter().map(Event::encode).collect();
        assert_eq!(parse_in_pieces(wire.as_bytes(), 7), events);
    }

    #[test]
    fn oversized_events_are_refused_and_the_bound_resets_per_event() {
        let mut p = Parser::new(16);
        let mut out = Vec::new();
        assert!(p.push(b"data: 0123456789\n\n", &mut out).is_ok());
        assert!(p.push(b"data: 0123456789\n\n", &mut out).is_ok());
        assert_eq!(out.len(), 2);
        let err = p.push(b"data: 0123456789abcdef\n", &mut out).unwrap_err();
        assert_eq!(err, TooLarge { limit: 16 });
    }

    #[test]
    fn what_is_buffered_counts_once_and_a_long_lines_room_is_let_go() {
        let mut p = Parser::new(4 << 20);
        let mut out = Vec::new();
        let long = format!("data: {}", "x".repeat(600 << 10));
        p.push(long.as_bytes(), &mut out).unwrap();
        let held = p.buffered();
        assert!(
            (long.len()..long.len() * 3 / 2).contains(&held),
            "the partial line counted once: {held}"
        );
        p.push(b"\n\n", &mut out).unwrap();
        assert_eq!(out.len(), 1);
        p.push(b"data: short", &mut out).unwrap();
        assert!(p.buffered() < 64 << 10, "{}", p.buffered());
    }

    #[test]
    fn unknown_fields_and_bad_retry_are_ignored() {
        let out = parse_in_pieces(b"foo: bar\nretry: soon\n\ndata\n\n", 3);
        assert_eq!(out, vec![Event::default()]);
        let retry =
            |line: &str| parse_in_pieces(format!("{line}\ndata\n\n").as_bytes(), 4)[0].retry;
        assert_eq!(retry("retry: +50"), None, "digits only");
        assert_eq!(retry("retry: -1"), None);
        assert_eq!(retry("retry:"), None);
        assert_eq!(retry("retry: 99999999999999999999"), Some(u64::MAX));
        assert_eq!(retry("retry: 0050"), Some(50));
    }
}
