//! Redis through Sentinel: a connection to whichever master the sentinels name, asked again
//! when the connection is lost, when the node answers `READONLY` (it was demoted), or when the
//! sentinels name another master (checked every [`MASTER_CHECK`]: after a failover that leaves
//! the old master reachable, Sentinel reconfigures it as a replica only some seconds later, and
//! writes that reach it meanwhile are lost in its resync), so idemstore follows a failover
//! without a restart. One multiplexed connection at a time, shared by
//! every request, as [`::redis::aio::ConnectionManager`] does for a fixed address; while there
//! is none, the first request to need it asks the sentinels and the others wait for that
//! answer rather than asking too.
//!
//! Used by [`super::redis`] (the backend's connection) and [`super::pubsub`] (the
//! subscription follows the master too).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;

use ::redis::aio::{ConnectionLike, MultiplexedConnection};
use ::redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, TlsMode, Value,
};

use super::access::Access;
use super::BackendError;

/// How often the sentinels are asked which node is the master.
pub const MASTER_CHECK: Duration = Duration::from_millis(500);

#[derive(Clone)]
pub struct SentinelConnection {
    shared: Arc<Shared>,
}

struct Shared {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    master: String,
    /// The master's connection: a request that saw it fail drops it only if nobody replaced it
    /// since.
    current: Mutex<Option<Current>>,
    config: AsyncConnectionConfig,
    /// Bumped whenever the master's connection is dropped: the wake-up subscription moves too.
    dropped: watch::Sender<u64>,
}

#[derive(Clone)]
struct Current {
    generation: u64,
    /// The master's address as the sentinels gave it.
    addr: (String, u16),
    conn: MultiplexedConnection,
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
        let shared = Arc::new(Shared {
            sentinel: tokio::sync::Mutex::new(client),
            master: master.to_owned(),
            current: Mutex::new(None),
            config,
            dropped: watch::Sender::new(0),
        });
        // Without a runtime (a unit test) only the checks on errors remain.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(watch_master(Arc::downgrade(&shared)));
        }
        Ok(Self { shared })
    }

    /// Changes whenever the master's connection is dropped (lost, demoted or replaced).
    pub fn master_changes(&self) -> watch::Receiver<u64> {
        self.shared.dropped.subscribe()
    }

    /// A client of the master the sentinels name now.
    pub async fn master_client(&self) -> RedisResult<Client> {
        self.shared.sentinel.lock().await.async_get_client().await
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.shared.current.lock().ok().and_then(|c| c.as_ref().map(|c| (c.generation, c.conn.clone())))
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
        let client = sentinel.async_get_client().await.map_err(from_sentinels)?;
        let addr = match client.get_connection_info().addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                (host.clone(), *port)
            }
            other => (other.to_string(), 0),
        };
        let conn = client.get_multiplexed_async_connection_with_config(&self.shared.config).await?;
        let mut current = self.shared.current.lock().map_err(|_| poisoned())?;
        let generation = *self.shared.dropped.borrow();
        *current = Some(Current { generation, addr, conn: conn.clone() });
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
            self.shared.drop_if(|c| c.generation == generation);
        }
    }
}

impl Shared {
    /// Drops the master's connection if `stale` says so; the next request asks the sentinels.
    fn drop_if(&self, stale: impl FnOnce(&Current) -> bool) {
        let Ok(mut current) = self.current.lock() else { return };
        if current.as_ref().is_some_and(stale) {
            *current = None;
            self.dropped.send_modify(|g| *g += 1);
        }
    }
}

/// Asks a sentinel every [`MASTER_CHECK`] which node is the master, and drops the master's
/// connection when it is another one. One connection to one sentinel, made again after an
/// error; ends with the [`SentinelConnection`].
async fn watch_master(shared: Weak<Shared>) {
    let mut sentinel: Option<MultiplexedConnection> = None;
    loop {
        tokio::time::sleep(MASTER_CHECK).await;
        let Some(live) = shared.upgrade() else { return };
        if sentinel.is_none() {
            let client = live.sentinel.lock().await.async_get_sentinel_client().await;
            sentinel = match client {
                Ok(client) => client.get_multiplexed_async_connection_with_config(&live.config).await.ok(),
                Err(_) => None,
            };
        }
        let Some(conn) = sentinel.as_mut() else { continue };
        let mut ask = ::redis::cmd("SENTINEL");
        ask.arg("GET-MASTER-ADDR-BY-NAME").arg(&live.master);
        match ask.query_async::<Option<(String, u16)>>(conn).await {
            Ok(Some(named)) => live.drop_if(|c| c.addr != named),
            Ok(None) => {}
            Err(_) => sentinel = None,
        }
    }
}

/// How a refused login to the sentinels is told apart from one to the master.
pub(crate) const SENTINELS_REFUSED: &str = "the sentinels refused the credentials";

/// An error from asking the sentinels, said to be theirs (their credentials are not the
/// master's). Only the sentinels' own answers: a master refusing the login while its role is
/// checked stays the master's.
fn from_sentinels(e: RedisError) -> RedisError {
    match e.code() {
        Some("NOAUTH" | "WRONGPASS") => RedisError::from((
            ::redis::ErrorKind::AuthenticationFailed,
            SENTINELS_REFUSED,
            format!(
                "{e} (--redis-sentinel-username, --redis-sentinel-password-file or \
                 IDEMSTORE_REDIS_SENTINEL_PASSWORD)"
            ),
        )),
        _ => e,
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
