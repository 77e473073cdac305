use super::*;
use crate::sim::request::MockView;
use crate::sim::worker::tally::{Rng, SimEnv, Tally};
use crate::sim::worker::World;
use crate::store::record::Record;
use crate::worker::command::Dispatch;
use idem_protocol as proto;

const T0: u64 = 1_700_000_000_000_000;

fn coordinator(extra: &str) -> Coordinator {
    let json = format!(r#"{{"store_cluster":"idemstore","store_transport":"callout"{extra}}}"#);
    Coordinator::new(Rc::new(Config::from_json(json.as_bytes()).unwrap()))
}

fn drain(c: &mut Coordinator) -> Vec<Command> {
    std::iter::from_fn(|| c.poll()).collect()
}

fn view(key: &str, body: &str) -> MockView {
    let mut v = MockView::post(Some(key));
    v.request_body = body.as_bytes().to_vec();
    v
}

/// Request headers and the whole body: the stream asks for its `begin`.
fn request(c: &mut Coordinator, id: u32, v: &MockView, clock: &SimEnv) -> (Stepped, Vec<Command>) {
    let len = v.request_body.len();
    c.on_stream_event(id, v, clock, |s, v| s.on_request_headers(v, false));
    let stepped = c.on_stream_event(id, v, clock, |s, v| s.on_request_body(v, len, true));
    (stepped, drain(c))
}

fn dispatches(commands: &[Command]) -> Vec<Dispatch> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Dispatch(d) => Some(d.clone()),
            _ => None,
        })
        .collect()
}

fn path(d: &Dispatch) -> &str {
    d.headers.iter().find(|(n, _)| n == ":path").map_or("", |(_, v)| v.as_str())
}

fn header<'a>(d: &'a Dispatch, name: &str) -> &'a str {
    d.headers.iter().find(|(n, _)| n == name).map_or("", |(_, v)| v.as_str())
}

fn answer(outcome: &str, extra: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    let mut h =
        vec![(":status".to_string(), b"200".to_vec()), (proto::HEADER_OUTCOME.into(), outcome.into())];
    h.extend(extra.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())));
    h
}

/// Wakes the root and dispatches what is queued, every callout given the next token.
fn dispatch_all(c: &mut Coordinator, clock: &SimEnv, next_token: &mut u32) -> Vec<(u32, Dispatch)> {
    c.on_queue_ready(clock);
    let mut sent = Vec::new();
    for d in dispatches(&drain(c)) {
        *next_token += 1;
        c.on_dispatched(d.job, Some(*next_token), clock);
        sent.push((*next_token, d));
    }
    sent
}

fn responses(commands: &[Command]) -> Vec<(u32, u32)> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Respond { stream, response } => Some((*stream, response.status)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_stream_callback_asks_for_one_wake_up_and_the_root_dispatches() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    let (stepped, commands) = request(&mut c, 2, &view("k1", "a"), &clock);
    assert_eq!(stepped, Stepped { action: Action::Pause, done: false });
    assert_eq!(commands.iter().filter(|c| **c == Command::Wake).count(), 1);
    assert!(dispatches(&commands).is_empty(), "never from a stream callback: {commands:?}");
    // A second stream's call joins the same wake-up.
    let (_, commands) = request(&mut c, 3, &view("k2", "a"), &clock);
    assert!(!commands.contains(&Command::Wake));

    let mut token = 0;
    let sent = dispatch_all(&mut c, &clock, &mut token);
    assert_eq!(sent.len(), 2);
    assert!(sent.iter().all(|(_, d)| path(d) == proto::PATH_BEGIN && d.cluster == "idemstore"));
    assert_eq!(c.pending(), (2, 2));

    // Each answer goes to the stream that asked, whatever the order.
    let (t3, _) = sent.iter().find(|(_, d)| d.job == 1).unwrap();
    clock.0.set(T0 + 800);
    c.on_callout_answer(*t3, answer("locked", &[(proto::HEADER_TOKEN, "tok3")]), vec![], &clock);
    let commands = drain(&mut c);
    assert!(commands.contains(&Command::Resume { stream: 3 }), "{commands:?}");
    assert!(commands.contains(&Command::Latency { kind: CallKind::Begin, micros: 800 }));
    let (t2, _) = sent.iter().find(|(_, d)| d.job == 0).unwrap();
    c.on_callout_answer(*t2, answer("busy", &[]), vec![], &clock);
    assert_eq!(responses(&drain(&mut c)), vec![(2, 409)]);
}

