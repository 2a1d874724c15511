//! The upstream streams of a flow in progress (or held between rounds): the call's own
//! SSE stream and the session's GET stream, their SSE parsers, and a backlog of events
//! parsed but not yet read by the flow. Owns reading a chunk into the backlog, and
//! (re)opening a stream after an event id, a conflict tried again briefly.

use crate::config::DEFAULT_MAX_UPSTREAM_MESSAGE_BYTES;
use crate::protocol::sse;
use crate::upstream::exchange::{Connection, Response, UpstreamClient};
use crate::upstream::legacy_session::{LegacySession, SessionError, SessionFailure};
use bytes::Bytes;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// Which upstream stream an event came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    /// The call's own POST stream (or its resumption).
    Call,
    /// The session's standalone GET stream.
    Session,
}

/// An exchange whose response header has not come (the call's POST, the session's GET):
/// owned, so it can be held with the flow.
pub(super) type PendingResponse =
    Pin<Box<dyn Future<Output = Result<Response, SessionError>> + Send>>;

pub(super) struct Streams {
    pub(super) call: Option<Response>,
    /// The call's POST while its answer (the response header) has not come; `call` is
    /// its stream once it has. Dropped, it closes the connection.
    pub(super) posted: Option<PendingResponse>,
    call_parser: sse::Parser,
    pub(super) session: Option<Response>,
    /// The session's GET while the upstream takes longer than its patience to open it:
    /// `session` once it opens. Dropped, it closes the connection.
    pub(super) session_opening: Option<PendingResponse>,
    session_parser: sse::Parser,
    /// Events parsed but not yet read: a round that fills up stops between two events of
    /// one chunk, and the rest belong to the next round (held with the flow).
    pub(super) backlog: VecDeque<(Source, sse::Event)>,
}

/// A parser for a stream's events, bounded by the response's message limit (a stream not
/// yet open gets the default's: it is replaced with the stream).
fn parser_for(response: Option<&Response>) -> sse::Parser {
    let bound = response.map_or(DEFAULT_MAX_UPSTREAM_MESSAGE_BYTES, Response::max_message);
    sse::Parser::new(bound)
}

impl Streams {
    pub(super) fn new(call: Option<Response>, session: Option<Response>) -> Streams {
        Streams {
            call_parser: parser_for(call.as_ref()),
            call,
            posted: None,
            session_parser: parser_for(session.as_ref()),
            session,
            session_opening: None,
            backlog: VecDeque::new(),
        }
    }

    pub(super) async fn close(self, client: &UpstreamClient) {
        for response in [self.call, self.session].into_iter().flatten() {
            client.finish(response).await;
        }
    }

    /// Reads the streams off to their end, briefly (`UpstreamClient::discard`), once
    /// their session is deleted: servers end a session's streams with it, and a stream
    /// read to its end keeps its connection for the next exchange.
    pub(super) async fn drain(self, client: &UpstreamClient, limit: Duration) {
        for response in [self.call, self.session].into_iter().flatten() {
            client.discard(response, limit).await;
        }
    }

    /// Bytes of events the parsers and the backlog hold.
    pub(super) fn buffered(&self) -> usize {
        let backlog: usize = self.backlog.iter().map(|(_, e)| e.data.len()).sum();
        self.call_parser.buffered() + self.session_parser.buffered() + backlog
    }

    /// Parses a chunk of `source`'s stream into the backlog; returns how many events it
    /// held.
    pub(super) fn push(&mut self, source: Source, bytes: &[u8]) -> Result<usize, sse::TooLarge> {
        let parser = match source {
            Source::Call => &mut self.call_parser,
            Source::Session => &mut self.session_parser,
        };
        let mut events = Vec::new();
        let parsed = parser.push(bytes, &mut events);
        let count = events.len();
        self.backlog
            .extend(events.into_iter().map(|event| (source, event)));
        parsed.map(|()| count)
    }

    /// Puts a new call stream (the call's POST response, or a resumption) in place of
    /// the old one.
    pub(super) fn replace_call(&mut self, response: Response) {
        self.call_parser = parser_for(Some(&response));
        self.call = Some(response);
    }

    /// Puts a new session GET stream (or none) in place of the old one: what the old one
    /// left of a line is not the new one's.
    pub(super) fn replace_session(&mut self, response: Option<Response>) {
        self.session_parser = parser_for(response.as_ref());
        self.session = response;
    }

    /// Takes a stream that ended out of the flow: one read to its end goes back to the
    /// pool (`UpstreamClient::finish`), any other is closed (never pooled half-read).
    pub(super) fn take_stream(&mut self, source: Source) -> Option<Response> {
        match source {
            Source::Call => self.call.take(),
            Source::Session => self.session.take(),
        }
    }
}

/// The answer to the call's POST, or never while there is none awaited.
pub(super) async fn answer_of(
    posted: &mut Option<PendingResponse>,
) -> Result<Response, SessionError> {
    match posted {
        Some(answer) => answer.await,
        None => std::future::pending().await,
    }
}

