//! The store's circuit breaker, one per VM: after `breaker_failures` store calls in a row time
//! out, `begin`s skip the store for `breaker_open_ms` (each request fails open or closed at once
//! instead of waiting out `store_timeout_ms`), then one `begin` goes out as a probe while the
//! others still skip (one more each interval while none has answered); any store answer closes the breaker again, a timeout reopens it. So a
//! store that hangs costs a VM one timeout per interval, not one per request. Failures that
//! cost no wait (refused, reset, no healthy host, garbage) are not counted: they fail open at
//! once already, and skipping would only delay the guarantee's return.
//!
//! Only `begin`s are gated: a commit or release settles a lock the store granted, and is sent
//! whatever the breaker says (its answer counts like any other).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Failures in a row so far.
    Closed(u32),
    /// Skipping until this time (milliseconds since the Unix epoch).
    Open(u64),
    /// A `begin` went out as the probe at this time; another may go one interval later (the
    /// probe may be a duplicate long-polling for a lock, answering only after its wait).
    Probing(u64),
}

/// What to do with a `begin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Call,
    /// Call: it is the probe after the open interval.
    Probe,
    /// Do not call: the store failed recently.
    Skip,
}

#[derive(Debug, Clone)]
pub struct Breaker {
    failures: u32,
    open_ms: u64,
    state: State,
}

impl Breaker {
    /// `open_ms == 0` turns the breaker off: every `begin` is called.
    pub fn new(failures: u32, open_ms: u64) -> Breaker {
        Breaker { failures: failures.max(1), open_ms, state: State::Closed(0) }
    }

    /// No clock needed: the store is answering.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed(_))
    }

    /// For a `begin` about to go out at `now_ms` (`None`: the host cannot tell; it is called).
    pub fn gate(&mut self, now_ms: Option<u64>) -> Gate {
        match (self.state, now_ms) {
            (State::Closed(_), _) | (_, None) => Gate::Call,
            (State::Open(until), Some(now)) if now >= until => {
                self.state = State::Probing(now);
                Gate::Probe
            }
            (State::Probing(since), Some(now)) if now >= since.saturating_add(self.open_ms) => {
                self.state = State::Probing(now);
                Gate::Probe
            }
            (State::Open(_) | State::Probing(_), Some(_)) => Gate::Skip,
        }
    }

    /// A store call ended: answered (`ok`), or failed at `now_ms` (without a clock, a failure
    /// cannot open the breaker: nothing could tell when to probe). True when this opened it.
    pub fn record(&mut self, ok: bool, now_ms: Option<u64>) -> bool {
        if self.open_ms == 0 {
            return false;
        }
        let was_closed = self.is_closed();
        self.state = match (ok, self.state, now_ms) {
            (true, _, _) => State::Closed(0),
            (false, state, None) => state,
            (false, State::Closed(n), _) if n + 1 < self.failures => State::Closed(n + 1),
            (false, _, Some(now)) => State::Open(now.saturating_add(self.open_ms)),
        };
        was_closed && !self.is_closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_failures_in_a_row_then_probes_once_per_interval() {
        let mut b = Breaker::new(3, 1000);
        b.record(false, Some(0));
        b.record(false, Some(1));
        b.record(true, Some(2));
        assert!(b.is_closed(), "an answer resets the count");
        for t in 3..6 {
            assert_eq!(b.gate(Some(t)), Gate::Call);
            b.record(false, Some(t));
        }
        assert!(!b.is_closed());
        assert_eq!(b.gate(Some(6)), Gate::Skip);
        assert_eq!(b.gate(Some(1004)), Gate::Skip);
        assert_eq!(b.gate(Some(1005)), Gate::Probe);
        assert_eq!(b.gate(Some(1006)), Gate::Skip, "one probe at a time");
        assert_eq!(b.gate(Some(2005)), Gate::Probe, "another an interval later if it is still out");
        b.record(false, Some(2500));
        assert_eq!(b.gate(Some(3499)), Gate::Skip);
        assert_eq!(b.gate(Some(3500)), Gate::Probe);
        b.record(true, Some(3600));
        assert_eq!(b.gate(Some(3601)), Gate::Call);
    }

    #[test]
    fn off_or_without_a_clock_every_begin_is_called() {
        let mut off = Breaker::new(1, 0);
        for t in 0..10 {
            off.record(false, Some(t));
            assert_eq!(off.gate(Some(t)), Gate::Call);
        }
        let mut b = Breaker::new(1, 1000);
        b.record(false, None);
        assert!(b.is_closed());
        b.record(false, Some(5));
        assert_eq!(b.gate(None), Gate::Call);
        assert_eq!(b.gate(Some(6)), Gate::Skip);
    }
}
