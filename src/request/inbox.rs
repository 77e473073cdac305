//! Inbox mode: the identity of a message a broker pushes over HTTP (Knative, Dapr, Event Grid,
//! Pub/Sub push), read from the request instead of an `Idempotency-Key`. No proxy-wasm here.
//!
//! * CloudEvents (the HTTP protocol binding, v1.0): in binary mode the headers `ce-id` and
//!   `ce-source`; in structured mode (`content-type: application/cloudevents+json`, parameters
//!   allowed, any case) the string fields `id` and `source` of the JSON body. The spec makes
//!   `source` + `id` the identity of an event, so both are required: an id without a source is
//!   a missing id. Batches (`application/cloudevents-batch+json`) carry many ids in one request,
//!   which one record cannot stand for: they count as a missing id.
//! * A header: its single value; the source is empty.
//! * A JSON pointer (RFC 6901) into the body: a string, or a number taken as its JSON text
//!   (`/message/messageId` for Pub/Sub push); the source is empty.
//!
//! Ids are kept as exact bytes. The errors never carry the id itself.

use serde_json::Value;
use std::fmt;

use crate::config::values::MessageIdSource;
use crate::http::headers::MediaType;
use crate::request::fingerprint::spells_number_token;

pub const STRUCTURED: &str = "application/cloudevents+json";
pub const BATCH: &str = "application/cloudevents-batch+json";

/// A message's identity: the id, and the source that scopes it (empty when the id's source
/// has none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageId {
    pub source: Vec<u8>,
    pub id: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdError {
    /// No id where the configuration says it is (or not a whole one: an id without a source,
    /// a body that is not JSON, a batch). `inbox.missing_id` decides.
    Missing,
    /// Present but empty.
    Empty,
    TooLong {
        max: usize,
    },
    /// Present, but neither a string nor (for a JSON pointer) a number.
    NotAString,
    /// More than one header carries it.
    Multiple,
}

impl IdError {
    pub fn is_missing(self) -> bool {
        self == IdError::Missing
    }
}

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdError::Missing => f.write_str("The request carries no message id."),
            IdError::Empty => f.write_str("The message id is empty."),
            IdError::TooLong { max } => write!(f, "The message id is longer than {max} bytes."),
            IdError::NotAString => f.write_str("The message id (or its source) is not a string."),
            IdError::Multiple => f.write_str("The message id (or its source) is sent more than once."),
        }
    }
}

/// Where the id of this request is, as far as its headers tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtHeaders {
    Found(MessageId),
    /// In the body: read it with [`from_body`] once the body is complete.
    InBody,
}

/// Reads the id from the request headers (`header(name)`: every value of a lower-case name).
pub fn at_headers(
    src: &MessageIdSource,
    header: &dyn Fn(&str) -> Vec<Vec<u8>>,
    max_len: usize,
) -> Result<AtHeaders, IdError> {
    match src {
        MessageIdSource::CloudEvents => {
            if let Some(ct) = header("content-type").first() {
                if is_media_type(ct, STRUCTURED) {
                    return Ok(AtHeaders::InBody);
                }
                if is_media_type(ct, BATCH) {
                    return Err(IdError::Missing);
                }
            }
            let id = single(header("ce-id"))?;
            let source = single(header("ce-source"))?;
            if source.is_empty() {
                return Err(IdError::Missing);
            }
            Ok(AtHeaders::Found(MessageId { source, id: checked(id, max_len)? }))
        }
        MessageIdSource::Header(name) => {
            let id = single(header(name))?;
            Ok(AtHeaders::Found(MessageId { source: Vec::new(), id: checked(id, max_len)? }))
        }
        MessageIdSource::JsonPointer(_) => Ok(AtHeaders::InBody),
    }
}

/// Reads the id from the complete request body (after [`at_headers`] said [`AtHeaders::InBody`]).
pub fn from_body(src: &MessageIdSource, body: &[u8], max_len: usize) -> Result<MessageId, IdError> {
    let Ok(doc) = serde_json::from_slice::<Value>(body) else {
        return Err(IdError::Missing);
    };
    match src {
        MessageIdSource::CloudEvents => {
            let id = match doc.get("id") {
                None | Some(Value::Null) => return Err(IdError::Missing),
                Some(Value::String(s)) => s.as_bytes().to_vec(),
                Some(_) => return Err(IdError::NotAString),
            };
            let source = match doc.get("source") {
                None | Some(Value::Null) => return Err(IdError::Missing),
                Some(Value::String(s)) if s.is_empty() => return Err(IdError::Missing),
                Some(Value::String(s)) => s.as_bytes().to_vec(),
                Some(_) => return Err(IdError::NotAString),
            };
            Ok(MessageId { source, id: checked(id, max_len)? })
        }
        MessageIdSource::JsonPointer(pointer) => {
            let id = match doc.pointer(pointer) {
                None | Some(Value::Null) => return Err(IdError::Missing),
                Some(Value::String(s)) => s.as_bytes().to_vec(),
                // An object serde_json reads as a number is not one (see `spells_number_token`).
                Some(Value::Number(_)) if spells_number_token(body) => return Err(IdError::NotAString),
                Some(Value::Number(n)) => n.to_string().into_bytes(),
                Some(_) => return Err(IdError::NotAString),
            };
            Ok(MessageId { source: Vec::new(), id: checked(id, max_len)? })
        }
        MessageIdSource::Header(_) => Err(IdError::Missing),
    }
}

