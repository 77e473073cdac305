//! One request, from its headers to its end: the state machine ([`machine`]) and the rules it
//! decides by: the client's key and the store key ([`key`]), what makes a retry the same request
//! ([`fingerprint`]), which answers are kept ([`keep`]), how a record is replayed ([`replay`]),
//! the problems the filter answers ([`problem`]), message ids in inbox mode ([`inbox`]), detached
//! execution ([`detached`]), how an attempt ended ([`ending`]), and the counters it moves ([`metrics`]). Sees one request only: the
//! host is behind `machine::StreamView`, store calls are effects the worker carries out. May use
//! `config`, `store` and `http`.

pub mod detached;
pub mod ending;
pub mod fingerprint;
pub mod inbox;
pub mod keep;
pub mod key;
pub mod machine;
pub mod metrics;
pub mod problem;
pub mod replay;
