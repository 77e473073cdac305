//! The shared scenarios against a real 3-master Redis Cluster on loopback ports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use idemstore::backend::pubsub::CHANNEL;
use idemstore::backend::redis::RedisBackend;
use idemstore::backend::Backend;
use idemstore::store::Store;
use redis::cluster_async::ClusterConnection;

/// Three cluster-enabled `redis-server`s joined by `redis-cli --cluster create`, killed by
/// PID when dropped.
struct Cluster {
    nodes: Vec<Child>,
    urls: Vec<String>,
    _dir: TempDir,
}

/// A scratch folder for the nodes' `nodes.conf`, removed when dropped.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Cluster nodes also listen on port + 10000, so the port must stay below 55536.
fn free_port() -> u16 {
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let bus = std::net::TcpListener::bind(("127.0.0.1", port.wrapping_add(10_000)));
        if port <= 55_535 && bus.is_ok() {
            return port;
        }
    }
}

impl Cluster {
    async fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("idemstore-cluster-{}", common::key()));
        std::fs::create_dir_all(&dir).unwrap();
        let dir = TempDir(dir);
        let mut cluster = Self { nodes: Vec::new(), urls: Vec::new(), _dir: dir };
        let mut addrs = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let node_dir = cluster._dir.0.join(i.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            let child = Command::new("redis-server")
                .current_dir(&node_dir)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--cluster-enabled", "yes"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed");
            cluster.nodes.push(child);
            addrs.push(format!("127.0.0.1:{port}"));
            cluster.urls.push(format!("redis://127.0.0.1:{port}/"));
        }
        for addr in &addrs {
            let port = addr.rsplit(':').next().unwrap();
            wait_for(|| redis_cli(&["-p", port, "ping"]).is_some_and(|out| out.trim() == "PONG")).await;
        }
        let mut create = vec!["--cluster", "create"];
        create.extend(addrs.iter().map(String::as_str));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        assert!(redis_cli(&create).is_some(), "redis-cli --cluster create failed");
        for addr in &addrs {
            let port = addr.rsplit(':').next().unwrap();
            wait_for(|| {
                redis_cli(&["-p", port, "cluster", "info"])
                    .is_some_and(|out| out.contains("cluster_state:ok"))
            })
            .await;
        }
        cluster
    }

    fn backend(&self) -> RedisBackend<ClusterConnection> {
        RedisBackend::cluster(&self.urls, Duration::from_secs(2)).unwrap()
    }

    fn store(&self) -> Store<RedisBackend<ClusterConnection>> {
        Store::new(self.backend())
    }
}

fn redis_cli(args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli").args(args).stdin(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn wait_for(mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready() {
        assert!(Instant::now() < deadline, "cluster did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
    }
}

/// One cluster for all scenarios: starting one costs seconds. Keys are random, so they
/// spread over the three masters' slots.
#[tokio::test]
async fn scenarios_on_three_masters() {
    let cluster = Cluster::start().await;
    let store = cluster.store();
    store.health().await.unwrap();
    for _ in 0..6 {
        common::begin_locks_then_replays(&store).await;
    }
    common::mismatch(&store).await;
    common::release_lets_next_begin_lock(&store).await;
    common::late_commit_and_exists(&store).await;
    common::busy_after_wait(&store).await;
    common::busy_at_once_without_wait(&store).await;
    common::binary_record(&store).await;
    common::waiter_woken_by_commit(cluster.store().backend().clone()).await;
    common::waiter_on_other_instance(cluster.store(), cluster.store()).await;
    common::lock_remaining_over_http(std::sync::Arc::new(cluster.store())).await;
    batch_on_mixed_slots(&cluster).await;
}

/// The master that holds `key`'s slot: the only node that answers for it (the others answer
/// `MOVED`).
async fn owner(nodes: &mut [redis::aio::MultiplexedConnection], key: &str) -> usize {
    let mut owners = Vec::new();
    for (i, conn) in nodes.iter_mut().enumerate() {
        let found: redis::RedisResult<i64> =
            redis::cmd("EXISTS").arg(format!("idem:{{{key}}}:r")).query_async(conn).await;
        if found.is_ok() {
            owners.push(i);
        }
    }
    assert_eq!(owners.len(), 1, "{key}: answered by {owners:?}");
    owners[0]
}

