use super::*;
use crate::detached::{UpstreamAnswer, UpstreamCall};
use crate::key::hex;
use crate::store::BeginAnswer;
use std::collections::HashMap;

/// A scripted host: headers, properties and bodies the test sets.
#[derive(Default)]
struct MockView {
    request: Vec<(String, Vec<u8>)>,
    response: Vec<(String, Vec<u8>)>,
    props: HashMap<String, Vec<u8>>,
    request_body: Vec<u8>,
    response_chunk: Vec<u8>,
}

impl MockView {
    fn post(key: Option<&str>) -> MockView {
        let mut v = MockView::default();
        v.req(":method", "POST").req(":path", "/orders?x=1");
        if let Some(k) = key {
            v.req("idempotency-key", k);
        }
        v.prop("source.address", "127.0.0.1:40000");
        v
    }

    fn req(&mut self, name: &str, value: &str) -> &mut Self {
        self.request.push((name.into(), value.as_bytes().to_vec()));
        self
    }

    fn resp(&mut self, name: &str, value: &str) -> &mut Self {
        self.response.push((name.into(), value.as_bytes().to_vec()));
        self
    }

    fn prop(&mut self, path: &str, value: &str) -> &mut Self {
        self.props.insert(path.into(), value.as_bytes().to_vec());
        self
    }
}

impl StreamView for MockView {
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.request.clone()
    }
    fn request_header(&self, name: &str) -> Vec<Vec<u8>> {
        self.request.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect()
    }
    fn response_header(&self, name: &str) -> Vec<Vec<u8>> {
        self.response.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.props.get(&path.join(".")).cloned()
    }
    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        self.request_body.get(start..start + len).map(<[u8]>::to_vec)
    }
    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        self.response_chunk.get(start..start + len).map(<[u8]>::to_vec)
    }
}

fn cfg(extra: &str) -> Rc<Config> {
    let json =
        format!(r#"{{"store_cluster":"idemstore","max_body_bytes":100,"max_record_bytes":50{extra}}}"#);
    Rc::new(Config::from_json(json.as_bytes()).unwrap())
}

fn sha_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn begin_call(effects: &[Effect]) -> (String, String) {
    for e in effects {
        if let Effect::Store(StoreCall::Begin { key, body_hash }) = e {
            return (key.clone(), body_hash.clone());
        }
    }
    panic!("no begin in {effects:?}")
}

fn respond_status(effects: &[Effect]) -> Option<u32> {
    effects.iter().find_map(|e| match e {
        Effect::Respond(r) => Some(r.status),
        _ => None,
    })
}

fn counts(effects: &[Effect]) -> Vec<Metric> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Count(m) => Some(*m),
            _ => None,
        })
        .collect()
}

/// A stream that has taken the lock with token `t1` for a request with body `{}`.
fn executing(extra: &str) -> (Stream, String) {
    let mut s = Stream::new(cfg(extra));
    let mut v = MockView::post(Some("k1"));
    v.request_body = b"{}".to_vec();
    assert_eq!(s.on_request_headers(&v, false).action, Action::Pause);
    let step = s.on_request_body(&v, 2, true);
    let (key, _) = begin_call(&step.effects);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
    (s, key)
}

fn release_of(key: &str) -> Vec<Effect> {
    vec![
        Effect::Store(StoreCall::Release { key: key.into(), token: "t1".into() }),
        Effect::Count(Metric::Released),
    ]
}

#[test]
fn unguarded_methods_and_keyless_requests_pass() {
    let mut s = Stream::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.request[0].1 = b"GET".to_vec();
    assert_eq!(s.on_request_headers(&v, true), Step::go(vec![]));
    assert!(s.is_settled());

    let mut s = Stream::new(cfg(""));
    assert_eq!(
        s.on_request_headers(&MockView::post(None), false),
        Step::go(vec![Effect::Count(Metric::Passthrough)])
    );
    // Nothing afterwards touches the stream.
    assert_eq!(s.on_request_body(&MockView::post(None), 5, true), Step::go(vec![]));
    assert_eq!(s.on_stream_end(), vec![]);
}

