//! How a client request ended, in one type for pass-through and bridge alike: whether it
//! succeeded, and if not, what the client is told. A refusal knows its metric label, its
//! HTTP status, its JSON-RPC code and its message, so no call site picks them apart.

use crate::protocol::jsonrpc::code;
use crate::upstream::exchange::ExchangeFailure;
use serde_json::Value;
use std::fmt;

/// How a request ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Ok,
    /// A bridged round ended with questions (or a state only) for the client.
    InputRequired,
    /// A new call deferred under load shedding (a state-only result).
    Shed,
    /// A retry handed to the replica holding its flow, which counts its own outcome.
    Forwarded,
    /// The client left before the answer.
    ClientGone,
    /// An SSE stream ended cleanly because the gateway is shutting down.
    Drained,
    /// The request was answered with an error.
    Refused(Refusal),
}

/// An error the client is answered with.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub class: Class,
    /// The JSON-RPC error code.
    pub code: i64,
    pub message: String,
    /// The JSON-RPC error's `data`.
    pub data: Option<Value>,
    /// For a denial (401, 403): the challenge the client gets in `WWW-Authenticate`.
    pub challenge: Option<String>,
}

/// What kind of refusal: its metric label and HTTP status follow from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    BadRequest,
    TooLarge,
    /// A legacy client's `Mcp-Session-Id` did not open (404, to make it initialize again).
    SessionRejected,
    /// A data-layer session cookie did not open (400).
    CookieRejected,
    SessionRequired,
    SessionEnded,
    StateRejected,
    MissingCapability,
    /// A round beyond the gateway's limits (questions, bytes, rounds, state size).
    OverLimit,
    /// No healthy endpoint to open a session on.
    NoUpstream,
    UpstreamError,
    /// The upstream did not answer in time.
    UpstreamTimeout,
    /// This replica is too busy (a table is full).
    Overloaded,
    /// The upstream wants the caller to authenticate (401, with its challenge).
    Unauthorized,
    /// The upstream denied the caller access (403).
    Forbidden,
}

impl Class {
    /// The `outcome` label of the requests metric.
    pub fn label(self) -> &'static str {
        match self {
            Class::BadRequest => "bad_request",
            Class::TooLarge => "too_large",
            Class::SessionRejected | Class::CookieRejected => "session_rejected",
            Class::SessionRequired => "session_required",
            Class::SessionEnded => "session_ended",
            Class::StateRejected => "state_rejected",
            Class::MissingCapability => "missing_capability",
            Class::OverLimit => "over_limit",
            Class::NoUpstream => "no_upstream",
            Class::UpstreamError | Class::UpstreamTimeout => "upstream_error",
            Class::Overloaded => "overloaded",
            Class::Unauthorized => "unauthorized",
            Class::Forbidden => "forbidden",
        }
    }

    /// The HTTP status the failure deserves. (A 2026-07-28 client gets a server-side one
    /// as 200 carrying the error: see `bridge::reply`.)
    pub fn status(self) -> u16 {
        match self {
            Class::BadRequest
            | Class::CookieRejected
            | Class::SessionRequired
            | Class::StateRejected
            | Class::MissingCapability => 400,
            Class::Unauthorized => 401,
            Class::Forbidden => 403,
            Class::TooLarge => 413,
            Class::SessionRejected | Class::SessionEnded => 404,
            Class::OverLimit | Class::UpstreamError => 502,
            Class::NoUpstream | Class::Overloaded => 503,
            Class::UpstreamTimeout => 504,
        }
    }
}

impl From<ExchangeFailure> for Class {
    /// What a client is told of an upstream exchange that failed: a timeout is the
    /// upstream's, a replica out of descriptors is busy, anything else is an upstream
    /// error.
    fn from(failure: ExchangeFailure) -> Class {
        match failure {
            ExchangeFailure::Timeout => Class::UpstreamTimeout,
            ExchangeFailure::NoDescriptor => Class::Overloaded,
            _ => Class::UpstreamError,
        }
    }
}

impl Refusal {
    pub fn new(class: Class, code: i64, message: impl Into<String>) -> Refusal {
        Refusal {
            class,
            code,
            message: message.into(),
            data: None,
            challenge: None,
        }
    }

    /// A server-side failure with the JSON-RPC internal-error code.
    pub fn internal(class: Class, message: impl Into<String>) -> Refusal {
        Refusal::new(class, code::INTERNAL_ERROR, message)
    }

    pub fn with_data(mut self, data: Value) -> Refusal {
        self.data = Some(data);
        self
    }

    pub fn with_challenge(mut self, challenge: Option<String>) -> Refusal {
        self.challenge = challenge;
        self
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.class.label(),
            self.code,
            self.message
        )
    }
}

impl Outcome {
    /// A request answered in full: `Ok` when the client took the answer, `ClientGone`
    /// when writing it failed (the client left, or stopped reading).
    pub fn answered(delivered: bool) -> Outcome {
        match delivered {
            true => Outcome::Ok,
            false => Outcome::ClientGone,
        }
    }

    /// The `outcome` label of the requests metric.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::InputRequired => "input_required",
            Outcome::Shed => "shed",
            Outcome::Forwarded => "forwarded",
            Outcome::ClientGone => "client_gone",
            Outcome::Drained => "drained",
            Outcome::Refused(refusal) => refusal.class.label(),
        }
    }
}

impl From<Refusal> for Outcome {
    fn from(refusal: Refusal) -> Outcome {
        Outcome::Refused(refusal)
    }
}

/// An error with its chain of sources, one after another, for a log line.
pub struct Report<'a>(pub &'a dyn std::error::Error);

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_knows_its_label_status_and_code() {
        let r = Refusal::internal(Class::UpstreamTimeout, "no answer in time");
        assert_eq!(r.class.label(), "upstream_error");
        assert_eq!(r.class.status(), 504);
        assert_eq!(r.code, code::INTERNAL_ERROR);
        assert_eq!(Outcome::from(r).label(), "upstream_error");
        assert_eq!(Class::StateRejected.status(), 400);
        assert_eq!(Class::SessionRejected.status(), 404);
        assert_eq!(Outcome::Shed.label(), "shed");
    }
}
