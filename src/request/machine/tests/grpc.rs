//! Unary gRPC calls: what is guarded, kept and replayed, and what passes.

use super::*;
use crate::http::grpc::{self as g, HOP_HEADER};

fn frame(message: &[u8]) -> Vec<u8> {
    let mut f = vec![0];
    f.extend_from_slice(&(message.len() as u32).to_be_bytes());
    f.extend_from_slice(message);
    f
}

fn call(key: Option<&str>, path: &str) -> MockView {
    let mut v = MockView::post(key);
    v.request.retain(|(n, _)| n != ":path");
    v.req(":path", path).req("content-type", "application/grpc").req("te", "trailers");
    v
}

const CREATE: &str = "/shop.v1.Orders/CreateOrder";
const GRPC: &str = r#","replay_headers":["x-order-bin"],"grpc_streaming_methods":["/shop.v1.Orders/Watch","/shop.v1.Chat/*"]"#;

/// A guarded call, locked with `t1`, its one message `m1` read.
fn locked(extra: &str) -> (Machine, String) {
    let mut s = Machine::new(cfg(extra));
    let mut v = call(Some("k1"), CREATE);
    v.request_body = frame(b"m1");
    assert_eq!(s.on_request_headers(&v, false).action, Action::Pause);
    assert!(s.is_grpc());
    let step = s.on_request_body(&v, v.request_body.len(), true);
    let (key, _) = begin_call(&step.effects);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
    (s, key)
}

fn answer_headers(s: &mut Machine, end_of_stream: bool, extra: &[(&str, &str)]) -> Vec<Effect> {
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/grpc");
    for (n, val) in extra {
        v.resp(n, val);
    }
    s.on_response_headers(&v, end_of_stream).effects
}

fn body(s: &mut Machine, bytes: &[u8], end_of_stream: bool) -> Vec<Effect> {
    let v = MockView { response_chunk: bytes.to_vec(), ..MockView::default() };
    s.on_response_body(&v, bytes.len(), end_of_stream).effects
}

fn trailers(s: &mut Machine, t: &[(&str, &str)]) -> Vec<Effect> {
    let v = MockView {
        response_trailers: t.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect(),
        ..MockView::default()
    };
    s.on_response_trailers(&v).effects
}

fn committed(effects: &[Effect]) -> Record {
    match effects {
        [Effect::Store(StoreCall::Commit { record, .. })] => Record::decode(record).unwrap(),
        other => panic!("no commit: {other:?}"),
    }
}

#[test]
fn an_ok_answer_is_kept_with_its_metadata_message_and_trailers() {
    let (mut s, _) = locked(GRPC);
    assert!(
        answer_headers(&mut s, false, &[("x-order-bin", "AP8B"), ("grpc-encoding", "identity")]).is_empty()
    );
    let message = frame(b"order 1");
    assert!(body(&mut s, &message[..3], false).is_empty());
    assert!(body(&mut s, &message[3..], false).is_empty());
    let record = committed(&trailers(
        &mut s,
        &[("grpc-status", "0"), ("grpc-status-details-bin", "CAA"), ("x-other", "no")],
    ));
    assert_eq!(record.status, 200);
    assert_eq!(record.body, message);
    assert_eq!(
        record.headers,
        vec![
            ("x-order-bin".into(), "AP8B".into()),
            ("content-type".into(), "application/grpc".into()),
            ("grpc-encoding".into(), "identity".into())
        ]
    );
    assert_eq!(
        record.trailers,
        Some(vec![("grpc-status".into(), "0".into()), ("grpc-status-details-bin".into(), "CAA".into())])
    );
    assert!(record.print.is_some());
}