#[test]
fn a_commit_goes_out_after_the_response_and_is_counted() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    let v = view("k1", "a");
    request(&mut c, 2, &v, &clock);
    let mut token = 0;
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], &clock);
    drain(&mut c);
    let mut v = v.clone();
    v.resp(":status", "201");
    v.response_chunk = b"done".to_vec();
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_headers(v, false));
    let stepped = c.on_stream_event(2, &v, &clock, |s, v| s.on_response_body(v, 4, true));
    assert!(stepped.done, "nothing pending once the commit is queued");
    assert!(drain(&mut c).contains(&Command::Wake));
    c.on_stream_done(2, &MockView::default(), &clock);
    let sent = dispatch_all(&mut c, &clock, &mut token);
    assert_eq!(path(&sent[0].1), proto::PATH_COMMIT);
    assert_eq!(header(&sent[0].1, proto::HEADER_TOKEN), "tok");
    c.on_callout_answer(sent[0].0, answer("stored", &[]), vec![], &clock);
    assert!(drain(&mut c).contains(&Command::Count(Metric::Stored)));
    assert_eq!(c.pending(), (0, 0));
}

/// Runs streams `ids` (keys `k<id>`) under store locks `tok<id>` to their answers; their
/// commits are queued, not yet dispatched.
fn run_to_commit(c: &mut Coordinator, ids: &[u32], clock: &SimEnv, token: &mut u32) {
    for &id in ids {
        let mut v = view(&format!("k{id}"), "a");
        request(c, id, &v, clock);
        let (t, _) = dispatch_all(c, clock, token)[0].clone();
        c.on_callout_answer(
            t,
            answer("locked", &[(proto::HEADER_TOKEN, &format!("tok{id}"))]),
            vec![],
            clock,
        );
        v.resp(":status", "201");
        v.response_chunk = format!("made {id}").into_bytes();
        c.on_stream_event(id, &v, clock, |s, v| s.on_response_headers(v, false));
        c.on_stream_event(id, &v, clock, |s, v| s.on_response_body(v, 6, true));
        c.on_stream_done(id, &MockView::default(), clock);
        drain(c);
    }
}

#[test]
fn commits_made_while_one_is_in_flight_go_together_and_each_is_answered() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    let mut token = 0;
    run_to_commit(&mut c, &[2], &clock, &mut token);
    let first = dispatch_all(&mut c, &clock, &mut token);
    assert_eq!(first.len(), 1);
    assert_eq!(path(&first[0].1), proto::PATH_COMMIT, "none in flight: sent alone, at once");

    // While it is in flight, three more commits are held, then go as one `commits`.
    run_to_commit(&mut c, &[3, 4, 5], &clock, &mut token);
    assert!(dispatch_all(&mut c, &clock, &mut token).is_empty());
    assert_eq!(c.pending(), (0, 4));
    c.on_callout_answer(first[0].0, answer("stored", &[]), vec![], &clock);
    let commands = drain(&mut c);
    let sent = dispatches(&commands);
    assert_eq!(sent.len(), 1, "{commands:?}");
    assert_eq!(path(&sent[0]), proto::PATH_COMMITS);
    let body = sent[0].body.clone().unwrap();
    let items = proto::decode_batch(&body).unwrap();
    assert_eq!(items.iter().map(|i| i.token).collect::<Vec<_>>(), ["tok3", "tok4", "tok5"]);
    token += 1;
    c.on_dispatched(sent[0].job, Some(token), &clock);

    // One item not done: tried again alone (then released if that fails too); the others count.
    c.on_callout_answer(token, answer("batch", &[]), b"stored\nfailed\nexists".to_vec(), &clock);
    let commands = drain(&mut c);
    assert_eq!(commands.iter().filter(|c| **c == Command::Count(Metric::Stored)).count(), 1);
    assert_eq!(commands.iter().filter(|c| **c == Command::Count(Metric::CommitFailed)).count(), 1);
    assert_eq!(commands.iter().filter(|c| **c == Command::Count(Metric::StoreErrors)).count(), 1);
    let retry = dispatches(&commands);
    assert_eq!(retry.len(), 1);
    assert_eq!((path(&retry[0]), header(&retry[0], proto::HEADER_TOKEN)), (proto::PATH_COMMIT, "tok4"));
    token += 1;
    c.on_dispatched(retry[0].job, Some(token), &clock);
    c.on_callout_answer(token, answer("stored", &[]), vec![], &clock);
    assert!(drain(&mut c).contains(&Command::Count(Metric::Stored)));
    assert_eq!(c.pending(), (0, 0));
}

