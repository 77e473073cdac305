//! Redis backend, standalone or Cluster: the same five Lua scripts either way (`scripts/`):
//! `begin.lua`, `commit.lua` and `release.lua` for the protocol's operations, `inspect.lua` and
//! `delete.lua` for the operator's; counting and finding keys is a `SCAN` (of the server, or of
//! every master), the health check a `PING`. A key's record (`idem:{<key>}:r`), lock (`idem:{<key>}:l`) and waiter
//! mark (`idem:{<key>}:w`) share a hash tag, so each script touches a single Cluster slot.
//! Commits, releases and deletes also publish the key for waiters on other idemstore instances
//! ([`super::pubsub`]), when a waiter has marked the key: most keys are never waited on, and
//! then cost no message.
//!
//! Uses the backend interface ([`crate::backend`]), [`super::pubsub`] and [`crate::waiters`].

use std::sync::Weak;
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::io::tcp::TcpSettings;
use ::redis::{Client, ConnectionInfo, IntoConnectionInfo, RedisError, RedisResult, Script, Value};
use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{
    pubsub, record_status, Attempt, Backend, BackendError, CommitOutcome, Counts, Deleted, Inspection,
    LockInfo, RecordInfo, ReleaseOutcome, Result, RECORD_HEAD_BYTES,
};
use crate::waiters::{RemoteWakeups, Waiters};

#[derive(Clone)]
pub struct RedisBackend<C> {
    conn: C,
    scripts: Scripts,
    /// Bounds every operation as a whole, whatever the client's retries do.
    timeout: Duration,
    /// Where to subscribe to wake-ups: the server, or the cluster's seed nodes (any one node
    /// hears every slot's wake-ups).
    wake_nodes: Vec<Client>,
}

#[derive(Clone)]
struct Scripts {
    begin: Script,
    commit: Script,
    release: Script,
    inspect: Script,
    delete: Script,
}

impl<C> std::fmt::Debug for RedisBackend<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend").finish_non_exhaustive()
    }
}

impl Scripts {
    fn new() -> Self {
        Self {
            begin: Script::new(include_str!("scripts/begin.lua")),
            commit: Script::new(include_str!("scripts/commit.lua")),
            release: Script::new(include_str!("scripts/release.lua")),
            inspect: Script::new(include_str!("scripts/inspect.lua")),
            delete: Script::new(include_str!("scripts/delete.lua")),
        }
    }
}

impl RedisBackend<ConnectionManager> {
    /// Connects lazily, so the service starts (and `/healthz` says 503) while Redis is down;
    /// the manager reconnects after I/O errors. `timeout` bounds connecting and each reply.
    pub fn standalone(url: &str, timeout: Duration) -> Result<Self> {
        let client = Client::open(with_nodelay(url)?).map_err(unavailable)?;
        // Requests queue behind a reconnect, so its retries must not outlast the filter's
        // callout timeout: one quick retry, then the request fails (503) and the next one
        // tries again.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(100));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config).map_err(unavailable)?;
        Ok(Self { conn, scripts: Scripts::new(), timeout, wake_nodes: vec![client] })
    }
}

impl RedisBackend<ClusterConnection> {
    /// `urls` are seed nodes; the slot map is discovered from them, in the background.
    pub fn cluster(urls: &[String], timeout: Duration) -> Result<Self> {
        // The default retries (16, backing off to minutes) would hold a request for a slot
        // whose master is down far beyond the filter's timeout; a few quick ones still
        // follow MOVED/ASK redirections during resharding.
        let seeds = urls.iter().map(|u| with_nodelay(u)).collect::<Result<Vec<_>>>()?;
        let client = ClusterClient::builder(seeds)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(100)
            .build()
            .map_err(unavailable)?;
        // `with_config` replaces the builder's response timeout, so it is given again.
        let config = ClusterConfig::new().set_connection_timeout(timeout).set_response_timeout(timeout);
        let conn = client.get_pending_async_connection_with_config(config);
        let wake_nodes = urls
            .iter()
            .map(|url| Client::open(url.as_str()))
            .collect::<RedisResult<_>>()
            .map_err(unavailable)?;
        Ok(Self { conn, scripts: Scripts::new(), timeout, wake_nodes })
    }
}

