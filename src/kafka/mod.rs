//! Kafka's binary protocol: the second front door onto the broker (DESIGN §2).
//!
//! [`serve`] accepts connections on the Kafka listener; [`connection`] reads size-prefixed
//! frames, answers pipelined requests in order and closes a connection on any malformed
//! frame; [`frame`] parses and encodes with the `kafka-protocol` crate's codecs. One file
//! per API family maps Kafka messages onto the same [`BrokerNode`] operations (and, for
//! topic administration, the same Admin service) that the gRPC API uses, so both doors
//! share validation, logs and errors; [`errors`] is the one table from tidelog's error
//! codes to Kafka's. Record batches pass through unchanged: produced bytes go to the
//! append path (which validates them as it does gRPC pre-encoded batches) and fetches
//! return the stored bytes.
//!
//! No logic of its own lives here beyond translating messages: anything a Kafka client can
//! do, a gRPC client can do with the same outcome.

pub mod admin;
pub mod alloc_guard;
pub mod api_versions;
pub mod cluster_admin;
pub mod connection;
pub mod errors;
pub mod fetch;
pub mod frame;
pub mod groups;
pub mod metadata;
pub mod offsets;
pub mod produce;
pub mod txn;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::api::broker_admin_service::BrokerAdminService;
use crate::api::groups_service::GroupsService;
use crate::api::txn_service::TxnService;
use crate::broker::BrokerNode;
use crate::net::LogLimiter;

/// Limits of the Kafka listener.
#[derive(Debug, Clone, Copy)]
pub struct KafkaLimits {
    /// Largest request frame (Kafka's `socket.request.max.bytes`).
    pub request_bytes_max: usize,
    /// A connection with no request for this long (and none in flight) is closed.
    pub idle_timeout: Duration,
    /// Most connections open at once.
    pub connections_max: usize,
}

/// Requests read ahead on one connection while earlier ones are still being answered:
/// bounds the memory one connection holds (at most this many request frames).
pub const IN_FLIGHT_PER_CONNECTION_MAX: usize = 16;

/// What the API handlers need: the broker, the Admin service for topic changes, the
/// Groups service (coordinator lookup and the coordinator), and whether Metadata may
/// create topics.
pub struct KafkaHandler {
    /// The broker's request handling.
    pub node: BrokerNode,
    /// The Groups service gRPC clients call (same coordinator, same offsets).
    pub groups: GroupsService,
    /// The Transactions service gRPC clients call (coordinator lookup and the
    /// coordinator).
    pub txns: TxnService,
    /// The Admin service gRPC clients call (same validation and forwarding).
    pub admin: BrokerAdminService,
    /// `auto_create_topics_enable`.
    pub auto_create: bool,
}

/// Accepts Kafka connections on `listener` until `cancel`, each served by
/// [`connection::serve_connection`] in a task owned by `tasks`.
pub async fn serve(
    listener: TcpListener,
    handler: Arc<KafkaHandler>,
    limits: KafkaLimits,
    tasks: TaskTracker,
    cancel: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.connections_max.max(1)));
    let logs = Arc::new(LogLimiter::default());
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                if logs.allow("kafka-accept-error") {
                    tracing::warn!(error = %e, "Kafka listener: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            if logs.allow("kafka-limit") {
                tracing::warn!(
                    limit = limits.connections_max,
                    "Kafka listener: connection limit reached; closing new connections"
                );
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (handler, logs, cancel) = (handler.clone(), logs.clone(), cancel.clone());
        tasks.spawn(async move {
            let _permit = permit;
            connection::serve_connection(stream, peer, handler, limits, logs, cancel).await;
        });
    }
}
