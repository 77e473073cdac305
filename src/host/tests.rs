//! Every command carried out over the fake host: the calls it makes, with their arguments, and
//! what becomes of a failed call (a log line, a report to the coordinator, never a panic).

use log::Level;
use std::time::Duration;

use super::calls::{HostCalls, Map, MetricKind, Status};
use super::fake::{Fake, HostCall};
use super::vm::{Report, Vm};
use crate::config::Config;
use crate::http::grpc::{HOP_HEADER, HOP_PATH, RECORD_CONTENT_TYPE};
use crate::request::metrics::{Metric, LOCAL_RECORDS, OUTCOME_PROPERTY, STORE_LATENCY, STREAM_CALLS};
use crate::request::problem::{LocalResponse, INSTANCE_PROPERTY};
use crate::sim::request::MockView;
use crate::store::client::CallKind;
use crate::store::record::Record;
use crate::worker::command::{Command, Dispatch};
use idem_protocol as proto;
use idem_protocol::stream::{METHOD, SERVICE};

const ROOT: u32 = 1;
const NOT_FOUND: Status = Status(1);
const BAD_ARGUMENT: Status = Status(2);

/// A VM over a fresh fake, the calls of its set-up forgotten; the fake's first id, which its
/// first metric got.
fn vm_with(extra: &str) -> (Vm<Fake>, u32) {
    let fake = Fake::default();
    let first = fake.next_id();
    let json = format!(r#"{{"store_cluster":"idemstore","store_transport":"callout"{extra}}}"#);
    let cfg = Config::from_json(json.as_bytes()).unwrap();
    let vm = Vm::new(fake, ROOT, cfg, "outbox").ok().unwrap();
    vm.host().take_calls();
    (vm, first)
}

fn vm() -> Vm<Fake> {
    vm_with("").0
}

/// Metric ids as the fake hands them out, in the order `Vm::new` defines them.
struct Ids(u32);

impl Ids {
    fn counter(&self, m: Metric) -> u32 {
        self.0 + m.index() as u32
    }
    fn histogram(&self, kind: CallKind) -> u32 {
        let i = STORE_LATENCY.iter().position(|(k, _)| *k == kind).unwrap();
        self.0 + (Metric::ALL.len() + i) as u32
    }
    fn local_records(&self) -> u32 {
        self.0 + (Metric::ALL.len() + STORE_LATENCY.len()) as u32
    }
    fn stream_calls(&self) -> u32 {
        self.local_records() + 1
    }
    fn queue(&self) -> u32 {
        self.local_records() + 2
    }
}

fn response(status: u32) -> LocalResponse {
    LocalResponse {
        status,
        headers: vec![("content-type".into(), "application/problem+json".into())],
        body: br#"{"code":"busy"}"#.to_vec(),
    }
}

fn header(map: Map, name: &str, value: Option<&str>) -> HostCall {
    HostCall::SetHeader { map, name: name.into(), value: value.map(String::from) }
}

fn warn(message: &str) -> (Level, String) {
    (Level::Warn, message.into())
}

/// One of each command, so that a new one is not forgotten here (see `every_command_is_listed`).
fn every_command() -> Vec<Command> {
    vec![
        Command::Respond { stream: 7, response: response(409) },
        Command::Resume { stream: 7 },
        hop(),
        Command::Instance { stream: 7, instance: "urn:uuid:i".into() },
        Command::RemoveResponseHeader { stream: 7, name: "x-a".into() },
        Command::SetResponseHeader { stream: 7, name: "x-a".into(), value: "1".into() },
        Command::AddResponseTrailers { stream: 7, trailers: vec![("grpc-status".into(), "0".into())] },
        Command::SetRequestHeader { stream: 7, name: "x-a".into(), value: "1".into() },
        Command::RemoveRequestHeader { stream: 7, name: "x-a".into() },
        Command::Outcome { stream: 7, outcome: "executed" },
        Command::Count(Metric::Guarded),
        Command::Add { metric: Metric::Guarded, n: 2 },
        Command::LocalRecords(3),
        Command::StreamCalls(-1),
        Command::Tick { period_ms: 250 },
        Command::Latency { kind: CallKind::Begin, micros: 800 },
        Command::Wake,
        Command::Dispatch(Dispatch {
            job: 4,
            cluster: "idemstore".into(),
            headers: vec![(":path".into(), "/v1/begin".into())],
            body: None,
            timeout_ms: 1000,
        }),
        Command::OpenStream { service: "grpc-service".into(), metadata: vec![] },
        Command::StreamSend { token: 9, message: b"m".to_vec() },
        Command::CancelStream { token: 9 },
    ]
}

#[test]
fn every_command_is_listed() {
    let names: Vec<&str> = every_command()
        .iter()
        .map(|c| match c {
            // A new command fails to compile here: add it to `every_command` and test it below.
            Command::Respond { .. } => "Respond",
            Command::Resume { .. } => "Resume",
            Command::Hop { .. } => "Hop",
            Command::RemoveResponseHeader { .. } => "RemoveResponseHeader",
            Command::SetResponseHeader { .. } => "SetResponseHeader",
            Command::AddResponseTrailers { .. } => "AddResponseTrailers",
            Command::SetRequestHeader { .. } => "SetRequestHeader",
            Command::RemoveRequestHeader { .. } => "RemoveRequestHeader",
            Command::Instance { .. } => "Instance",
            Command::Outcome { .. } => "Outcome",
            Command::Count(_) => "Count",
            Command::Add { .. } => "Add",
            Command::LocalRecords(_) => "LocalRecords",
            Command::StreamCalls(_) => "StreamCalls",
            Command::Tick { .. } => "Tick",
            Command::Latency { .. } => "Latency",
            Command::Wake => "Wake",
            Command::Dispatch(_) => "Dispatch",
            Command::OpenStream { .. } => "OpenStream",
            Command::StreamSend { .. } => "StreamSend",
            Command::CancelStream { .. } => "CancelStream",
        })
        .collect();
    let mut unique = names.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "{names:?}");
}

