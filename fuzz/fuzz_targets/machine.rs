//! The per-request state machine fed random configurations, requests and event sequences through
//! the shared driver (`idempotency_filter::sim::request`), which checks after every event: at most one
//! local answer and one execution (never both a local answer and a resume, nothing after the
//! stream ended), one well-formed `begin`, every granted lock committed or released exactly once,
//! committed records that replay, answers to calls not pending ignored, and a settled stream once
//! every pending call is answered. The unit test `random_event_sequences_keep_the_invariants`
//! runs the same driver on a fixed pseudo-random sample.
//!
//! The configurations use the record-v2 keys too (`fingerprint_headers`, `fingerprint_json` with
//! `ignore`, `store_statuses` with 4xx/5xx, `store_content_types`, `record_too_large`,
//! `body_omitted_header`, `lock_wait_ms: 0`); responses have kept and refused statuses, streams
//! and other content types, codings and lengths around `max_record_bytes`; replayed records
//! carry this request's print, another one's or none, codings the request may refuse, omitted
//! bodies; `busy` answers carry the lock's remaining time or not.

#![no_main]

use std::rc::Rc;

use arbitrary::Arbitrary;
use fuzz_common::{ArbRecord, Bytes, Digest, Name, Status};
use idempotency_filter::config::Config;
use idempotency_filter::request::detached::UpstreamAnswer;
use idempotency_filter::sim::request::{Driver, Event, MockView};
use idempotency_filter::store::client::{BeginAnswer, CalloutFault};
use idempotency_filter::store::record::RequestPrint;
use libfuzzer_sys::fuzz_target;

const MAX_EVENTS: usize = 48;
const SIZES: [usize; 6] = [0, 1, 8, 50, 100, 1_048_576];
const REPLAY_HEADERS: [&str; 4] = ["content-type", "location", "etag", "link"];
const FINGERPRINT_HEADERS: [&str; 3] = ["x-tenant", "content-type", "accept-encoding"];
const IGNORE: [&str; 4] = ["/client_sent_at", "/items/1", "/meta/trace", "/a~1b"];

#[derive(Arbitrary, Debug)]
struct Knobs {
    failure_closed: bool,
    detached: bool,
    store_key_header: bool,
    require_key: bool,
    methods_put: bool,
    /// `pause_on_headers: false`, the mode Istio can configure.
    continue_on_headers: bool,
    max_key_length: u8,
    max_body: u8,
    max_record: u8,
    /// Bit i: `REPLAY_HEADERS[i]` is allow-listed.
    replay_headers: u8,
    /// 0: client IP, 1: a header, 2: JWT metadata.
    subject: u8,
    /// Inbox mode: 0 off (most inputs), 1 CloudEvents, 2 a header, 3 a JSON pointer; bit 2:
    /// `missing_id: pass`; bit 3: `duplicate_status: 200`.
    inbox: u8,
    /// Bit i < 3: `FINGERPRINT_HEADERS[i]` is fingerprinted; bit 3: `fingerprint_json`, bit 4
    /// not `canonical`, bits 5..=6: how many of `IGNORE` it ignores.
    fingerprint: u8,
    /// Bits 0..=2: `store_statuses` (`STATUSES`); bits 3..=4: `store_content_types`
    /// (`CONTENT_TYPES`); bit 5: `record_too_large: release`; bit 6: `lock_wait_ms: 0`; bit 7: a
    /// `body_omitted_header` of its own.
    keep: u8,
    /// `unknown_outcome`: 0 `hold` (the default, left out), 1 `run_again`, 2 `hold` with
    /// `outcome_lookup` (and so `store_key_header`).
    unknown: u8,
}

/// `store_statuses` choices (`null`: the key is left out).
fn statuses(i: u8) -> serde_json::Value {
    use serde_json::json;
    match i % 6 {
        1 => json!(["2xx", "404"]),
        2 => json!(["4xx", "5xx"]),
        3 => json!(["2xx", "3xx", "4xx", "5xx"]),
        4 => json!([500, "201", 409]),
        5 => json!(["2XX"]),
        _ => serde_json::Value::Null,
    }
}

/// `store_content_types` choices.
fn content_types(i: u8) -> serde_json::Value {
    use serde_json::json;
    match i % 4 {
        1 => json!(["application/json", "+json"]),
        2 => json!(["text/*"]),
        3 => json!(["*/*"]),
        _ => serde_json::Value::Null,
    }
}