/// Stream 2's commit goes alone; streams 3 and 4 commit while it is in flight and, once it is
/// stored, go together as one `commits` callout, dispatched with the token `*token`.
fn batch_in_flight(c: &mut Coordinator, clock: &SimEnv, token: &mut u32) {
    run_to_commit(c, &[2], clock, token);
    let first = dispatch_all(c, clock, token);
    run_to_commit(c, &[3, 4], clock, token);
    dispatch_all(c, clock, token);
    c.on_callout_answer(first[0].0, answer("stored", &[]), vec![], clock);
    let batch = dispatches(&drain(c));
    assert_eq!(path(&batch[0]), proto::PATH_COMMITS);
    *token += 1;
    c.on_dispatched(batch[0].job, Some(*token), clock);
}

#[test]
fn a_batch_that_fails_as_a_whole_fails_each_commit_once_and_the_breaker_hears_it_once() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator(r#","breaker_failures":2"#);
    let mut token = 0;
    batch_in_flight(&mut c, &clock, &mut token);
    c.on_callout_answer(token, vec![(":status".into(), b"504".to_vec())], vec![], &clock);
    let commands = drain(&mut c);
    // Both retried alone, each with its own token; one timeout does not open a breaker of two.
    let retries = dispatches(&commands);
    let tokens: Vec<&str> = retries.iter().map(|d| header(d, proto::HEADER_TOKEN)).collect();
    assert_eq!(tokens, ["tok3", "tok4"]);
    assert!(retries.iter().all(|d| path(d) == proto::PATH_COMMIT));
    assert!(c.path.breaker_is_closed());
}

#[test]
fn an_idemstore_without_commits_gets_each_commit_alone_from_then_on() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    let mut token = 0;
    batch_in_flight(&mut c, &clock, &mut token);
    // An older idemstore: no such route.
    c.on_callout_answer(token, vec![(":status".into(), b"404".to_vec())], vec![], &clock);
    let commands = drain(&mut c);
    assert!(!commands.iter().any(|c| matches!(c, Command::Count(_))), "not a failure: {commands:?}");
    let alone = dispatches(&commands);
    let sent: Vec<(&str, &str)> = alone.iter().map(|d| (path(d), header(d, proto::HEADER_TOKEN))).collect();
    assert_eq!(sent, [(proto::PATH_COMMIT, "tok3"), (proto::PATH_COMMIT, "tok4")], "first tries, at once");
    for d in &alone {
        token += 1;
        c.on_dispatched(d.job, Some(token), &clock);
    }
    // With those in flight, the next commit is not held for a batch.
    run_to_commit(&mut c, &[5], &clock, &mut token);
    let next = dispatch_all(&mut c, &clock, &mut token);
    assert_eq!(next.len(), 1);
    assert_eq!((path(&next[0].1), header(&next[0].1, proto::HEADER_TOKEN)), (proto::PATH_COMMIT, "tok5"));
}

#[test]
fn a_lock_granted_to_a_stream_that_ended_is_released_and_nothing_answers_it() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    request(&mut c, 2, &view("k1", "a"), &clock);
    let mut token = 0;
    let (t, begin) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_stream_done(2, &MockView::default(), &clock);
    assert_eq!(c.pending(), (1, 1), "kept until its begin answers");
    c.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], &clock);
    let commands = drain(&mut c);
    assert!(responses(&commands).is_empty() && !commands.contains(&Command::Resume { stream: 2 }));
    // Answered in a root callback: the release is dispatched at once, no wake-up.
    let release = dispatches(&commands);
    assert_eq!(release.len(), 1, "{commands:?}");
    assert_eq!(path(&release[0]), proto::PATH_RELEASE);
    assert_eq!(header(&release[0], proto::HEADER_KEY), header(&begin, proto::HEADER_KEY));
    assert_eq!(header(&release[0], proto::HEADER_TOKEN), "tok");
    c.on_dispatched(release[0].job, Some(9), &clock);
    c.on_callout_answer(9, answer("released", &[]), vec![], &clock);
    drain(&mut c);
    assert_eq!(c.pending(), (0, 0));
}

