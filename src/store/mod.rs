//! The store client and the record codec: the calls the filter makes to idemstore (`begin`,
//! `commit`, a batch of commits, `release`), how each becomes an HTTP callout and how its answer
//! is read ([`client`]), the same calls as messages on the store stream ([`stream`]), and the bytes of a record as the store keeps them ([`record`]). Pure: it
//! builds and reads messages and decides nothing about a request. May use `config` and `http`.

pub mod client;
pub mod record;
pub mod stream;
