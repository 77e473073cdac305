//! Redis backend, standalone or Cluster: the same five Lua scripts either way (`scripts/`):
//! `begin.lua`, `commit.lua` and `release.lua` for the protocol's operations, `inspect.lua` and
//! `delete.lua` for the operator's; counting and finding keys is a `SCAN` (of the server, or of
//! every master), the health check a `PING`. A key's record (`idem:{<key>}:r`), lock
//! (`idem:{<key>}:l`), waiter mark (`idem:{<key>}:w`) and the trace of an attempt begun with a
//! hold (`idem:{<key>}:t`, see [`super`]) share a hash tag, so each script touches a single
//! Cluster slot. `begin.lua` reads Redis's clock (`TIME`) for a trace's start.
//! Commits, releases and deletes also publish the key for waiters on other idemstore instances
//! ([`super::pubsub`]), when a waiter has marked the key: most keys are never waited on, and
//! then cost no message.
//!
//! Uses the backend interface ([`crate::backend`]), [`super::pubsub`], [`super::sentinel`],
//! [`super::access`], [`super::redis_error`] (what a Redis error means) and [`crate::waiters`].

use std::sync::Weak;
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{RedisError, RedisResult, Script, Value};
use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::access::Access;
use super::pubsub::WakeNodes;
use super::redis_error::{failed, login_refused};
use super::sentinel::SentinelConnection;
use super::{
    pubsub, record_status, Attempt, Backend, BackendError, Commit, CommitOutcome, Counts, Deleted, Hold,
    Inspection, LockInfo, RecordInfo, ReleaseOutcome, Result, TraceInfo, RECORD_HEAD_BYTES,
};
use crate::waiters::{RemoteWakeups, Waiters};

#[derive(Clone)]
pub struct RedisBackend<C> {
    conn: C,
    scripts: Scripts,
    /// Bounds every operation as a whole, whatever the client's retries do.
    timeout: Duration,
    /// Where to subscribe to wake-ups.
    wake_nodes: WakeNodes,
    keys: Keys,
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

impl RedisBackend<Standalone> {
    /// Connects lazily, so the service starts (and `/healthz` says 503) while Redis is down;
    /// the manager reconnects after I/O errors. `timeout` bounds connecting and each reply.
    pub fn standalone(url: &str, timeout: Duration) -> Result<Self> {
        Self::standalone_with(url, &Access::default(), timeout)
    }

    /// [`Self::standalone`] with TLS, credentials and a key prefix.
    pub fn standalone_with(url: &str, access: &Access, timeout: Duration) -> Result<Self> {
        let client = access.client(url).map_err(BackendError::Unavailable)?;
        // Requests queue behind a reconnect, so its retries must not outlast the filter's
        // callout timeout: one quick retry, then the request fails (503) and the next one
        // tries again.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(100));
        let conn = Standalone::new(client.clone(), config)?;
        Ok(Self::new(conn, access, timeout, WakeNodes::Fixed(vec![client])))
    }
}

/// Standalone Redis through a [`ConnectionManager`], replaced by a new one after Redis refused
/// the credentials: the manager reconnects after I/O errors only, and would answer that
/// refusal forever after the password was fixed.
#[derive(Clone)]
pub struct Standalone {
    client: ::redis::Client,
    config: ConnectionManagerConfig,
    manager: std::sync::Arc<std::sync::Mutex<ConnectionManager>>,
}

impl Standalone {
    fn new(client: ::redis::Client, config: ConnectionManagerConfig) -> Result<Self> {
        let manager =
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone()).map_err(failed)?;
        Ok(Self { client, config, manager: std::sync::Arc::new(std::sync::Mutex::new(manager)) })
    }

    fn manager(&self) -> RedisResult<ConnectionManager> {
        self.manager.lock().map(|m| m.clone()).map_err(|_| {
            RedisError::from((::redis::ErrorKind::Client, "the connection manager's lock is poisoned"))
        })
    }

    /// After `e`: a fresh manager if `e` was a refused login, so the next call logs in again.
    fn after_error(&self, e: &RedisError) {
        if !login_refused(e) {
            return;
        }
        if let Ok(fresh) = ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            if let Ok(mut manager) = self.manager.lock() {
                *manager = fresh;
            }
        }
    }
}

