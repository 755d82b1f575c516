//! Gauges read at scrape time: each partition's offsets and size, leadership counts,
//! Raft and cluster state, and process figures. Counters and histograms are recorded
//! where things happen; [`describe`] documents all of them once.

use std::sync::OnceLock;
use std::time::Instant;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, Unit};

use super::health::Roles;
use crate::controller::model::BrokerState;
use crate::replication::Role;

static STARTED: OnceLock<Instant> = OnceLock::new();

/// Registers the help text and unit of every metric.
pub fn describe() {
    STARTED.get_or_init(Instant::now);
    describe_counter!(
        "tidelog_records_in_total",
        "Records appended by producers, per topic."
    );
    describe_counter!(
        "tidelog_bytes_in_total",
        Unit::Bytes,
        "Record-batch bytes appended by producers, per topic."
    );
    describe_counter!(
        "tidelog_records_out_total",
        "Records sent to consumers, per topic."
    );
    describe_counter!(
        "tidelog_bytes_out_total",
        Unit::Bytes,
        "Record-batch bytes sent to consumers, per topic."
    );
    describe_counter!(
        "tidelog_requests_total",
        "Requests handled, per protocol and API."
    );
    describe_counter!(
        "tidelog_request_errors_total",
        "Requests that failed as a whole, per protocol, API and error code."
    );
    describe_histogram!(
        "tidelog_request_duration_seconds",
        Unit::Seconds,
        "Time to answer a request, per protocol and API."
    );
    describe_counter!(
        "tidelog_isr_changes_total",
        "ISR changes this broker's leaders committed, by change (shrink, expand)."
    );
    describe_histogram!(
        "tidelog_log_flush_duration_seconds",
        Unit::Seconds,
        "Time of one fsync pass over a partition's unflushed segments."
    );
    describe_counter!(
        "tidelog_filtered_read_bytes_total",
        "Bytes of log that filtered fetches read (tag-index candidates, or every batch for SQL filters)."
    );
    describe_gauge!(
        "tidelog_connections_active",
        "Open connections, per listener."
    );
    describe_gauge!(
        "tidelog_partition_log_start_offset",
        "A stored partition's log start offset."
    );
    describe_gauge!(
        "tidelog_partition_log_end_offset",
        "A stored partition's log end offset."
    );
    describe_gauge!(
        "tidelog_partition_high_watermark",
        "A stored partition's high watermark."
    );
    describe_gauge!(
        "tidelog_partition_size_bytes",
        Unit::Bytes,
        "A stored partition's segment bytes."
    );
    describe_gauge!(
        "tidelog_timers_pending",
        "Per topic: scheduled (delayed) records pending in the __timers partitions this broker leads."
    );
    describe_gauge!("tidelog_partitions", "Partitions stored on this broker.");
    describe_gauge!("tidelog_partitions_leader", "Partitions this broker leads.");
    describe_gauge!(
        "tidelog_partitions_under_replicated",
        "Partitions this broker leads whose ISR is smaller than their replica set."
    );
    describe_gauge!(
        "tidelog_partitions_offline",
        "Replicas on this broker that cannot serve (damaged, failed to open, I/O error)."
    );
    describe_gauge!(
        "tidelog_broker_fenced",
        "1 while the controllers hold this broker fenced."
    );
    describe_gauge!("tidelog_raft_term", "The controller's current Raft term.");
    describe_counter!(
        "tidelog_raft_elections_total",
        "Elections the controller quorum has held (each starts a Raft term)."
    );
    describe_gauge!(
        "tidelog_metadata_version",
        "The metadata version this controller applied (its last applied Raft index)."
    );
    describe_gauge!(
        "tidelog_replica_lag_records",
        "Per follower of a partition this broker leads: records behind the leader's log end."
    );
    describe_gauge!(
        "tidelog_replica_lag_seconds",
        Unit::Seconds,
        "Per follower of a partition this broker leads: how long since it was last caught up."
    );
    describe_gauge!(
        "tidelog_raft_leader",
        "The Raft leader's node id (-1: none known)."
    );
    describe_gauge!("tidelog_raft_is_leader", "1 on the Raft leader.");
    describe_gauge!(
        "tidelog_raft_commit_index",
        "Highest Raft log index known committed."
    );
    describe_gauge!(
        "tidelog_raft_applied_index",
        "Last applied Raft log index (the metadata version)."
    );
    describe_gauge!("tidelog_raft_last_log_index", "Last Raft log index.");
    describe_gauge!(
        "tidelog_raft_snapshot_index",
        "Last Raft log index the latest snapshot covers."
    );
    describe_gauge!(
        "tidelog_raft_snapshot_size_bytes",
        Unit::Bytes,
        "Size of the latest metadata snapshot file."
    );
    describe_counter!(
        "tidelog_group_rebalances_total",
        "Rebalances of each group since this broker took it over (new consumer-group epochs, completed classic join phases)."
    );
    describe_histogram!(
        "tidelog_controller_write_duration_seconds",
        Unit::Seconds,
        "Time to commit one metadata command through Raft."
    );
    describe_gauge!(
        "tidelog_cluster_brokers",
        "Registered brokers, by state (controller view)."
    );
    describe_gauge!("tidelog_cluster_topics", "Topics (controller view).");
    describe_gauge!(
        "tidelog_cluster_partitions_offline",
        "Partitions without a usable leader (controller view)."
    );
    describe_gauge!(
        "tidelog_cluster_partitions_under_replicated",
        "Partitions whose ISR is smaller than their replica set (controller view)."
    );
    describe_gauge!(
        "tidelog_process_resident_memory_bytes",
        Unit::Bytes,
        "Resident memory of the process."
    );
    describe_gauge!(
        "tidelog_process_open_fds",
        "Open file descriptors of the process."
    );
    describe_gauge!(
        "tidelog_process_uptime_seconds",
        Unit::Seconds,
        "Seconds since the process installed its metrics."
    );
    describe_gauge!(
        "tidelog_build_info",
        "Always 1; the label `version` names the build."
    );
}