#[test]
fn require_key_and_malformed_keys_get_400() {
    let mut s = Stream::new(cfg(r#","require_key":true"#));
    let step = s.on_request_headers(&MockView::post(None), false);
    assert_eq!(step.action, Action::Pause);
    assert_eq!(respond_status(&step.effects), Some(400));
    assert_eq!(counts(&step.effects), vec![Metric::Rejected]);

    for bad in ["", "a b", "\"open"] {
        let mut s = Stream::new(cfg(""));
        let step = s.on_request_headers(&MockView::post(Some(bad)), false);
        assert_eq!(respond_status(&step.effects), Some(400), "{bad:?}");
        let Some(Effect::Respond(r)) = step.effects.first() else { panic!() };
        assert!(!String::from_utf8_lossy(&r.body).contains(bad) || bad.is_empty());
    }
    let mut s = Stream::new(cfg(""));
    let mut v = MockView::post(Some("a"));
    v.req("idempotency-key", "b");
    assert_eq!(respond_status(&s.on_request_headers(&v, false).effects), Some(400));
}

#[test]
fn declared_oversized_body_gets_413_before_buffering() {
    let mut s = Stream::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.req("content-length", "101");
    let step = s.on_request_headers(&v, false);
    assert_eq!(respond_status(&step.effects), Some(413));
    assert_eq!(counts(&step.effects), vec![Metric::Guarded, Metric::Rejected]);
    assert!(s.is_settled());
}

#[test]
fn streamed_oversized_body_gets_413() {
    let mut s = Stream::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.request_body = vec![b'x'; 101];
    s.on_request_headers(&v, false);
    assert_eq!(s.on_request_body(&v, 60, false), Step::pause(vec![]));
    let step = s.on_request_body(&v, 101, false);
    assert_eq!(respond_status(&step.effects), Some(413));
    assert_eq!(s.on_stream_end(), vec![], "no lock was taken");
}

#[test]
fn body_is_hashed_incrementally_and_trailers_end_it() {
    let mut s = Stream::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.request_body = b"hello world".to_vec();
    s.on_request_headers(&v, false);
    s.on_request_body(&v, 5, false);
    s.on_request_body(&v, 5, false); // no new bytes
    let step = s.on_request_body(&v, 11, false);
    assert_eq!(step, Step::pause(vec![]));
    let step = s.on_request_trailers();
    assert_eq!(step.action, Action::Pause);
    assert_eq!(begin_call(&step.effects).1, sha_hex(b"hello world"));
}

#[test]
fn headers_only_request_hashes_the_empty_body() {
    let mut s = Stream::new(cfg(""));
    let step = s.on_request_headers(&MockView::post(Some("k")), true);
    assert_eq!(step.action, Action::Pause);
    assert_eq!(counts(&step.effects), vec![Metric::Guarded]);
    assert_eq!(begin_call(&step.effects).1, sha_hex(b""));
    assert!(!s.is_settled());
}

#[test]
fn store_key_scope() {
    let key_for = |v: &MockView, extra: &str| {
        let mut s = Stream::new(cfg(extra));
        begin_call(&s.on_request_headers(v, true).effects).0
    };
    let base = MockView::post(Some("k"));
    let k = key_for(&base, "");
    assert_eq!(k, crate::key::store_key("anon:127.0.0.1", "POST", "/orders", "k"));
    // A new connection (port) is the same caller; the query is not part of the route.
    let mut other_port = MockView::post(Some("k"));
    other_port.prop("source.address", "127.0.0.1:50000");
    other_port.request[1].1 = b"/orders?x=2".to_vec();
    assert_eq!(key_for(&other_port, ""), k);
    let mut named = MockView::post(Some("k"));
    named.prop("xds.route_name", "orders");
    assert_eq!(key_for(&named, ""), crate::key::store_key("anon:127.0.0.1", "POST", "orders", "k"));
    let mut other_ip = MockView::post(Some("k"));
    other_ip.prop("source.address", "127.0.0.2:40000");
    assert_ne!(key_for(&other_ip, ""), k);
    // `"k"` and `k` are one key.
    assert_eq!(key_for(&MockView::post(Some("\"k\"")), ""), k);

    let mut alice = MockView::post(Some("k"));
    alice.req("x-user", "alice");
    let header = r#","subject":{"header":"x-user"}"#;
    assert_eq!(key_for(&alice, header), crate::key::store_key("id:alice", "POST", "/orders", "k"));
    // Without the header the caller is anonymous.
    assert_eq!(key_for(&base, header), k);

    let mut jwt = MockView::post(Some("k"));
    jwt.prop("metadata.filter_metadata.envoy.filters.http.jwt_authn.payload.sub", "user-1");
    let meta =
        r#","subject":{"metadata":{"filter":"envoy.filters.http.jwt_authn","path":["payload","sub"]}}"#;
    assert_eq!(key_for(&jwt, meta), crate::key::store_key("id:user-1", "POST", "/orders", "k"));
}

#[test]
fn begin_answers_replay_reject_or_execute() {
    let record = Record {
        status: 201,
        headers: vec![("location".into(), "/orders/1".into())],
        body: b"{\"id\":1}".to_vec(),
    };
    let cases: Vec<(BeginAnswer, Option<u32>, Metric)> = vec![
        (BeginAnswer::Replay(record.clone()), Some(201), Metric::Replayed),
        (BeginAnswer::Mismatch, Some(422), Metric::Mismatched),
        (BeginAnswer::Busy, Some(409), Metric::Conflicted),
        (BeginAnswer::Locked { token: "t".into() }, None, Metric::Executed),
    ];
    for (answer, status, metric) in cases {
        let mut s = Stream::new(cfg(""));
        s.on_request_headers(&MockView::post(Some("k")), true);
        let effects = s.on_begin_answer(Ok(answer));
        assert_eq!(respond_status(&effects), status);
        assert_eq!(counts(&effects), vec![metric]);
        assert!(s.is_settled());
        // A second answer (duplicate delivery) does nothing.
        assert_eq!(s.on_begin_answer(Ok(BeginAnswer::Busy)), vec![]);
    }
    let mut s = Stream::new(cfg(r#","replay_header":"x-replayed""#));
    s.on_request_headers(&MockView::post(Some("k")), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Replay(record)));
    let Effect::Respond(r) = &effects[0] else { panic!() };
    assert_eq!(r.status, 201);
    assert_eq!(r.body, b"{\"id\":1}");
    assert_eq!(
        r.headers,
        vec![("location".into(), "/orders/1".into()), ("x-replayed".into(), "true".into())]
    );
}

#[test]
fn store_faults_fail_open_or_closed() {
    let faults = [
        StoreFault::Dispatch,
        StoreFault::Reset,
        StoreFault::Timeout,
        StoreFault::Status(500),
        StoreFault::Garbage("bad magic"),
    ];
    for fault in faults {
        let mut s = Stream::new(cfg(""));
        s.on_request_headers(&MockView::post(Some("k")), true);
        assert_eq!(s.on_begin_answer(Err(fault)), vec![Effect::Resume, Effect::Count(Metric::Degraded)]);
        // Ran unguarded: the response is not captured and nothing is released.
        let mut v = MockView::default();
        v.resp(":status", "201").resp("content-type", "application/json");
        assert_eq!(s.on_response_headers(&v, true), Step::go(vec![]));
        assert_eq!(s.on_stream_end(), vec![]);

        let mut s = Stream::new(cfg(r#","failure_mode":"closed""#));
        s.on_request_headers(&MockView::post(Some("k")), true);
        let effects = s.on_begin_answer(Err(fault));
        assert_eq!(respond_status(&effects), Some(503));
        assert_eq!(counts(&effects), vec![Metric::Degraded, Metric::Unavailable]);
    }
}

#[test]
fn json_2xx_is_committed_with_allow_listed_headers() {
    let (mut s, key) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "201")
        .resp("content-type", "application/json")
        .resp("location", "/orders/7")
        .resp("set-cookie", "session=secret")
        .resp("x-other", "no");
    assert_eq!(s.on_response_headers(&v, false), Step::go(vec![]));
    v.response_chunk = b"{\"id\":".to_vec();
    assert_eq!(s.on_response_body(&v, 6, false), Step::go(vec![]));
    v.response_chunk = b"7}".to_vec();
    let step = s.on_response_body(&v, 2, true);
    assert_eq!(step.action, Action::Continue);
    let [Effect::Store(StoreCall::Commit { key: k, token, body_hash, record })] = step.effects.as_slice()
    else {
        panic!("{:?}", step.effects)
    };
    assert_eq!((k, token.as_str(), body_hash.clone()), (&key, "t1", sha_hex(b"{}")));
    let record = Record::decode(record).unwrap();
    assert_eq!(record.status, 201);
    assert_eq!(record.body, b"{\"id\":7}");
    assert_eq!(
        record.headers,
        vec![("content-type".into(), "application/json".into()), ("location".into(), "/orders/7".into())]
    );
    assert_eq!(s.on_stream_end(), vec![], "committed: nothing left to release");
}

#[test]
fn bare_204_is_committed_at_headers() {
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "204");
    let step = s.on_response_headers(&v, true);
    let [Effect::Store(StoreCall::Commit { record, .. })] = step.effects.as_slice() else { panic!() };
    assert_eq!(Record::decode(record).unwrap(), Record { status: 204, headers: vec![], body: vec![] });
}

#[test]
fn unstorable_responses_release_the_lock() {
    let cases: [&[(&str, &str)]; 5] = [
        &[(":status", "500"), ("content-type", "application/json")],
        &[(":status", "400"), ("content-type", "application/json")],
        &[(":status", "302"), ("location", "/x")],
        &[(":status", "200"), ("content-type", "text/plain")],
        &[(":status", "200"), ("content-type", "application/json"), ("content-length", "51")],
    ];
    for headers in cases {
        let (mut s, key) = executing("");
        let mut v = MockView::default();
        for (n, val) in headers {
            v.resp(n, val);
        }
        assert_eq!(s.on_response_headers(&v, false), Step::go(release_of(&key)), "{headers:?}");
        assert_eq!(s.on_response_body(&v, 0, true), Step::go(vec![]));
        assert_eq!(s.on_stream_end(), vec![]);
    }
}

#[test]
fn untyped_body_and_oversized_stream_release_at_the_end() {
    let (mut s, key) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200");
    s.on_response_headers(&v, false);
    v.response_chunk = b"plain".to_vec();
    assert_eq!(s.on_response_body(&v, 5, true), Step::go(release_of(&key)));

    let (mut s, key) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    v.response_chunk = vec![b' '; 30];
    assert_eq!(s.on_response_body(&v, 30, false), Step::go(vec![]));
    assert_eq!(s.on_response_body(&v, 30, false), Step::go(release_of(&key)), "over max_record_bytes");
    assert_eq!(s.on_response_body(&v, 0, true), Step::go(vec![]));
}

#[test]
fn response_trailers_end_the_capture() {
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    v.response_chunk = b"{}".to_vec();
    s.on_response_body(&v, 2, false);
    let step = s.on_response_trailers();
    assert!(matches!(step.effects.as_slice(), [Effect::Store(StoreCall::Commit { .. })]));
}

#[test]
fn reset_or_client_gone_releases_the_lock() {
    let (mut s, key) = executing("");
    assert_eq!(s.on_stream_end(), release_of(&key), "upstream reset before any response");

    let (mut s, key) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    assert_eq!(s.on_stream_end(), release_of(&key), "client gone mid-response");
    assert_eq!(s.on_stream_end(), vec![]);
}

#[test]
fn stream_ending_while_begin_is_pending_releases_a_late_lock() {
    let mut s = Stream::new(cfg(""));
    let key = begin_call(&s.on_request_headers(&MockView::post(Some("k")), true).effects).0;
    assert_eq!(s.on_stream_end(), vec![]);
    assert!(!s.is_settled(), "the entry must outlive the stream until begin answers");
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, release_of(&key), "no Resume for a stream that is gone");
    assert!(s.is_settled());

    for answer in [Ok(BeginAnswer::Busy), Ok(BeginAnswer::Mismatch), Err(StoreFault::Timeout)] {
        let mut s = Stream::new(cfg(""));
        s.on_request_headers(&MockView::post(Some("k")), true);
        s.on_stream_end();
        assert_eq!(s.on_begin_answer(answer), vec![]);
        assert!(s.is_settled());
    }
}

#[test]
fn envoy_answering_while_begin_is_pending_orphans_the_call() {
    // E.g. the stream idle timeout fires while the store holds `begin`: Envoy sends a 504 local
    // reply through this filter; the request never reaches the upstream.
    let mut s = Stream::new(cfg(""));
    let key = begin_call(&s.on_request_headers(&MockView::post(Some("k")), true).effects).0;
    let mut v = MockView::default();
    v.resp(":status", "504");
    assert_eq!(s.on_response_headers(&v, true), Step::go(vec![]));
    assert_eq!(s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() })), release_of(&key));
}

