//! `store`: the settings of the store the native host runs in Envoy's process, as the filter's
//! JSON gives them. The same choices and files as idemstore's flags (`--redis`,
//! `--redis-cluster`, `--redis-sentinel`, `--redis-ca-file`, ...), spelled as keys without the
//! `redis_` where the object already says it: `{"redis": "rediss://...", "ca_file": "...",
//! "password_file": "..."}`. Pure: the files are read, and the backend is built, by `store.rs`.

use serde::Deserialize;
use serde_json::Value;

/// Which backend holds the records and locks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// In this Envoy process only (every worker shares it; another Envoy does not).
    Memory { max_keys: usize, max_bytes: usize },
    /// One Redis (`redis://` or `rediss://`).
    Redis(String),
    /// A Redis Cluster, from these seed nodes.
    Cluster(Vec<String>),
    /// The master these sentinels name.
    Sentinel { sentinels: Vec<String>, master: String },
}

/// The whole `store` object, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSettings {
    pub backend: Backend,
    pub ca_file: Option<String>,
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
    pub tls_insecure: bool,
    pub username: Option<String>,
    pub password_file: Option<String>,
    pub sentinel_username: Option<String>,
    pub sentinel_password_file: Option<String>,
    pub key_prefix: String,
    /// Each Redis command's deadline (idemstore's `--redis-timeout-ms`).
    pub timeout_ms: u64,
    /// The store's own threads (the Redis client, the lock wake-ups, the sweeper).
    pub threads: usize,
}

/// idemstore's defaults (`--memory-max-keys`, `--memory-max-bytes`, `--redis-timeout-ms`).
pub const DEFAULT_MEMORY_MAX_KEYS: usize = 1_000_000;
pub const DEFAULT_MEMORY_MAX_BYTES: usize = 1024 * 1024 * 1024;
pub const DEFAULT_TIMEOUT_MS: u64 = 1000;
pub const DEFAULT_THREADS: usize = 1;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    memory: Option<bool>,
    memory_max_keys: Option<usize>,
    memory_max_bytes: Option<usize>,
    redis: Option<String>,
    redis_cluster: Option<Vec<String>>,
    redis_sentinel: Option<Vec<String>>,
    sentinel_master: Option<String>,
    ca_file: Option<String>,
    cert_file: Option<String>,
    key_file: Option<String>,
    tls_insecure: Option<bool>,
    username: Option<String>,
    password_file: Option<String>,
    sentinel_username: Option<String>,
    sentinel_password_file: Option<String>,
    key_prefix: Option<String>,
    timeout_ms: Option<u64>,
    threads: Option<usize>,
}

fn err(message: impl std::fmt::Display) -> String {
    format!("invalid configuration: `store` {message}")
}