/// Sets every scrape-time gauge from the roles' current state.
pub async fn refresh(roles: &Roles) {
    process();
    if let Some(node) = &roles.controller {
        let status = node.status().await;
        gauge!("tidelog_raft_term").set(status.term as f64);
        gauge!("tidelog_raft_leader").set(status.leader.map_or(-1.0, |l| l as f64));
        gauge!("tidelog_raft_is_leader").set(f64::from(u8::from(status.leader == Some(status.id))));
        gauge!("tidelog_raft_commit_index").set(status.commit_index as f64);
        gauge!("tidelog_raft_applied_index").set(status.applied_index as f64);
        gauge!("tidelog_raft_last_log_index").set(status.last_log_index as f64);
        gauge!("tidelog_raft_snapshot_index").set(status.snapshot_index as f64);
        gauge!("tidelog_raft_snapshot_size_bytes").set(status.snapshot_bytes as f64);
        // Every election starts a term: the term counts the quorum's elections.
        metrics::counter!("tidelog_raft_elections_total").absolute(status.term);
        let (brokers, topics, offline, under, version) = node.store().read(|image, applied| {
            let mut brokers = [0usize; 3];
            for b in image.brokers.values() {
                brokers[match b.state {
                    BrokerState::Fenced => 0,
                    BrokerState::Unfenced => 1,
                    BrokerState::ShuttingDown => 2,
                }] += 1;
            }
            (
                brokers,
                image.topics.len(),
                image.offline_partitions(),
                image.under_replicated_partitions(),
                applied,
            )
        });
        gauge!("tidelog_metadata_version").set(version as f64);
        for (i, state) in [
            BrokerState::Fenced,
            BrokerState::Unfenced,
            BrokerState::ShuttingDown,
        ]
        .iter()
        .enumerate()
        {
            gauge!("tidelog_cluster_brokers", "state" => state.as_str()).set(brokers[i] as f64);
        }
        gauge!("tidelog_cluster_topics").set(topics as f64);
        gauge!("tidelog_cluster_partitions_offline").set(offline as f64);
        gauge!("tidelog_cluster_partitions_under_replicated").set(under as f64);
    }
    if let Some(broker) = &roles.broker {
        let partitions = broker.node.partitions().clone();
        let metadata = broker.node.metadata().clone();
        let fenced = broker.link.is_fenced();
        // Many partitions: read them off the async threads.
        let _ = tokio::task::spawn_blocking(move || {
            let all = partitions.all();
            let (mut led, mut under) = (0usize, 0usize);
            for lp in &all {
                let labels = [
                    ("topic", lp.topic.clone()),
                    ("partition", lp.partition.to_string()),
                ];
                gauge!("tidelog_partition_log_start_offset", &labels)
                    .set(lp.log.log_start_offset().0 as f64);
                gauge!("tidelog_partition_log_end_offset", &labels)
                    .set(lp.log.log_end_offset().0 as f64);
                gauge!("tidelog_partition_high_watermark", &labels)
                    .set(lp.log.high_watermark().0 as f64);
                gauge!("tidelog_partition_size_bytes", &labels).set(lp.log.size_bytes() as f64);
                if let Role::Leader(leader) = &*lp.role() {
                    led += 1;
                    let end = lp.log.log_end_offset().0;
                    let now = crate::broker::node::now_ms();
                    for (follower, p) in leader.view.lock().followers.iter() {
                        let labels = [
                            ("topic", lp.topic.clone()),
                            ("partition", lp.partition.to_string()),
                            ("follower", follower.0.to_string()),
                        ];
                        gauge!("tidelog_replica_lag_records", &labels)
                            .set(end.saturating_sub(p.log_end_offset.0) as f64);
                        gauge!("tidelog_replica_lag_seconds", &labels)
                            .set((now - p.last_caught_up_ms).max(0) as f64 / 1000.0);
                    }
                    let replicas = metadata
                        .partition(&lp.topic, lp.partition)
                        .map_or(0, |(_, p)| p.replicas.len());
                    if lp.leader_isr().is_some_and(|isr| isr.len() < replicas) {
                        under += 1;
                    }
                }
            }
            gauge!("tidelog_partitions").set(all.len() as f64);
            gauge!("tidelog_partitions_leader").set(led as f64);
            gauge!("tidelog_partitions_under_replicated").set(under as f64);
            gauge!("tidelog_partitions_offline").set(partitions.offline_replicas().len() as f64);
        })
        .await;
        gauge!("tidelog_broker_fenced").set(f64::from(u8::from(fenced)));
        groups(broker).await;
        timers(broker);
    }
}