#[test]
fn a_callout_that_cannot_leave_fails_the_request_as_configured() {
    for (extra, expect_resume) in [("", true), (r#","failure_mode":"closed""#, false)] {
        let clock = SimEnv::at(T0);
        // Not dispatched.
        let mut c = coordinator(extra);
        request(&mut c, 2, &view("k1", "a"), &clock);
        c.on_queue_ready(&clock);
        let d = dispatches(&drain(&mut c)).remove(0);
        c.on_dispatched(d.job, None, &clock);
        let commands = drain(&mut c);
        assert_eq!(commands.contains(&Command::Resume { stream: 2 }), expect_resume, "{commands:?}");
        assert_eq!(responses(&commands), if expect_resume { vec![] } else { vec![(2, 503)] });
        assert!(commands.contains(&Command::Count(Metric::StoreErrors)));

        // No wake-up: every queued call fails, each in its own stream.
        let mut c = coordinator(extra);
        request(&mut c, 2, &view("k1", "a"), &clock);
        request(&mut c, 3, &view("k2", "a"), &clock);
        c.on_wake_failed(&clock);
        let commands = drain(&mut c);
        for stream in [2, 3] {
            assert_eq!(commands.contains(&Command::Resume { stream }), expect_resume);
        }
        assert!(dispatches(&commands).is_empty());
        assert_eq!(c.pending().1, 0);
    }
}

#[test]
fn a_failed_commit_is_tried_again_then_its_lock_released() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    let mut v = view("k1", "a");
    request(&mut c, 2, &v, &clock);
    let mut token = 0;
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], &clock);
    v.resp(":status", "200");
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_headers(v, true));
    c.on_stream_done(2, &MockView::default(), &clock);
    let (mut t, commit) = dispatch_all(&mut c, &clock, &mut token).remove(0);
    let mut paths = vec![path(&commit).to_string()];
    let mut counted = Vec::new();
    // Every answer a reset (no headers); each next try is dispatched at once, from the root
    // callback that saw the fault.
    loop {
        c.on_callout_answer(t, vec![], vec![], &clock);
        let commands = drain(&mut c);
        counted.extend(commands.iter().filter(|c| matches!(c, Command::Count(_))).cloned());
        let Some(next) = dispatches(&commands).pop() else { break };
        paths.push(path(&next).to_string());
        token += 1;
        c.on_dispatched(next.job, Some(token), &clock);
        t = token;
    }
    assert_eq!(paths, [proto::PATH_COMMIT, proto::PATH_COMMIT, proto::PATH_RELEASE]);
    let errors = counted.iter().filter(|c| **c == Command::Count(Metric::StoreErrors)).count();
    assert_eq!(errors, 3);
    assert_eq!(counted.iter().filter(|c| **c == Command::Count(Metric::CommitFailed)).count(), 1);
    assert_eq!(c.pending(), (0, 0));
}

