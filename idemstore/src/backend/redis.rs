//! Redis backend, standalone or Cluster: the same three Lua scripts either way. A key's
//! record (`idem:{<key>}:r`) and lock (`idem:{<key>}:l`) share a hash tag, so each script
//! touches a single Cluster slot. Commits and releases also publish the key for waiters on
//! other idemstore instances ([`super::pubsub`]), when a waiter has marked the key
//! (`idem:{<key>}:w`): most keys are never waited on, and then cost no message.

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

use super::{pubsub, Attempt, Backend, BackendError, CommitOutcome, ReleaseOutcome, Result};
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
    C: ConnectionLike + Ping + Clone + Send + Sync + 'static,
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