/// One `commits` call whose items live on all three masters: each is stored on its own
/// master and replays, in one answer.
async fn batch_on_mixed_slots(cluster: &Cluster) {
    let mut nodes = Vec::new();
    for url in &cluster.urls {
        let client = redis::Client::open(url.as_str()).unwrap();
        nodes.push(client.get_multiplexed_async_connection().await.unwrap());
    }
    // One key per master, then a few more wherever they fall.
    let mut keys: Vec<(String, usize)> = Vec::new();
    while (0..nodes.len()).any(|n| keys.iter().all(|(_, o)| *o != n)) {
        let key = common::key();
        let node = owner(&mut nodes, &key).await;
        if keys.iter().all(|(_, o)| *o != node) {
            keys.push((key, node));
        }
    }
    for _ in 0..5 {
        let key = common::key();
        let node = owner(&mut nodes, &key).await;
        keys.push((key, node));
    }

    let store = std::sync::Arc::new(cluster.store());
    let addr = common::client::serve_store(store, idemstore::http::Options::new(1024 * 1024)).await;
    let client = common::client::Client::new(addr, common::client::Version::H2c).await;
    let hash = common::hash('a');
    let mut items = Vec::new();
    for (i, (key, _)) in keys.iter().enumerate() {
        let token = client.begin(key, &hash, "0").await.token();
        items.push((key.as_str(), token, format!("record {i}\n\0 of {key}").into_bytes()));
    }
    let batch: Vec<(&str, &str, &str, &[u8])> =
        items.iter().map(|(key, token, record)| (*key, token.as_str(), hash.as_str(), &record[..])).collect();
    let reply = client.commits(common::client::batch_body(&batch)).await;
    assert_eq!(reply.batch(keys.len()), vec![Some(idemstore::backend::CommitOutcome::Stored); keys.len()]);
    for ((key, node), (_, _, record)) in keys.iter().zip(&items) {
        let replay = client.begin(key, &hash, "0").await;
        assert_eq!((replay.outcome(), &replay.body[..]), ("record", &record[..]));
        let stored: Vec<u8> =
            redis::cmd("GET").arg(format!("idem:{{{key}}}:r")).query_async(&mut nodes[*node]).await.unwrap();
        assert_eq!(stored, [hash.as_bytes(), record].concat(), "on its own master");
    }
}

/// A master down (no replica to fail over to): keys in its slots fail fast, within the
/// timeout, instead of riding the client's retries; keys on the other masters still work.
#[tokio::test]
async fn dead_master_fails_only_its_slots_and_fast() {
    let mut cluster = Cluster::start().await;
    let timeout = Duration::from_millis(500);
    let backend = RedisBackend::cluster(&cluster.urls, timeout).unwrap();
    backend.health().await.unwrap();
    cluster.nodes[1].kill().unwrap();
    cluster.nodes[1].wait().unwrap();
    let (mut ok, mut failed) = (0, 0);
    // 40 random keys: all on one side of the split by chance is below 1e-7.
    for _ in 0..40 {
        let started = Instant::now();
        let attempt = backend.try_begin(&common::key(), &common::hash('a'), "t", common::TTL, None).await;
        let took = started.elapsed();
        assert!(took < timeout + Duration::from_millis(700), "took {took:?}");
        if attempt.is_ok() {
            ok += 1;
        } else {
            failed += 1;
        }
    }
    assert!(ok > 0 && failed > 0, "ok {ok}, failed {failed}");
}

/// Wake-ups cross instances on a cluster too. A script's classic `PUBLISH` runs on the key's
/// master and is broadcast over the cluster bus: a subscriber on each of the three nodes hears
/// every key waited on (a `begin` that found the lock held marked it), so at least two of them
/// hear it from another node than the one that ran the script. Then two instances (each subscribed to one random seed) wake each other fast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wakes_cross_instances_on_three_masters() {
    let cluster = Cluster::start().await;
    let mut subscribers = Vec::new();
    for url in &cluster.urls {
        let mut pubsub = redis::Client::open(url.as_str()).unwrap().get_async_pubsub().await.unwrap();
        pubsub.subscribe(CHANNEL).await.unwrap();
        subscribers.push(pubsub.into_on_message());
    }
    let store = cluster.store();
    for _ in 0..6 {
        let key = common::key();
        let token = common::lock(&store, &key).await;
        let waited = store.begin(&key, &common::hash('a'), common::TTL, Duration::from_millis(1)).await;
        common::busy_remaining(waited.unwrap());
        store.commit(common::commit(&key, &token, &common::hash('a'), Bytes::new())).await.unwrap();
        for (node, messages) in subscribers.iter_mut().enumerate() {
            let message = tokio::time::timeout(Duration::from_secs(5), messages.next())
                .await
                .unwrap_or_else(|_| panic!("node {node} never heard the wake-up"))
                .unwrap();
            assert_eq!(message.get_payload::<String>().unwrap(), key, "node {node}");
        }
    }

    let (one, two) = (common::no_recheck(cluster.backend()), common::no_recheck(cluster.backend()));
    common::listening(&one, 1).await;
    common::listening(&two, 1).await;
    common::wakes_cross_instances(&one, &two).await;
    common::measure_cross_instance_wakes("cluster", &one, &two, 200).await;
}

/// The operator's tools on a cluster: counts and prefix lookups scan every master (60 more
/// records, spread over the three by their keys).
#[tokio::test]
async fn operator_tools_on_three_masters() {
    let cluster = Cluster::start().await;
    common::operator_tools(&cluster.backend(), 60).await;
    let (one, two) = (common::no_recheck(cluster.backend()), common::no_recheck(cluster.backend()));
    common::listening(&one, 1).await;
    common::listening(&two, 1).await;
    common::delete_wakes_other_instance(&one, &two).await;
}

/// Attempts whose outcome is unknown on a cluster: the trace shares its key's slot, the
/// scripts run on its master.
#[tokio::test]
async fn in_doubt_scenarios_on_three_masters() {
    let cluster = Cluster::start().await;
    let backend = cluster.backend();
    common::in_doubt::every_scenario(&backend).await;
    common::in_doubt::waiter_woken_by_an_in_doubt_release(common::no_recheck(cluster.backend())).await;
}
