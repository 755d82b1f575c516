//! The broker's side of the broker lifecycle: register with the controllers, heartbeat,
//! follow metadata by long-poll (opening and deleting partitions to match), and hand
//! leadership off in a controlled shutdown.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::lease::LeaderLease;
use super::metadata_cache::MetadataCache;
use super::partition_manager::PartitionManager;
use super::producer_ids::ProducerIdBlocks;
use super::replica_manager::ReplicaManager;
use crate::api::convert;
use crate::api::proto::{
    AllocateProducerIdsRequest, AlterPartitionRequest, BrokerHeartbeatRequest, OfflineReplica,
    RegisterBrokerRequest,
};
use crate::client::controller::ControllerClient;
use crate::client::ClientError;
use crate::controller::model::PartitionRecord;
use crate::error_code::ErrorCode;
use crate::net::node_auth::ClusterSecret;
use crate::replication::IsrChange;
use crate::types::BrokerId;

/// How long one metadata long-poll waits for a change.
const METADATA_POLL_WAIT: Duration = Duration::from_secs(5);
/// Pause after a failed metadata fetch.
const METADATA_RETRY: Duration = Duration::from_millis(300);
/// How long to wait for a previous holder of this broker id when the controllers do not
/// say (they normally send their session timeout minus the holder's silence).
const DUPLICATE_WAIT_DEFAULT: Duration = Duration::from_secs(10);
/// Margin over the controllers' estimate before a duplicate broker id is an error.
const DUPLICATE_WAIT_SLACK: Duration = Duration::from_secs(2);
/// Pause after a failed producer-id reservation.
const PRODUCER_IDS_RETRY: Duration = Duration::from_secs(1);
/// Shortest time one heartbeat may take before it counts as unanswered.
const HEARTBEAT_TIMEOUT_MIN: Duration = Duration::from_secs(1);

/// Who this broker is, for registration.
#[derive(Debug, Clone)]
pub struct BrokerIdentity {
    /// Its id.
    pub id: BrokerId,
    /// The address clients use.
    pub address: String,
    /// Its internal listener, where followers fetch.
    pub internal_address: String,
    /// Its Kafka listener's advertised address, if it serves one.
    pub kafka_address: Option<String>,
    /// Its rack.
    pub rack: Option<String>,
}

/// What [`ControllerLink::status`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkStatus {
    /// The controllers gave this process a broker epoch.
    pub registered: bool,
    /// The last heartbeat answer said fenced (true until the first says otherwise).
    pub fenced: bool,
    /// The metadata version this broker has applied.
    pub metadata_version: u64,
    /// The controllers' metadata version at the last heartbeat answer.
    pub controller_version: u64,
    /// False once the lease lapsed and no controller answers.
    pub controllers_reachable: bool,
}

/// The link between a broker and the controller quorum.
pub struct ControllerLink {
    client: ControllerClient,
    /// For heartbeats only: a short deadline, so an unreachable quorum is noticed within
    /// about two heartbeat intervals.
    heartbeat_client: ControllerClient,
    /// Whether the last heartbeat went unanswered (logged once per outage).
    unreachable: AtomicBool,
    identity: BrokerIdentity,
    incarnation_id: String,
    epoch: AtomicU64,
    fenced: AtomicBool,
    /// The controller's metadata version at the last heartbeat answer.
    controller_version: AtomicU64,
    heartbeat_interval: Duration,
    metadata: Arc<MetadataCache>,
    partitions: Arc<PartitionManager>,
    replicas: Arc<ReplicaManager>,
    lease: Arc<LeaderLease>,
    /// When open failures were last logged, and how many there were: repeated failures
    /// log one summary line at most every [`OPEN_FAILURE_LOG_INTERVAL`].
    open_failures_logged: parking_lot::Mutex<Option<(std::time::Instant, usize)>>,
}

/// Shortest pause between two summaries of the same number of partitions failing to open.
const OPEN_FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Whether to log `failed` open failures now, given the last summary (pure): when the
/// count changed, or the same count was last logged at least `interval` ago.
fn should_log_failures(
    last: Option<(std::time::Instant, usize)>,
    failed: usize,
    now: std::time::Instant,
    interval: Duration,
) -> bool {
    match last {
        _ if failed == 0 => false,
        Some((at, count)) => count != failed || now.duration_since(at) >= interval,
        None => true,
    }
}