#[test]
fn a_replayed_record_is_cached_until_the_store_would_drop_it() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    let mut token = 0;
    // The first request runs; its record is what the store would hand back.
    let mut v = view("k1", "a");
    request(&mut c, 2, &v, &clock);
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], &clock);
    v.resp(":status", "201");
    v.response_chunk = b"made".to_vec();
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_headers(v, false));
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_body(v, 4, true));
    c.on_stream_done(2, &MockView::default(), &clock);
    let (_, commit) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    let record = commit.body.clone().unwrap();

    // A retry asks the store, which replays with 1 s left: the record is cached from the
    // time the begin was sent.
    request(&mut c, 3, &view("k1", "a"), &clock);
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    clock.0.set(T0 + 200_000);
    c.on_callout_answer(t, answer("record", &[(proto::HEADER_TTL_MS, "1000")]), record, &clock);
    assert_eq!(responses(&drain(&mut c)), vec![(3, 201)]);

    // The next retry is answered in its own callback, with no store call.
    clock.0.set(T0 + 999_000);
    let (_, commands) = request(&mut c, 4, &view("k1", "a"), &clock);
    assert_eq!(responses(&commands), vec![(4, 201)]);
    assert!(commands.contains(&Command::Count(Metric::CacheHits)) && !commands.contains(&Command::Wake));
    // Another body under the same key: 422 from the cache too.
    let (_, commands) = request(&mut c, 5, &view("k1", "b"), &clock);
    assert_eq!(responses(&commands), vec![(5, 422)]);

    // At the record's expiry (sent + 1000 ms), the store is asked again.
    clock.0.set(T0 + 1_000_000);
    let (_, commands) = request(&mut c, 6, &view("k1", "a"), &clock);
    assert!(responses(&commands).is_empty() && commands.contains(&Command::Wake), "{commands:?}");
}

#[test]
fn answers_to_unknown_callouts_change_nothing() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    request(&mut c, 2, &view("k1", "a"), &clock);
    c.on_callout_answer(77, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], &clock);
    c.on_dispatched(77, Some(5), &clock);
    assert!(drain(&mut c).is_empty());
    assert_eq!(c.pending(), (1, 1));
}

#[test]
fn a_local_answer_keeps_the_content_type_envoy_would_change() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator("");
    let mut token = 0;
    request(&mut c, 2, &view("k1", "a"), &clock);
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    // A 204 recorded with a content type and no body: Envoy would drop the type.
    let record = Record {
        status: 204,
        headers: vec![("content-type".into(), "application/json".into())],
        ..Record::default()
    };
    c.on_callout_answer(t, answer("record", &[]), record.encode(), &clock);
    assert_eq!(responses(&drain(&mut c)), vec![(2, 204)]);
    assert_eq!(c.take_restore(2), Some(Some("application/json".into())));
    assert_eq!(c.take_restore(2), None);
    // A failed send leaves nothing to restore.
    request(&mut c, 3, &view("k2", "a"), &clock);
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_callout_answer(t, answer("record", &[]), record.encode(), &clock);
    drain(&mut c);
    c.on_respond_failed(3);
    assert_eq!(c.take_restore(3), None);
}