impl StoreSettings {
    pub fn parse(value: &Value) -> Result<StoreSettings, String> {
        let raw = Raw::deserialize(value).map_err(err)?;
        let memory = raw.memory.unwrap_or(false);
        let cluster = raw.redis_cluster.filter(|c| !c.is_empty());
        let sentinel = raw.redis_sentinel.filter(|s| !s.is_empty());
        let chosen = [memory, raw.redis.is_some(), cluster.is_some(), sentinel.is_some()];
        if chosen.iter().filter(|c| **c).count() != 1 {
            return Err(err(
                "needs exactly one of `memory: true`, `redis`, `redis_cluster` or `redis_sentinel`",
            ));
        }
        if !memory && (raw.memory_max_keys.is_some() || raw.memory_max_bytes.is_some()) {
            return Err(err("`memory_max_keys` and `memory_max_bytes` go with `memory: true`"));
        }
        if sentinel.is_none() && raw.sentinel_master.is_some() {
            return Err(err("`sentinel_master` goes with `redis_sentinel`"));
        }
        let backend = if memory {
            Backend::Memory {
                max_keys: raw.memory_max_keys.unwrap_or(DEFAULT_MEMORY_MAX_KEYS),
                max_bytes: raw.memory_max_bytes.unwrap_or(DEFAULT_MEMORY_MAX_BYTES),
            }
        } else if let Some(url) = raw.redis {
            Backend::Redis(url)
        } else if let Some(nodes) = cluster {
            Backend::Cluster(nodes)
        } else if let Some(sentinels) = sentinel {
            let master = raw.sentinel_master.filter(|m| !m.is_empty());
            let master = master.ok_or_else(|| err("`redis_sentinel` needs `sentinel_master`"))?;
            Backend::Sentinel { sentinels, master }
        } else {
            return Err(err("names no backend"));
        };
        let redis_only = [
            raw.ca_file.is_some(),
            raw.cert_file.is_some(),
            raw.key_file.is_some(),
            raw.tls_insecure.is_some(),
            raw.username.is_some(),
            raw.password_file.is_some(),
            raw.key_prefix.as_deref().is_some_and(|p| !p.is_empty()),
        ];
        if memory && redis_only.iter().any(|g| *g) {
            return Err(err("TLS, credential and `key_prefix` keys need a Redis backend"));
        }
        if raw.cert_file.is_some() != raw.key_file.is_some() {
            return Err(err("`cert_file` and `key_file` go together"));
        }
        let timeout_ms = raw.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
        if !(1..=60_000).contains(&timeout_ms) {
            return Err(err("`timeout_ms` must be within 1..=60000"));
        }
        let threads = raw.threads.unwrap_or(DEFAULT_THREADS);
        if !(1..=16).contains(&threads) {
            return Err(err("`threads` must be within 1..=16"));
        }
        Ok(StoreSettings {
            backend,
            ca_file: raw.ca_file,
            cert_file: raw.cert_file,
            key_file: raw.key_file,
            tls_insecure: raw.tls_insecure.unwrap_or(false),
            username: raw.username,
            password_file: raw.password_file,
            sentinel_username: raw.sentinel_username,
            sentinel_password_file: raw.sentinel_password_file,
            key_prefix: raw.key_prefix.unwrap_or_default(),
            timeout_ms,
            threads,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<StoreSettings, String> {
        StoreSettings::parse(&v)
    }

    #[test]
    fn one_backend() {
        let s = parse(json!({"redis": "redis://127.0.0.1:6379"})).unwrap();
        assert_eq!(s.backend, Backend::Redis("redis://127.0.0.1:6379".into()));
        assert_eq!((s.timeout_ms, s.threads), (DEFAULT_TIMEOUT_MS, DEFAULT_THREADS));
        let m = parse(json!({"memory": true, "memory_max_keys": 10})).unwrap();
        assert_eq!(m.backend, Backend::Memory { max_keys: 10, max_bytes: DEFAULT_MEMORY_MAX_BYTES });
        let c = parse(json!({"redis_cluster": ["redis://a:1", "redis://b:2"]})).unwrap();
        assert_eq!(c.backend, Backend::Cluster(vec!["redis://a:1".into(), "redis://b:2".into()]));
        let s = parse(json!({"redis_sentinel": ["redis://s:26379"], "sentinel_master": "m"})).unwrap();
        assert_eq!(
            s.backend,
            Backend::Sentinel { sentinels: vec!["redis://s:26379".into()], master: "m".into() }
        );
        for bad in [
            json!({}),
            json!({"memory": false}),
            json!({"memory": true, "redis": "redis://x"}),
            json!({"redis": "redis://x", "redis_cluster": ["redis://y"]}),
            json!({"redis_cluster": []}),
            json!({"redis_sentinel": ["redis://s"]}),
        ] {
            let e = parse(bad.clone()).unwrap_err();
            assert!(e.contains("`store`"), "{bad}: {e}");
        }
    }

    #[test]
    fn keys_that_need_another_key() {
        for (bad, says) in [
            (json!({"redis": "redis://x", "bogus": 1}), "unknown field"),
            (json!({"memory": true, "ca_file": "/ca.pem"}), "need a Redis backend"),
            (json!({"memory": true, "key_prefix": "shop:"}), "need a Redis backend"),
            (json!({"redis": "redis://x", "memory_max_keys": 1}), "go with `memory: true`"),
            (json!({"redis": "redis://x", "sentinel_master": "m"}), "goes with `redis_sentinel`"),
            (json!({"redis": "redis://x", "cert_file": "/c.pem"}), "go together"),
            (json!({"redis": "redis://x", "timeout_ms": 0}), "timeout_ms"),
            (json!({"redis": "redis://x", "threads": 17}), "threads"),
            (json!({"redis": 5}), "invalid type"),
        ] {
            let e = parse(bad.clone()).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let tls = parse(json!({"redis": "rediss://r:6380", "ca_file": "/ca.pem", "username": "idem",
                               "password_file": "/pw", "key_prefix": "shop:"}))
        .unwrap();
        assert_eq!(tls.ca_file.as_deref(), Some("/ca.pem"));
        assert_eq!(tls.key_prefix, "shop:");
    }
}