#[test]
fn the_vm_defines_every_metric_and_registers_its_wake_up_queue() {
    let fake = Fake::default();
    let ids = Ids(fake.next_id());
    let cfg = Config::from_json(br#"{"store_cluster":"idemstore"}"#).unwrap();
    let vm = Vm::new(fake, ROOT, cfg, "idempotency-outbox-0001").ok().unwrap();
    let mut expected: Vec<HostCall> = Metric::ALL
        .iter()
        .map(|m| HostCall::DefineMetric { kind: MetricKind::Counter, name: m.name().into() })
        .collect();
    expected.extend(
        STORE_LATENCY
            .iter()
            .map(|(_, n)| HostCall::DefineMetric { kind: MetricKind::Histogram, name: (*n).into() }),
    );
    expected.push(HostCall::DefineMetric { kind: MetricKind::Gauge, name: LOCAL_RECORDS.into() });
    expected.push(HostCall::DefineMetric { kind: MetricKind::Gauge, name: STREAM_CALLS.into() });
    expected.push(HostCall::RegisterSharedQueue("idempotency-outbox-0001".into()));
    assert_eq!(vm.host().take_calls(), expected);
    // The ids it got are the ones it uses.
    vm.carry_out(Command::Count(Metric::Replayed));
    vm.carry_out(Command::Latency { kind: CallKind::Release, micros: 5 });
    vm.carry_out(Command::LocalRecords(2));
    vm.carry_out(Command::StreamCalls(1));
    vm.carry_out(Command::Wake);
    assert_eq!(
        vm.host().take_calls(),
        vec![
            HostCall::IncrementMetric { id: ids.counter(Metric::Replayed), offset: 1 },
            HostCall::RecordMetric { id: ids.histogram(CallKind::Release), value: 5 },
            HostCall::RecordMetric { id: ids.local_records(), value: 2 },
            HostCall::IncrementMetric { id: ids.stream_calls(), offset: 1 },
            HostCall::EnqueueSharedQueue { queue: ids.queue(), value: b"1".to_vec() },
        ]
    );
}

#[test]
fn a_metric_or_queue_the_host_refuses_refuses_the_configuration() {
    let cfg = || Config::from_json(br#"{"store_cluster":"idemstore"}"#).unwrap();
    let fake = Fake::default();
    fake.fail(|c| matches!(c, HostCall::DefineMetric { name, .. } if name == LOCAL_RECORDS), BAD_ARGUMENT);
    let err = Vm::new(fake, ROOT, cfg(), "q").err().unwrap();
    assert_eq!(err, format!("cannot define metric {LOCAL_RECORDS}: BadArgument"));

    let fake = Fake::default();
    fake.fail(|c| matches!(c, HostCall::RegisterSharedQueue(_)), Status(10));
    let err = Vm::new(fake, ROOT, cfg(), "q").err().unwrap();
    assert_eq!(err, "cannot register shared queue: InternalFailure");
}

#[test]
fn a_local_answer_goes_to_its_stream() {
    let vm = vm();
    let report = vm.carry_out(Command::Respond { stream: 7, response: response(409) });
    assert_eq!(report, None);
    let r = response(409);
    assert_eq!(
        vm.host().take_calls(),
        vec![
            HostCall::SetEffectiveContext(7),
            HostCall::SendLocalResponse {
                status: 409,
                headers: r.headers,
                body: Some(r.body),
                trailers: None
            },
        ]
    );
    assert!(vm.host().take_logs().is_empty());
}

#[test]
fn a_local_answer_envoy_refuses_is_logged_and_reported() {
    let vm = vm();
    // The context is not checked: the answer is tried anyway.
    vm.host().fail(|c| matches!(c, HostCall::SetEffectiveContext(_)), NOT_FOUND);
    vm.host().fail(|c| matches!(c, HostCall::SendLocalResponse { .. }), BAD_ARGUMENT);
    let report = vm.carry_out(Command::Respond { stream: 7, response: response(409) });
    assert_eq!(report, Some(Report::RespondFailed { stream: 7 }));
    assert_eq!(vm.host().take_calls().len(), 2);
    assert_eq!(vm.host().take_logs(), vec![warn("cannot send local response 409: BadArgument")]);
}

#[test]
fn a_resume_goes_to_its_stream_and_a_failed_one_is_logged() {
    let vm = vm();
    assert_eq!(vm.carry_out(Command::Resume { stream: 7 }), None);
    assert_eq!(vm.host().take_calls(), vec![HostCall::SetEffectiveContext(7), HostCall::ResumeRequest]);
    assert!(vm.host().take_logs().is_empty());

    vm.host().fail(|c| *c == HostCall::ResumeRequest, NOT_FOUND);
    assert_eq!(vm.carry_out(Command::Resume { stream: 7 }), None);
    assert_eq!(vm.host().take_logs(), vec![warn("cannot resume request: NotFound")]);
}

/// The calls of a hop that succeeds, after the effective context.
fn hop_steps() -> Vec<HostCall> {
    let headers = Map::RequestHeaders;
    vec![
        header(headers, HOP_HEADER, Some("1")),
        header(headers, ":path", Some(HOP_PATH)),
        header(headers, "content-type", Some(RECORD_CONTENT_TYPE)),
        header(headers, "content-length", None),
        HostCall::SetRequestBody { start: 0, size: 5, value: b"rec".to_vec() },
        HostCall::CallForeignFunction("clear_route_cache".into()),
        HostCall::ResumeRequest,
    ]
}

fn hop() -> Command {
    Command::Hop {
        stream: 7,
        record: b"rec".to_vec(),
        body_len: 5,
        fallback: response(503),
        instance: "urn:uuid:i".into(),
        refusal: "request r key k: refused replay-failed (grpc-status 14), instance urn:uuid:i".into(),
    }
}

#[test]
fn a_hop_re_routes_its_stream_and_resumes_it() {
    let vm = vm();
    assert_eq!(vm.carry_out(hop()), None);
    let mut expected = vec![HostCall::SetEffectiveContext(7)];
    expected.extend(hop_steps());
    assert_eq!(vm.host().take_calls(), expected);
    assert!(vm.host().take_logs().is_empty());
}

#[test]
fn a_hop_step_that_fails_answers_the_fallback_and_never_resumes() {
    let steps = hop_steps();
    let names = [
        "marking it",
        "its path",
        "its content type",
        "its length",
        "its body",
        "clearing the route",
        "resuming it",
    ];
    for (i, (step, name)) in steps.iter().zip(names).enumerate() {
        let vm = vm();
        let failing = step.clone();
        vm.host().fail(move |c| *c == failing, BAD_ARGUMENT);
        assert_eq!(vm.carry_out(hop()), None);
        let mut expected = vec![HostCall::SetEffectiveContext(7)];
        expected.extend(steps[..=i].iter().cloned());
        let fallback = response(503);
        expected.push(HostCall::SetProperty {
            path: vec![INSTANCE_PROPERTY.into()],
            value: b"urn:uuid:i".to_vec(),
        });
        expected.push(HostCall::SendLocalResponse {
            status: 503,
            headers: fallback.headers,
            body: None,
            trailers: None,
        });
        assert_eq!(vm.host().take_calls(), expected, "{name}");
        let line = format!(
            "cannot re-route a gRPC replay ({name}): request r key k: refused replay-failed (grpc-status 14), \
             instance urn:uuid:i"
        );
        assert_eq!(vm.host().take_logs(), vec![warn(&line)]);
    }

    // The fallback refused too: logged, nothing else.
    let vm = vm();
    vm.host().fail(
        |c| matches!(c, HostCall::CallForeignFunction(_) | HostCall::SendLocalResponse { .. }),
        NOT_FOUND,
    );
    vm.carry_out(hop());
    assert_eq!(
        vm.host().take_logs(),
        vec![
            warn(
                "cannot re-route a gRPC replay (clearing the route): request r key k: refused replay-failed \
                 (grpc-status 14), instance urn:uuid:i"
            ),
            warn("cannot send local response: NotFound"),
        ]
    );
}

#[test]
fn a_hop_for_a_stream_envoy_no_longer_knows_touches_nothing() {
    let vm = vm();
    vm.host().fail(|c| matches!(c, HostCall::SetEffectiveContext(_)), BAD_ARGUMENT);
    assert_eq!(vm.carry_out(hop()), None);
    assert_eq!(vm.host().take_calls(), vec![HostCall::SetEffectiveContext(7)]);
    assert!(vm.host().take_logs().is_empty());
}

#[test]
fn headers_are_set_and_removed_on_the_current_stream() {
    let vm = vm();
    for command in every_command() {
        if matches!(
            command,
            Command::SetResponseHeader { .. }
                | Command::RemoveResponseHeader { .. }
                | Command::SetRequestHeader { .. }
                | Command::RemoveRequestHeader { .. }
        ) {
            assert_eq!(vm.carry_out(command), None);
        }
    }
    // In the stream's own callback: no effective context is set.
    assert_eq!(
        vm.host().take_calls(),
        vec![
            header(Map::ResponseHeaders, "x-a", None),
            header(Map::ResponseHeaders, "x-a", Some("1")),
            header(Map::RequestHeaders, "x-a", Some("1")),
            header(Map::RequestHeaders, "x-a", None),
        ]
    );
}

#[test]
fn a_header_envoy_refuses_is_logged() {
    let vm = vm();
    vm.host().fail(|c| matches!(c, HostCall::SetHeader { .. }), NOT_FOUND);
    let set = |name: &str| Command::SetRequestHeader { stream: 7, name: name.into(), value: "v".into() };
    assert_eq!(vm.carry_out(set("x-key")), None);
    assert_eq!(vm.carry_out(Command::RemoveRequestHeader { stream: 7, name: "x-b".into() }), None);
    vm.carry_out(Command::SetResponseHeader { stream: 7, name: "expires".into(), value: "v".into() });
    vm.carry_out(Command::RemoveResponseHeader { stream: 7, name: "x-c".into() });
    assert_eq!(
        vm.host().take_logs(),
        vec![
            warn("cannot set request header x-key: NotFound"),
            warn("cannot remove request header x-b: NotFound"),
            warn("cannot set response header expires: NotFound"),
            // The replay listener's clean-up: Envoy may have none to remove.
            (Level::Debug, "cannot remove response header x-c: NotFound".into()),
        ]
    );
}

#[test]
fn every_trailer_is_added_even_after_one_is_refused() {
    let vm = vm();
    vm.host().fail(|c| matches!(c, HostCall::AddHeader { name, .. } if name == "grpc-message"), BAD_ARGUMENT);
    let trailers = [("grpc-status", "5"), ("grpc-message", "gone"), ("x-t", "1")];
    let trailers: Vec<(String, String)> = trailers.iter().map(|(n, v)| ((*n).into(), (*v).into())).collect();
    assert_eq!(vm.carry_out(Command::AddResponseTrailers { stream: 7, trailers: trailers.clone() }), None);
    let added: Vec<HostCall> = trailers
        .into_iter()
        .map(|(name, value)| HostCall::AddHeader { map: Map::ResponseTrailers, name, value })
        .collect();
    assert_eq!(vm.host().take_calls(), added);
    assert_eq!(vm.host().take_logs(), vec![warn("cannot add trailer grpc-message: BadArgument")]);
}

#[test]
fn the_outcome_and_a_refusals_instance_go_to_their_streams_filter_state() {
    let outcome = || Command::Outcome { stream: 7, outcome: "replayed" };
    let instance = || Command::Instance { stream: 7, instance: "urn:uuid:i".into() };
    for (command, property, value) in
        [(outcome(), OUTCOME_PROPERTY, &b"replayed"[..]), (instance(), INSTANCE_PROPERTY, b"urn:uuid:i")]
    {
        let vm = vm();
        assert_eq!(vm.carry_out(command.clone()), None);
        assert_eq!(
            vm.host().take_calls(),
            vec![
                HostCall::SetEffectiveContext(7),
                HostCall::SetProperty { path: vec![property.into()], value: value.to_vec() },
            ]
        );
        vm.host().fail(|c| matches!(c, HostCall::SetProperty { .. }), NOT_FOUND);
        vm.carry_out(command);
        assert_eq!(vm.host().take_logs(), vec![(Level::Debug, format!("cannot set {property}: NotFound"))]);
    }
}

#[test]
fn metrics_tick_and_latency_are_one_call_each() {
    let (vm, first) = vm_with("");
    let ids = Ids(first);
    for command in [
        Command::Count(Metric::StoreErrors),
        Command::Add { metric: Metric::HandBackDropped, n: 3 },
        // Past i64: as much as a counter takes.
        Command::Add { metric: Metric::Guarded, n: u64::MAX },
        Command::LocalRecords(12),
        Command::StreamCalls(-2),
        Command::Tick { period_ms: 250 },
        Command::Tick { period_ms: 0 },
        Command::Latency { kind: CallKind::Commit, micros: 800 },
    ] {
        assert_eq!(vm.carry_out(command), None);
    }
    assert_eq!(
        vm.host().take_calls(),
        vec![
            HostCall::IncrementMetric { id: ids.counter(Metric::StoreErrors), offset: 1 },
            HostCall::IncrementMetric { id: ids.counter(Metric::HandBackDropped), offset: 3 },
            HostCall::IncrementMetric { id: ids.counter(Metric::Guarded), offset: i64::MAX },
            HostCall::RecordMetric { id: ids.local_records(), value: 12 },
            HostCall::IncrementMetric { id: ids.stream_calls(), offset: -2 },
            HostCall::SetTickPeriod(Duration::from_millis(250)),
            HostCall::SetTickPeriod(Duration::ZERO),
            HostCall::RecordMetric { id: ids.histogram(CallKind::Commit), value: 800 },
        ]
    );
}

#[test]
fn metrics_and_ticks_the_host_refuses_are_dropped_silently() {
    let vm = vm();
    vm.host().fail(
        |c| {
            matches!(
                c,
                HostCall::IncrementMetric { .. } | HostCall::RecordMetric { .. } | HostCall::SetTickPeriod(_)
            )
        },
        NOT_FOUND,
    );
    for command in every_command() {
        if matches!(
            command,
            Command::Count(_)
                | Command::Add { .. }
                | Command::LocalRecords(_)
                | Command::StreamCalls(_)
                | Command::Tick { .. }
                | Command::Latency { .. }
        ) {
            assert_eq!(vm.carry_out(command), None);
        }
    }
    assert_eq!(vm.host().take_calls().len(), 6);
    assert!(vm.host().take_logs().is_empty());
}

#[test]
fn a_wake_up_is_enqueued_and_a_failed_one_is_logged_and_reported() {
    let (vm, first) = vm_with("");
    assert_eq!(vm.carry_out(Command::Wake), None);
    let enqueued = HostCall::EnqueueSharedQueue { queue: Ids(first).queue(), value: b"1".to_vec() };
    assert_eq!(vm.host().take_calls(), vec![enqueued]);

    vm.host().fail(|c| matches!(c, HostCall::EnqueueSharedQueue { .. }), NOT_FOUND);
    assert_eq!(vm.carry_out(Command::Wake), Some(Report::WakeFailed));
    assert_eq!(vm.host().take_logs(), vec![(Level::Error, "cannot wake the root context: NotFound".into())]);
}

fn dispatch() -> Dispatch {
    Dispatch {
        job: 4,
        cluster: "idemstore".into(),
        headers: vec![(":path".into(), "/v1/begin".into()), ("x-idem-key".into(), "k".into())],
        body: Some(b"body".to_vec()),
        timeout_ms: 1500,
    }
}

#[test]
fn a_callout_is_sent_as_the_root_and_its_token_reported() {
    let vm = vm();
    vm.enter(7);
    let token = vm.host().next_id();
    assert_eq!(
        vm.carry_out(Command::Dispatch(dispatch())),
        Some(Report::Dispatched { job: 4, token: Some(token) })
    );
    let d = dispatch();
    assert_eq!(
        vm.host().take_calls(),
        vec![
            HostCall::SetEffectiveContext(ROOT),
            HostCall::DispatchHttpCall {
                cluster: d.cluster,
                headers: d.headers,
                body: d.body,
                timeout: Duration::from_millis(1500),
            },
        ]
    );
}

#[test]
fn a_callout_that_cannot_leave_is_logged_and_reported_without_a_token() {
    let vm = vm();
    vm.host().fail(|c| matches!(c, HostCall::DispatchHttpCall { .. }), Status(10));
    assert_eq!(vm.carry_out(Command::Dispatch(dispatch())), Some(Report::Dispatched { job: 4, token: None }));
    assert_eq!(vm.host().take_logs(), vec![warn("dispatch to idemstore failed: InternalFailure")]);
}

#[test]
fn the_store_stream_is_opened_as_the_root_and_its_token_reported() {
    let vm = vm();
    let token = vm.host().next_id();
    let metadata = vec![("x-idem-secret".to_string(), "s".to_string())];
    let open = Command::OpenStream { service: "grpc-service".into(), metadata };
    assert_eq!(vm.carry_out(open.clone()), Some(Report::StreamOpened { token: Some(token) }));
    assert_eq!(
        vm.host().take_calls(),
        vec![
            HostCall::SetEffectiveContext(ROOT),
            HostCall::OpenGrpcStream {
                service: "grpc-service".into(),
                grpc_service: SERVICE.into(),
                method: METHOD.into(),
                metadata: vec![("x-idem-secret".into(), b"s".to_vec())],
            },
        ]
    );

    vm.host().fail(|c| matches!(c, HostCall::OpenGrpcStream { .. }), Status(4));
    assert_eq!(vm.carry_out(open), Some(Report::StreamOpened { token: None }));
    assert_eq!(vm.host().take_logs(), vec![warn("cannot open the store stream: ParseFailure")]);
}

#[test]
fn a_store_stream_message_is_sent_as_the_root_then_the_stream_is_current_again() {
    let vm = vm();
    vm.enter(7);
    let send = Command::StreamSend { token: 9, message: b"m".to_vec() };
    assert_eq!(vm.carry_out(send.clone()), None);
    let calls = vec![
        HostCall::SetEffectiveContext(ROOT),
        HostCall::GrpcSend { token: 9, message: b"m".to_vec() },
        HostCall::SetEffectiveContext(7),
    ];
    assert_eq!(vm.host().take_calls(), calls);

    // A failed send: the same calls, and the coordinator hears of it.
    vm.host().fail(|c| matches!(c, HostCall::GrpcSend { .. }), NOT_FOUND);
    assert_eq!(vm.carry_out(send), Some(Report::StreamSendFailed { token: 9 }));
    assert_eq!(vm.host().take_calls(), calls);
    assert_eq!(vm.host().take_logs(), vec![warn("cannot send on the store stream: NotFound")]);
}

#[test]
fn a_store_stream_is_cancelled_as_the_root_and_a_failure_only_logged() {
    let vm = vm();
    vm.enter(7);
    assert_eq!(vm.carry_out(Command::CancelStream { token: 9 }), None);
    let calls =
        vec![HostCall::SetEffectiveContext(ROOT), HostCall::GrpcCancel(9), HostCall::SetEffectiveContext(7)];
    assert_eq!(vm.host().take_calls(), calls);

    vm.host().fail(|c| matches!(c, HostCall::GrpcCancel(_)), NOT_FOUND);
    assert_eq!(vm.carry_out(Command::CancelStream { token: 9 }), None);
    assert_eq!(vm.host().take_calls(), calls);
    assert_eq!(
        vm.host().take_logs(),
        vec![(Level::Debug, "cannot cancel the store stream: NotFound".into())]
    );
}

#[test]
fn every_command_survives_a_host_that_refuses_everything() {
    let vm = vm();
    vm.host().fail(|_| true, Status(10));
    let reports: Vec<Report> = every_command().into_iter().filter_map(|c| vm.carry_out(c)).collect();
    assert_eq!(
        reports,
        vec![
            Report::RespondFailed { stream: 7 },
            Report::WakeFailed,
            Report::Dispatched { job: 4, token: None },
            Report::StreamOpened { token: None },
            Report::StreamSendFailed { token: 9 },
        ]
    );
}

// Through the coordinator: what the host reports changes what it is asked next.

/// Request headers and the whole body on stream `id`: its `begin` waits for the wake-up.
fn request(vm: &Vm<Fake>, id: u32, key: &str) {
    let mut v = MockView::post(Some(key));
    v.request_body = b"a".to_vec();
    let env = vm.host().env();
    vm.enter(id);
    vm.run(|c| c.on_stream_event(id, &v, env, |s, v| s.on_request_headers(v, false)));
    vm.run(|c| c.on_stream_event(id, &v, env, |s, v| s.on_request_body(v, 1, true)));
}

fn queue_ready(vm: &Vm<Fake>) {
    vm.enter(ROOT);
    vm.run(|c| c.on_queue_ready(vm.host().env()));
}

#[test]
fn a_callout_that_cannot_leave_fails_its_request_as_configured() {
    for (extra, open) in [("", true), (r#","failure_mode":"closed""#, false)] {
        let (vm, first) = vm_with(extra);
        request(&vm, 2, "k1");
        assert!(vm.host().take_calls().iter().any(|c| matches!(c, HostCall::EnqueueSharedQueue { .. })));
        vm.host().fail(|c| matches!(c, HostCall::DispatchHttpCall { .. }), BAD_ARGUMENT);
        queue_ready(&vm);
        let calls = vm.host().take_calls();
        assert!(calls.iter().any(|c| matches!(c, HostCall::DispatchHttpCall { .. })), "{calls:?}");
        let failed = HostCall::IncrementMetric { id: Ids(first).counter(Metric::StoreErrors), offset: 1 };
        assert!(calls.contains(&failed), "{calls:?}");
        let resumed =
            calls.windows(2).any(|w| w == [HostCall::SetEffectiveContext(2), HostCall::ResumeRequest]);
        let answered = calls.windows(2).any(|w| {
            w[0] == HostCall::SetEffectiveContext(2)
                && matches!(w[1], HostCall::SendLocalResponse { status: 503, .. })
        });
        assert_eq!((resumed, answered), (open, !open), "{calls:?}");
    }
}

#[test]
fn a_wake_up_that_cannot_be_queued_fails_every_waiting_request() {
    let vm = vm();
    vm.host().fail(|c| matches!(c, HostCall::EnqueueSharedQueue { .. }), NOT_FOUND);
    request(&vm, 2, "k1");
    let calls = vm.host().take_calls();
    let resumed = [HostCall::SetEffectiveContext(2), HostCall::ResumeRequest];
    assert!(calls.windows(2).any(|w| w == resumed), "{calls:?}");
    // Nothing is left to dispatch.
    vm.host().take_calls();
    queue_ready(&vm);
    assert!(!vm.host().take_calls().iter().any(|c| matches!(c, HostCall::DispatchHttpCall { .. })));
}

#[test]
fn a_local_answer_gets_its_content_type_back_unless_it_was_never_sent() {
    let record = Record {
        status: 204,
        headers: vec![("content-type".into(), "application/json".into())],
        ..Record::default()
    };
    let answer = vec![
        (":status".to_string(), b"200".to_vec()),
        (proto::HEADER_OUTCOME.to_string(), b"record".to_vec()),
    ];
    for refused in [false, true] {
        let vm = vm();
        if refused {
            vm.host().fail(|c| matches!(c, HostCall::SendLocalResponse { .. }), BAD_ARGUMENT);
        }
        request(&vm, 2, "k1");
        let token = vm.host().next_id();
        queue_ready(&vm);
        vm.host().take_calls();
        // A 204 replayed with a content type and no body: Envoy drops the type.
        let env = vm.host().env();
        vm.run(|c| c.on_callout_answer(token, answer.clone(), record.encode(), env));
        let calls = vm.host().take_calls();
        assert!(
            calls.iter().any(|c| matches!(c, HostCall::SendLocalResponse { status: 204, .. })),
            "{calls:?}"
        );
        vm.restore_content_type(2);
        let restored = vec![header(Map::ResponseHeaders, "content-type", Some("application/json"))];
        let expected = if refused { vec![] } else { restored };
        assert_eq!(vm.host().take_calls(), expected);
        // Once.
        vm.restore_content_type(2);
        assert!(vm.host().take_calls().is_empty());
    }
}