/// The next chunk of a stream, or never when there is none.
pub(super) async fn next_chunk(
    response: &mut Option<Response>,
) -> Option<Result<Option<Bytes>, String>> {
    match response {
        Some(r) => Some(r.next_chunk().await.map_err(|e| e.to_string())),
        None => std::future::pending().await,
    }
}

/// How often, and after how long at first (doubling: 2 ms to 128 ms, 254 ms in all), a
/// GET the upstream answers with 409 is tried again: it still holds the previous
/// connection of that stream, which the gateway has just closed. A server lets go as soon
/// as it reads that close, within a millisecond or two unless it is busy, which a client
/// that retries at once meets on most rounds: the first waits are short.
const CONFLICT_RETRIES: u32 = 7;
const CONFLICT_BACKOFF: Duration = Duration::from_millis(2);

/// The wait before the `attempt`-th retry (from 0) of a GET refused with 409, or `None`
/// once patience is spent.
fn conflict_backoff(attempt: u32) -> Option<Duration> {
    (attempt < CONFLICT_RETRIES).then(|| CONFLICT_BACKOFF * 2u32.pow(attempt))
}

/// Whether the upstream refused a GET because it still holds the stream's previous one.
fn is_conflict(e: &SessionError) -> bool {
    *e.failure() == SessionFailure::Refused(409)
}

/// Resumes the call's stream after `after`, trying a conflict again briefly. On a new
/// connection: the resumption replaces a stream whose connection was closed moments
/// before (`Connection::New`).
pub(super) async fn resume_call(
    upstream: &LegacySession<'_>,
    after: &str,
) -> Result<Response, SessionError> {
    let mut attempt = 0;
    loop {
        match upstream.get(Some(after), Connection::New).await {
            Err(e) if is_conflict(&e) => match conflict_backoff(attempt) {
                Some(wait) => tokio::time::sleep(wait).await,
                None => return Err(e),
            },
            got => return got,
        }
        attempt += 1;
    }
}

/// How long a flow waits for the session's GET stream to open (its response header)
/// before it goes on: servers open it at once; one that does not must not hold the call
/// (or a retry whose call stream is back) for the response timeout. The GET goes on
/// beside the flow, and its stream joins when it opens (`Streams::session_opening`); a
/// warm session's is dropped.
pub(super) const SESSION_STREAM_PATIENCE: Duration = Duration::from_secs(5);

/// What came of opening the session's GET stream.
pub(super) enum SessionStream {
    Open(Response),
    /// The upstream has not answered within the patience: the GET goes on (owned), and
    /// its stream joins the flow when it opens.
    Opening(PendingResponse),
    /// None: refused, failed, or (`kept`) in conflict throughout.
    None {
        kept: bool,
    },
}

/// The session's GET stream, where a legacy server sends requests not tied to a call,
/// resumed after `after` when given (falling back to a fresh one when the upstream
/// refuses the resumption). A second GET in one session gets 409 while the server still
/// holds the previous round's, so a conflict is tried again a few times, briefly, when
/// `patient`; a stream that replaces the previous round's goes on a new `connection`.
/// A GET not answered within `patience` is handed back still going. Also says whether
/// the stream (or the GET still going) resumes after `after`: not when there was none,
/// nor when the upstream refused it and the stream is fresh.
pub(super) async fn open_session_stream(
    upstream: &LegacySession<'_>,
    client: &Arc<UpstreamClient>,
    after: Option<&str>,
    patient: bool,
    connection: Connection,
    patience: Duration,
) -> (SessionStream, bool) {
    let deadline = tokio::time::Instant::now() + patience;
    let mut after = after;
    for attempt in 0..=CONFLICT_RETRIES {
        let position = after.map(str::to_string);
        let mut get: PendingResponse =
            Box::pin(upstream.get_detached(client.clone(), position, connection));
        let resumed = after.is_some();
        let Ok(got) = tokio::time::timeout_at(deadline, &mut get).await else {
            return (SessionStream::Opening(get), resumed);
        };
        match got {
            Ok(response) => return (SessionStream::Open(response), resumed),
            Err(e) if is_conflict(&e) => match conflict_backoff(attempt).filter(|_| patient) {
                Some(wait) => tokio::time::sleep(wait).await,
                None => return (SessionStream::None { kept: true }, false),
            },
            Err(e) if matches!(e.failure(), SessionFailure::Refused(_)) && after.is_some() => {
                after = None
            }
            Err(_) => return (SessionStream::None { kept: false }, false),
        }
    }
    (SessionStream::None { kept: false }, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conflict_is_tried_again_within_milliseconds_and_given_up_after_a_quarter_second() {
        assert_eq!(conflict_backoff(0), Some(Duration::from_millis(2)));
        let waits: Vec<Duration> = (0..).map_while(conflict_backoff).collect();
        assert_eq!(waits.len(), CONFLICT_RETRIES as usize);
        // No less patient than the 140 ms (20, 40, 80) a busy server was given before.
        let patience: Duration = waits.iter().sum();
        assert_eq!(patience, Duration::from_millis(254));
    }
}
