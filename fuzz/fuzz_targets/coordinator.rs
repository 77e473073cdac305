//! The per-VM coordinator in a simulated worker (`idempotency_filter::sim::worker`): many
//! streams, a store with expiring records and locks, faults, wake-ups and clock jumps, every
//! choice read from the input. The world checks after every event that each granted lock ends
//! once, answers reach the stream they are for, nothing is served from the record cache past its
//! expiry, and that nothing waits or is held once everything is answered. The unit test
//! `random_interleavings_keep_the_coordinator_invariants` runs the same world on 16,000 seeds.
//! Each run picks its store transport: callouts, or the store streams (answers in any order,
//! a stream reset mid-call, answers after their deadline, bytes that are no answer).

#![no_main]

use idempotency_filter::sim::worker::tally::Rng;
use idempotency_filter::sim::worker::World;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Two bytes a choice; the steps cover the input, and a short input still runs a while.
    let steps = (data.len() / 4).clamp(20, 400);
    if let Err(e) = World::run(Rng::from_input(data), steps) {
        panic!("{e}");
    }
});
