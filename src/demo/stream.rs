//! The demo server's event store: each SSE stream of a session is an append-only list of
//! events with ids `STREAM-SEQ`, so a reader can follow it live or resume after any id
//! (`Last-Event-ID`), on any connection, while the tool behind it keeps running.

use crate::protocol::sse::Event;
use std::sync::Mutex;
use tokio::sync::Notify;

/// Retry hint sent in every priming event, in milliseconds.
pub const RETRY_MS: u64 = 1000;

#[derive(Default)]
struct Log {
    events: Vec<String>,
    closed: bool,
}

pub struct EventStream {
    pub id: u64,
    log: Mutex<Log>,
    changed: Notify,
}

/// What a reader gets: the encoded events after its cursor, and whether the stream ended.
pub struct Batch {
    pub wire: String,
    pub next: usize,
    pub closed: bool,
}

impl EventStream {
    /// A new stream that starts with a priming event (an id and empty data).
    pub fn new(id: u64) -> EventStream {
        let stream = EventStream {
            id,
            log: Mutex::new(Log::default()),
            changed: Notify::new(),
        };
        stream.append_with(|event_id| Event {
            id: Some(event_id),
            data: String::new(),
            retry: Some(RETRY_MS),
            event: None,
        });
        stream
    }

    fn append_with(&self, make: impl FnOnce(String) -> Event) {
        let mut log = self.log.lock().expect("event log lock");
        if log.closed {
            return;
        }
        let event_id = format!("{}-{}", self.id, log.events.len());
        log.events.push(make(event_id).encode());
        drop(log);
        self.changed.notify_waiters();
    }

    /// Appends one JSON-RPC message as a `message` event.
    pub fn send(&self, message: &serde_json::Value) {
        self.append_with(|id| Event::message(Some(id), message.to_string()));
    }

    /// Appends the final message and ends the stream.
    pub fn finish(&self, message: &serde_json::Value) {
        self.send(message);
        self.log.lock().expect("event log lock").closed = true;
        self.changed.notify_waiters();
    }

    /// Ends the stream without a message (its session was deleted).
    pub fn close(&self) {
        self.log.lock().expect("event log lock").closed = true;
        self.changed.notify_waiters();
    }

    /// The events from index `from` on.
    pub fn since(&self, from: usize) -> Batch {
        let log = self.log.lock().expect("event log lock");
        let from = from.min(log.events.len());
        Batch {
            wire: log.events[from..].concat(),
            next: log.events.len(),
            closed: log.closed,
        }
    }

    /// Waits until something is appended after index `seen`, or the stream ends.
    pub async fn wait_past(&self, seen: usize) {
        let notified = self.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let batch = self.since(seen);
        if batch.next > seen || batch.closed {
            return;
        }
        notified.await;
    }
}

/// Splits an event id `STREAM-SEQ` into the stream and the index just after it.
pub fn parse_event_id(id: &str) -> Option<(u64, usize)> {
    let (stream, seq) = id.split_once('-')?;
    Some((stream.parse().ok()?, seq.parse::<usize>().ok()? + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn resume_after_an_id_replays_only_what_followed() {
        let s = EventStream::new(4);
        s.send(&json!({"n": 1}));
        s.finish(&json!({"n": 2}));
        let all = s.since(0);
        assert!(all.closed);
        assert!(all.wire.starts_with("id: 4-0\nretry: 1000\ndata: \n\n"));
        let (stream, next) = parse_event_id("4-1").unwrap();
        assert_eq!(stream, 4);
        let rest = s.since(next);
        assert_eq!(rest.wire, "id: 4-2\nevent: message\ndata: {\"n\":2}\n\n");
        s.send(&json!({"late": true}));
        assert_eq!(s.since(0).next, 3, "nothing is appended after the end");
        assert_eq!(parse_event_id("x"), None);
    }

    #[test]
    fn a_stream_closed_with_its_session_ends_without_a_message() {
        let s = EventStream::new(1);
        s.close();
        let all = s.since(0);
        assert!(all.closed);
        assert_eq!(all.next, 1, "only the priming event");
    }
}