#[test]
fn after_store_failures_begins_skip_the_store_until_one_probe_answers() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator(r#","breaker_failures":2,"breaker_open_ms":1000"#);
    let mut token = 0;
    for id in [2, 3] {
        request(&mut c, id, &view(&format!("k{id}"), "a"), &clock);
        let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
        c.on_callout_answer(t, vec![(":status".into(), b"504".to_vec())], vec![], &clock);
        assert!(drain(&mut c).contains(&Command::Resume { stream: id }), "failed open");
    }
    // Open: answered in the stream's own callback, no store call, counted.
    let (stepped, commands) = request(&mut c, 4, &view("k4", "a"), &clock);
    assert_eq!(stepped.action, Action::Pause);
    assert!(commands.contains(&Command::Resume { stream: 4 }), "{commands:?}");
    assert!(commands.contains(&Command::Count(Metric::StoreSkipped)));
    assert!(commands.contains(&Command::Count(Metric::Degraded)));
    assert!(!commands.contains(&Command::Wake) && !commands.contains(&Command::Count(Metric::StoreErrors)));

    // After the interval one begin probes; the others still skip until it answers.
    clock.0.set(T0 + 1_000_000);
    let (_, commands) = request(&mut c, 5, &view("k5", "a"), &clock);
    assert!(commands.contains(&Command::Wake));
    let (_, commands) = request(&mut c, 6, &view("k6", "a"), &clock);
    assert!(commands.contains(&Command::Count(Metric::StoreSkipped)) && !commands.contains(&Command::Wake));
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], &clock);
    assert!(drain(&mut c).contains(&Command::Resume { stream: 5 }));
    // Answered: closed again.
    let (_, commands) = request(&mut c, 7, &view("k7", "a"), &clock);
    assert!(commands.contains(&Command::Wake) && !commands.contains(&Command::Count(Metric::StoreSkipped)));

    // Failures that cost no wait (a reset) do not open it.
    let mut c = coordinator(r#","breaker_failures":1"#);
    for id in [2, 3] {
        request(&mut c, id, &view(&format!("k{id}"), "a"), &clock);
        let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
        c.on_callout_answer(t, vec![], vec![], &clock);
        assert!(!drain(&mut c).contains(&Command::Count(Metric::StoreSkipped)));
    }

    // Closed mode: a skipped begin is a 503 at once.
    let mut c = coordinator(r#","breaker_failures":1,"failure_mode":"closed""#);
    request(&mut c, 2, &view("k1", "a"), &clock);
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_callout_answer(t, vec![(":status".into(), b"504".to_vec())], vec![], &clock);
    assert_eq!(responses(&drain(&mut c)), vec![(2, 503)]);
    let (_, commands) = request(&mut c, 3, &view("k2", "a"), &clock);
    assert_eq!(responses(&commands), vec![(3, 503)]);
}

#[test]
fn while_the_store_fails_duplicates_wait_for_the_local_lock_and_replay() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator(r#","local_record_entries":256,"breaker_open_ms":0"#);
    c.set_up(&clock, 5);
    drain(&mut c);
    let mut token = 0;
    let mut v = view("k1", "a");
    for id in [2, 3] {
        request(&mut c, id, &v, &clock);
    }
    // Both begins fail at once (reset): the first takes the local lock, the second waits.
    let sent = dispatch_all(&mut c, &clock, &mut token);
    c.on_callout_answer(sent[0].0, vec![], vec![], &clock);
    let commands = drain(&mut c);
    assert!(commands.contains(&Command::Resume { stream: 2 }), "{commands:?}");
    assert!(commands.contains(&Command::Count(Metric::LocalLocks)));
    assert!(!commands.contains(&Command::Count(Metric::Executed)), "not under the store's lock");
    c.on_callout_answer(sent[1].0, vec![], vec![], &clock);
    let commands = drain(&mut c);
    assert!(commands.contains(&Command::Tick { period_ms: 20 }) && responses(&commands).is_empty());
    // The first answers: its record stays local (no store call), the waiter replays it.
    v.resp(":status", "201");
    v.response_chunk = b"made".to_vec();
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_headers(v, false));
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_body(v, 4, true));
    let commands = drain(&mut c);
    assert!(!commands.contains(&Command::Wake), "{commands:?}");
    clock.0.set(T0 + 20_000);
    c.on_tick(&clock);
    let commands = drain(&mut c);
    assert_eq!(responses(&commands), vec![(3, 201)]);
    assert!(commands.contains(&Command::Count(Metric::LocalReplays)));
    // The same tick offers the record back to the store, which still fails: offered again.
    let hand_back = dispatches(&commands);
    assert_eq!(hand_back.len(), 1);
    c.on_dispatched(hand_back[0].job, Some(98), &clock);
    c.on_callout_answer(98, vec![], vec![], &clock);
    assert!(!drain(&mut c).contains(&Command::Count(Metric::HandedBack)));
    // Once the store answers again, the record is handed back to it (after a back-off).
    clock.0.set(T0 + 2_100_000);
    c.on_tick(&clock);
    let hand_back = dispatches(&drain(&mut c));
    assert_eq!(hand_back.len(), 1);
    assert_eq!(path(&hand_back[0]), proto::PATH_COMMIT);
    assert_eq!(header(&hand_back[0], proto::HEADER_TOKEN), "handback");
    c.on_dispatched(hand_back[0].job, Some(99), &clock);
    c.on_callout_answer(99, answer("late", &[]), vec![], &clock);
    assert!(drain(&mut c).contains(&Command::Count(Metric::HandedBack)));
}

