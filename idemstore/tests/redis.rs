//! The shared scenarios against a real `redis-server`, one per test on a free loopback port.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use idemstore::backend::pubsub::CHANNEL;
use idemstore::backend::redis::RedisBackend;
use idemstore::backend::{Backend, Commit, ReleaseOutcome};
use idemstore::store::{Begin, Store};

/// A private `redis-server`, killed by PID when dropped.
struct RedisServer {
    child: Child,
    url: String,
}

impl RedisServer {
    async fn start() -> Self {
        Self::start_on(free_port()).await
    }

    async fn start_on(port: u16) -> Self {
        let bin = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        let server = Self { child, url: url(port) };
        let backend = server.backend();
        let deadline = Instant::now() + Duration::from_secs(10);
        while backend.health().await.is_err() {
            assert!(Instant::now() < deadline, "redis-server did not answer PING");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server
    }

    fn backend(&self) -> RedisBackend<idemstore::backend::redis::Standalone> {
        RedisBackend::standalone(&self.url, Duration::from_secs(2)).unwrap()
    }

    fn store(&self) -> Store<RedisBackend<idemstore::backend::redis::Standalone>> {
        Store::new(self.backend())
    }

    /// Two idemstore instances on this Redis (separate connections and subscriptions), with
    /// 60 s re-checks, once both hear each other's wake-ups.
    async fn two_instances(&self) -> (Arc<Store<StandaloneBackend>>, Arc<Store<StandaloneBackend>>) {
        let (one, two) = (common::no_recheck(self.backend()), common::no_recheck(self.backend()));
        common::listening(&one, 1).await;
        common::listening(&two, 1).await;
        (one, two)
    }

    async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.url.as_str()).unwrap();
        client.get_multiplexed_async_connection().await.unwrap()
    }
}

type StandaloneBackend = RedisBackend<idemstore::backend::redis::Standalone>;

/// Pub/sub clients connected to the server.
async fn pubsub_clients(conn: &mut redis::aio::MultiplexedConnection) -> usize {
    let list: String =
        redis::cmd("CLIENT").arg("LIST").arg("TYPE").arg("pubsub").query_async(conn).await.unwrap();
    list.lines().filter(|l| !l.trim().is_empty()).count()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn begin_locks_then_replays() {
    let redis = RedisServer::start().await;
    common::begin_locks_then_replays(&redis.store()).await;
}

#[tokio::test]
async fn waiter_woken_by_commit() {
    let redis = RedisServer::start().await;
    common::waiter_woken_by_commit(redis.backend()).await;
}

#[tokio::test]
async fn waiter_woken_by_release() {
    let redis = RedisServer::start().await;
    common::waiter_woken_by_release(redis.backend()).await;
}

#[tokio::test]
async fn busy_after_wait() {
    let redis = RedisServer::start().await;
    common::busy_after_wait(&redis.store()).await;
}

#[tokio::test]
async fn busy_at_once_without_wait() {
    let redis = RedisServer::start().await;
    common::busy_at_once_without_wait(&redis.store()).await;
}

#[tokio::test]
async fn lock_remaining_over_http() {
    let redis = RedisServer::start().await;
    common::lock_remaining_over_http(Arc::new(redis.store())).await;
}

/// A lock without expiry (set by hand): `busy` says nothing of its remaining time, and the
/// answer carries no `x-idem-lock-remaining-ms`.
#[tokio::test]
async fn lock_without_expiry_has_no_remaining_time() {
    let redis = RedisServer::start().await;
    let store = Arc::new(redis.store());
    let key = common::key();
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("SET")
        .arg(format!("idem:{{{key}}}:l"))
        .arg("by-hand")
        .query_async(&mut conn)
        .await
        .unwrap();
    let begun = store.begin(&key, &common::hash('a'), common::TTL, Duration::ZERO).await.unwrap();
    assert_eq!(begun, Begin::Busy { remaining: None });
    let addr = common::client::serve_store(store, idemstore::http::Options::new(1024)).await;
    let client = common::client::Client::new(addr, common::client::Version::H2c).await;
    let busy = client.begin(&key, &common::hash('a'), "0").await;
    assert_eq!((busy.outcome(), busy.lock_remaining()), ("busy", None));
}

#[tokio::test]
async fn batch_commit_over_http() {
    let redis = RedisServer::start().await;
    common::batch_commit_over_http(Arc::new(redis.store())).await;
}

/// A TCP proxy to `upstream` that delays what the client sends by `delay`, without limiting
/// how much is in flight (every chunk is forwarded `delay` after it was read), so a round trip
/// through it costs `delay` more and pipelined requests share it. Runs until the test ends.
async fn latency_proxy(upstream: std::net::SocketAddr, delay: Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
            client.set_nodelay(true).unwrap();
            server.set_nodelay(true).unwrap();
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            let (chunks, mut delayed) =
                tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                while let Ok(n @ 1..) = client_read.read(&mut buf).await {
                    if chunks.send((tokio::time::Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                while let Some((at, chunk)) = delayed.recv().await {
                    tokio::time::sleep_until(at).await;
                    if server_write.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
            });
        }
    });
    url(port)
}

