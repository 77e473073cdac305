//! Facts of gRPC over HTTP/2: what makes a request a gRPC call, the framing of its messages,
//! the status codes and how `grpc-message` is encoded.
//!
//! A unary call (one request message, one answer message and its trailers) is guarded like any
//! keyed request; what streams passes through. Envoy's local reply to a gRPC request is
//! trailers-only, so the filter's refusals are a `grpc-status` with a `grpc-message`
//! (`request::problem::Problem::answer`), and a replay, which needs a message and trailers, goes
//! by a second hop (see [`HOP_HEADER`]).

use crate::http::headers::MediaType;

/// Set by the guard on a retry it re-routes to the replay listener (a route matching it is in
/// every shipped config); refused on a request that arrives with it.
pub const HOP_HEADER: &str = "x-idempotency-grpc-replay";
/// The path of a re-routed retry (the replay route matches it with [`HOP_HEADER`]): a method
/// no service has. Envoy picks the route again only once the request goes on, so the guard
/// cannot see whether the route is there; without it the retry reaches the service, which
/// answers `UNIMPLEMENTED` and runs nothing (measured with grpcio: with the original path, it
/// ran the call again on the record's bytes).
pub const HOP_PATH: &str = "/idempotency.filter.v1.GrpcReplay/Replay";
/// The content type of a re-routed retry: its body is the record. Not gRPC, so that the replay
/// listener's local answer may carry a message and trailers, and no gRPC server takes it for a
/// call if a config lacks the replay route.
pub const RECORD_CONTENT_TYPE: &str = "application/x-idempotency-record";

pub const OK: u8 = 0;
pub const UNKNOWN: u8 = 2;
pub const INVALID_ARGUMENT: u8 = 3;
pub const DEADLINE_EXCEEDED: u8 = 4;
pub const ALREADY_EXISTS: u8 = 6;
pub const RESOURCE_EXHAUSTED: u8 = 8;
pub const FAILED_PRECONDITION: u8 = 9;
pub const ABORTED: u8 = 10;
pub const INTERNAL: u8 = 13;
pub const UNAVAILABLE: u8 = 14;

/// The canonical names, by code.
pub const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// What a request's content type makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Http,
    /// `application/grpc`, `application/grpc+proto`, `application/grpc+json`, ...
    Grpc,
    /// `application/grpc-web*`: passes through unguarded (its trailers are in the body).
    GrpcWeb,
}

pub fn kind(content_type: Option<&[u8]>) -> Kind {
    let Some(media) = content_type.and_then(MediaType::parse) else { return Kind::Http };
    if media.kind != "application" {
        return Kind::Http;
    }
    match media.subtype.as_str() {
        "grpc" => Kind::Grpc,
        s if s.starts_with("grpc+") => Kind::Grpc,
        s if s.starts_with("grpc-web") => Kind::GrpcWeb,
        _ => Kind::Http,
    }
}

/// A `grpc-status` value: the decimal code, 0 to 16.
pub fn parse_status(value: &[u8]) -> Option<u8> {
    let s = std::str::from_utf8(value).ok()?;
    if s.is_empty() || s.len() > 2 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u8>().ok().filter(|c| usize::from(*c) < NAMES.len())
}

/// Counts the length-prefixed messages of a gRPC body as its bytes go by: a 5-byte prefix
/// (compressed flag, big-endian length), then the message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frames {
    prefix: [u8; 5],
    /// Prefix bytes of the current message seen so far.
    have: usize,
    /// Message bytes still to come.
    left: u64,
    /// Messages whose prefix arrived.
    pub messages: u32,
}

impl Frames {
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left > 0 {
                let take = self.left.min(bytes.len() as u64) as usize;
                self.left -= take as u64;
                bytes = &bytes[take..];
                continue;
            }
            self.prefix[self.have] = bytes[0];
            self.have += 1;
            bytes = &bytes[1..];
            if self.have == 5 {
                self.have = 0;
                self.messages = self.messages.saturating_add(1);
                let p = self.prefix;
                self.left = u64::from(u32::from_be_bytes([p[1], p[2], p[3], p[4]]));
            }
        }
    }

    /// Every message that started is whole.
    pub fn complete(&self) -> bool {
        self.have == 0 && self.left == 0
    }
}

/// gRPC's `grpc-message` encoding: bytes outside printable ASCII, and `%`, as `%XX`.
pub fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        assert_eq!(kind(Some(b"application/grpc")), Kind::Grpc);
        assert_eq!(kind(Some(b"application/grpc+proto")), Kind::Grpc);
        assert_eq!(kind(Some(b"Application/GRPC+json; charset=utf-8")), Kind::Grpc);
        assert_eq!(kind(Some(b"application/grpc-web+proto")), Kind::GrpcWeb);
        assert_eq!(kind(Some(b"application/grpc-web-text")), Kind::GrpcWeb);
        assert_eq!(kind(Some(b"application/grpcx")), Kind::Http);
        assert_eq!(kind(Some(b"application/json")), Kind::Http);
        assert_eq!(kind(None), Kind::Http);
    }

    #[test]
    fn frames_are_counted_across_chunks() {
        let mut body = vec![0, 0, 0, 0, 3, b'a', b'b', b'c'];
        body.extend_from_slice(&[1, 0, 0, 0, 0]);
        body.extend_from_slice(&[0, 0, 0, 1, 0]);
        body.extend_from_slice(&[7; 256]);
        for split in 0..body.len() {
            let mut f = Frames::default();
            f.feed(&body[..split]);
            f.feed(&body[split..]);
            assert_eq!((f.messages, f.complete()), (3, true), "split at {split}");
        }
        let mut f = Frames::default();
        f.feed(&body[..6]);
        assert_eq!((f.messages, f.complete()), (1, false));
        let mut f = Frames::default();
        f.feed(&[0, 0, 0]);
        assert_eq!((f.messages, f.complete()), (0, false));
    }

    #[test]
    fn statuses() {
        assert_eq!(parse_status(b"0"), Some(0));
        assert_eq!(parse_status(b"16"), Some(16));
        for bad in [&b""[..], b"17", b"-1", b" 1", b"007", b"x"] {
            assert_eq!(parse_status(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%c\n\u{e9}"), "a b%25c%0A%C3%A9");
    }
}
