//! Arbitrary bytes as the active segment of a partition that crashed: opening either
//! recovers (cutting a torn tail) or refuses with a damage report when valid batches
//! follow the damage, never panics, and everything it then serves has a valid CRC.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use tidelog::partition::{Isolation, LogError, PartitionLog, SystemClock};
use tidelog::record::BatchIter;
use tidelog::topic_config::TopicConfig;
use tidelog::types::Offset;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("00000000000000000000.log"), data).unwrap();
    let log = match PartitionLog::open(dir.path(), TopicConfig::default(), Arc::new(SystemClock)) {
        Ok(log) => log,
        Err(LogError::Damaged(report)) => {
            assert!(!report.ranges.is_empty());
            return;
        }
        Err(e) => panic!("recovery failed: {e}"),
    };
    let mut offset = 0;
    while offset < log.log_end_offset().0 {
        let fetched = log.read(Offset(offset), 1 << 16, Isolation::LogEnd).unwrap();
        let last = BatchIter::new(&fetched.records).last().unwrap().unwrap();
        assert!(last.verify_crc().is_ok());
        offset = last.header().next_offset() as u64;
    }
});