/// The point of `commits`: its items' scripts are pipelined on the Redis connection, so a
/// batch of 64 costs about one Redis round trip, not 64. Through a proxy adding 25 ms to each
/// round trip, one at a time they would take at least 1.6 s.
#[tokio::test]
async fn batch_commits_share_a_redis_round_trip() {
    let redis = RedisServer::start().await;
    let upstream = redis.url.trim_start_matches("redis://").trim_end_matches('/').parse().unwrap();
    let delay = Duration::from_millis(25);
    let proxied = latency_proxy(upstream, delay).await;
    let store = Arc::new(Store::new(RedisBackend::standalone(&proxied, Duration::from_secs(5)).unwrap()));
    let hash = common::hash('a');
    // Loads the script (the first call of a fresh server answers NOSCRIPT) and connects.
    let started = Instant::now();
    store.commit(common::commit(&common::key(), "warm-up", &hash, Bytes::from_static(b"r"))).await.unwrap();
    assert!(started.elapsed() >= delay, "not through the proxy: {:?}", started.elapsed());

    let addr = common::client::serve_store(store, idemstore::http::Options::new(1024 * 1024)).await;
    let client = common::client::Client::new(addr, common::client::Version::H2c).await;
    let n = idem_protocol::MAX_BATCH_ITEMS;
    let keys: Vec<String> = (0..n).map(|_| common::key()).collect();
    let items: Vec<(&str, &str, &str, &[u8])> =
        keys.iter().map(|k| (k.as_str(), "no-lock", hash.as_str(), &b"r"[..])).collect();
    let started = Instant::now();
    let reply = client.commits(common::client::batch_body(&items)).await;
    let took = started.elapsed();
    assert_eq!(reply.batch(n), vec![Some(idemstore::backend::CommitOutcome::Late); n]);
    eprintln!("{n} commits in one batch through a {delay:?} round trip: {took:?}");
    assert!(took < delay * 16, "{n} commits took {took:?}: not pipelined");
}

#[tokio::test]
async fn mismatch() {
    let redis = RedisServer::start().await;
    common::mismatch(&redis.store()).await;
}

#[tokio::test]
async fn release_lets_next_begin_lock() {
    let redis = RedisServer::start().await;
    common::release_lets_next_begin_lock(&redis.store()).await;
}

#[tokio::test]
async fn late_commit_and_exists() {
    let redis = RedisServer::start().await;
    common::late_commit_and_exists(&redis.store()).await;
}

#[tokio::test]
async fn expired_lock_is_taken_over() {
    let redis = RedisServer::start().await;
    common::expired_lock_is_taken_over(&redis.store()).await;
}

#[tokio::test]
async fn record_expires() {
    let redis = RedisServer::start().await;
    common::record_expires(&redis.store(), Duration::from_secs(1)).await;
}

#[tokio::test]
async fn binary_record() {
    let redis = RedisServer::start().await;
    common::binary_record(&redis.store()).await;
}

#[tokio::test]
async fn waiter_on_other_instance() {
    let redis = RedisServer::start().await;
    common::waiter_on_other_instance(redis.store(), redis.store()).await;
}

#[tokio::test]
async fn stop_waiting_answers_busy() {
    let redis = RedisServer::start().await;
    common::stop_waiting_answers_busy(Arc::new(redis.store())).await;
}