impl Knobs {
    fn config(&self) -> Option<Config> {
        let replay: Vec<&str> = REPLAY_HEADERS
            .iter()
            .enumerate()
            .filter(|(i, _)| self.replay_headers & (1 << i) != 0)
            .map(|(_, h)| *h)
            .collect();
        let mut json = serde_json::json!({
            "store_cluster": "idemstore",
            "failure_mode": if self.failure_closed { "closed" } else { "open" },
            "detached_execution": self.detached,
            "require_key": self.require_key,
            "max_key_length": u64::from(self.max_key_length) + 1,
            "max_body_bytes": SIZES[usize::from(self.max_body) % SIZES.len()],
            "max_record_bytes": SIZES[usize::from(self.max_record) % SIZES.len()],
            "replay_headers": replay,
        });
        if self.store_key_header || self.unknown % 3 == 2 {
            json["store_key_header"] = "x-store-key".into();
        }
        match self.unknown % 3 {
            1 => json["unknown_outcome"] = "run_again".into(),
            2 => json["outcome_lookup"] = serde_json::json!({"path": "/orders/by-key/{key}"}),
            _ => {}
        }
        if self.continue_on_headers {
            json["pause_on_headers"] = false.into();
        }
        if self.methods_put {
            json["methods"] = serde_json::json!(["PUT", "POST"]);
        }
        match self.subject % 3 {
            1 => json["subject"] = serde_json::json!({"header": "x-user"}),
            2 => {
                json["subject"] = serde_json::json!({"metadata": {"filter": "envoy.filters.http.jwt_authn", "path": ["payload", "sub"]}})
            }
            _ => {}
        }
        if !self.inbox.is_multiple_of(4) {
            let message_id = match self.inbox % 4 {
                1 => serde_json::json!("cloudevents"),
                2 => serde_json::json!({"header": "x-message-id"}),
                _ => serde_json::json!({"json_pointer": "/message/messageId"}),
            };
            let mut inbox = serde_json::json!({"message_id": message_id});
            if self.inbox & 4 != 0 {
                inbox["missing_id"] = "pass".into();
            }
            if self.inbox & 8 != 0 {
                inbox["duplicate_status"] = 200.into();
            }
            json["mode"] = "inbox".into();
            json["inbox"] = inbox;
        }
        let inbox = !self.inbox.is_multiple_of(4);
        // Record-v2 keys; inbox mode refuses the request-side ones, so they are left out there.
        if !inbox {
            let names: Vec<&str> = FINGERPRINT_HEADERS
                .iter()
                .enumerate()
                .filter(|(i, _)| self.fingerprint & (1 << i) != 0)
                .map(|(_, h)| *h)
                .collect();
            if !names.is_empty() {
                json["fingerprint_headers"] = serde_json::json!(names);
            }
            if self.fingerprint & 8 != 0 {
                let ignore = &IGNORE[..usize::from((self.fingerprint >> 5) & 3) + 1];
                json["fingerprint_json"] =
                    serde_json::json!({"canonical": self.fingerprint & 16 == 0, "ignore": ignore});
            }
            let statuses = statuses(self.keep & 7);
            if !statuses.is_null() {
                json["store_statuses"] = statuses;
            }
            if self.keep & 32 != 0 {
                json["record_too_large"] = "release".into();
            }
        }
        let types = content_types((self.keep >> 3) & 3);
        if !types.is_null() {
            json["store_content_types"] = types;
        }
        if self.keep & 64 != 0 {
            json["lock_wait_ms"] = 0.into();
        }
        if self.keep & 128 != 0 {
            json["body_omitted_header"] = "x-omitted".into();
        }
        // Inbox mode refuses some combinations (require_key, subject): those inputs are skipped.
        Config::from_json(json.to_string().as_bytes()).ok()
    }
}

#[derive(Arbitrary, Debug)]
enum Method {
    Post,
    Patch,
    Put,
    Get,
    Raw(Vec<u8>),
    Missing,
}

#[derive(Arbitrary, Debug)]
enum KeyValue {
    Good(u8),
    Quoted(u8),
    Raw(Bytes),
}

#[derive(Arbitrary, Debug)]
struct Request {
    method: Method,
    keys: Vec<KeyValue>,
    content_length: Option<Bytes>,
    path: Option<Bytes>,
    source_address: Option<Bytes>,
    route_name: Option<Bytes>,
    cluster_name: Option<Bytes>,
    user: Option<Bytes>,
    jwt_sub: Option<Bytes>,
    forged_store_key: bool,
    /// Inbox mode's sources: `ce-id`, `ce-source`, `x-message-id`, a content type.
    ce_id: Option<Bytes>,
    ce_source: Option<Bytes>,
    message_id: Option<Bytes>,
    content_type: Option<ContentType>,
    /// The `grpc-status` trailer of the answer (a code 0..=16, or past it: not a status).
    trailer_status: Option<u8>,
    /// `accept-encoding` values (a replay in a coding they refuse is a `406`).
    accept_encoding: Vec<Bytes>,
    /// A fingerprinted header.
    tenant: Option<Bytes>,
    other: Vec<(Name, Bytes)>,
    body: Bytes,
}