#[test]
fn other_statuses_a_second_message_or_a_cut_answer_give_the_lock_back() {
    let (mut s, key) = locked(GRPC);
    answer_headers(&mut s, false, &[]);
    body(&mut s, &frame(b"x"), false);
    assert_eq!(trailers(&mut s, &[("grpc-status", "5"), ("grpc-message", "not found")]), release_of(&key));

    let (mut s, key) = locked(r#","store_grpc_statuses":["OK","not_found"]"#);
    answer_headers(&mut s, false, &[]);
    body(&mut s, &frame(b"x"), false);
    assert_eq!(committed(&trailers(&mut s, &[("grpc-status", "5")])).body, frame(b"x"));

    let (mut s, key2) = locked(GRPC);
    answer_headers(&mut s, false, &[]);
    let mut two = frame(b"a");
    two.extend(frame(b"b"));
    let mut expected = release_of(&key2);
    expected.push(Effect::Count(Metric::GrpcUnguarded));
    assert_eq!(body(&mut s, &two, false), expected);
    assert!(s.is_done());
    let _ = key;

    let (mut s, key) = locked(GRPC);
    answer_headers(&mut s, false, &[]);
    assert_eq!(body(&mut s, &frame(b"x"), true), release_of(&key), "no trailers: no status");

    let (mut s, key) = locked(GRPC);
    let mut v = MockView::default();
    v.resp(":status", "503").resp("content-type", "text/plain");
    assert_eq!(s.on_response_headers(&v, false).effects, release_of(&key));
}

#[test]
fn a_trailers_only_answer_is_decided_on_its_headers() {
    let (mut s, key) = locked(GRPC);
    let effects = answer_headers(&mut s, true, &[("grpc-status", "14"), ("grpc-message", "down")]);
    assert_eq!(effects, release_of(&key));
    let (mut s, _) = locked(r#","store_grpc_statuses":[5]"#);
    let record = committed(&answer_headers(&mut s, true, &[("grpc-status", "5"), ("grpc-message", "gone")]));
    assert!(record.body.is_empty());
    assert_eq!(
        record.trailers,
        Some(vec![("grpc-status".into(), "5".into()), ("grpc-message".into(), "gone".into())])
    );
}

#[test]
fn a_large_answer_is_kept_without_its_message_or_released() {
    let (mut s, _) = locked(GRPC);
    answer_headers(&mut s, false, &[]);
    body(&mut s, &frame(&[7; 60]), false);
    let record = committed(&trailers(&mut s, &[("grpc-status", "0")]));
    assert!(record.body_omitted && record.body.is_empty());
    let (mut s, key) = locked(r#","record_too_large":"release""#);
    answer_headers(&mut s, false, &[]);
    assert_eq!(body(&mut s, &frame(&[7; 60]), false), release_of(&key));
}

fn replayed(record: Record, extra: &str) -> Vec<Effect> {
    let mut s = Machine::new(cfg(extra));
    let mut v = call(Some("k1"), CREATE);
    v.request_body = frame(b"m1");
    s.on_request_headers(&v, false);
    s.on_request_body(&v, v.request_body.len(), true);
    s.on_begin_answer(Ok(BeginAnswer::Replay(record)))
}

fn grpc_record(body: &[u8]) -> Record {
    let mut print_of = Machine::new(cfg(GRPC));
    let mut v = call(Some("k1"), CREATE);
    v.request_body = frame(b"m1");
    print_of.on_request_headers(&v, false);
    Record {
        status: 200,
        headers: vec![
            ("x-order-bin".into(), "AP8B".into()),
            ("content-type".into(), "application/grpc+proto".into()),
        ],
        body: body.to_vec(),
        body_omitted: false,
        print: print_of.print.clone(),
        trailers: Some(vec![("grpc-status".into(), "0".into())]),
        expires_ms: None,
    }
}

#[test]
fn a_replay_with_a_message_goes_by_the_second_hop() {
    let effects = replayed(grpc_record(&frame(b"order 1")), GRPC);
    let [Effect::Hop { record, body_len, fallback }, Effect::Count(Metric::Replayed)] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(*body_len, frame(b"m1").len());
    let hop = Record::decode(record).unwrap();
    assert_eq!(hop.body, frame(b"order 1"));
    assert_eq!(hop.print, None);
    assert_eq!(
        hop.headers,
        vec![
            ("content-type".into(), "application/grpc+proto".into()),
            ("x-order-bin".into(), "AP8B".into()),
            ("x-idempotent-replay".into(), "true".into())
        ]
    );
    assert_eq!(hop.trailers, Some(vec![("grpc-status".into(), "0".into())]));
    assert_eq!((fallback.code, fallback.grpc_status), (Code::ReplayFailed, g::UNAVAILABLE));
}

#[test]
fn replays_without_a_message_are_local_answers() {
    let mut omitted = grpc_record(b"");
    omitted.body_omitted = true;
    let effects = replayed(omitted, GRPC);
    let [Effect::Respond(r), Effect::Count(Metric::Replayed)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert!(r.headers.contains(&("grpc-status".into(), g::ALREADY_EXISTS.to_string())));
    assert!(r.headers.contains(&("x-idempotent-body-omitted".into(), "true".into())));

    let mut only = grpc_record(b"");
    only.trailers = Some(vec![("grpc-status".into(), "5".into()), ("grpc-message".into(), "gone".into())]);
    let effects = replayed(only, GRPC);
    let [Effect::Respond(r), Effect::Count(Metric::Replayed)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert!(r.body.is_empty());
    assert!(r.headers.contains(&("grpc-status".into(), "5".into())));
    assert!(r.headers.contains(&("x-idempotent-replay".into(), "true".into())));

    let mut http = grpc_record(b"{}");
    http.trailers = None;
    let effects = replayed(http, GRPC);
    let [Effect::Refuse(p), Effect::Count(Metric::Mismatched)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert_eq!((p.code, p.grpc_status), (Code::KeyReused, g::FAILED_PRECONDITION));
}

#[test]
fn what_cannot_be_a_unary_call_passes_counted() {
    for (path, ct) in [
        ("/shop.v1.Orders/Watch", "application/grpc"),
        ("/shop.v1.Chat/Talk", "application/grpc+proto"),
        (CREATE, "application/grpc-web+proto"),
    ] {
        let mut s = Machine::new(cfg(GRPC));
        let mut v = call(Some("k1"), path);
        v.request.retain(|(n, _)| n != "content-type");
        v.req("content-type", ct);
        let step = s.on_request_headers(&v, false);
        assert_eq!(step, Step::go(vec![Effect::Count(Metric::GrpcUnguarded)]), "{path} {ct}");
        assert!(s.is_done());
    }
    // A second request message: the call streams; no lock was taken.
    let mut s = Machine::new(cfg(GRPC));
    let mut v = call(Some("k1"), CREATE);
    v.request_body = [frame(b"a"), frame(b"b")].concat();
    s.on_request_headers(&v, false);
    let step = s.on_request_body(&v, 11, false);
    assert_eq!(step, Step::pause(vec![Effect::Resume, Effect::Count(Metric::GrpcUnguarded)]));
    assert!(s.is_done());
}

#[test]
fn the_hop_header_is_refused_from_clients() {
    let mut s = Machine::new(cfg(GRPC));
    let mut v = call(Some("k1"), CREATE);
    v.req(HOP_HEADER, "1");
    let step = s.on_request_headers(&v, false);
    assert_eq!(respond_status(&step.effects), Some(400));
    assert!(s.is_grpc(), "answered as a gRPC status by the worker");
}

#[test]
fn the_replay_listener_answers_the_record_and_adds_its_trailers() {
    let hop_record = match replayed(grpc_record(&frame(b"order 1")), GRPC).remove(0) {
        Effect::Hop { record, .. } => record,
        other => panic!("{other:?}"),
    };
    let replay_cfg = Rc::new(Config::from_json(br#"{"mode":"grpc_replay"}"#).unwrap());
    let mut s = Machine::new(Rc::clone(&replay_cfg));
    let mut v = MockView::default();
    v.req(":method", "POST")
        .req(":path", g::HOP_PATH)
        .req("content-type", g::RECORD_CONTENT_TYPE)
        .req(HOP_HEADER, "1");
    v.request_body = hop_record.clone();
    assert_eq!(s.on_request_headers(&v, false), Step::pause(vec![]));
    assert_eq!(s.on_request_body(&v, 10, false), Step::pause(vec![]));
    let step = s.on_request_body(&v, hop_record.len(), true);
    let [Effect::Respond(r)] = step.effects.as_slice() else { panic!("{step:?}") };
    assert_eq!((r.status, r.body.as_slice()), (200, frame(b"order 1").as_slice()));
    assert!(r.headers.contains(&("x-idempotent-replay".into(), "true".into())));
    // A host that sends trailers with its answer (the native one) reads them here.
    assert_eq!(s.answer_trailers(), Some([("grpc-status".to_string(), "0".to_string())].as_slice()));
    let mut reply = MockView::default();
    reply.resp(":status", "200").resp("content-length", "13");
    assert_eq!(
        s.on_response_headers(&reply, false),
        Step::go(vec![Effect::RemoveResponseHeader("content-length".into())]),
        "a gRPC answer has no length"
    );
    assert_eq!(s.on_response_body(&MockView::default(), 4, false), Step::go(vec![]));
    assert_eq!(
        s.on_response_body(&MockView::default(), 8, true),
        Step::go(vec![Effect::AddResponseTrailers(vec![("grpc-status".into(), "0".into())])])
    );
    assert!(s.is_done() && s.answer_trailers().is_none());

    // Anything else gets an error status, never an empty OK.
    for (path, body) in [(CREATE, hop_record.clone()), (g::HOP_PATH, b"IDR2 garbage".to_vec())] {
        let mut s = Machine::new(Rc::clone(&replay_cfg));
        let mut v = MockView::default();
        v.req(":method", "POST")
            .req(":path", path)
            .req("content-type", g::RECORD_CONTENT_TYPE)
            .req(HOP_HEADER, "1");
        v.request_body = body.clone();
        let mut effects = s.on_request_headers(&v, false).effects;
        if effects.is_empty() {
            effects = s.on_request_body(&v, body.len(), true).effects;
        }
        let [Effect::Refuse(p)] = effects.as_slice() else { panic!("{effects:?}") };
        assert_eq!((p.code, p.grpc_status), (Code::ReplayFailed, g::INTERNAL), "{path}");
    }
}

#[test]
fn the_replay_listener_reads_no_more_than_a_record_can_be() {
    let replay_cfg =
        Rc::new(Config::from_json(br#"{"mode":"grpc_replay","max_record_bytes":1024}"#).unwrap());
    let cap = 1024 + crate::store::record::MAX_FRAMING;
    let hop = |extra: &[(&str, &str)]| {
        let mut v = MockView::default();
        v.req(":method", "POST")
            .req(":path", g::HOP_PATH)
            .req("content-type", g::RECORD_CONTENT_TYPE)
            .req(HOP_HEADER, "1");
        for (n, val) in extra {
            v.req(n, val);
        }
        v
    };
    let exhausted = |effects: &[Effect]| {
        let [Effect::Refuse(p)] = effects else { panic!("{effects:?}") };
        assert_eq!((p.code, p.grpc_status), (Code::ReplayFailed, g::RESOURCE_EXHAUSTED), "{p:?}");
    };
    // Declared too large: refused before a byte is read.
    let mut s = Machine::new(Rc::clone(&replay_cfg));
    exhausted(&s.on_request_headers(&hop(&[("content-length", &(cap + 1).to_string())]), false).effects);
    assert!(s.is_done());
    // Sent too large: refused as soon as Envoy has buffered more.
    let mut s = Machine::new(Rc::clone(&replay_cfg));
    let mut v = hop(&[]);
    v.request_body = vec![0; cap];
    assert_eq!(s.on_request_headers(&v, false), Step::pause(vec![]));
    assert_eq!(s.on_request_body(&v, cap, false), Step::pause(vec![]));
    exhausted(&s.on_request_body(&v, cap + 1, false).effects);
    assert!(s.is_done());
    // Up to the cap, declared and read: read.
    let mut s = Machine::new(replay_cfg);
    let v = hop(&[("content-length", &cap.to_string())]);
    assert_eq!(s.on_request_headers(&v, false), Step::pause(vec![]));
}
