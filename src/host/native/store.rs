//! The store in Envoy's process: idemstore's backends (`idem-store`: the same Lua scripts, key
//! names, lock wake-ups) on the module's own tokio threads, serving the coordinator's store
//! stream calls with the same function idemstore's store stream runs for each call. A call is
//! a message in, an answer out, as over gRPC, so the core cannot tell the difference.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_protocol::stream::{Answer, Call};
use idem_store::backend::access::{redact, Access, AccessArgs};
use idem_store::backend::memory::MemoryBackend;
use idem_store::backend::redis::RedisBackend;
use idem_store::backend::{Backend as StoreBackend, BackendError};
use idem_store::store::{Observer, Op, Store};
use tokio::runtime::{Handle, Runtime};

use super::settings::{Backend, StoreSettings};

/// How often the in-memory backend drops expired entries (idemstore's period).
const SWEEP_PERIOD: Duration = Duration::from_secs(5);

type Answering = Pin<Box<dyn Future<Output = Answer> + Send>>;

/// One backend's store, behind one type whatever the backend.
trait Serve: Send + Sync {
    fn serve(&self, call: Call) -> Answering;
}

/// What the store tells Envoy's log of its calls: a refusal the operator must fix (an ACL
/// permission, credentials, TLS), once per cause, as idemstore's health check would (the module
/// has none); outages are the filter's to count (`store_errors`, `degraded`).
struct Refusals;

impl Observer for Refusals {
    fn for_backend<B: StoreBackend>(_: &B) -> Self {
        Refusals
    }

    fn wait_started(&self) {}

    fn wait_ended(&self, _: Duration) {}

    fn call_failed(&self, op: Op, error: &BackendError, _: Duration) {
        if matches!(error, BackendError::Refused(_)) {
            error.log(&format!("store {op:?}"));
        }
    }
}

struct Served<B> {
    store: Arc<Store<B, Refusals>>,
    max_record_bytes: usize,
}

impl<B: StoreBackend> Serve for Served<B> {
    fn serve(&self, call: Call) -> Answering {
        let (store, max) = (Arc::clone(&self.store), self.max_record_bytes);
        Box::pin(async move { idem_store::calls::serve(&store, call, max).await })
    }
}

/// How the store's threads are stopped: a multi-threaded runtime is shut down; a single
/// thread (the default: every call's hops stay on one thread, the fewest wake-ups) runs its
/// runtime until told to stop.
enum Threads {
    Many(Runtime),
    One(tokio::sync::oneshot::Sender<()>),
}

/// The runtime (stopped with the filter's configuration) and the store on it.
pub struct InProcess {
    threads: Mutex<Option<Threads>>,
    handle: Handle,
    /// `None`: no store (mint and grpc_replay modes make no calls); the threads only tick.
    serve: Option<Arc<dyn Serve>>,
    /// What the log says of it (the URL without its password).
    pub describe: String,
}