impl Request {
    fn view(&self) -> MockView {
        let mut v = MockView::default();
        let method: Option<Vec<u8>> = match &self.method {
            Method::Post => Some(b"POST".to_vec()),
            Method::Patch => Some(b"PATCH".to_vec()),
            Method::Put => Some(b"PUT".to_vec()),
            Method::Get => Some(b"GET".to_vec()),
            Method::Raw(m) => Some(m.clone()),
            Method::Missing => None,
        };
        if let Some(m) = method {
            v.request.push((":method".into(), m));
        }
        let path = self.path.as_ref().map_or(b"/orders?x=1".to_vec(), Bytes::to_vec);
        v.request.push((":path".into(), path));
        for k in self.keys.iter().take(3) {
            let value = match k {
                KeyValue::Good(n) => format!("key-{n}").into_bytes(),
                KeyValue::Quoted(n) => format!("\"key {n}\"").into_bytes(),
                KeyValue::Raw(b) => b.to_vec(),
            };
            v.request.push(("idempotency-key".into(), value));
        }
        if let Some(cl) = &self.content_length {
            v.request.push(("content-length".into(), cl.to_vec()));
        }
        if let Some(u) = &self.user {
            v.request.push(("x-user".into(), u.to_vec()));
        }
        if self.forged_store_key {
            v.request.push(("x-store-key".into(), b"forged".to_vec()));
        }
        for (name, value) in
            [("ce-id", &self.ce_id), ("ce-source", &self.ce_source), ("x-message-id", &self.message_id)]
        {
            if let Some(value) = value {
                v.request.push((name.into(), value.to_vec()));
            }
        }
        if let Some(ct) = &self.content_type {
            v.request.push(("content-type".into(), ct.request_value()));
        }
        if let Some(code) = self.trailer_status {
            v.response_trailers = vec![("grpc-status".into(), (code % 20).to_string().into_bytes())];
        }
        for ae in self.accept_encoding.iter().take(2) {
            v.request.push(("accept-encoding".into(), ae.to_vec()));
        }
        if let Some(t) = &self.tenant {
            v.request.push(("x-tenant".into(), t.to_vec()));
        }
        for (n, val) in self.other.iter().take(8) {
            v.request.push((n.name(), val.to_vec()));
        }
        let source = self.source_address.as_ref().map_or(b"127.0.0.1:40000".to_vec(), Bytes::to_vec);
        v.props.insert("source.address".into(), source);
        if let Some(r) = &self.route_name {
            v.props.insert("xds.route_name".into(), r.to_vec());
        }
        if let Some(c) = &self.cluster_name {
            v.props.insert("xds.cluster_name".into(), c.to_vec());
        }
        if let Some(s) = &self.jwt_sub {
            v.props.insert(
                "metadata.filter_metadata.envoy.filters.http.jwt_authn.payload.sub".into(),
                s.to_vec(),
            );
        }
        v.request_body = self.body.to_vec();
        v
    }
}

#[derive(Arbitrary, Debug)]
enum Begin {
    Replay(ArbRecord, PrintOf),
    Locked,
    Busy(LockMs),
    Mismatch,
    Fault(Fault),
    /// In doubt; `true`: the first attempt may still be running.
    InDoubt(bool),
}

/// Envoy's `response.code_details` for the response headers, and the router's tries.
#[derive(Arbitrary, Debug)]
enum Details {
    ViaUpstream,
    Timeout,
    ResetAfterSent,
    Refused,
    NoHealthyUpstream,
    BeforeRouter,
    Raw(Bytes),
}

impl Details {
    fn details(&self) -> String {
        match self {
            Details::ViaUpstream => "via_upstream".into(),
            Details::Timeout => "response_timeout".into(),
            Details::ResetAfterSent => "upstream_reset_before_response_started{connection_termination}".into(),
            Details::Refused => {
                "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}".into()
            }
            Details::NoHealthyUpstream => "no_healthy_upstream".into(),
            Details::BeforeRouter => "request_payload_too_large".into(),
            Details::Raw(b) => String::from_utf8_lossy(&b.to_vec()).into_owned(),
        }
    }
}