/// Records are sent in one write and answered at once: Nagle's algorithm would only add delay.
fn with_nodelay(url: &str) -> Result<ConnectionInfo> {
    let info = url.into_connection_info().map_err(unavailable)?;
    Ok(info.set_tcp_settings(TcpSettings::default().set_nodelay(true)))
}

fn record_key(key: &str) -> String {
    format!("idem:{{{key}}}:r")
}

fn lock_key(key: &str) -> String {
    format!("idem:{{{key}}}:l")
}

/// Set while a `begin` waits on the key's lock: commit and release publish a wake-up only then.
fn waiter_key(key: &str) -> String {
    format!("idem:{{{key}}}:w")
}

/// The store key a record or lock key of ours (as [`record_key`] and [`lock_key`] spell them)
/// belongs to, with the kind of key; `None` for any other key.
fn parse_key(redis_key: &[u8]) -> Option<(String, Kind)> {
    let text = std::str::from_utf8(redis_key).ok()?;
    let key = text.split_once('{')?.1.split_once('}')?.0;
    if text == record_key(key) {
        Some((key.to_owned(), Kind::Record))
    } else if text == lock_key(key) {
        Some((key.to_owned(), Kind::Lock))
    } else {
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Record,
    Lock,
}

/// Keys each `SCAN` call asks a node to look at (a hint: a call returns about as many keys as
/// match among them).
const SCAN_COUNT: u64 = 1000;

/// A PTTL reply as a lifetime: `None` for a key without expiry (-1); -2 (no key) never gets here.
fn pttl(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

fn parse_inspection(reply: Value) -> Result<Inspection> {
    let garbage = || garbage("inspect");
    let Value::Array(items) = reply else { return Err(garbage()) };
    let [Value::Int(len), head, Value::Int(record_pttl), Value::Int(lock_pttl)] = items.as_slice() else {
        return Err(garbage());
    };
    let head: Vec<u8> = match head {
        Value::BulkString(bytes) => bytes.clone(),
        Value::SimpleString(text) => text.clone().into_bytes(),
        _ => return Err(garbage()),
    };
    let record = if *record_pttl == -2 {
        None
    } else {
        // The stored value is the 64-hex body hash followed by the filter's record (a value set
        // by hand may be anything: shown as it is).
        let split = head.len().min(64);
        Some(RecordInfo {
            body_hash: String::from_utf8_lossy(&head[..split]).into_owned(),
            bytes: usize::try_from(*len).map_err(|_| garbage())?.saturating_sub(64),
            status: record_status(&head[split..]),
            ttl: pttl(*record_pttl),
        })
    };
    let lock = (*lock_pttl != -2).then(|| LockInfo { ttl: pttl(*lock_pttl) });
    Ok(Inspection { record, lock })
}

fn unavailable(e: RedisError) -> BackendError {
    BackendError::Unavailable(e.to_string())
}

fn garbage(what: &str) -> BackendError {
    BackendError::Unavailable(format!("unexpected reply from the {what} script"))
}

fn parse_attempt(reply: Value) -> Result<Attempt> {
    let Value::Array(items) = reply else {
        return Err(garbage("begin"));
    };
    match items.as_slice() {
        [Value::BulkString(tag), Value::BulkString(bytes), Value::Int(pttl)] if tag == b"record" => {
            // PTTL is negative for a record without expiry (set by hand): remaining unknown.
            let remaining = u64::try_from(*pttl).ok().map(Duration::from_millis);
            Ok(Attempt::Record(Bytes::copy_from_slice(bytes), remaining))
        }
        [Value::BulkString(tag)] if tag == b"mismatch" => Ok(Attempt::Mismatch),
        [Value::BulkString(tag)] if tag == b"locked" => Ok(Attempt::Locked),
        [Value::BulkString(tag), Value::Int(pttl)] if tag == b"held" => {
            // PTTL is negative when the lock has no expiry (set by hand): remaining unknown.
            let remaining = u64::try_from(*pttl).ok().map(Duration::from_millis);
            Ok(Attempt::Held { remaining })
        }
        _ => Err(garbage("begin")),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl<C> RedisBackend<C> {
    async fn bounded<T>(&self, op: impl std::future::Future<Output = RedisResult<T>>) -> Result<T> {
        match tokio::time::timeout(self.timeout, op).await {
            Ok(result) => result.map_err(unavailable),
            Err(_) => Err(BackendError::Unavailable(format!("no reply within {:?}", self.timeout))),
        }
    }
}

impl<C: Scan + Clone + Send + Sync> RedisBackend<C> {
    /// Calls `each` with every key matching `pattern` on every node that holds keys, until it
    /// returns `false`. One `SCAN` call at a time, each bounded by the timeout: never `KEYS`,
    /// which would block Redis for the whole keyspace. A key may come twice (`SCAN` returns a
    /// key again while Redis resizes its table) and one created or deleted meanwhile may be
    /// missed: good enough for an operator's count.
    async fn scan(&self, pattern: &str, mut each: impl FnMut(&[u8]) -> bool + Send) -> Result<()> {
        let mut conn = self.conn.clone();
        let nodes = self.bounded(conn.nodes()).await?;
        for node in &nodes {
            let mut cursor = 0;
            loop {
                let (next, keys) = self.bounded(conn.scan_step(node, cursor, pattern)).await?;
                for key in &keys {
                    if !each(key) {
                        return Ok(());
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(())
    }
}

/// A node to `SCAN`: the server itself (standalone), or a cluster master by its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    This,
    At { host: String, port: u16 },
}

/// How the operator's tools walk the keyspace: every node holding keys, one `SCAN` call at a
/// time.
pub trait Scan {
    /// The nodes that hold keys: the server, or every cluster master.
    fn nodes(&mut self) -> impl std::future::Future<Output = RedisResult<Vec<Node>>> + Send;

    /// One `SCAN <cursor> MATCH <pattern> COUNT ...` on `node`: the next cursor (0: done) and keys.
    fn scan_step(
        &mut self,
        node: &Node,
        cursor: u64,
        pattern: &str,
    ) -> impl std::future::Future<Output = RedisResult<(u64, Vec<Vec<u8>>)>> + Send;
}

fn scan_cmd(cursor: u64, pattern: &str) -> ::redis::Cmd {
    let mut cmd = ::redis::cmd("SCAN");
    cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(SCAN_COUNT);
    cmd
}

impl Scan for ConnectionManager {
    async fn nodes(&mut self) -> RedisResult<Vec<Node>> {
        Ok(vec![Node::This])
    }

    async fn scan_step(
        &mut self,
        _node: &Node,
        cursor: u64,
        pattern: &str,
    ) -> RedisResult<(u64, Vec<Vec<u8>>)> {
        scan_cmd(cursor, pattern).query_async(self).await
    }
}

impl Scan for ClusterConnection {
    /// Every master, by the address the client knows it by: a `PING` to all of them answers
    /// with one reply per address.
    async fn nodes(&mut self) -> RedisResult<Vec<Node>> {
        use ::redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
        let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
        let reply = self.route_command(::redis::cmd("PING"), routing).await?;
        let Value::Map(replies) = reply else {
            return Err(RedisError::from((
                ::redis::ErrorKind::Client,
                "PING to every master: not one reply per node",
            )));
        };
        let mut nodes = Vec::with_capacity(replies.len());
        for (addr, _) in replies {
            let addr: String = ::redis::from_redis_value(addr)?;
            let parsed = addr.rsplit_once(':').and_then(|(host, port)| {
                let host = host.trim_start_matches('[').trim_end_matches(']');
                Some(Node::At { host: host.to_owned(), port: port.parse().ok()? })
            });
            match parsed {
                Some(node) => nodes.push(node),
                None => {
                    return Err(RedisError::from((
                        ::redis::ErrorKind::Client,
                        "a cluster master's address",
                        addr,
                    )))
                }
            }
        }
        Ok(nodes)
    }

    async fn scan_step(
        &mut self,
        node: &Node,
        cursor: u64,
        pattern: &str,
    ) -> RedisResult<(u64, Vec<Vec<u8>>)> {
        use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let routing = match node {
            Node::At { host, port } => {
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port })
            }
            Node::This => RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
        };
        let reply = self.route_command(scan_cmd(cursor, pattern), routing).await?;
        Ok(::redis::from_redis_value(reply)?)
    }
}

/// How `/healthz` asks Redis whether it answers.
pub trait Ping {
    fn ping(&mut self) -> impl std::future::Future<Output = RedisResult<()>> + Send;
}

impl Ping for ConnectionManager {
    async fn ping(&mut self) -> RedisResult<()> {
        ::redis::cmd("PING").query_async::<String>(self).await.map(|_| ())
    }
}

impl Ping for ClusterConnection {
    /// One node, not all: a plain cluster PING needs every primary, so one dead master (whose
    /// slots fail over in seconds) would make an Envoy health check drop this idemstore and
    /// degrade every key instead of a third of them.
    async fn ping(&mut self) -> RedisResult<()> {
        use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        self.route_command(::redis::cmd("PING"), RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
            .await
            .map(|_| ())
    }
}

impl<C> Backend for RedisBackend<C>
where
    C: ConnectionLike + Ping + Scan + Clone + Send + Sync + 'static,
{
    async fn try_begin(
        &self,
        key: &str,
        body_hash: &str,
        token: &str,
        lock_ttl: Duration,
    ) -> Result<Attempt> {
        let mut script = self.scripts.begin.key(record_key(key));
        script.key(lock_key(key)).key(waiter_key(key)).arg(body_hash).arg(token).arg(millis(lock_ttl));
        let reply: Value = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        parse_attempt(reply)
    }

    async fn commit(
        &self,
        key: &str,
        token: &str,
        body_hash: &str,
        record: Bytes,
        retention: Duration,
    ) -> Result<CommitOutcome> {
        let mut script = self.scripts.commit.key(record_key(key));
        script.key(lock_key(key)).key(waiter_key(key)).arg(token).arg(body_hash).arg(millis(retention));
        script.arg(record.as_ref()).arg(pubsub::CHANNEL).arg(key);
        let reply: Vec<u8> = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        CommitOutcome::parse(&reply).ok_or_else(|| garbage("commit"))
    }

    async fn release(&self, key: &str, token: &str) -> Result<ReleaseOutcome> {
        let mut script = self.scripts.release.key(lock_key(key));
        script.key(waiter_key(key)).arg(token).arg(pubsub::CHANNEL).arg(key);
        let deleted: i64 = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        Ok(if deleted == 1 { ReleaseOutcome::Released } else { ReleaseOutcome::NotOwner })
    }

    async fn health(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        self.bounded(conn.ping()).await
    }

    async fn inspect(&self, key: &str) -> Result<Inspection> {
        let mut script = self.scripts.inspect.key(record_key(key));
        script.key(lock_key(key)).arg(64 + RECORD_HEAD_BYTES - 1);
        let reply: Value = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        parse_inspection(reply)
    }

    async fn delete(&self, key: &str) -> Result<Deleted> {
        let mut script = self.scripts.delete.key(record_key(key));
        script.key(lock_key(key)).key(waiter_key(key)).arg(pubsub::CHANNEL).arg(key);
        let (record, lock): (i64, i64) = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        Ok(Deleted { record: record == 1, lock: lock == 1 })
    }

    async fn counts(&self) -> Result<Counts> {
        let mut counts = Counts::default();
        // The patterns are the key names with `*` for the store key, so they match exactly
        // what `record_key` and `lock_key` make.
        self.scan(&record_key("*"), |k| {
            counts.records += u64::from(parse_key(k).is_some_and(|(_, kind)| kind == Kind::Record));
            true
        })
        .await?;
        self.scan(&lock_key("*"), |k| {
            counts.locks += u64::from(parse_key(k).is_some_and(|(_, kind)| kind == Kind::Lock));
            true
        })
        .await?;
        Ok(counts)
    }

    async fn find(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let mut found = std::collections::BTreeSet::new();
        let pattern = format!("{prefix}*");
        for redis_pattern in [record_key(&pattern), lock_key(&pattern)] {
            if found.len() >= limit {
                break;
            }
            // A set: a key with both a record and a lock, or returned twice by SCAN, is one key.
            self.scan(&redis_pattern, |k| {
                if let Some((key, _)) = parse_key(k).filter(|(key, _)| key.starts_with(prefix)) {
                    found.insert(key);
                }
                found.len() < limit
            })
            .await?;
        }
        Ok(found.into_iter().collect())
    }

    fn spawn_remote_wakeups(
        &self,
        waiters: Weak<Waiters>,
        status: watch::Sender<RemoteWakeups>,
    ) -> Option<JoinHandle<()>> {
        pubsub::spawn(self.wake_nodes.clone(), self.timeout, waiters, status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_a_hash_tag() {
        assert_eq!(record_key("ab"), "idem:{ab}:r");
        assert_eq!(lock_key("ab"), "idem:{ab}:l");
        assert_eq!(waiter_key("ab"), "idem:{ab}:w");
    }

    #[test]
    fn parses_inspections() {
        let bulk = |s: &[u8]| Value::BulkString(s.to_vec());
        let hash = "a".repeat(64);
        let head = [hash.as_bytes(), b"IDR2\x01\x96"].concat();
        let reply = |len, head: &[u8], r, l| {
            Value::Array(vec![Value::Int(len), bulk(head), Value::Int(r), Value::Int(l)])
        };
        let seen = parse_inspection(reply(64 + 300, &head, 5_000, -2)).unwrap();
        let record = seen.record.unwrap();
        assert_eq!((record.status, record.bytes, record.ttl), (Some(406), 300, Some(Duration::from_secs(5))));
        assert_eq!((record.body_hash, seen.lock), (hash, None));
        let seen = parse_inspection(reply(0, b"", -2, 1_500)).unwrap();
        assert_eq!(
            (seen.record, seen.lock),
            (None, Some(LockInfo { ttl: Some(Duration::from_millis(1500)) }))
        );
        assert!(parse_inspection(reply(0, b"", -2, -2)).unwrap().is_empty());
        // Set by hand: short, not a filter record, no expiry.
        let seen = parse_inspection(reply(3, b"abc", -1, -1)).unwrap();
        let record = seen.record.unwrap();
        assert_eq!(
            (record.status, record.bytes, record.ttl, record.body_hash.as_str()),
            (None, 0, None, "abc")
        );
        assert_eq!(seen.lock, Some(LockInfo { ttl: None }));
        assert!(parse_inspection(Value::Okay).is_err());
        assert!(parse_inspection(Value::Array(vec![Value::Int(1)])).is_err());
    }

    #[test]
    fn parses_our_keys_only() {
        let key = "ab".repeat(32);
        assert_eq!(parse_key(record_key(&key).as_bytes()), Some((key.clone(), Kind::Record)));
        assert_eq!(parse_key(lock_key(&key).as_bytes()), Some((key.clone(), Kind::Lock)));
        assert_eq!(parse_key(waiter_key(&key).as_bytes()), None);
        assert_eq!(parse_key(b"idem:wake"), None);
        assert_eq!(parse_key(b"idem:{a}:r:x"), None);
    }

    #[test]
    fn parses_script_replies() {
        let bulk = |s: &[u8]| Value::BulkString(s.to_vec());
        assert_eq!(
            parse_attempt(Value::Array(vec![bulk(b"record"), bulk(b"\0x"), Value::Int(86_399_000)])),
            Ok(Attempt::Record(Bytes::from_static(b"\0x"), Some(Duration::from_secs(86_399))))
        );
        assert_eq!(
            parse_attempt(Value::Array(vec![bulk(b"record"), bulk(b"r"), Value::Int(-1)])),
            Ok(Attempt::Record(Bytes::from_static(b"r"), None))
        );
        assert!(parse_attempt(Value::Array(vec![bulk(b"record"), bulk(b"r")])).is_err());
        assert_eq!(parse_attempt(Value::Array(vec![bulk(b"locked")])), Ok(Attempt::Locked));
        assert_eq!(
            parse_attempt(Value::Array(vec![bulk(b"held"), Value::Int(1500)])),
            Ok(Attempt::Held { remaining: Some(Duration::from_millis(1500)) })
        );
        assert_eq!(
            parse_attempt(Value::Array(vec![bulk(b"held"), Value::Int(-1)])),
            Ok(Attempt::Held { remaining: None })
        );
        assert!(parse_attempt(Value::Okay).is_err());
        assert!(parse_attempt(Value::Array(vec![bulk(b"what")])).is_err());
    }
}
