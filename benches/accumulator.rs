//! Producer accumulator benchmark (issue 13). Run: `cargo bench --bench accumulator`.
//!
//! Appends 1 KiB records into the accumulator without a network, as `Producer::send` does
//! after picking the partition: reserve the record's bytes, encode it into the
//! partition's open batch (16 KiB batches over 6 partitions), and, as the sender would,
//! drain and complete full batches so the buffer pool never runs dry. The figure is the
//! client's per-record cost floor: CPU per GB = time per record x 1e9 / 1024.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tidelog::client::accumulator::{record_size_bound, Accumulator, AccumulatorConfig};
use tidelog::record::{Compression, RecordRef};

fn append_1kib(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let acc = Accumulator::new(AccumulatorConfig {
        batch_size: 16 * 1024,
        linger: Duration::from_secs(3600),
        buffer_memory: 32 * 1024 * 1024,
        compression: Compression::None,
        drain_bytes_max: 1024 * 1024,
    });
    let value = vec![b'x'; 1024];
    let reserved = record_size_bound(None, Some(&value), &[]);
    let mut group = c.benchmark_group("accumulator");
    group.throughput(Throughput::Bytes(value.len() as u64));
    let mut n = 0u32;
    group.bench_function("append_1KiB_6_partitions", |b| {
        b.iter(|| {
            runtime.block_on(acc.reserve(reserved)).unwrap();
            let appended = acc.append(
                "bench",
                n % 6,
                RecordRef {
                    timestamp: 1_764_670_000_000,
                    key: None,
                    value: Some(&value),
                    headers: &[],
                },
                reserved,
                (false, false),
            );
            n = n.wrapping_add(1);
            if appended.index == 0 {
                // A batch was sealed: send (and acknowledge) the full ones.
                let (batches, _) = acc.drain(Instant::now(), |_, _| true);
                for batch in &batches {
                    acc.complete(batch, Ok(0));
                }
            }
            appended.index
        })
    });
    group.finish();
}

criterion_group!(benches, append_1kib);
criterion_main!(benches);