/// True when a `content-type` value's essence is `want` (lower case), whatever its case and
/// parameters.
pub fn is_media_type(content_type: &[u8], want: &str) -> bool {
    MediaType::parse(content_type).is_some_and(|m| m.is(want))
}

fn single(values: Vec<Vec<u8>>) -> Result<Vec<u8>, IdError> {
    let mut values = values.into_iter();
    match (values.next(), values.next()) {
        (None, _) => Err(IdError::Missing),
        (Some(one), None) => Ok(one),
        (Some(_), Some(_)) => Err(IdError::Multiple),
    }
}

fn checked(id: Vec<u8>, max_len: usize) -> Result<Vec<u8>, IdError> {
    if id.is_empty() {
        return Err(IdError::Empty);
    }
    if id.len() > max_len {
        return Err(IdError::TooLong { max: max_len });
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &[u8])]) -> impl Fn(&str) -> Vec<Vec<u8>> {
        let pairs: Vec<(String, Vec<u8>)> = pairs.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect();
        move |name: &str| pairs.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect()
    }

    fn found(source: &[u8], id: &[u8]) -> Result<AtHeaders, IdError> {
        Ok(AtHeaders::Found(MessageId { source: source.to_vec(), id: id.to_vec() }))
    }

    const CE: MessageIdSource = MessageIdSource::CloudEvents;

    fn pointer(p: &str) -> MessageIdSource {
        MessageIdSource::JsonPointer(p.into())
    }

    #[test]
    fn cloudevents_binary_mode() {
        let h = headers(&[("ce-id", b"A234-1234"), ("ce-source", b"/mycontext"), ("ce-type", b"t")]);
        assert_eq!(at_headers(&CE, &h, 255), found(b"/mycontext", b"A234-1234"));
        // Any other content type is the event's data: still binary mode.
        let h = headers(&[("content-type", b"application/json"), ("ce-id", b"1"), ("ce-source", b"s")]);
        assert_eq!(at_headers(&CE, &h, 255), found(b"s", b"1"));
        // Exact bytes, not necessarily UTF-8.
        let h = headers(&[("ce-id", b"\xff\x01"), ("ce-source", b"s")]);
        assert_eq!(at_headers(&CE, &h, 255), found(b"s", b"\xff\x01"));
    }

    #[test]
    fn cloudevents_binary_mode_malformed() {
        let missing = Err(IdError::Missing);
        assert_eq!(at_headers(&CE, &headers(&[]), 255), missing);
        assert_eq!(at_headers(&CE, &headers(&[("ce-id", b"1")]), 255), missing, "no source");
        assert_eq!(at_headers(&CE, &headers(&[("ce-source", b"s")]), 255), missing, "no id");
        assert_eq!(at_headers(&CE, &headers(&[("ce-id", b"1"), ("ce-source", b"")]), 255), missing);
        assert_eq!(
            at_headers(&CE, &headers(&[("ce-id", b""), ("ce-source", b"s")]), 255),
            Err(IdError::Empty)
        );
        assert_eq!(
            at_headers(&CE, &headers(&[("ce-id", b"123456"), ("ce-source", b"s")]), 5),
            Err(IdError::TooLong { max: 5 })
        );
        assert_eq!(
            at_headers(&CE, &headers(&[("ce-id", b"12345"), ("ce-source", b"s")]), 5),
            found(b"s", b"12345")
        );
        assert_eq!(
            at_headers(&CE, &headers(&[("ce-id", b"1"), ("ce-id", b"2"), ("ce-source", b"s")]), 255),
            Err(IdError::Multiple)
        );
        assert_eq!(
            at_headers(&CE, &headers(&[("ce-id", b"1"), ("ce-source", b"a"), ("ce-source", b"b")]), 255),
            Err(IdError::Multiple)
        );
    }

    #[test]
    fn cloudevents_structured_mode() {
        for ct in [
            &b"application/cloudevents+json"[..],
            b"application/cloudevents+json; charset=utf-8",
            b"Application/CloudEvents+JSON;charset=UTF-8",
            b" application/cloudevents+json ",
        ] {
            // ce-* headers do not count in structured mode.
            let h = headers(&[("content-type", ct), ("ce-id", b"header-id"), ("ce-source", b"s")]);
            assert_eq!(at_headers(&CE, &h, 255), Ok(AtHeaders::InBody), "{ct:?}");
        }
        let body =
            br#"{"specversion":"1.0","type":"com.example.order","source":"/shop","id":"e-1","data":{}}"#;
        assert_eq!(
            from_body(&CE, body, 255),
            Ok(MessageId { source: b"/shop".to_vec(), id: b"e-1".to_vec() })
        );
    }

    #[test]
    fn cloudevents_structured_mode_malformed() {
        let missing = Err(IdError::Missing);
        for body in [
            &b""[..],
            b"not json",
            b"[1,2]",
            b"{\"id\":\"e\"",
            br#"{"source":"s"}"#,
            br#"{"id":"e"}"#,
            br#"{"id":"e","source":""}"#,
            br#"{"id":null,"source":"s"}"#,
            b"\xff{}",
        ] {
            assert_eq!(from_body(&CE, body, 255), missing, "{body:?}");
        }
        assert_eq!(from_body(&CE, br#"{"id":7,"source":"s"}"#, 255), Err(IdError::NotAString));
        assert_eq!(from_body(&CE, br#"{"id":"e","source":{"a":1}}"#, 255), Err(IdError::NotAString));
        assert_eq!(from_body(&CE, br#"{"id":"","source":"s"}"#, 255), Err(IdError::Empty));
        assert_eq!(from_body(&CE, br#"{"id":"abcdef","source":"s"}"#, 5), Err(IdError::TooLong { max: 5 }));
    }

    #[test]
    fn cloudevents_batches_are_a_missing_id() {
        for ct in
            [&b"application/cloudevents-batch+json"[..], b"APPLICATION/CLOUDEVENTS-BATCH+JSON; charset=utf-8"]
        {
            let h = headers(&[("content-type", ct), ("ce-id", b"1"), ("ce-source", b"s")]);
            assert_eq!(at_headers(&CE, &h, 255), Err(IdError::Missing), "{ct:?}");
        }
    }

    #[test]
    fn header_source() {
        let src = MessageIdSource::Header("x-message-id".into());
        assert_eq!(at_headers(&src, &headers(&[("x-message-id", b"m-1")]), 255), found(b"", b"m-1"));
        assert_eq!(at_headers(&src, &headers(&[("ce-id", b"m-1")]), 255), Err(IdError::Missing));
        assert_eq!(at_headers(&src, &headers(&[("x-message-id", b"")]), 255), Err(IdError::Empty));
        assert_eq!(
            at_headers(&src, &headers(&[("x-message-id", b"toolong")]), 3),
            Err(IdError::TooLong { max: 3 })
        );
        assert_eq!(
            at_headers(&src, &headers(&[("x-message-id", b"a"), ("x-message-id", b"b")]), 255),
            Err(IdError::Multiple)
        );
        assert_eq!(from_body(&src, b"{}", 255), Err(IdError::Missing));
    }

    #[test]
    fn json_pointer_source() {
        let src = pointer("/message/messageId");
        assert_eq!(at_headers(&src, &headers(&[("x-message-id", b"m")]), 255), Ok(AtHeaders::InBody));
        // A Pub/Sub push body.
        let body = br#"{"message":{"data":"eyJ9","messageId":"2070443601311540","publishTime":"2021-02-26T19:13:55.749Z"},"subscription":"projects/p/subscriptions/s","deliveryAttempt":3}"#;
        assert_eq!(
            from_body(&src, body, 255),
            Ok(MessageId { source: vec![], id: b"2070443601311540".to_vec() })
        );
        // A number is taken as its JSON text.
        assert_eq!(
            from_body(&src, br#"{"message":{"messageId":12345}}"#, 255).map(|m| m.id),
            Ok(b"12345".to_vec())
        );
        assert_eq!(from_body(&pointer("/a~1b/0"), br#"{"a/b":["x"]}"#, 255).map(|m| m.id), Ok(b"x".to_vec()));
        // Event Grid's own schema: an array of one event.
        let grid = br#"[{"id":"eg-1","eventType":"t","subject":"s","data":{},"dataVersion":"1"}]"#;
        assert_eq!(from_body(&pointer("/0/id"), grid, 255).map(|m| m.id), Ok(b"eg-1".to_vec()));
    }

    #[test]
    fn json_pointer_source_malformed() {
        let src = pointer("/message/messageId");
        for body in [&b""[..], b"nope", br#"{"message":{}}"#, br#"{"message":{"messageId":null}}"#, b"[]"] {
            assert_eq!(from_body(&src, body, 255), Err(IdError::Missing), "{body:?}");
        }
        for body in [
            &br#"{"message":{"messageId":true}}"#[..],
            br#"{"message":{"messageId":{"a":1}}}"#,
            br#"{"message":{"messageId":{"$serde_json::private::Number":"12345"}}}"#,
        ] {
            assert_eq!(from_body(&src, body, 255), Err(IdError::NotAString), "{body:?}");
        }
        assert_eq!(from_body(&src, br#"{"message":{"messageId":""}}"#, 255), Err(IdError::Empty));
        assert_eq!(
            from_body(&src, br#"{"message":{"messageId":"abcd"}}"#, 3),
            Err(IdError::TooLong { max: 3 })
        );
    }

    #[test]
    fn errors_do_not_carry_the_id() {
        for e in [
            IdError::Missing,
            IdError::Empty,
            IdError::TooLong { max: 9 },
            IdError::NotAString,
            IdError::Multiple,
        ] {
            assert!(!e.to_string().is_empty());
            assert_eq!(e.is_missing(), e == IdError::Missing);
        }
    }
}