/// Random interleavings of many streams, store answers and faults, wake-ups, stream ends and
/// clock jumps, each run checked by [`World`] (see `sim::worker`). `fuzz/` drives the same
/// world from its own inputs.
#[test]
fn random_interleavings_keep_the_coordinator_invariants() {
    let mut seen = Tally::default();
    for seed in 0..16_000u64 {
        match World::run(Rng::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)), 60) {
            Ok(t) => seen.add(&t),
            Err(e) => panic!("seed {seed}: {e}"),
        }
    }
    // The sample reaches every path, so the invariants were checked on each.
    assert!(seen.all_at_least(50), "{seen:?}");
    // Rarer (a commit and its retry both failed, then a hand-back before the short retention
    // ends): still taken.
    assert!(seen.kept_handed_back >= 20, "{seen:?}");
    // Rarer too (two commits held while a third is in flight): a batch, some of its items not
    // done, the whole call faulted.
    assert!(seen.batches >= 10, "{seen:?}");
    // Keys in doubt: resolved by a lookup's `404` after the attempt's lock TTL (a new attempt
    // supersedes it), and ran again only degraded, never through the store.
    assert!(seen.superseded >= 10, "{seen:?}");
}

/// Runs stream `id` under the store's lock `tok` to a 201 `made`; returns the commit sent.
fn run_under_store_lock(c: &mut Coordinator, id: u32, clock: &SimEnv, token: &mut u32) -> (u32, Dispatch) {
    let mut v = view("k1", "a");
    request(c, id, &v, clock);
    let (t, _) = dispatch_all(c, clock, token)[0].clone();
    c.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], clock);
    assert!(drain(c).contains(&Command::Resume { stream: id }));
    v.resp(":status", "201");
    v.response_chunk = b"made".to_vec();
    c.on_stream_event(id, &v, clock, |s, v| s.on_response_headers(v, false));
    c.on_stream_event(id, &v, clock, |s, v| s.on_response_body(v, 4, true));
    drain(c);
    let sent = dispatch_all(c, clock, token);
    assert_eq!(path(&sent[0].1), proto::PATH_COMMIT);
    sent[0].clone()
}

#[test]
fn what_ran_under_the_stores_lock_never_runs_again_in_this_envoy_when_the_store_fails() {
    let clock = SimEnv::at(T0);
    let cfg = r#","local_record_entries":256,"breaker_open_ms":0"#;
    let mut c = coordinator(cfg);
    c.set_up(&clock, 5);
    drain(&mut c);
    let mut token = 0;
    // Another worker's VM of the same Envoy (the same shared data).
    let mut other = coordinator(cfg);
    other.set_up(&clock, 6);
    drain(&mut other);

    // While stream 2 runs under the store's lock, the store fails for a duplicate on the other
    // worker: it waits for the mirrored lock instead of running.
    let mut v = view("k1", "a");
    request(&mut c, 2, &v, &clock);
    let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    c.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok")]), vec![], &clock);
    assert!(drain(&mut c).contains(&Command::Resume { stream: 2 }));
    request(&mut other, 7, &v, &clock);
    let (t, _) = dispatch_all(&mut other, &clock, &mut token)[0].clone();
    other.on_callout_answer(t, vec![], vec![], &clock);
    let commands = drain(&mut other);
    assert!(
        responses(&commands).is_empty() && !commands.contains(&Command::Resume { stream: 7 }),
        "{commands:?}"
    );

    // The original's commit is sent: the duplicate's wait ends with a 503 (the answer is in the
    // store, which cannot be read), not a second execution.
    v.resp(":status", "201");
    v.response_chunk = b"made".to_vec();
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_headers(v, false));
    c.on_stream_event(2, &v, &clock, |s, v| s.on_response_body(v, 4, true));
    drain(&mut c);
    let (commit, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
    clock.0.set(T0 + 20_000);
    other.on_tick(&clock);
    let commands = drain(&mut other);
    assert_eq!(responses(&commands), vec![(7, 503)]);
    assert!(commands.contains(&Command::Count(Metric::Unavailable)));

    // The commit and its retry fail: the record is kept locally, and no release is sent (the
    // hand-back ends the store's lock). A retry on the other worker replays it.
    c.on_callout_answer(commit, vec![], vec![], &clock);
    let retry = dispatch_all(&mut c, &clock, &mut token);
    assert_eq!(path(&retry[0].1), proto::PATH_COMMIT);
    c.on_callout_answer(retry[0].0, vec![], vec![], &clock);
    let commands = drain(&mut c);
    assert!(dispatches(&commands).is_empty(), "{commands:?}");
    request(&mut other, 8, &v, &clock);
    let (t, _) = dispatch_all(&mut other, &clock, &mut token)[0].clone();
    other.on_callout_answer(t, vec![], vec![], &clock);
    let commands = drain(&mut other);
    assert_eq!(responses(&commands), vec![(8, 201)]);
    assert!(commands.contains(&Command::Count(Metric::LocalReplays)));

    // The store is back before the hand-back: it grants a retry its lock, but the local record
    // answers, and goes to the store under that lock.
    request(&mut other, 9, &v, &clock);
    let (t, _) = dispatch_all(&mut other, &clock, &mut token)[0].clone();
    other.on_callout_answer(t, answer("locked", &[(proto::HEADER_TOKEN, "tok2")]), vec![], &clock);
    let commands = drain(&mut other);
    assert_eq!(responses(&commands), vec![(9, 201)]);
    let sent = dispatches(&commands);
    assert_eq!((path(&sent[0]), header(&sent[0], proto::HEADER_TOKEN)), (proto::PATH_COMMIT, "tok2"));
    // The scan hands the record back under the lock it was made under.
    clock.0.set(T0 + 1_100_000);
    c.on_tick(&clock);
    let hand_back = dispatches(&drain(&mut c));
    assert_eq!(header(&hand_back[0], proto::HEADER_TOKEN), "tok");
}

