//! Arbitrary bytes through the batch parser, CRC check and record decoder: never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidelog::record::BatchIter;

fuzz_target!(|data: &[u8]| {
    for batch in BatchIter::new(data) {
        let Ok(batch) = batch else { break };
        let _ = batch.validate(1 << 20);
        let _ = batch.records(1 << 20);
    }
});
