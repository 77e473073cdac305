//! Wake-ups across idemstore instances, over Redis pub/sub.
//!
//! The commit, release and delete scripts `PUBLISH` the store key on [`CHANNEL`] whenever they
//! drop a lock or store (or delete) a record of a key someone waits on. Every instance keeps
//! one connection subscribed to that channel and rings its local [`Waiters`] for each key it
//! hears: a map lookup, nothing to do when nobody here waits on that key. One channel for all
//! keys keeps the subscription O(1) per instance, whatever the number of keys in flight.
//!
//! On Redis Cluster a classic `PUBLISH`, from a script too, is broadcast over the cluster bus
//! to every node, so a subscriber connected to any one node hears the wake-ups of all slots.
//! The subscriber sits on one seed node and moves on to the next when it loses it.
//!
//! A waiter arms its notification before each atomic attempt, and the wake-up is published
//! by the script that changes the key, after any attempt that saw the lock held: no wake-up
//! falls between an attempt and the wait. While the subscription is down, waiters still make
//! progress through their bounded re-check ([`crate::store::Store::begin`]); once it is back,
//! every local waiter tries again, for whatever was published meanwhile.
//!
//! Started by [`super::redis`]; uses [`super::sentinel`] (the subscription follows the master),
//! [`super::redis_error`] and [`crate::waiters`].

use std::sync::Weak;
use std::time::Duration;

use ::redis::aio::PubSub;
use ::redis::{Client, Value};
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::redis_error::failed;
use super::sentinel::SentinelConnection;
use super::BackendError;
use crate::waiters::{RemoteWakeups, Waiters};

/// The target of this module's log lines: idemstore's module path before the backends had a
/// crate of their own, so that `RUST_LOG` filters and log searches that name it still match.
const LOG_TARGET: &str = "idemstore::backend::pubsub";

/// The channel the scripts publish store keys on (after `--key-prefix`).
pub const CHANNEL: &str = "idem:wake";

/// A silent subscription (Redis frozen, a connection black-holed) is noticed by a `PING`
/// going unanswered: one per instance and period.
const KEEPALIVE: Duration = Duration::from_secs(1);
/// Reconnect delays: the first retry after a loss is immediate, then they double.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A subscription that lasted this long resets the backoff; shorter ones (a flapping
/// server) keep it growing.
const STABLE: Duration = Duration::from_secs(10);

/// Where the subscription goes.
#[derive(Clone)]
pub enum WakeNodes {
    /// The server, or the seeds of a cluster, taken in turn.
    Fixed(Vec<Client>),
    /// Whichever master the sentinels name at the time (wake-ups published on the master
    /// reach its replicas' subscribers too, so a demoted master still hears them).
    Sentinel(SentinelConnection),
}

impl WakeNodes {
    fn is_empty(&self) -> bool {
        matches!(self, Self::Fixed(nodes) if nodes.is_empty())
    }

    /// The next node to subscribe through, the `n`th try.
    async fn pick(&self, n: usize) -> Result<Client, String> {
        match self {
            Self::Fixed(nodes) => {
                nodes.get(n % nodes.len().max(1)).cloned().ok_or_else(|| "no node".to_owned())
            }
            Self::Sentinel(sentinel) => sentinel.master_client().await.map_err(|e| e.to_string()),
        }
    }

    /// With Sentinel: changes when the master's connection is dropped.
    fn master_changes(&self) -> Option<watch::Receiver<u64>> {
        match self {
            Self::Fixed(_) => None,
            Self::Sentinel(sentinel) => Some(sentinel.master_changes()),
        }
    }

    fn count(&self) -> usize {
        match self {
            Self::Fixed(nodes) => nodes.len(),
            Self::Sentinel(_) => 1,
        }
    }
}

/// Subscribes to `channel` through `nodes`, in a task that reconnects until aborted or until
/// `waiters` is gone. `timeout` bounds connecting, subscribing and each keepalive `PING`.
/// Needs a tokio runtime; without one (or without nodes) nothing starts and waiters rely on
/// their re-checks.
pub(crate) fn spawn(
    nodes: WakeNodes,
    channel: String,
    timeout: Duration,
    waiters: Weak<Waiters>,
    status: watch::Sender<RemoteWakeups>,
) -> Option<JoinHandle<()>> {
    if nodes.is_empty() {
        return None;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => Some(runtime.spawn(run(nodes, channel, timeout, waiters, status))),
        Err(e) => {
            tracing::warn!(target: LOG_TARGET,
                error = %e,
                "no async runtime: wake-ups from other idemstore instances are not subscribed to"
            );
            None
        }
    }
}