/// Pending scheduled records per target topic in the `__timers` partitions this broker
/// leads (0 for the other topics, so a count that fell to nothing shows it); summed over
/// the brokers, a topic's pending delayed records.
fn timers(broker: &super::health::BrokerRole) {
    let pending = broker.timers.pending_by_topic();
    let topics: Vec<String> = broker
        .node
        .metadata()
        .read(|image| image.topics.keys().cloned().collect());
    for topic in topics {
        if crate::controller::validation::is_reserved_topic(&topic) {
            continue;
        }
        let n = pending.get(&topic).copied().unwrap_or(0);
        gauge!("tidelog_timers_pending", "topic" => topic).set(n as f64);
    }
}

/// Members, epoch, committed offsets and lag of the groups this broker coordinates. Lag
/// is measured against the high watermark (the last stable offset for groups that read
/// committed records) where this broker leads the partition (always in `standalone`);
/// elsewhere only the committed offset is exported.
async fn groups(broker: &super::health::BrokerRole) {
    for g in broker.groups.snapshot().await {
        let group = [("group", g.name.clone())];
        gauge!("tidelog_group_members", &group).set(g.members as f64);
        gauge!("tidelog_group_epoch", &group).set(f64::from(g.epoch));
        counter!("tidelog_group_rebalances_total", &group).absolute(g.rebalances);
        for (key, offset) in g.offsets {
            let mut labels = vec![
                ("group", g.name.clone()),
                ("topic", key.topic.clone()),
                ("partition", key.partition.to_string()),
            ];
            if !key.instance.is_empty() {
                labels.push(("instance", key.instance.clone()));
            }
            gauge!("tidelog_group_committed_offset", &labels).set(offset as f64);
            let led = broker.node.leader_partition(&key.topic, key.partition);
            if let Ok((local, _)) = led {
                let end = if g.read_committed {
                    local.log.last_stable_offset()
                } else {
                    local.log.high_watermark()
                };
                gauge!("tidelog_group_lag", &labels).set((end.as_i64() - offset).max(0) as f64);
            }
        }
    }
}

/// Resident memory, descriptors, uptime and build.
fn process() {
    let started = *STARTED.get_or_init(Instant::now);
    gauge!("tidelog_process_uptime_seconds").set(started.elapsed().as_secs_f64());
    gauge!("tidelog_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
        if let Some(pages) = statm
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<f64>().ok())
        {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as f64;
            gauge!("tidelog_process_resident_memory_bytes").set(pages * page);
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        gauge!("tidelog_process_open_fds").set(fds.count() as f64);
    }
}