/// A call that failed on a connection found dropped (Redis restarted while it sat idle: the
/// first call after the restart meets the dead socket) goes once more, on the connection the
/// manager makes again. Without it that call failed and its request ran unguarded: a retry
/// through another replica ran a second time. A call the old Redis may have run before the
/// connection dropped is safe to send again: a begin then meets its own lock (the client is
/// told the request is in flight), a commit or release its own token.
fn dropped(reply: &RedisResult<impl Sized>) -> bool {
    reply.as_ref().is_err_and(|e| e.is_connection_dropped() && !e.is_connection_refusal())
}

impl ConnectionLike for Standalone {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a ::redis::Cmd) -> ::redis::RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut reply = self.manager()?.req_packed_command(cmd).await;
            if dropped(&reply) {
                reply = self.manager()?.req_packed_command(cmd).await;
            }
            if let Err(e) = &reply {
                self.after_error(e);
            }
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a ::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> ::redis::RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut reply = self.manager()?.req_packed_commands(cmd, offset, count).await;
            if dropped(&reply) {
                reply = self.manager()?.req_packed_commands(cmd, offset, count).await;
            }
            if let Err(e) = &reply {
                self.after_error(e);
            }
            reply
        })
    }

    fn get_db(&self) -> i64 {
        self.client.get_connection_info().redis_settings().db()
    }
}

impl RedisBackend<ClusterConnection> {
    /// `urls` are seed nodes; the slot map is discovered from them, in the background.
    pub fn cluster(urls: &[String], timeout: Duration) -> Result<Self> {
        Self::cluster_with(urls, &Access::default(), timeout)
    }

    /// [`Self::cluster`] with TLS, credentials and a key prefix (every node gets the same).
    pub fn cluster_with(urls: &[String], access: &Access, timeout: Duration) -> Result<Self> {
        let seeds = urls
            .iter()
            .map(|u| access.connection_info(u))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(BackendError::Unavailable)?;
        // The default retries (16, backing off to minutes) would hold a request for a slot
        // whose master is down far beyond the filter's timeout; a few quick ones still
        // follow MOVED/ASK redirections during resharding.
        let mut builder = ClusterClient::builder(seeds)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(100);
        if let Some(user) = access.username() {
            builder = builder.username(user);
        }
        if let Some(password) = access.password() {
            builder = builder.password(password);
        }
        if let Some(certificates) = access.certificates() {
            builder = builder.certs(certificates.clone());
        }
        let client = builder.build().map_err(failed)?;
        // `with_config` replaces the builder's response timeout, so it is given again.
        let config = ClusterConfig::new().set_connection_timeout(timeout).set_response_timeout(timeout);
        let conn = client.get_pending_async_connection_with_config(config);
        let wake_nodes = urls
            .iter()
            .map(|url| access.client(url))
            .collect::<std::result::Result<_, _>>()
            .map_err(BackendError::Unavailable)?;
        Ok(Self::new(conn, access, timeout, WakeNodes::Fixed(wake_nodes)))
    }
}

impl RedisBackend<SentinelConnection> {
    /// The master that `sentinels` (`HOST:PORT`, or `redis://` / `rediss://` URLs: TLS to the
    /// sentinels and the master alike) know as `master`, asked again after every lost
    /// connection or `READONLY` answer: it follows a failover.
    pub fn sentinel(sentinels: &[String], master: &str, access: &Access, timeout: Duration) -> Result<Self> {
        let conn = SentinelConnection::new(sentinels, master, access, timeout)?;
        let wake = WakeNodes::Sentinel(conn.clone());
        Ok(Self::new(conn, access, timeout, wake))
    }
}

impl<C> RedisBackend<C> {
    fn new(conn: C, access: &Access, timeout: Duration, wake_nodes: WakeNodes) -> Self {
        Self { conn, scripts: Scripts::new(), timeout, wake_nodes, keys: Keys::new(access.prefix()) }
    }
}

