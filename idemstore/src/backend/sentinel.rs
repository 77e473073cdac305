//! Redis through Sentinel: a connection to whichever master the sentinels name, asked again
//! when the connection is lost or the node answers `READONLY` (it was demoted), so idemstore
//! follows a failover without a restart. One multiplexed connection at a time, shared by
//! every request, as [`::redis::aio::ConnectionManager`] does for a fixed address; while there
//! is none, the first request to need it asks the sentinels and the others wait for that
//! answer rather than asking too.
//!
//! Used by [`super::redis`] (the backend's connection) and [`super::pubsub`] (the
//! subscription follows the master too).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::{ConnectionLike, MultiplexedConnection};
use ::redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, TlsMode, Value,
};

use super::access::Access;
use super::BackendError;

#[derive(Clone)]
pub struct SentinelConnection {
    shared: Arc<Shared>,
}

struct Shared {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    /// The master's connection, with the generation it was made in: a request that saw it
    /// fail drops it only if nobody replaced it since.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    config: AsyncConnectionConfig,
}

impl SentinelConnection {
    /// `sentinels`: `HOST:PORT` or `redis://` / `rediss://HOST:PORT` (one scheme for all: TLS
    /// to the sentinels means TLS to the master, with the same CA and client certificate).
    pub fn new(
        sentinels: &[String],
        master: &str,
        access: &Access,
        timeout: Duration,
    ) -> Result<Self, BackendError> {
        let refuse = |why: String| BackendError::Unavailable(format!("--redis-sentinel: {why}"));
        if sentinels.is_empty() {
            return Err(refuse("no sentinel given".into()));
        }
        let mut addrs = Vec::with_capacity(sentinels.len());
        for entry in sentinels {
            let url = if entry.contains("://") { entry.clone() } else { format!("redis://{entry}") };
            let info = url.as_str().into_connection_info().map_err(|e| refuse(format!("{entry}: {e}")))?;
            addrs.push(info.addr().clone());
        }
        let tls = addrs.iter().filter(|a| matches!(a, ConnectionAddr::TcpTls { .. })).count();
        if tls != 0 && tls != addrs.len() {
            return Err(refuse("give every sentinel the same scheme (rediss:// for TLS)".into()));
        }
        if tls == 0 && (access.has_tls_files() || access.insecure()) {
            return Err(refuse("the TLS flags need rediss:// sentinels".into()));
        }
        let mode = if access.insecure() { TlsMode::Insecure } else { TlsMode::Secure };
        let mut builder = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
            .map_err(|e| refuse(e.to_string()))?;
        if tls != 0 {
            builder = builder.set_client_to_redis_tls_mode(mode).set_client_to_sentinel_tls_mode(mode);
            if let Some(certificates) = access.certificates() {
                builder = builder
                    .set_client_to_redis_certificates(certificates.clone())
                    .set_client_to_sentinel_certificates(certificates.clone());
            }
        }
        if let Some(user) = access.username() {
            builder = builder.set_client_to_redis_username(user);
        }
        if let Some(password) = access.password() {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(user) = access.sentinel_username() {
            builder = builder.set_client_to_sentinel_username(user);
        }
        if let Some(password) = access.sentinel_password() {
            builder = builder.set_client_to_sentinel_password(password);
        }
        let nodelay = ::redis::io::tcp::TcpSettings::default().set_nodelay(true);
        builder = builder.set_client_to_redis_tcp_settings(nodelay);
        let client = builder.build().map_err(|e| refuse(e.to_string()))?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        Ok(Self {
            shared: Arc::new(Shared {
                sentinel: tokio::sync::Mutex::new(client),
                current: Mutex::new(None),
                config,
            }),
        })
    }

    /// A client of the master the sentinels name now.
    pub async fn master_client(&self) -> RedisResult<Client> {
        self.shared.sentinel.lock().await.async_get_client().await
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.shared.current.lock().ok().and_then(|c| c.clone())
    }

    /// The master's connection, asking the sentinels for the master when there is none.
    async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(found) = self.current() {
            return Ok(found);
        }
        let mut sentinel = self.shared.sentinel.lock().await;
        // Another request may have connected while this one waited for the lock.
        if let Some(found) = self.current() {
            return Ok(found);
        }
        let client = sentinel.async_get_client().await?;
        let conn = client.get_multiplexed_async_connection_with_config(&self.shared.config).await?;
        let mut current = self.shared.current.lock().map_err(|_| poisoned())?;
        let generation = current.as_ref().map_or(0, |(g, _)| g + 1);
        *current = Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    /// After `e` on the connection of `generation`: forget it if it cannot serve again.
    fn after_error(&self, generation: u64, e: &RedisError) {
        let demoted = e.code() == Some("READONLY");
        if demoted
            || e.is_io_error()
            || e.is_connection_dropped()
            || e.is_timeout()
            || e.is_unrecoverable_error()
        {
            if let Ok(mut current) = self.shared.current.lock() {
                if current.as_ref().is_some_and(|(g, _)| *g == generation) {
                    *current = None;
                }
            }
        }
    }
}

fn poisoned() -> RedisError {
    RedisError::from((::redis::ErrorKind::Client, "the sentinel connection's lock is poisoned"))
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.connection().await?;
            let reply = conn.req_packed_command(cmd).await;
            if let Err(e) = &reply {
                self.after_error(generation, e);
            }
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.connection().await?;
            let reply = conn.req_packed_commands(cmd, offset, count).await;
            if let Err(e) = &reply {
                self.after_error(generation, e);
            }
            reply
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}
