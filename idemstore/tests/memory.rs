//! The shared scenarios against the in-memory backend.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::in_doubt;
use idemstore::backend::memory::MemoryBackend;
use idemstore::store::Store;

fn store() -> Store<MemoryBackend> {
    Store::new(MemoryBackend::new(1000))
}

#[tokio::test]
async fn begin_locks_then_replays() {
    common::begin_locks_then_replays(&store()).await;
}

#[tokio::test]
async fn waiter_woken_by_commit() {
    common::waiter_woken_by_commit(MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn waiter_woken_by_release() {
    common::waiter_woken_by_release(MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn busy_after_wait() {
    common::busy_after_wait(&store()).await;
}

#[tokio::test]
async fn busy_at_once_without_wait() {
    common::busy_at_once_without_wait(&store()).await;
}

#[tokio::test]
async fn lock_remaining_over_http() {
    common::lock_remaining_over_http(Arc::new(store())).await;
}

#[tokio::test]
async fn batch_commit_over_http() {
    common::batch_commit_over_http(Arc::new(store())).await;
}

#[tokio::test]
async fn mismatch() {
    common::mismatch(&store()).await;
}

#[tokio::test]
async fn release_lets_next_begin_lock() {
    common::release_lets_next_begin_lock(&store()).await;
}

#[tokio::test]
async fn late_commit_and_exists() {
    common::late_commit_and_exists(&store()).await;
}

#[tokio::test]
async fn expired_lock_is_taken_over() {
    common::expired_lock_is_taken_over(&store()).await;
}

#[tokio::test]
async fn record_expires() {
    common::record_expires(&store(), Duration::from_millis(200)).await;
}

#[tokio::test]
async fn binary_record() {
    common::binary_record(&store()).await;
}

#[tokio::test]
async fn waiter_on_other_instance() {
    // Clones share the map but each store has its own waiters, like two processes on one Redis.
    let backend = MemoryBackend::new(1000);
    common::waiter_on_other_instance(Store::new(backend.clone()), Store::new(backend)).await;
}

#[tokio::test]
async fn stop_waiting_answers_busy() {
    common::stop_waiting_answers_busy(Arc::new(store())).await;
}

#[tokio::test]
async fn operator_tools() {
    common::operator_tools(&MemoryBackend::new(1000), 5).await;
}

#[tokio::test]
async fn hold_writes_a_trace() {
    in_doubt::hold_writes_a_trace(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_after_an_in_doubt_release() {
    in_doubt::in_doubt_after_an_in_doubt_release(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_after_the_lock_expires() {
    in_doubt::in_doubt_after_the_lock_expires(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_another_body_is_a_mismatch() {
    in_doubt::another_body_is_a_mismatch(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_without_hold_the_trace_is_ignored() {
    in_doubt::without_hold_the_trace_is_ignored(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_supersede() {
    in_doubt::supersede(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_late_commit_resolves() {
    in_doubt::late_commit_resolves(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_release_not_in_doubt_clears_the_trace() {
    in_doubt::release_not_in_doubt_clears_the_trace(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_delete_clears_the_trace() {
    in_doubt::delete_clears_the_trace(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_counted_and_found() {
    in_doubt::counted_and_found(&MemoryBackend::new(1000)).await;
}

#[tokio::test]
async fn in_doubt_waiter_woken_by_an_in_doubt_release() {
    in_doubt::waiter_woken_by_an_in_doubt_release(common::no_recheck(MemoryBackend::new(1000))).await;
}