/// Which request a replayed record says it answers.
#[derive(Arbitrary, Debug)]
enum PrintOf {
    /// This one (a replay, unless a coding is refused).
    This,
    /// This one but for one fingerprinted header's value (a `422`, if that header is configured).
    OtherHeader(u8, Digest),
    /// Another target (a `422`).
    OtherTarget(Digest),
    /// None (a first-format or inbox record).
    Nothing,
    /// Whatever the record has.
    AsGenerated,
}

/// The lock's remaining time on `busy`, as the store decodes it (1 ..= its longest TTL), or not.
#[derive(Arbitrary, Debug)]
enum LockMs {
    Absent,
    Short(u16),
    Any(u64),
    Longest,
}

impl LockMs {
    fn ms(&self) -> Option<u64> {
        let max = idem_protocol::MAX_LOCK_TTL_MS;
        match self {
            LockMs::Absent => None,
            LockMs::Short(n) => Some(u64::from(*n) + 1),
            LockMs::Any(n) => Some(n % max + 1),
            LockMs::Longest => Some(max),
        }
    }
}

/// What the events need from the configuration and the request.
struct Ctx {
    max_record: usize,
    /// The request's print as the filter computes it (`None` when it is not guarded).
    print: RequestPrint,
}

impl Ctx {
    fn new(cfg: &Config, view: &MockView) -> Ctx {
        let first = |name: &str| {
            view.request.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).unwrap_or_default()
        };
        let header = |name: &str| -> Vec<Vec<u8>> {
            view.request.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect()
        };
        let print = RequestPrint::of(&first(":method"), &first(":path"), &cfg.fingerprint_headers, &header);
        Ctx { max_record: cfg.max_record_bytes, print }
    }

    fn record(&self, arb: &ArbRecord, print_of: &PrintOf) -> idempotency_filter::store::record::Record {
        let mut r = arb.to_record();
        r.print = match print_of {
            PrintOf::This => Some(self.print.clone()),
            PrintOf::OtherHeader(i, d) => {
                let mut p = self.print.clone();
                if !p.headers.is_empty() {
                    let n = usize::from(*i) % p.headers.len();
                    p.headers[n].1 = d.bytes();
                }
                Some(p)
            }
            PrintOf::OtherTarget(d) => Some(RequestPrint { target: d.bytes(), ..self.print.clone() }),
            PrintOf::Nothing => None,
            PrintOf::AsGenerated => r.print,
        };
        r
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Fault {
    Dispatch,
    Reset,
    Timeout,
    Status(u16),
    Garbage,
}

impl Fault {
    fn fault(self) -> CalloutFault {
        match self {
            Fault::Dispatch => CalloutFault::Dispatch,
            Fault::Reset => CalloutFault::Reset,
            Fault::Timeout => CalloutFault::Timeout,
            Fault::Status(s) => CalloutFault::Status(s),
            Fault::Garbage => CalloutFault::Garbage("fuzz"),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum ContentType {
    Json,
    ProblemJson,
    Text,
    EventStream,
    Grpc,
    Xml,
    Raw(Bytes),
}

impl ContentType {
    /// As a request's content type: the JSON ones stand for structured and batched CloudEvents.
    fn request_value(&self) -> Vec<u8> {
        match self {
            ContentType::Json => b"application/cloudevents+json; charset=utf-8".to_vec(),
            ContentType::ProblemJson => b"application/cloudevents-batch+json".to_vec(),
            ContentType::Text => b"application/json".to_vec(),
            ContentType::EventStream => b"text/plain".to_vec(),
            ContentType::Grpc => b"application/grpc".to_vec(),
            ContentType::Xml => b"application/xml".to_vec(),
            ContentType::Raw(b) => b.to_vec(),
        }
    }
}

/// A response's `content-length`: any, or near `max_record_bytes`.
#[derive(Arbitrary, Debug)]
enum Length {
    Exact(u32),
    NearRecordLimit(i8),
    Garbage(Bytes),
}

#[derive(Arbitrary, Debug)]
struct Response {
    status: Option<Status>,
    content_type: Option<ContentType>,
    content_encoding: Option<Bytes>,
    content_length: Option<Length>,
    headers: Vec<(Name, Bytes)>,
    /// `count` more values of one header (more than a record holds).
    repeat: Option<(Name, u8)>,
}

impl Response {
    fn headers(&self, ctx: &Ctx) -> Vec<(String, Vec<u8>)> {
        let mut h = Vec::new();
        if let Some(s) = self.status {
            h.push((":status".to_string(), s.code().to_string().into_bytes()));
        }
        if let Some(ct) = &self.content_type {
            let v = match ct {
                ContentType::Json => b"application/json".to_vec(),
                ContentType::ProblemJson => b"application/problem+json; charset=utf-8".to_vec(),
                ContentType::Text => b"text/plain".to_vec(),
                ContentType::EventStream => b"text/event-stream".to_vec(),
                ContentType::Grpc => b"application/grpc".to_vec(),
                ContentType::Xml => b"application/xml".to_vec(),
                ContentType::Raw(b) => b.to_vec(),
            };
            h.push(("content-type".to_string(), v));
        }
        if let Some(ce) = &self.content_encoding {
            h.push(("content-encoding".to_string(), ce.to_vec()));
        }
        if let Some(n) = &self.content_length {
            let v = match n {
                Length::Exact(n) => n.to_string().into_bytes(),
                Length::NearRecordLimit(d) => {
                    (ctx.max_record as i64 + i64::from(*d)).max(0).to_string().into_bytes()
                }
                Length::Garbage(b) => b.to_vec(),
            };
            h.push(("content-length".to_string(), v));
        }
        for (n, v) in self.headers.iter().take(16) {
            h.push((n.name(), v.to_vec()));
        }
        if let Some((n, count)) = &self.repeat {
            for i in 0..*count {
                h.push((n.name(), format!("v{i}").into_bytes()));
            }
        }
        h
    }
}

#[derive(Arbitrary, Debug)]
enum Upstream {
    Answer(Response, Bytes),
    Fault(Fault),
}

#[derive(Arbitrary, Debug)]
enum Ev {
    RequestHeaders(bool),
    RequestBody(u32, bool),
    RequestTrailers,
    Begin(Begin),
    ResponseHeaders(Response, Option<Details>, bool),
    ResponseBody(Bytes, bool),
    ResponseTrailers,
    Upstream(Upstream),
    StreamEnd,
}

impl Ev {
    fn event(&self, ctx: &Ctx) -> Event {
        match self {
            Ev::RequestHeaders(eos) => Event::RequestHeaders { end_of_stream: *eos },
            Ev::RequestBody(n, eos) => Event::RequestBody { buffered: *n as usize, end_of_stream: *eos },
            Ev::RequestTrailers => Event::RequestTrailers,
            Ev::Begin(b) => Event::BeginAnswer(match b {
                Begin::Replay(r, print_of) => Ok(BeginAnswer::Replay(ctx.record(r, print_of))),
                Begin::Locked => Ok(BeginAnswer::Locked { token: "".into() }),
                Begin::Busy(ms) => Ok(BeginAnswer::Busy { lock_ms: ms.ms() }),
                Begin::Mismatch => Ok(BeginAnswer::Mismatch),
                Begin::Fault(f) => Err(f.fault()),
                Begin::InDoubt(running) => Ok(BeginAnswer::InDoubt {
                    token: "t0".into(),
                    started_ms: 1,
                    running_ms: if *running { 2_000 } else { 0 },
                }),
            }),
            Ev::ResponseHeaders(r, details, eos) => Event::ResponseHeaders {
                headers: r.headers(ctx),
                details: details.as_ref().map(Details::details),
                end_of_stream: *eos,
            },
            Ev::ResponseBody(b, eos) => Event::ResponseBody { chunk: b.to_vec(), end_of_stream: *eos },
            Ev::ResponseTrailers => Event::ResponseTrailers,
            Ev::Upstream(Upstream::Answer(r, body)) => {
                Event::UpstreamAnswer(UpstreamAnswer::decode(r.headers(ctx), body.to_vec()))
            }
            Ev::Upstream(Upstream::Fault(f)) => Event::UpstreamAnswer(Err(f.fault())),
            Ev::StreamEnd => Event::StreamEnd,
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    knobs: Knobs,
    request: Request,
    events: Vec<Ev>,
}

fuzz_target!(|input: Input| {
    let Some(cfg) = input.knobs.config() else {
        return;
    };
    let view = input.request.view();
    let ctx = Ctx::new(&cfg, &view);
    let mut driver = Driver::new(Rc::new(cfg), view);
    for ev in input.events.iter().take(MAX_EVENTS) {
        if let Err(e) = driver.step(ev.event(&ctx)) {
            panic!("{e}");
        }
    }
    if let Err(e) = driver.finish() {
        panic!("{e}");
    }
});
