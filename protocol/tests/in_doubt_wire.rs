//! The wire form of the stream's in-doubt fields: the tags `proto/idemstore.proto` gives, as
//! any protobuf library writes them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use idem_protocol::stream::{Begin, Begun, Release};
use prost::Message;

#[test]
fn begin_hold_retention_supersede_are_tags_6_7_8() {
    let begin = Begin { hold: true, retention_s: 60, supersede: "t".into(), ..Begin::default() };
    // 6 varint 1, 7 varint 60, 8 length-delimited "t"; zero and empty fields are not written.
    assert_eq!(begin.encode_to_vec(), b"\x30\x01\x38\x3c\x42\x01t");
    assert_eq!(Begin::decode(&b"\x30\x01\x38\x3c\x42\x01t"[..]).unwrap(), begin);
    // Without a hold, nothing more than before goes on the wire.
    assert!(Begin::default().encode_to_vec().is_empty());
}

#[test]
fn release_in_doubt_is_tag_3() {
    let release = Release { key: "k".into(), token: "t".into(), in_doubt: true };
    assert_eq!(release.encode_to_vec(), b"\x0a\x01k\x12\x01t\x18\x01");
}

#[test]
fn begun_started_and_running_are_tags_6_7() {
    let begun = Begun {
        outcome: idem_protocol::BeginOutcome::InDoubt.as_str().into(),
        token: "t".into(),
        started_ms: 1,
        running_ms: 2,
        ..Begun::default()
    };
    assert_eq!(begun.encode_to_vec(), b"\x0a\x08in-doubt\x22\x01t\x30\x01\x38\x02");
}