/// Random event sequences: the machine never answers twice, never resumes after answering, and
/// every lock it is handed ends in exactly one commit or release.
#[test]
fn random_event_sequences_keep_the_invariants() {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for _ in 0..5000 {
        let mut s = Stream::new(cfg([r#""#, r#","failure_mode":"closed""#, DETACHED][next(3) as usize]));
        let mut v = MockView::post(if next(5) == 0 { None } else { Some("k") });
        v.prop("xds.cluster_name", "app");
        v.request_body = vec![b'x'; 120];
        v.response_chunk = vec![b'y'; 40];
        let statuses = ["200", "201", "204", "500", "302"];
        v.resp(":status", statuses[next(5) as usize]);
        if next(2) == 0 {
            v.resp("content-type", "application/json");
        }
        let mut responded = 0;
        let mut resumed = false;
        let mut locks = 0;
        let mut settled_locks = 0;
        let mut tally = |effects: &[Effect], responded: &mut i32, resumed: &mut bool| {
            for e in effects {
                match e {
                    Effect::Respond(_) => *responded += 1,
                    Effect::Resume => {
                        assert_eq!(*responded, 0, "resume after a local answer");
                        *resumed = true;
                    }
                    Effect::Store(StoreCall::Commit { .. } | StoreCall::Release { .. }) => settled_locks += 1,
                    _ => {}
                }
            }
        };
        let mut trace = Vec::new();
        for _ in 0..12 {
            let ev = next(10);
            trace.push(ev);
            let effects = match ev {
                0 => s.on_request_headers(&v, next(2) == 0).effects,
                1 => s.on_request_body(&v, next(121) as usize, next(2) == 0).effects,
                2 => s.on_request_trailers().effects,
                3 => {
                    let answer = match next(6) {
                        0 => Ok(BeginAnswer::Busy),
                        1 => Ok(BeginAnswer::Mismatch),
                        2 => Ok(BeginAnswer::Replay(Record { status: 200, headers: vec![], body: vec![] })),
                        3 => Err(StoreFault::Reset),
                        _ => {
                            let pending = matches!(s.state, State::Beginning { .. } | State::Orphaned { .. });
                            if pending {
                                locks += 1;
                            }
                            Ok(BeginAnswer::Locked { token: "t".into() })
                        }
                    };
                    s.on_begin_answer(answer)
                }
                4 | 5 => s.on_response_headers(&v, next(3) == 0).effects,
                6 | 7 => s.on_response_body(&v, next(41) as usize, next(3) == 0).effects,
                8 => s.on_response_trailers().effects,
                9 if next(2) == 0 => {
                    let a = ["201", "500"][next(2) as usize];
                    s.on_upstream_answer(if next(4) == 0 {
                        Err(StoreFault::Timeout)
                    } else {
                        Ok(answer(a, None, b""))
                    })
                }
                _ => s.on_stream_end(),
            };
            tally(&effects, &mut responded, &mut resumed);
        }
        let effects = s.on_stream_end();
        tally(&effects, &mut responded, &mut resumed);
        if !s.is_settled() {
            // A call still pending when the test stops: its answer settles it.
            if matches!(s.state, State::Detached { .. }) {
                let effects = s.on_upstream_answer(Ok(answer("201", None, b"")));
                tally(&effects, &mut responded, &mut resumed);
            } else {
                let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t".into() }));
                locks += 1;
                tally(&effects, &mut responded, &mut resumed);
            }
        }
        assert!(responded <= 1, "two local answers");
        assert_eq!(
            locks, settled_locks,
            "every lock is committed or released exactly once: {trace:?} {:?}",
            s.state
        );
        assert!(s.is_settled());
    }
}

const DETACHED: &str = r#","detached_execution":true,"store_key_header":"x-store-key""#;

/// A detached stream that has taken the lock: returns the stream, the store key and the call.
fn detached_locked() -> (Stream, String, UpstreamCall) {
    let mut s = Stream::new(cfg(DETACHED));
    let mut v = MockView::post(Some("k1"));
    v.req("x-request-id", "rid-1").req("content-length", "2").req("x-store-key", "forged");
    v.prop("xds.cluster_name", "app");
    v.request_body = b"{}".to_vec();
    let step = s.on_request_headers(&v, false);
    let key = begin_call(&s.on_request_body(&v, 2, true).effects).0;
    assert!(step.effects.contains(&Effect::SetRequestHeader("x-store-key".into(), key.clone())));
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    let [Effect::Upstream(call), Effect::Count(Metric::Executed), Effect::Count(Metric::Detached)] =
        effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    (s, key, call.clone())
}

fn answer(status: &str, content_type: Option<&str>, body: &[u8]) -> UpstreamAnswer {
    let mut headers = vec![(":status".to_string(), status.as_bytes().to_vec())];
    if let Some(ct) = content_type {
        headers.push(("content-type".into(), ct.as_bytes().to_vec()));
    }
    headers.push(("location".into(), b"/orders/9".to_vec()));
    UpstreamAnswer::decode(headers, body.to_vec()).unwrap()
}

#[test]
fn detached_execution_sends_the_request_itself() {
    let (s, key, call) = detached_locked();
    assert_eq!(call.cluster, "app");
    assert_eq!(call.body, b"{}");
    assert_eq!(call.timeout_ms, 15_000);
    let get =
        |n: &str| call.headers.iter().filter(|(h, _)| h == n).map(|(_, v)| v.as_str()).collect::<Vec<_>>();
    assert_eq!(get(":method"), ["POST"]);
    assert_eq!(get(":path"), ["/orders?x=1"]);
    assert_eq!(get("x-request-id"), ["rid-1"]);
    assert_eq!(get("x-store-key"), [key.as_str()], "the client's value is replaced");
    assert!(get("content-length").is_empty(), "framing is the callout's own");
    assert!(!s.is_settled(), "the answer is still to come");
}

#[test]
fn detached_answer_goes_to_the_client_and_the_store() {
    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("201", Some("application/json"), b"{\"id\":9}")));
    let [Effect::Respond(r), Effect::Store(StoreCall::Commit { key: k, record, .. })] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((r.status, r.body.as_slice()), (201, b"{\"id\":9}".as_slice()));
    assert!(r.headers.contains(&("location".into(), "/orders/9".into())));
    assert_eq!(k, &key);
    let record = Record::decode(record).unwrap();
    assert_eq!(record.status, 201);
    assert!(s.is_settled());
    // The local reply passes through the filter again: nothing happens.
    let mut v = MockView::default();
    v.resp(":status", "201").resp("content-type", "application/json");
    assert_eq!(s.on_response_headers(&v, true), Step::go(vec![]));
    assert_eq!(s.on_stream_end(), vec![]);
}

#[test]
fn detached_answer_after_the_client_left_is_still_committed() {
    let (mut s, _, _) = detached_locked();
    assert_eq!(s.on_stream_end(), vec![], "the call goes on");
    assert!(!s.is_settled());
    let effects = s.on_upstream_answer(Ok(answer("200", Some("application/json"), b"{}")));
    assert!(matches!(
        effects.as_slice(),
        [Effect::Store(StoreCall::Commit { .. }), Effect::Count(Metric::CommittedAfterGone)]
    ));
    assert!(s.is_settled());
}

#[test]
fn detached_failures_release_the_lock() {
    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("500", Some("application/json"), b"{}")));
    assert_eq!(respond_status(&effects), Some(500));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/plain"), b"hi")));
    assert_eq!(respond_status(&effects), Some(200));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Err(StoreFault::Reset));
    assert_eq!(respond_status(&effects), Some(502));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Err(StoreFault::Timeout));
    assert_eq!(respond_status(&effects), Some(504));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    s.on_stream_end();
    assert_eq!(s.on_upstream_answer(Err(StoreFault::Reset)), release_of(&key));
}

#[test]
fn without_a_cluster_the_request_is_routed_normally() {
    let mut s = Stream::new(cfg(DETACHED));
    s.on_request_headers(&MockView::post(Some("k")), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
}

#[test]
fn store_key_header_is_set_for_guarded_and_removed_from_other_requests() {
    let mut s = Stream::new(cfg(DETACHED));
    let mut v = MockView::post(None);
    v.req("x-store-key", "forged");
    let step = s.on_request_headers(&v, true);
    assert_eq!(step.effects[0], Effect::RemoveRequestHeader("x-store-key".into()));
    let mut s = Stream::new(cfg(DETACHED));
    assert_eq!(
        s.on_request_headers(&MockView::post(None), true).effects,
        vec![Effect::Count(Metric::Passthrough)]
    );
}