/// The stored layout is what the scripts promise: hash tag, 64-byte hash prefix, PX expiry.
#[tokio::test]
async fn stored_layout_and_expiry() {
    let redis = RedisServer::start().await;
    let store = redis.store();
    let key = common::key();
    let token = common::lock(&store, &key).await;
    let client = redis::Client::open(redis.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let lock: String =
        redis::cmd("GET").arg(format!("idem:{{{key}}}:l")).query_async(&mut conn).await.unwrap();
    assert_eq!(lock, token);
    store
        .commit(Commit {
            retention: Duration::from_secs(60),
            ..common::commit(&key, &token, &common::hash('a'), bytes::Bytes::from_static(b"\0rec"))
        })
        .await
        .unwrap();
    let record_key = format!("idem:{{{key}}}:r");
    let value: Vec<u8> = redis::cmd("GET").arg(&record_key).query_async(&mut conn).await.unwrap();
    assert_eq!(value, [common::hash('a').as_bytes(), b"\0rec"].concat());
    let pttl: i64 = redis::cmd("PTTL").arg(&record_key).query_async(&mut conn).await.unwrap();
    assert!((59_000..=60_000).contains(&pttl), "{pttl}");
    let exists: i64 =
        redis::cmd("EXISTS").arg(format!("idem:{{{key}}}:l")).query_async(&mut conn).await.unwrap();
    assert_eq!(exists, 0);
}

/// Redis down: every operation fails fast (503 upstream) instead of queueing behind
/// reconnect retries; once Redis is back, the same backend recovers, its wake-up
/// subscription included.
#[tokio::test]
async fn redis_outage_fails_fast_and_recovers() {
    let port = free_port();
    let redis = RedisServer::start_on(port).await;
    let store = redis.store();
    store.health().await.unwrap();
    // The subscriber subscribes in the background: on a loaded machine it may not have done
    // so yet, and a first subscription made only after the restart would never count as the
    // second one awaited below. So the outage starts once it is subscribed...
    common::listening(&store, 1).await;
    let mut remote = store.remote_wakeups();
    drop(redis);
    // ...and is noticed: connection closed, or at worst a PING unanswered (1 s + 2 s).
    tokio::time::timeout(Duration::from_secs(10), remote.wait_for(|s| !s.listening))
        .await
        .expect("the subscriber did not notice that Redis went away")
        .unwrap();
    for _ in 0..3 {
        let started = Instant::now();
        assert!(store.health().await.is_err());
        let begun = store.begin(&common::key(), &common::hash('a'), common::TTL, common::WAIT).await;
        assert!(begun.is_err());
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    }
    let _redis = RedisServer::start_on(port).await;
    common::begin_locks_then_replays(&store).await;
    // The wake-up subscription came back too: a second subscription, on the new server.
    common::listening(&store, 2).await;
}

/// Redis restarted while the connection sat idle: the first call after the restart meets the
/// dead socket and goes again on a new connection, instead of failing (its request would run
/// unguarded, and a retry elsewhere a second time).
#[tokio::test]
async fn a_restart_while_idle_fails_no_call() {
    let port = free_port();
    let redis = RedisServer::start_on(port).await;
    let store = redis.store();
    common::begin_locks_then_replays(&store).await;
    drop(redis);
    let _redis = RedisServer::start_on(port).await;
    let begun = store.begin(&common::key(), &common::hash('a'), common::TTL, common::WAIT).await;
    assert!(matches!(begun, Ok(Begin::Locked { .. })), "{begun:?}");
}

/// Started before Redis: the lazy connection comes up once Redis does.
#[tokio::test]
async fn starts_before_redis() {
    let port = free_port();
    let backend = RedisBackend::standalone(&url(port), Duration::from_secs(1)).unwrap();
    assert!(backend.health().await.is_err());
    let _redis = RedisServer::start_on(port).await;
    backend.health().await.unwrap();
}

/// A Redis that accepts but never answers (SIGSTOP): operations end at the timeout.
#[tokio::test]
async fn frozen_redis_times_out() {
    let redis = RedisServer::start().await;
    let timeout = Duration::from_millis(300);
    let backend = RedisBackend::standalone(&redis.url, timeout).unwrap();
    backend.health().await.unwrap();
    let pid = redis.child.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let started = Instant::now();
    let attempt = backend.try_begin(&common::key(), &common::hash('a'), "t", common::TTL, None).await;
    let took = started.elapsed();
    assert!(Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    assert!(attempt.is_err());
    assert!(took >= timeout && took < timeout + Duration::from_millis(700), "took {took:?}");
}

/// A commit or release through one instance wakes a duplicate waiting on the other within
/// milliseconds; with 60 s re-checks only the pub/sub wake-up can explain it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wakes_cross_instances() {
    let redis = RedisServer::start().await;
    let (one, two) = redis.two_instances().await;
    common::wakes_cross_instances(&one, &two).await;
}

/// The numbers for the closing note: `cargo test -p idemstore --test redis cross_instance_wake_latency -- --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_instance_wake_latency() {
    let redis = RedisServer::start().await;
    let (one, two) = redis.two_instances().await;
    common::measure_cross_instance_wakes("standalone", &one, &two, 200).await;
}

