//! What the worker reads from the host besides its events: the clock, and the shared data every
//! worker of the Envoy process sees (the local fallback's locks and records). The host
//! implements both over proxy-wasm; the unit tests and the simulations over memory.

/// The host's clock, read only when a decision needs it.
pub trait Clock {
    /// Microseconds since the Unix epoch, if the host can tell.
    fn now_us(&self) -> Option<u64>;

    /// Milliseconds since the Unix epoch, if the host can tell.
    fn now_ms(&self) -> Option<u64> {
        self.now_us().map(|us| us / 1000)
    }
}

/// Envoy's shared data: values with a version, written only if the version is unchanged.
pub trait SharedData {
    /// The value and its version; `None` if the key was never set.
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes `value` if the key's version is still `cas`; `false` if it is not (or the host
    /// refused).
    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool;
}

/// Everything the worker reads from the host.
pub trait Env: Clock + SharedData {}

impl<T: Clock + SharedData + ?Sized> Env for T {}