async fn run(
    nodes: WakeNodes,
    channel: String,
    timeout: Duration,
    waiters: Weak<Waiters>,
    status: watch::Sender<RemoteWakeups>,
) {
    // Instances spread over the seeds rather than all sitting on the first.
    let mut next = rand::random_range(0..nodes.count().max(1));
    let mut backoff = Duration::ZERO;
    // Since when wake-ups have not been heard: the outage is logged once, at its start.
    let mut outage: Option<Instant> = None;
    loop {
        if waiters.strong_count() == 0 {
            return;
        }
        // Taken before the master is asked for, so a change after that is seen.
        let moved = nodes.master_changes();
        let picked = nodes.pick(next).await;
        next = next.wrapping_add(1);
        let subscribed = match picked {
            Ok(node) => subscribe(&node, &channel, timeout).await,
            Err(e) => Err(BackendError::Unavailable(e)),
        };
        match subscribed {
            Ok(pubsub) => {
                if let Some(since) = outage.take() {
                    tracing::info!(target: LOG_TARGET,
                        after = ?since.elapsed(),
                        "wake-ups from other idemstore instances are heard again"
                    );
                }
                status.send_modify(|s| {
                    s.listening = true;
                    s.subscriptions += 1;
                });
                let Some(local) = waiters.upgrade() else { return };
                // Anything published while we were not listening is lost: everyone retries.
                local.wake_all();
                drop(local);
                let started = Instant::now();
                let lost = listen(pubsub, &waiters, timeout, moved).await;
                status.send_modify(|s| s.listening = false);
                let Some(why) = lost else { return };
                tracing::warn!(target: LOG_TARGET,
                    reason = %why,
                    "lost the Redis subscription to {channel}: until it is back, waiters on \
                     locks held through other idemstore instances notice them finish by \
                     re-checking"
                );
                outage = Some(Instant::now());
                if started.elapsed() >= STABLE {
                    backoff = Duration::ZERO;
                }
            }
            Err(refused @ BackendError::Refused(_)) => {
                // Logged once as the cause, as the health check logs it.
                refused.log("subscribing to wake-ups");
                outage.get_or_insert_with(Instant::now);
            }
            Err(why) => {
                if outage.is_none() {
                    tracing::warn!(target: LOG_TARGET,
                        reason = %why,
                        "cannot subscribe to {channel} on Redis: until it works, waiters on locks \
                         held through other idemstore instances notice them finish by re-checking"
                    );
                    outage = Some(Instant::now());
                } else {
                    tracing::debug!(target: LOG_TARGET, reason = %why, "subscribing to {channel} failed again");
                }
            }
        }
        tokio::time::sleep(jitter(backoff)).await;
        backoff = (backoff * 2).clamp(MIN_BACKOFF, MAX_BACKOFF);
    }
}

/// Between half and all of `delay`, so instances that lost Redis together do not all come
/// back in the same instant.
fn jitter(delay: Duration) -> Duration {
    delay.mul_f64(rand::random_range(0.5..=1.0))
}

async fn subscribe(node: &Client, channel: &str, timeout: Duration) -> Result<PubSub, BackendError> {
    let connect = async {
        let mut pubsub = node.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok::<_, ::redis::RedisError>(pubsub)
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(pubsub)) => Ok(pubsub),
        Ok(Err(e)) => Err(failed(e)),
        Err(_) => Err(BackendError::Unavailable(format!("no answer within {timeout:?}"))),
    }
}

/// Forwards wake-ups until the subscription fails (`Some(reason)`) or `waiters` is gone
/// (`None`).
async fn listen(
    pubsub: PubSub,
    waiters: &Weak<Waiters>,
    timeout: Duration,
    moved: Option<watch::Receiver<u64>>,
) -> Option<String> {
    let (mut sink, mut stream) = pubsub.split();
    let forward = async {
        while let Some(message) = stream.next().await {
            let local = waiters.upgrade()?;
            if let Ok(key) = std::str::from_utf8(message.get_payload_bytes()) {
                local.wake(key);
            }
        }
        Some("connection closed".to_owned())
    };
    let keepalive = async {
        loop {
            tokio::time::sleep(KEEPALIVE).await;
            if waiters.strong_count() == 0 {
                return None;
            }
            match tokio::time::timeout(timeout, sink.ping::<Value>()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Some(e.to_string()),
                Err(_) => return Some(format!("no answer to PING within {timeout:?}")),
            }
        }
    };
    // A subscription on a master that Sentinel replaced hears nothing published on the new one.
    let master_moved = async {
        match moved {
            Some(mut moved) => {
                let _ = moved.changed().await;
                Some("the sentinels named another master".to_owned())
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        lost = forward => lost,
        lost = keepalive => lost,
        lost = master_moved => lost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_half_and_whole() {
        for _ in 0..100 {
            let d = jitter(Duration::from_millis(1000));
            assert!(d >= Duration::from_millis(500) && d <= Duration::from_millis(1000), "{d:?}");
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }

    #[tokio::test]
    async fn nothing_to_subscribe_through_starts_nothing() {
        let waiters = std::sync::Arc::new(Waiters::default());
        let status = watch::Sender::new(RemoteWakeups::default());
        assert!(spawn(
            WakeNodes::Fixed(Vec::new()),
            CHANNEL.to_owned(),
            Duration::from_secs(1),
            std::sync::Arc::downgrade(&waiters),
            status
        )
        .is_none());
    }
}
