//! Storage engine benchmarks (issue 2). Run: `cargo bench --bench storage`.
//!
//! - append: 1 KiB records in batches of 100, async flush (page cache);
//! - read: sequential 1 MiB reads of a 1 GiB log from the page cache;
//! - lookup: offset -> (segment, position) for random offsets in that log;
//! - sync append: one 1 KiB record per append with `flush.mode=sync`, 1/4/16 appenders,
//!   showing group commit sharing fsyncs.
//!
//! Data lives under `TIDELOG_BENCH_DIR` (default: the system temp dir).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tidelog::partition::{Isolation, PartitionLog, SystemClock};
use tidelog::record::{BatchBuilder, Compression, RecordRef};
use tidelog::topic_config::{FlushMode, TopicConfig};
use tidelog::types::{LeaderEpoch, Offset};

fn bench_dir() -> tempfile::TempDir {
    let base = std::env::var_os("TIDELOG_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    tempfile::tempdir_in(base).unwrap()
}

fn batch(records: usize, value_len: usize) -> Vec<u8> {
    let value = vec![b'x'; value_len];
    let mut b = BatchBuilder::new(Compression::None);
    for i in 0..records {
        let key = format!("key-{i}");
        b.push(RecordRef {
            timestamp: 1_764_670_000_000,
            key: Some(key.as_bytes()),
            value: Some(&value),
            headers: &[],
        });
    }
    b.build(0).unwrap()
}

fn append_async(c: &mut Criterion) {
    let dir = bench_dir();
    let config = TopicConfig {
        segment_bytes: 256 << 20,
        retention_bytes: 1 << 30,
        retention_ms: -1,
        ..TopicConfig::default()
    };
    let log = PartitionLog::open(dir.path(), config, Arc::new(SystemClock)).unwrap();
    let mut data = batch(100, 1024);
    let mut group = c.benchmark_group("append");
    group.throughput(Throughput::Bytes(data.len() as u64));
    group.measurement_time(Duration::from_secs(8));
    let mut appends = 0u64;
    group.bench_function("1KiB_x100_async", |b| {
        b.iter(|| {
            log.append_as_leader(&mut data, LeaderEpoch(0)).unwrap();
            appends += 1;
            if appends.is_multiple_of(2048) {
                // Keep the working set bounded: about 1 GiB on disk.
                log.set_high_watermark(log.log_end_offset());
                log.apply_retention().unwrap();
            }
        })
    });
    group.finish();
}

/// A 1 GiB log of 100 x 1 KiB batches, shared by the read and lookup benchmarks.
fn gigabyte_log() -> (tempfile::TempDir, PartitionLog) {
    let dir = bench_dir();
    let log =
        PartitionLog::open(dir.path(), TopicConfig::default(), Arc::new(SystemClock)).unwrap();
    let mut data = batch(100, 1024);
    while log.size_bytes() < 1 << 30 {
        log.append_as_leader(&mut data, LeaderEpoch(0)).unwrap();
    }
    (dir, log)
}

fn read_and_lookup(c: &mut Criterion) {
    let (_dir, log) = gigabyte_log();
    let end = log.log_end_offset().0;
    // Warm the page cache once.
    let mut offset = 0;
    while offset < end {
        let data = log
            .read(Offset(offset), 1 << 20, Isolation::LogEnd)
            .unwrap();
        offset = next_offset(&data.records);
    }

    let mut group = c.benchmark_group("read");
    group.throughput(Throughput::Bytes(1 << 20));
    group.measurement_time(Duration::from_secs(8));
    let mut offset = 0u64;
    group.bench_function("sequential_1MiB_page_cache", |b| {
        b.iter(|| {
            let data = log
                .read(Offset(offset), 1 << 20, Isolation::LogEnd)
                .unwrap();
            offset = next_offset(&data.records);
            if offset >= end {
                offset = 0;
            }
            data.records.len()
        })
    });
    group.finish();

    let mut group = c.benchmark_group("lookup");
    group.throughput(Throughput::Elements(1));
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    group.bench_function("random_offset_to_position", |b| {
        b.iter(|| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            log.position_of(Offset(state % end)).unwrap().unwrap()
        })
    });
    group.finish();
}

fn next_offset(records: &[u8]) -> u64 {
    tidelog::record::BatchIter::new(records)
        .last()
        .map(|b| b.unwrap().header().next_offset() as u64)
        .unwrap()
}

fn append_sync(c: &mut Criterion) {
    let mut group = c.benchmark_group("append_sync");
    group.measurement_time(Duration::from_secs(8));
    group.sample_size(10);
    for appenders in [1usize, 4, 16] {
        let dir = bench_dir();
        let config = TopicConfig {
            flush_mode: FlushMode::Sync,
            segment_bytes: 256 << 20,
            ..TopicConfig::default()
        };
        let log = Arc::new(PartitionLog::open(dir.path(), config, Arc::new(SystemClock)).unwrap());
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("1KiB_x1_{appenders}_appenders"), |b| {
            b.iter_custom(|iters| {
                let per_thread = iters.div_ceil(appenders as u64);
                let start = Instant::now();
                let threads: Vec<_> = (0..appenders)
                    .map(|_| {
                        let log = log.clone();
                        std::thread::spawn(move || {
                            let mut data = batch(1, 1024);
                            for _ in 0..per_thread {
                                log.append_as_leader(&mut data, LeaderEpoch(0)).unwrap();
                            }
                        })
                    })
                    .collect();
                for t in threads {
                    t.join().unwrap();
                }
                // Report time per append across all threads.
                start
                    .elapsed()
                    .mul_f64(iters as f64 / (per_thread * appenders as u64) as f64)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, append_async, read_and_lookup, append_sync);
criterion_main!(benches);