impl ControllerLink {
    /// A link through the internal listeners of `controllers`, authenticated with
    /// `secret`. Metadata changes are applied to `partitions` (opened
    /// and deleted) and then to `replicas` (roles); heartbeat answers renew `lease`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        controllers: Vec<String>,
        secret: Arc<ClusterSecret>,
        identity: BrokerIdentity,
        heartbeat_interval: Duration,
        metadata: Arc<MetadataCache>,
        partitions: Arc<PartitionManager>,
        replicas: Arc<ReplicaManager>,
        lease: Arc<LeaderLease>,
    ) -> Self {
        let heartbeat_timeout = (heartbeat_interval * 2).max(HEARTBEAT_TIMEOUT_MIN);
        Self {
            heartbeat_client: ControllerClient::new(
                controllers.clone(),
                heartbeat_timeout,
                secret.clone(),
            ),
            unreachable: AtomicBool::new(false),
            client: ControllerClient::new(controllers, Duration::from_secs(10), secret),
            identity,
            incarnation_id: uuid::Uuid::new_v4().to_string(),
            epoch: AtomicU64::new(0),
            fenced: AtomicBool::new(true),
            controller_version: AtomicU64::new(0),
            heartbeat_interval,
            metadata,
            partitions,
            replicas,
            lease,
            open_failures_logged: parking_lot::Mutex::new(None),
        }
    }

    /// Whether the controller last answered that this broker is fenced.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::SeqCst)
    }

    /// Registration, fencing and metadata progress, for health probes.
    pub fn status(&self) -> LinkStatus {
        LinkStatus {
            registered: self.epoch.load(Ordering::SeqCst) > 0,
            fenced: self.is_fenced(),
            metadata_version: self.metadata.version(),
            controller_version: self.controller_version.load(Ordering::SeqCst),
            controllers_reachable: self.lease.controllers_reachable(),
        }
    }

    /// Registers, retrying until `deadline`. When another process holds this broker id,
    /// waits only as long as the controllers say its session can last (a crashed
    /// predecessor's session expires by then); a live holder is an error.
    pub async fn register(&self, deadline: Instant) -> Result<(), ClientError> {
        let mut duplicate_until: Option<Instant> = None;
        loop {
            let request = RegisterBrokerRequest {
                broker_id: self.identity.id.0,
                address: self.identity.address.clone(),
                internal_address: self.identity.internal_address.clone(),
                kafka_address: self.identity.kafka_address.clone(),
                rack: self.identity.rack.clone(),
                incarnation_id: self.incarnation_id.clone(),
            };
            match self.client.register_broker(request).await {
                Ok(r) => {
                    self.epoch.store(r.broker_epoch, Ordering::SeqCst);
                    tracing::info!(broker_id = %self.identity.id, epoch = r.broker_epoch, cluster_id = %r.cluster_id, "registered with the controllers");
                    return Ok(());
                }
                Err(e) if e.code == ErrorCode::DuplicateBrokerRegistration => {
                    let now = Instant::now();
                    let until = *duplicate_until.get_or_insert_with(|| {
                        let wait = e.retry_after.unwrap_or(DUPLICATE_WAIT_DEFAULT);
                        tracing::info!(error = %e.message, wait_ms = wait.as_millis() as u64, "another process holds this broker id; waiting for its session to expire");
                        now + wait + DUPLICATE_WAIT_SLACK
                    });
                    if now >= until.min(deadline) {
                        return Err(ClientError::new(
                            e.code,
                            format!(
                                "broker id {} is in use by another live process: {} (stop it, or give this broker another --broker-id)",
                                self.identity.id, e.message
                            ),
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) if e.is_retriable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Fetches metadata once (waiting up to `wait` for a change) and applies it.
    pub async fn poll_metadata(&self, wait: Duration) -> Result<(), ClientError> {
        let since = self.metadata.version();
        let response = self.client.fetch_metadata(since, wait).await?;
        if let Some(image) = &response.image {
            self.metadata
                .replace(convert::image_from_proto(image), response.version);
        } else if response.version > since || !response.changes.is_empty() {
            let changes = response
                .changes
                .iter()
                .filter_map(convert::change_from_proto)
                .collect();
            self.metadata.apply(changes, response.version);
        } else {
            return Ok(());
        }
        self.reconcile().await;
        Ok(())
    }

    /// Opens and deletes partitions to match the metadata.
    pub async fn reconcile(&self) {
        let metadata = self.metadata.clone();
        let partitions = self.partitions.clone();
        let failures = tokio::task::spawn_blocking(move || {
            // A copy: opening and deleting partitions must not hold the metadata lock,
            // which every request reads.
            let image = metadata.read(|image| image.clone());
            partitions.reconcile(&image)
        })
        .await
        .unwrap_or_default();
        // One summary line, not one per partition per metadata change: thousands of
        // partitions failing alike (no descriptors left) must not flood the log.
        let now = std::time::Instant::now();
        {
            let mut logged = self.open_failures_logged.lock();
            if should_log_failures(*logged, failures.len(), now, OPEN_FAILURE_LOG_INTERVAL) {
                let examples: Vec<&str> =
                    failures.iter().take(3).map(|(p, _)| p.as_str()).collect();
                tracing::error!(
                    failed = failures.len(),
                    examples = %examples.join(", "),
                    first_error = %failures[0].1,
                    "cannot open partitions (repeats at most every {}s while the count stays the same)",
                    OPEN_FAILURE_LOG_INTERVAL.as_secs()
                );
                *logged = Some((now, failures.len()));
            } else if failures.is_empty() {
                *logged = None;
            }
        }
        self.replicas.apply_metadata().await;
    }

    /// Asks the controllers to commit an ISR change; returns the partition as committed.
    pub async fn alter_partition(
        &self,
        change: &IsrChange,
    ) -> Result<PartitionRecord, ClientError> {
        let response = self
            .client
            .alter_partition(AlterPartitionRequest {
                broker_id: self.identity.id.0,
                broker_epoch: self.epoch.load(Ordering::SeqCst),
                topic: change.topic.clone(),
                topic_id: change.topic_id.clone(),
                partition: change.partition,
                leader_epoch: change.leader_epoch.0,
                partition_epoch: change.partition_epoch,
                new_isr: change.new_isr.iter().map(|b| b.0).collect(),
            })
            .await?;
        let Some(p) = response.partition else {
            return Err(ClientError::new(
                ErrorCode::UnknownServerError,
                "AlterPartition answered without the partition",
            ));
        };
        Ok(convert::partition_from_proto(&p))
    }

    async fn heartbeat(&self, want_shut_down: bool) -> Result<bool, ClientError> {
        let request = BrokerHeartbeatRequest {
            broker_id: self.identity.id.0,
            broker_epoch: self.epoch.load(Ordering::SeqCst),
            metadata_version: self.metadata.version(),
            want_fence: false,
            want_shut_down,
            offline_replicas: self
                .partitions
                .offline_replicas()
                .into_iter()
                .map(|(topic_id, partition)| OfflineReplica {
                    topic_id,
                    partition,
                })
                .collect(),
        };
        let sent_at = Instant::now();
        match self.heartbeat_client.heartbeat(request).await {
            Ok(r) => {
                if self.unreachable.swap(false, Ordering::SeqCst) {
                    tracing::info!("the controllers answer again");
                }
                self.lease.on_heartbeat(
                    sent_at,
                    r.fenced,
                    r.metadata_version,
                    Duration::from_millis(u64::from(r.session_timeout_ms)),
                );
                self.controller_version
                    .fetch_max(r.metadata_version, Ordering::SeqCst);
                if self.fenced.swap(r.fenced, Ordering::SeqCst) != r.fenced {
                    tracing::info!(fenced = r.fenced, "broker fencing state changed");
                }
                Ok(r.should_shut_down)
            }
            Err(e)
                if matches!(
                    e.code,
                    ErrorCode::StaleBrokerEpoch | ErrorCode::BrokerNotRegistered
                ) =>
            {
                tracing::warn!(error = %e, "registration lost; registering again");
                self.fenced.store(true, Ordering::SeqCst);
                self.lease.revoke();
                self.register(Instant::now() + Duration::from_secs(60))
                    .await?;
                Ok(false)
            }
            Err(e) => {
                // No controller answered: the lease decides what that means for writes.
                self.lease.on_heartbeat_unanswered(sent_at);
                if !self.unreachable.swap(true, Ordering::SeqCst) {
                    tracing::warn!(error = %e, "no controller answers heartbeats; partition leaders keep serving, metadata changes wait");
                }
                Err(e)
            }
        }
    }

    /// Keeps `blocks` stocked with producer ids reserved at the controllers until `cancel`.
    pub async fn run_producer_id_blocks(
        self: Arc<Self>,
        blocks: Arc<ProducerIdBlocks>,
        cancel: CancellationToken,
    ) {
        let mut failing = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = blocks.block_needed() => {}
            }
            let request = AllocateProducerIdsRequest {
                broker_id: self.identity.id.0,
                broker_epoch: self.epoch.load(Ordering::SeqCst),
                count: blocks.block_size(),
            };
            let result = tokio::select! {
                _ = cancel.cancelled() => return,
                r = self.client.allocate_producer_ids(request) => r,
            };
            match result {
                Ok(r) => {
                    failing = false;
                    tracing::debug!(
                        first = r.first_producer_id,
                        count = r.count,
                        "reserved producer ids"
                    );
                    blocks.add_block(r.first_producer_id, r.count);
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, remaining = blocks.remaining(), "cannot reserve producer ids; retrying");
                    }
                    failing = true;
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(PRODUCER_IDS_RETRY) => {}
                    }
                }
            }
        }
    }

    /// Heartbeats until the controllers unfence this broker (or `deadline`), then catches
    /// up with the leaderships that gave it, so it serves its partitions once ready.
    pub async fn wait_unfenced(&self, deadline: Instant) -> Result<(), ClientError> {
        loop {
            match self.heartbeat(false).await {
                Ok(_) if !self.is_fenced() => break,
                Err(e) if !e.is_retriable() || Instant::now() >= deadline => return Err(e),
                _ if Instant::now() >= deadline => {
                    return Err(ClientError::new(
                        ErrorCode::RequestTimedOut,
                        "the controllers did not unfence this broker in time",
                    ))
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let target = self.controller_version.load(Ordering::SeqCst);
        while self.metadata.version() < target && Instant::now() < deadline {
            self.poll_metadata(Duration::from_millis(500)).await?;
        }
        Ok(())
    }

    /// Heartbeats until `cancel`.
    pub async fn run_heartbeats(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            if let Err(e) = self.heartbeat(false).await {
                tracing::debug!(error = %e, "heartbeat failed");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.heartbeat_interval) => {}
            }
        }
    }

    /// Follows metadata until `cancel`.
    pub async fn run_metadata(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let poll = self.poll_metadata(METADATA_POLL_WAIT);
            let result = tokio::select! {
                _ = cancel.cancelled() => return,
                r = poll => r,
            };
            if let Err(e) = result {
                tracing::debug!(error = %e, "metadata fetch failed");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(METADATA_RETRY) => {}
                }
            }
        }
    }

    /// Asks the controllers to move this broker's leaderships away; returns once they
    /// agree (or after `timeout`).
    pub async fn controlled_shutdown(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match self.heartbeat(true).await {
                Ok(true) => {
                    tracing::info!("controlled shutdown granted: leaderships moved");
                    return;
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "controlled shutdown heartbeat failed"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tracing::warn!("controlled shutdown not confirmed in time; stopping anyway");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_failures_are_logged_when_their_count_changes_or_once_a_minute() {
        let t0 = std::time::Instant::now();
        let minute = Duration::from_secs(60);
        assert!(should_log_failures(None, 5_000, t0, minute));
        assert!(!should_log_failures(None, 0, t0, minute));
        let last = Some((t0, 5_000));
        assert!(!should_log_failures(
            last,
            5_000,
            t0 + Duration::from_secs(59),
            minute
        ));
        assert!(should_log_failures(last, 5_000, t0 + minute, minute));
        assert!(should_log_failures(
            last,
            4_999,
            t0 + Duration::from_secs(1),
            minute
        ));
    }
}
