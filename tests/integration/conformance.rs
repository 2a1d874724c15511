//! The official conformance suite, run through the gateway.
