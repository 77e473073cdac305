//! What the core reads outside a stream, natively: the clock, and the shared data every worker
//! of the process sees (the local fallback's locks and records): one map in process memory,
//! with proxy-wasm's compare-and-set versions.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::worker::env::{Clock, SharedData};

pub struct NativeEnv;

impl Clock for NativeEnv {
    fn now_us(&self) -> Option<u64> {
        let us = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_micros();
        u64::try_from(us).ok()
    }
}

/// Each key's value and version.
type Data = HashMap<String, (Vec<u8>, u32)>;

fn shared() -> &'static Mutex<Data> {
    static DATA: OnceLock<Mutex<Data>> = OnceLock::new();
    DATA.get_or_init(Mutex::default)
}

impl SharedData for NativeEnv {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let data = shared().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        data.get(key).cloned()
    }

    /// As Envoy's shared data: `cas` 0 writes whatever the version, else only over that
    /// version (a key not yet set takes any); versions come from one counter, as Envoy's.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        static VERSION: AtomicU32 = AtomicU32::new(0);
        let mut data = shared().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, current)) = data.get(key) {
            if cas != 0 && cas != *current {
                return false;
            }
        }
        let next = VERSION.fetch_add(1, Ordering::Relaxed).wrapping_add(1).max(1);
        data.insert(key.to_string(), (value.to_vec(), next));
        true
    }
}

/// The process's shared data with a clock stopped at `0` (µs since the Unix epoch): what the
/// coordinator reads while it takes a queued event as of when it came (`link.rs`).
pub struct At(pub u64);

impl Clock for At {
    fn now_us(&self) -> Option<u64> {
        Some(self.0)
    }
}

impl SharedData for At {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        NativeEnv.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        NativeEnv.set(key, value, cas)
    }
}

/// 16 random bytes from the kernel (`/dev/urandom`), for mint mode's keys.
pub fn random_bytes() -> Option<[u8; 16]> {
    use std::io::Read;
    let mut buf = [0u8; 16];
    std::fs::File::open("/dev/urandom").ok()?.read_exact(&mut buf).ok()?;
    Some(buf)
}