/// The server drops the pub/sub connections: both instances resubscribe and cross-instance
/// wake-ups are fast again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_reconnects_after_client_kill() {
    let redis = RedisServer::start().await;
    let (one, two) = redis.two_instances().await;
    let mut conn = redis.conn().await;
    let killed: i64 =
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("pubsub").query_async(&mut conn).await.unwrap();
    assert_eq!(killed, 2);
    common::listening(&one, 2).await;
    common::listening(&two, 2).await;
    common::wakes_cross_instances(&one, &two).await;
}

/// A commit lands while the waiter's instance cannot subscribe (the ACL forbids the channel,
/// which also disconnects the subscribers and makes the script's PUBLISH fail): the commit
/// still succeeds, and the waiter gets the record as soon as its instance is subscribed
/// again, not at its 60 s re-check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wakeups_missed_while_unsubscribed_are_caught_up() {
    let redis = RedisServer::start().await;
    let (one, two) = redis.two_instances().await;
    let mut conn = redis.conn().await;
    let key = common::key();
    let token = common::lock(&one, &key).await;
    let waiter = tokio::spawn({
        let (two, key) = (Arc::clone(&two), key.clone());
        async move { two.begin(&key, &common::hash('a'), common::TTL, common::WAIT).await.unwrap() }
    });
    common::parked(&two, 0).await;
    let _: () =
        redis::cmd("ACL").arg(&["SETUSER", "default", "resetchannels"]).query_async(&mut conn).await.unwrap();
    let mut remote = two.remote_wakeups();
    tokio::time::timeout(Duration::from_secs(5), remote.wait_for(|s| !s.listening)).await.unwrap().unwrap();
    let record = Bytes::from_static(b"while deaf");
    one.commit(common::commit(&key, &token, &common::hash('a'), record.clone())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "woken while nobody could hear the commit");
    let _: () =
        redis::cmd("ACL").arg(&["SETUSER", "default", "allchannels"]).query_async(&mut conn).await.unwrap();
    let restored = Instant::now();
    let begun = tokio::time::timeout(Duration::from_secs(4), waiter).await.unwrap().unwrap();
    assert_eq!(common::replayed(begun), Some(record));
    eprintln!("caught up {:?} after the ACL allowed the channel again", restored.elapsed());
    common::listening(&two, 2).await;
}