fn start_threads(threads: usize) -> Result<(Threads, Handle), String> {
    let failed = |e: std::io::Error| format!("cannot start the store's threads: {e}");
    if threads > 1 {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("idempotency-store")
            .enable_all()
            .build()
            .map_err(failed)?;
        let handle = runtime.handle().clone();
        return Ok((Threads::Many(runtime), handle));
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(failed)?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("idempotency-store".into())
        // Its tasks run while it waits; a stop (or the sender dropped) ends them with the runtime.
        .spawn(move || runtime.block_on(async move { stopped.await.unwrap_or(()) }))
        .map_err(failed)?;
    Ok((Threads::One(stop), handle))
}

impl InProcess {
    /// Starts the threads and the backend (a Redis backend connects in the background: an
    /// unreachable Redis fails calls, not the configuration).
    pub fn start(settings: Option<&StoreSettings>, max_record_bytes: usize) -> Result<InProcess, String> {
        let (threads, handle) = start_threads(settings.map_or(1, |s| s.threads))?;
        // The backends spawn their connection and subscription tasks on the current runtime.
        let (serve, describe) = match settings {
            Some(settings) => {
                let _entered = handle.enter();
                let (serve, describe) = backend(settings, max_record_bytes)?;
                (Some(serve), describe)
            }
            None => (None, "none".to_string()),
        };
        Ok(InProcess { threads: Mutex::new(Some(threads)), handle, serve, describe })
    }

    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    pub fn has_store(&self) -> bool {
        self.serve.is_some()
    }

    /// Serves `call` on the store's threads; `answered` gets its answer there. `false`: there
    /// is no store.
    pub fn call(&self, call: Call, answered: impl FnOnce(Answer) + Send + 'static) -> bool {
        let Some(serve) = &self.serve else { return false };
        let answering = serve.serve(call);
        self.handle.spawn(async move { answered(answering.await) });
        true
    }

    /// Stops the threads without waiting for them: calls in flight end unanswered (their
    /// streams are gone: Envoy destroys a configuration after its last stream).
    pub fn stop(&self) {
        let threads = self.threads.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        match threads {
            Some(Threads::Many(runtime)) => runtime.shutdown_background(),
            Some(Threads::One(stop)) => {
                let _ = stop.send(());
            }
            None => {}
        }
    }
}

fn access_args(s: &StoreSettings) -> AccessArgs {
    AccessArgs {
        redis_ca_file: s.ca_file.as_ref().map(PathBuf::from),
        redis_cert_file: s.cert_file.as_ref().map(PathBuf::from),
        redis_key_file: s.key_file.as_ref().map(PathBuf::from),
        redis_tls_insecure: s.tls_insecure,
        redis_username: s.username.clone(),
        redis_password_file: s.password_file.as_ref().map(PathBuf::from),
        redis_sentinel_master: match &s.backend {
            Backend::Sentinel { master, .. } => Some(master.clone()),
            _ => None,
        },
        redis_sentinel_username: s.sentinel_username.clone(),
        redis_sentinel_password_file: s.sentinel_password_file.as_ref().map(PathBuf::from),
        key_prefix: s.key_prefix.clone(),
    }
}

fn served<B: StoreBackend>(backend: B, max_record_bytes: usize) -> Arc<dyn Serve> {
    Arc::new(Served { store: Arc::new(Store::new(backend)), max_record_bytes })
}

fn backend(s: &StoreSettings, max: usize) -> Result<(Arc<dyn Serve>, String), String> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let access = Access::load(&access_args(s), env).map_err(|e| format!("`store`: {e}"))?;
    let timeout = Duration::from_millis(s.timeout_ms);
    let prefix =
        if s.key_prefix.is_empty() { String::new() } else { format!(", key prefix {}", s.key_prefix) };
    Ok(match &s.backend {
        Backend::Memory { max_keys, max_bytes } => {
            let backend = MemoryBackend::with_limits(*max_keys, *max_bytes);
            backend.spawn_sweeper(SWEEP_PERIOD);
            (
                served(backend, max),
                format!("memory (max {max_keys} keys, {max_bytes} bytes), this Envoy only"),
            )
        }
        Backend::Redis(url) => {
            let backend = RedisBackend::standalone_with(url, &access, timeout)
                .map_err(|e| format!("`store.redis` {}: {e}", redact(url)))?;
            (served(backend, max), format!("redis {}{prefix}", redact(url)))
        }
        Backend::Cluster(nodes) => {
            let backend = RedisBackend::cluster_with(nodes, &access, timeout)
                .map_err(|e| format!("`store.redis_cluster`: {e}"))?;
            let seeds: Vec<String> = nodes.iter().map(|u| redact(u)).collect();
            (served(backend, max), format!("redis-cluster {}{prefix}", seeds.join(",")))
        }
        Backend::Sentinel { sentinels, master } => {
            let backend = RedisBackend::sentinel(sentinels, master, &access, timeout)
                .map_err(|e| format!("`store.redis_sentinel`: {e}"))?;
            let seeds: Vec<String> = sentinels.iter().map(|u| redact(u)).collect();
            (served(backend, max), format!("redis-sentinel {} master {master}{prefix}", seeds.join(",")))
        }
    })
}
