//! Time as the protocol carries it: durations in whole milliseconds, rounded up
//! (`x-idem-lock-remaining-ms`, `x-idem-running-ms` and their stream twins), and a caller's
//! wall-clock deadline as an instant on this host's monotonic clock. Its own module because a
//! store-stream call ([`crate::calls`]) and idemstore's HTTP routes both answer with them, and
//! an answer in milliseconds must round the same whichever way it went. Uses nothing of this
//! crate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Whole milliseconds rounded up, at least 1: what `x-idem-lock-remaining-ms` carries, so a
/// retry timed by it never comes before the lock expires.
pub fn ceil_millis(d: Duration) -> u64 {
    running_millis(d).max(1)
}

/// Whole milliseconds rounded up, 0 for zero: what `x-idem-running-ms` carries (`0`: the
/// in-doubt attempt can no longer be running).
pub fn running_millis(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// A caller's wall-clock deadline (milliseconds since the Unix epoch) on this host's monotonic
/// clock: the time left is read against this host's wall clock once, here (`x-idem-deadline-ms`
/// and a stream call's `deadline_ms`).
pub fn give_up_at(deadline_ms: u64) -> tokio::time::Instant {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let left_ms = u128::from(deadline_ms).saturating_sub(now_ms);
    let left = Duration::from_millis(u64::try_from(left_ms).unwrap_or(u64::MAX));
    let now = tokio::time::Instant::now();
    now.checked_add(left).unwrap_or(now + Duration::from_secs(86_400))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_remaining_rounds_up_to_at_least_one_millisecond() {
        assert_eq!(ceil_millis(Duration::ZERO), 1);
        assert_eq!(ceil_millis(Duration::from_nanos(1)), 1);
        assert_eq!(ceil_millis(Duration::from_millis(1)), 1);
        assert_eq!(ceil_millis(Duration::from_nanos(1_000_001)), 2);
        assert_eq!(ceil_millis(Duration::from_micros(29_999_001)), 30_000);
        assert_eq!(ceil_millis(Duration::from_secs(30)), 30_000);
        assert_eq!(ceil_millis(Duration::MAX), u64::MAX);
        assert_eq!(running_millis(Duration::ZERO), 0);
        assert_eq!(running_millis(Duration::from_nanos(1)), 1);
        assert_eq!(running_millis(Duration::from_millis(250)), 250);
    }
}