/// The scripts publish the store key when they drop a lock or store a record while a `begin`
/// waits on it (it marks the key when it finds the lock held), and only then: a key nobody
/// waited on costs no message.
#[tokio::test]
async fn scripts_publish_the_key_on_change_when_waited_on() {
    let redis = RedisServer::start().await;
    let store = redis.store();
    let client = redis::Client::open(redis.url.as_str()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe(CHANNEL).await.unwrap();
    // A `begin` that finds the lock held and gives up at once: it leaves the waiter mark.
    let wait_on = |key: String| {
        let store = &store;
        async move {
            let begun = store.begin(&key, &common::hash('a'), common::TTL, Duration::from_millis(1)).await;
            common::busy_remaining(begun.unwrap());
        }
    };
    let (committed, released, late) = (common::key(), common::key(), common::key());
    let (unwatched_commit, unwatched_release) = (common::key(), common::key());
    let token = common::lock(&store, &unwatched_commit).await;
    store.commit(common::commit(&unwatched_commit, &token, &common::hash('a'), Bytes::new())).await.unwrap();
    let token = common::lock(&store, &unwatched_release).await;
    assert_eq!(store.release(&unwatched_release, &token, false).await.unwrap(), ReleaseOutcome::Released);

    let token = common::lock(&store, &committed).await;
    wait_on(committed.clone()).await;
    store.commit(common::commit(&committed, &token, &common::hash('a'), Bytes::new())).await.unwrap();
    let token = common::lock(&store, &released).await;
    wait_on(released.clone()).await;
    assert_eq!(store.release(&released, "not-the-owner", false).await.unwrap(), ReleaseOutcome::NotOwner);
    assert_eq!(store.release(&released, &token, false).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(store.release(&released, &token, false).await.unwrap(), ReleaseOutcome::NotOwner);
    // A record stored without owning the lock (late) wakes; a second commit that changes
    // nothing does not.
    let _held = common::lock(&store, &late).await;
    wait_on(late.clone()).await;
    store.commit(common::commit(&late, "no-lock", &common::hash('a'), Bytes::new())).await.unwrap();
    store.commit(common::commit(&late, "no-lock", &common::hash('a'), Bytes::new())).await.unwrap();
    let mut conn = redis.conn().await;
    let _: i64 = redis::cmd("PUBLISH").arg(CHANNEL).arg("end").query_async(&mut conn).await.unwrap();
    let mut heard = Vec::new();
    let mut messages = pubsub.on_message();
    while let Some(message) = tokio::time::timeout(Duration::from_secs(5), messages.next()).await.unwrap() {
        let payload: String = message.get_payload().unwrap();
        if payload == "end" {
            break;
        }
        heard.push(payload);
    }
    assert_eq!(heard, [committed, released, late]);
}

/// A dropped store closes its subscription.
#[tokio::test]
async fn dropped_store_unsubscribes() {
    let redis = RedisServer::start().await;
    let store = redis.store();
    common::listening(&store, 1).await;
    let mut conn = redis.conn().await;
    assert_eq!(pubsub_clients(&mut conn).await, 1);
    drop(store);
    let deadline = Instant::now() + Duration::from_secs(5);
    while pubsub_clients(&mut conn).await > 0 {
        assert!(Instant::now() < deadline, "the subscription outlived its store");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The operator's tools on Redis: more records than one `SCAN` call returns, beside keys that
/// are not records or locks (a waiter mark, another application's keys), which are not counted.
#[tokio::test]
async fn operator_tools() {
    let redis = RedisServer::start().await;
    let mut conn = redis.conn().await;
    let mark = format!("idem:{{{}}}:w", common::key());
    for other in ["orders:1", "idem:wake", "idem:{notakey}:x", mark.as_str()] {
        let _: () = redis::cmd("SET").arg(other).arg("1").query_async(&mut conn).await.unwrap();
    }
    common::operator_tools(&redis.backend(), 2500).await;

    // A record and a lock set by hand without expiry: no lifetime to tell.
    let key = common::key();
    let value = [common::hash('a').into_bytes(), common::filter_record(b"").to_vec()].concat();
    let _: () =
        redis::cmd("SET").arg(format!("idem:{{{key}}}:r")).arg(value).query_async(&mut conn).await.unwrap();
    let _: () =
        redis::cmd("SET").arg(format!("idem:{{{key}}}:l")).arg("t").query_async(&mut conn).await.unwrap();
    let seen = redis.backend().inspect(&key).await.unwrap();
    assert_eq!(seen.record.map(|r| (r.status, r.bytes, r.ttl)), Some((Some(201), 9, None)));
    assert_eq!(seen.lock.map(|l| l.ttl), Some(None));
}

#[tokio::test]
async fn delete_wakes_other_instance() {
    let redis = RedisServer::start().await;
    let (one, two) = redis.two_instances().await;
    common::delete_wakes_other_instance(&one, &two).await;
}

/// `idemstore records` against Redis, as an operator runs it (the command's own code, not the
/// binary): the record of a request found by its subject, method, route and key, deleted, and
/// then nothing found.
#[tokio::test]
async fn records_command_on_redis() {
    use clap::Parser;
    use idemstore::tools::{execute, Records};

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        records: Records,
    }
    let redis = RedisServer::start().await;
    let store = redis.store();
    let key = idem_protocol::store_key("id:alice", "POST", "orders", "k-1");
    let token = common::lock(&store, &key).await;
    store
        .commit(common::commit(&key, &token, &common::hash('a'), common::filter_record(b"{}")))
        .await
        .unwrap();
    let run = |command: &'static str| {
        let url = redis.url.clone();
        async move {
            let args = ["records", command, "--redis", &url, "--subject", "id:alice", "--method", "POST"];
            let args = [&args[..], &["--route", "orders", "--key", "k-1", "--json"]].concat();
            execute(&Cli::parse_from(args).records, |_| None).await.unwrap()
        }
    };
    let found = run("lookup").await;
    assert!(found.found);
    let report: idemstore::admin::KeyReport = serde_json::from_str(&found.text).unwrap();
    assert_eq!((report.store_key.as_str(), report.record.unwrap().status), (key.as_str(), Some(201)));
    let deleted = run("delete").await;
    assert!(deleted.found && deleted.text.contains("\"deleted_record\":true"), "{}", deleted.text);
    let again = run("delete").await;
    assert!(!again.found && again.text.contains("\"deleted_record\":false"), "{}", again.text);
    assert!(!run("lookup").await.found);
}

/// Attempts whose outcome is unknown: every scenario of `common::in_doubt` on one server (the
/// scripts' traces, `TIME` for their start).
#[tokio::test]
async fn in_doubt_scenarios() {
    let redis = RedisServer::start().await;
    let backend = redis.backend();
    common::in_doubt::every_scenario(&backend).await;
}

/// An in-doubt release wakes a waiter on another instance: it gets `in-doubt` at once.
#[tokio::test]
async fn in_doubt_waiter_woken_by_an_in_doubt_release() {
    let redis = RedisServer::start().await;
    let (one, _) = redis.two_instances().await;
    common::in_doubt::waiter_woken_by_an_in_doubt_release(one).await;
}

/// The trace's Redis key: `idem:{<key>}:t` (the same hash tag), `<token> <started ms> <lock
/// TTL ms> <body hash>`, with a PTTL of max(retention, lock TTL).
#[tokio::test]
async fn the_trace_is_one_more_key_in_the_slot() {
    let redis = RedisServer::start().await;
    let backend = redis.backend();
    let key = common::key();
    let hold = common::in_doubt::hold();
    let locked = backend.try_begin(&key, &common::hash('a'), "tok-1", Duration::from_secs(30), hold).await;
    assert_eq!(locked, Ok(idemstore::backend::Attempt::Locked));
    let mut conn = redis.conn().await;
    let name = format!("idem:{{{key}}}:t");
    let value: String = redis::cmd("GET").arg(&name).query_async(&mut conn).await.unwrap();
    let parts: Vec<&str> = value.split(' ').collect();
    assert_eq!(
        (parts.len(), parts[0], parts[2], parts[3]),
        (4, "tok-1", "30000", common::hash('a').as_str())
    );
    let started: u64 = parts[1].parse().unwrap();
    assert!(started.abs_diff(idemstore::backend::now_ms()) < 5_000, "{started}");
    let pttl: i64 = redis::cmd("PTTL").arg(&name).query_async(&mut conn).await.unwrap();
    assert!(pttl > 55_000 && pttl <= 60_000, "{pttl}");
    // Set by hand to something else: ignored, and overwritten by the next attempt.
    let _: () = redis::cmd("SET").arg(&name).arg("garbage").query_async(&mut conn).await.unwrap();
    assert_eq!(backend.inspect(&key).await.unwrap().trace, None);
    assert_eq!(backend.release(&key, "tok-1", true).await, Ok(ReleaseOutcome::Released));
    let again = backend.try_begin(&key, &common::hash('a'), "tok-2", Duration::from_secs(30), hold).await;
    assert_eq!(again, Ok(idemstore::backend::Attempt::Locked));
    let value: String = redis::cmd("GET").arg(&name).query_async(&mut conn).await.unwrap();
    assert!(value.starts_with("tok-2 "), "{value}");
}
