//! Facts of HTTP itself, nothing of this filter's: which header names and values are valid,
//! which are never replayed, media types and content codings. Uses nothing else of the crate;
//! every other layer may use it.

pub mod grpc;
pub mod headers;
