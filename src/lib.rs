//! mrtr-gateway: a Pingora gateway in front of 2025-era MCP servers.
//!
//! The crate is split into socket-free protocol logic ([`protocol`], [`keys`], [`seal`],
//! [`principal`], [`config`]) and the Pingora shell that drives it ([`gateway`],
//! [`upstream`], and [`tls`] for both sides' certificates). [`demo`] is an embedded legacy MCP server for `mrtr-gateway demo` and the
//! benchmarks. See ARCHITECTURE.md for the map and the flow of one request.

pub mod cli;
pub mod config;
pub mod demo;
pub mod gateway;
pub mod inspect;
pub mod keys;
pub mod metrics;
pub mod mrtr;
pub mod outcome;
pub mod principal;
pub mod protocol;
pub mod seal;
pub mod socket;
pub mod tls;
pub mod upstream;

#[cfg(test)]
pub(crate) mod test_alloc;
