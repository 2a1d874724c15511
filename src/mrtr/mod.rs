//! The 2026-07-28 surface and the MRTR translation, socket-free: which era a request
//! speaks, what a modern request must carry (headers matching the body, `_meta`), and the
//! sealed `requestState` that lets any replica resume a flow.

pub mod data_session;
pub mod flow;
pub mod modern;
pub mod replay;
pub mod state;
pub mod translate;