/// Redis's names for a store key's record, lock, waiter mark and trace, and the wake-up
/// channel, under `--key-prefix`.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    prefix: std::sync::Arc<str>,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self { prefix: prefix.into() }
    }

    pub fn record(&self, key: &str) -> String {
        format!("{}idem:{{{key}}}:r", self.prefix)
    }

    pub fn lock(&self, key: &str) -> String {
        format!("{}idem:{{{key}}}:l", self.prefix)
    }

    /// Set while a `begin` waits on the key's lock: commit and release publish a wake-up only
    /// then.
    pub fn waiter(&self, key: &str) -> String {
        format!("{}idem:{{{key}}}:w", self.prefix)
    }

    /// The trace of an attempt begun with a hold (`begin.lua` says its form): outlives the
    /// lock, so that an attempt whose outcome is unknown is not run again blindly.
    pub fn trace(&self, key: &str) -> String {
        format!("{}idem:{{{key}}}:t", self.prefix)
    }

    /// The channel the scripts publish store keys on.
    pub fn channel(&self) -> String {
        format!("{}{}", self.prefix, pubsub::CHANNEL)
    }

    /// The store key a record, lock or trace key of ours (as [`Self::record`], [`Self::lock`]
    /// and [`Self::trace`] spell them) belongs to, with the kind of key; `None` for any other
    /// key.
    fn parse(&self, redis_key: &[u8]) -> Option<(String, Kind)> {
        let text = std::str::from_utf8(redis_key).ok()?;
        let key = text.strip_prefix(&*self.prefix)?.split_once('{')?.1.split_once('}')?.0;
        if text == self.record(key) {
            Some((key.to_owned(), Kind::Record))
        } else if text == self.lock(key) {
            Some((key.to_owned(), Kind::Lock))
        } else if text == self.trace(key) {
            Some((key.to_owned(), Kind::Trace))
        } else {
            None
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Record,
    Lock,
    Trace,
}

/// The store key the health probe inspects: not 64 hex characters, so never a real one.
const HEALTH_PROBE_KEY: &str = "healthz";

/// Keys each `SCAN` call asks a node to look at (a hint: a call returns about as many keys as
/// match among them).
const SCAN_COUNT: u64 = 1000;

/// A PTTL reply as a lifetime: `None` for a key without expiry (-1); -2 (no key) never gets here.
fn pttl(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// A trace's value, `<token> <started ms> <lock TTL ms> <body hash>` (`begin.lua`), with its
/// PTTL; `None` for a value not of that form (set by hand: `begin.lua` ignores it too).
fn parse_trace(value: &[u8], ttl: i64) -> Option<TraceInfo> {
    let text = std::str::from_utf8(value).ok()?;
    let mut parts = text.split(' ');
    let (Some(token), Some(started), Some(lock_ttl), Some(body_hash), None) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let number = |s: &str| s.bytes().all(|b| b.is_ascii_digit()).then(|| s.parse::<u64>().ok()).flatten();
    let hex = !body_hash.is_empty() && body_hash.bytes().all(|b| b.is_ascii_hexdigit());
    if !idem_protocol::is_token(token.as_bytes()) || !hex {
        return None;
    }
    Some(TraceInfo {
        token: token.to_owned(),
        started_ms: number(started)?,
        lock_ttl: Duration::from_millis(number(lock_ttl)?),
        body_hash: body_hash.to_owned(),
        ttl: pttl(ttl),
    })
}

fn parse_inspection(reply: Value) -> Result<Inspection> {
    let garbage = || garbage("inspect");
    let Value::Array(items) = reply else { return Err(garbage()) };
    let [Value::Int(len), head, Value::Int(record_pttl), Value::Int(lock_pttl), trace, Value::Int(tpttl)] =
        items.as_slice()
    else {
        return Err(garbage());
    };
    let trace = match trace {
        Value::Nil => None,
        Value::BulkString(bytes) => parse_trace(bytes, *tpttl),
        Value::SimpleString(text) => parse_trace(text.as_bytes(), *tpttl),
        _ => return Err(garbage()),
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
    Ok(Inspection { record, lock, trace })
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
        [Value::BulkString(tag), Value::BulkString(token), Value::BulkString(started), Value::Int(running)]
            if tag == b"in-doubt" =>
        {
            let token = String::from_utf8(token.clone()).map_err(|_| garbage("begin"))?;
            let started_ms = std::str::from_utf8(started)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| garbage("begin"))?;
            let running = Duration::from_millis(u64::try_from(*running).unwrap_or(0));
            Ok(Attempt::InDoubt { token, started_ms, running })
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
            Ok(result) => result.map_err(failed),
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

/// One server holds every key (standalone Redis, the master Sentinel names): `SCAN` and
/// `PING` go to it as they are.
macro_rules! one_server {
    ($($conn:ty),+) => {$(
        impl Scan for $conn {
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

        impl Ping for $conn {
            async fn ping(&mut self) -> RedisResult<()> {
                ::redis::cmd("PING").query_async::<String>(self).await.map(|_| ())
            }
        }
    )+};
}

one_server!(Standalone, SentinelConnection);

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
        hold: Option<Hold<'_>>,
    ) -> Result<Attempt> {
        let mut script = self.scripts.begin.key(self.keys.record(key));
        script
            .key(self.keys.lock(key))
            .key(self.keys.waiter(key))
            .key(self.keys.trace(key))
            .arg(body_hash)
            .arg(token)
            .arg(millis(lock_ttl))
            .arg(if hold.is_some() { "1" } else { "0" })
            .arg(hold.map_or(0, |h| millis(h.retention)))
            .arg(hold.and_then(|h| h.supersede).unwrap_or(""));
        let reply: Value = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        parse_attempt(reply)
    }

    async fn commit(&self, commit: Commit<'_>) -> Result<CommitOutcome> {
        let Commit { key, token, body_hash, record, retention } = commit;
        let mut script = self.scripts.commit.key(self.keys.record(key));
        script
            .key(self.keys.lock(key))
            .key(self.keys.waiter(key))
            .key(self.keys.trace(key))
            .arg(token)
            .arg(body_hash)
            .arg(millis(retention));
        script.arg(record.as_ref()).arg(self.keys.channel()).arg(key);
        let reply: Vec<u8> = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        CommitOutcome::parse(&reply).ok_or_else(|| garbage("commit"))
    }

    async fn release(&self, key: &str, token: &str, in_doubt: bool) -> Result<ReleaseOutcome> {
        let mut script = self.scripts.release.key(self.keys.lock(key));
        script
            .key(self.keys.waiter(key))
            .key(self.keys.trace(key))
            .arg(token)
            .arg(self.keys.channel())
            .arg(key)
            .arg(if in_doubt { "1" } else { "0" });
        let deleted: i64 = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        Ok(if deleted == 1 { ReleaseOutcome::Released } else { ReleaseOutcome::NotOwner })
    }

    /// A `PING` says whether Redis answers; a probe (the `inspect` script on a key no store
    /// key can be) then says whether it lets idemstore in: a missing ACL permission fails it
    /// as refused. The probe's outages do not count: on a Cluster it reaches one slot's
    /// master, whose failover must not fail the whole instance's health (as the `PING` to a
    /// random node does not).
    async fn health(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        self.bounded(conn.ping()).await?;
        match self.inspect(HEALTH_PROBE_KEY).await {
            Err(refused @ BackendError::Refused(_)) => Err(refused),
            _ => Ok(()),
        }
    }

    async fn inspect(&self, key: &str) -> Result<Inspection> {
        let mut script = self.scripts.inspect.key(self.keys.record(key));
        script.key(self.keys.lock(key)).key(self.keys.trace(key)).arg(64 + RECORD_HEAD_BYTES - 1);
        let reply: Value = self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        parse_inspection(reply)
    }

    async fn delete(&self, key: &str) -> Result<Deleted> {
        let mut script = self.scripts.delete.key(self.keys.record(key));
        script
            .key(self.keys.lock(key))
            .key(self.keys.waiter(key))
            .key(self.keys.trace(key))
            .arg(self.keys.channel())
            .arg(key);
        let (record, lock, trace): (i64, i64, i64) =
            self.bounded(script.invoke_async(&mut self.conn.clone())).await?;
        Ok(Deleted { record: record == 1, lock: lock == 1, trace: trace == 1 })
    }

    async fn counts(&self) -> Result<Counts> {
        let mut counts = Counts::default();
        let keys = &self.keys;
        // The patterns are the key names with `*` for the store key, so they match exactly
        // what `record`, `lock` and `trace` make.
        self.scan(&self.keys.record("*"), |k| {
            counts.records += u64::from(keys.parse(k).is_some_and(|(_, kind)| kind == Kind::Record));
            true
        })
        .await?;
        // The locked keys are remembered (locks are few: one per request running now), so that
        // a trace without one counts as in doubt.
        let mut locked = std::collections::HashSet::new();
        self.scan(&self.keys.lock("*"), |k| {
            if let Some((key, Kind::Lock)) = keys.parse(k) {
                locked.insert(key);
            }
            true
        })
        .await?;
        counts.locks = u64::try_from(locked.len()).unwrap_or(u64::MAX);
        self.scan(&self.keys.trace("*"), |k| {
            if let Some((key, Kind::Trace)) = keys.parse(k) {
                counts.in_doubt += u64::from(!locked.contains(&key));
            }
            true
        })
        .await?;
        Ok(counts)
    }

    async fn find(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let mut found = std::collections::BTreeSet::new();
        let keys = &self.keys;
        let pattern = format!("{prefix}*");
        for redis_pattern in [self.keys.record(&pattern), self.keys.lock(&pattern), self.keys.trace(&pattern)]
        {
            if found.len() >= limit {
                break;
            }
            // A set: a key with a record and a lock (or a trace), or returned twice by SCAN, is
            // one key.
            self.scan(&redis_pattern, |k| {
                if let Some((key, _)) = keys.parse(k).filter(|(key, _)| key.starts_with(prefix)) {
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
        pubsub::spawn(self.wake_nodes.clone(), self.keys.channel(), self.timeout, waiters, status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_a_hash_tag() {
        let keys = Keys::default();
        assert_eq!(keys.record("ab"), "idem:{ab}:r");
        assert_eq!(keys.lock("ab"), "idem:{ab}:l");
        assert_eq!(keys.waiter("ab"), "idem:{ab}:w");
        assert_eq!(keys.trace("ab"), "idem:{ab}:t");
        assert_eq!(keys.channel(), "idem:wake");
        let keys = Keys::new("shop:");
        assert_eq!(keys.record("ab"), "shop:idem:{ab}:r");
        assert_eq!(keys.waiter("ab"), "shop:idem:{ab}:w");
        assert_eq!(keys.trace("ab"), "shop:idem:{ab}:t");
        assert_eq!(keys.channel(), "shop:idem:wake");
    }

    #[test]
    fn parses_inspections() {
        let bulk = |s: &[u8]| Value::BulkString(s.to_vec());
        let hash = "a".repeat(64);
        let head = [hash.as_bytes(), b"IDR2\x01\x96"].concat();
        let reply = |len, head: &[u8], r, l| {
            Value::Array(vec![
                Value::Int(len),
                bulk(head),
                Value::Int(r),
                Value::Int(l),
                Value::Nil,
                Value::Int(-2),
            ])
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
        // A trace, as begin.lua writes it, and one set by hand (not shown).
        let traced = |value: &[u8], ttl| {
            Value::Array(vec![
                Value::Int(0),
                bulk(b""),
                Value::Int(-2),
                Value::Int(-2),
                bulk(value),
                Value::Int(ttl),
            ])
        };
        let hash = "a".repeat(64);
        let value = format!("tok-1 1700000000123 30000 {hash}");
        let seen = parse_inspection(traced(value.as_bytes(), 59_000)).unwrap();
        assert!(seen.in_doubt());
        assert_eq!(
            seen.trace,
            Some(TraceInfo {
                token: "tok-1".into(),
                started_ms: 1_700_000_000_123,
                lock_ttl: Duration::from_secs(30),
                body_hash: hash.clone(),
                ttl: Some(Duration::from_secs(59)),
            })
        );
        for bad in [&b"tok 1 2"[..], b"t!k 1 2 ab", b"tok x 2 ab", b"tok 1 2 ab extra", b""] {
            assert_eq!(parse_inspection(traced(bad, 1000)).unwrap().trace, None, "{bad:?}");
        }
    }

    #[test]
    fn parses_our_keys_only() {
        let key = "ab".repeat(32);
        let keys = Keys::default();
        assert_eq!(keys.parse(keys.record(&key).as_bytes()), Some((key.clone(), Kind::Record)));
        assert_eq!(keys.parse(keys.lock(&key).as_bytes()), Some((key.clone(), Kind::Lock)));
        assert_eq!(keys.parse(keys.trace(&key).as_bytes()), Some((key.clone(), Kind::Trace)));
        assert_eq!(keys.parse(keys.waiter(&key).as_bytes()), None);
        assert_eq!(keys.parse(b"idem:wake"), None);
        assert_eq!(keys.parse(b"idem:{a}:r:x"), None);
        // Another deployment's keys are not ours.
        let shop = Keys::new("shop:");
        assert_eq!(shop.parse(keys.record(&key).as_bytes()), None);
        assert_eq!(shop.parse(shop.record(&key).as_bytes()), Some((key.clone(), Kind::Record)));
        assert_eq!(keys.parse(shop.record(&key).as_bytes()), None);
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
        assert_eq!(
            parse_attempt(Value::Array(vec![
                bulk(b"in-doubt"),
                bulk(b"tok"),
                bulk(b"1700000000123"),
                Value::Int(250)
            ])),
            Ok(Attempt::InDoubt {
                token: "tok".into(),
                started_ms: 1_700_000_000_123,
                running: Duration::from_millis(250)
            })
        );
        assert!(parse_attempt(Value::Array(vec![
            bulk(b"in-doubt"),
            bulk(b"tok"),
            bulk(b"x"),
            Value::Int(0)
        ]))
        .is_err());
        assert!(parse_attempt(Value::Okay).is_err());
        assert!(parse_attempt(Value::Array(vec![bulk(b"what")])).is_err());
    }
}