#[test]
fn a_key_run_before_the_outage_is_not_run_again_during_it() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator(r#","local_record_entries":256,"breaker_open_ms":0"#);
    c.set_up(&clock, 5);
    drain(&mut c);
    let mut token = 0;
    let (commit, _) = run_under_store_lock(&mut c, 2, &clock, &mut token);
    c.on_callout_answer(commit, answer("stored", &[]), vec![], &clock);
    drain(&mut c);
    // The store fails: the same request gets 503 with Retry-After, another body 422.
    for (id, body, status) in [(3, "a", 503), (4, "b", 422)] {
        request(&mut c, id, &view("k1", body), &clock);
        let (t, _) = dispatch_all(&mut c, &clock, &mut token)[0].clone();
        c.on_callout_answer(t, vec![], vec![], &clock);
        let commands = drain(&mut c);
        assert_eq!(responses(&commands), vec![(id, status)], "{commands:?}");
        assert!(!commands.iter().any(|c| matches!(c, Command::Resume { .. })));
    }
}

/// The problem's `instance`: set in the filter state, then sent, the same in both; a new one for
/// every refusal, whatever the request.
#[test]
fn a_refusal_gets_an_instance_of_its_own_in_the_filter_state_and_the_answer() {
    let clock = SimEnv::at(T0);
    let mut c = coordinator(r#","require_key":true"#);
    c.set_up(&clock, 42);
    let mut instances = Vec::new();
    for id in [1, 2] {
        let mut v = MockView::post(None);
        v.req("x-request-id", "same-id-twice");
        c.on_stream_event(id, &v, &clock, |s, v| s.on_request_headers(v, false));
        let commands = drain(&mut c);
        let [Command::Instance { stream, instance }, Command::Respond { response, .. }, ..] =
            commands.as_slice()
        else {
            panic!("{commands:?}")
        };
        assert_eq!(*stream, id);
        let doc: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
        assert_eq!(
            (doc["code"].as_str(), doc["instance"].as_str()),
            (Some("missing-key"), Some(instance.as_str()))
        );
        assert_eq!(doc["retryable"], false);
        instances.push(instance.clone());
    }
    assert_ne!(instances[0], instances[1], "two occurrences, two instances");

    // A gRPC call gets the status, the instance in its message.
    let mut v = MockView::post(None);
    v.req("content-type", "application/grpc").req(":path", "/shop.v1.Orders/Create");
    c.on_stream_event(3, &v, &clock, |s, v| s.on_request_headers(v, false));
    let commands = drain(&mut c);
    let [Command::Instance { instance, .. }, Command::Respond { response, .. }, ..] = commands.as_slice()
    else {
        panic!("{commands:?}")
    };
    let message = response.headers.iter().find(|(n, _)| n == "grpc-message").map(|(_, v)| v.as_str());
    let expected =
        format!("missing-key: This request must carry an Idempotency-Key header. (instance {instance})");
    assert_eq!(message, Some(crate::http::grpc::percent_encode(&expected).as_str()));
    assert!(!instances.contains(instance));
}
