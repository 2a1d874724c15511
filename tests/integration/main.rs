//! Integration tests: in-process gateways in front of real MCP servers, driven by real
//! MCP clients and by raw HTTP where a client hides the wire.

mod auth;
mod bad_input;
mod bridge;
mod cli;
mod common;
mod conformance;
mod cors;
mod dns;
mod hold;
mod hostile;
mod hostile_upstream;
mod isolation;
mod keys;
mod operations;
mod pki;
mod real_peers;
mod recovery;
mod resumption;
mod scripted;
mod sessions;
mod shedding;
mod tls;
mod transport;
mod warm;
