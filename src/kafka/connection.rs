//! One Kafka connection: frames are read ahead (at most
//! [`IN_FLIGHT_PER_CONNECTION_MAX`](super::IN_FLIGHT_PER_CONNECTION_MAX) at once), handled
//! concurrently and answered strictly in request order, as Kafka clients require. A frame
//! above the size limit, a size prefix that lies (the stream ends inside the frame), an
//! unknown API or version, or a body that does not decode closes the connection with one
//! rate-limited log line; other connections are untouched. A connection with nothing in
//! flight and no request for the idle timeout is closed.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::{FuturesOrdered, StreamExt};
use kafka_protocol::messages::ApiKey;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::codec::{FramedRead, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use super::frame::{encode_response, parse_request, Body, Request};
use super::{api_versions, KafkaHandler, KafkaLimits, IN_FLIGHT_PER_CONNECTION_MAX};
use crate::net::LogLimiter;

type Pending = Pin<Box<dyn Future<Output = anyhow::Result<Option<Bytes>>> + Send>>;

/// Serves `stream` until the peer closes it, a frame is bad, or `cancel`.
pub async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    handler: Arc<KafkaHandler>,
    limits: KafkaLimits,
    logs: Arc<LogLimiter>,
    cancel: CancellationToken,
) {
    let (read, mut write) = stream.into_split();
    let codec = LengthDelimitedCodec::builder()
        .length_field_length(4)
        .max_frame_length(limits.request_bytes_max)
        .new_codec();
    let mut frames = FramedRead::new(read, codec);
    let mut in_flight: FuturesOrdered<Pending> = FuturesOrdered::new();
    let close = |why: String| {
        if logs.allow(&format!("kafka {}", peer.ip())) {
            tracing::warn!(%peer, "closing Kafka connection: {why}");
        }
    };
    loop {
        let idle = in_flight.is_empty();
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(limits.idle_timeout), if idle => {
                tracing::debug!(%peer, "closing idle Kafka connection");
                return;
            }
            done = in_flight.next(), if !idle => {
                match done {
                    Some(Ok(Some(response))) => {
                        if let Err(e) = write.write_all(&response).await {
                            tracing::debug!(%peer, error = %e, "Kafka connection: write failed");
                            return;
                        }
                    }
                    Some(Ok(None)) | None => {}
                    Some(Err(e)) => {
                        close(format!("cannot answer: {e:#}"));
                        return;
                    }
                }
            }
            frame = frames.next(), if in_flight.len() < IN_FLIGHT_PER_CONNECTION_MAX => {
                let frame = match frame {
                    None => return,
                    Some(Err(e)) => {
                        close(format!("bad frame (limit {} bytes): {e}", limits.request_bytes_max));
                        return;
                    }
                    Some(Ok(frame)) => frame.freeze(),
                };
                match parse_request(frame) {
                    Ok(request) => in_flight.push_back(Box::pin(handle(handler.clone(), request, peer))),
                    Err(e) => {
                        close(e.to_string());
                        return;
                    }
                }
            }
        }
    }
}

/// Answers one request: the encoded response frame, or `None` when Kafka sends none
/// (a produce with acks=0).
async fn handle(
    handler: Arc<KafkaHandler>,
    request: Request,
    peer: SocketAddr,
) -> anyhow::Result<Option<Bytes>> {
    let (header, api, body) = match request {
        Request::ApiVersionsTooNew { correlation_id } => {
            let body = api_versions::api_versions(
                kafka_protocol::error::ResponseError::UnsupportedVersion.code(),
            );
            return encode_response(ApiKey::ApiVersions, 0, correlation_id, &body).map(Some);
        }
        Request::Served { header, api, body } => (header, api, body),
    };
    let (version, id) = (header.request_api_version, header.correlation_id);
    let client = header
        .client_id
        .as_ref()
        .map(|c| c.to_string())
        .unwrap_or_default();
    let started = std::time::Instant::now();
    let labels = [
        ("protocol", "kafka".to_owned()),
        ("api", format!("{api:?}")),
    ];
    let h = &*handler;
    let encoded = match *body {
        Body::ApiVersions(_) => encode_response(api, version, id, &api_versions::api_versions(0)),
        Body::SaslHandshake(_) => {
            encode_response(api, version, id, &api_versions::sasl_handshake())
        }
        Body::Metadata(r) => encode_response(api, version, id, &h.metadata(r, version).await),
        Body::Produce(r) => match h.produce(r).await {
            Some(response) => encode_response(api, version, id, &response),
            None => {
                // acks=0: no answer, but the request counts.
                metrics::counter!("tidelog_requests_total", &labels).increment(1);
                return Ok(None);
            }
        },
        Body::Fetch(r) => encode_response(api, version, id, &h.fetch(r, version).await),
        Body::ListOffsets(r) => encode_response(api, version, id, &h.list_offsets(r).await),
        Body::OffsetForLeaderEpoch(r) => {
            encode_response(api, version, id, &h.offset_for_leader_epoch(r))
        }
        Body::InitProducerId(r) => encode_response(api, version, id, &h.init_producer_id(r).await),
        Body::CreateTopics(r) => encode_response(api, version, id, &h.create_topics(r).await),
        Body::DeleteTopics(r) => {
            encode_response(api, version, id, &h.delete_topics(r, version).await)
        }
        Body::CreatePartitions(r) => {
            encode_response(api, version, id, &h.create_partitions(r).await)
        }
        Body::DescribeConfigs(r) => encode_response(api, version, id, &h.describe_configs(r)),
        Body::FindCoordinator(r) => {
            encode_response(api, version, id, &h.find_coordinator(r, version).await)
        }
        Body::JoinGroup(r) => {
            let answer = h.join_group(r, version, &client, peer).await;
            encode_response(api, version, id, &answer)
        }
        Body::SyncGroup(r) => encode_response(api, version, id, &h.sync_group(r).await),
        Body::Heartbeat(r) => encode_response(api, version, id, &h.heartbeat(r).await),
        Body::LeaveGroup(r) => encode_response(api, version, id, &h.leave_group(r, version).await),
        Body::OffsetCommit(r) => encode_response(api, version, id, &h.offset_commit(r).await),
        Body::OffsetFetch(r) => {
            encode_response(api, version, id, &h.offset_fetch(r, version).await)
        }
        Body::OffsetDelete(r) => encode_response(api, version, id, &h.offset_delete(r).await),
        Body::DescribeGroups(r) => encode_response(api, version, id, &h.describe_groups(r).await),
        Body::ListGroups(r) => encode_response(api, version, id, &h.list_groups(r).await),
        Body::DeleteGroups(r) => encode_response(api, version, id, &h.delete_groups(r).await),
        Body::ConsumerGroupHeartbeat(r) => {
            let answer = h.consumer_group_heartbeat(r, &client).await;
            encode_response(api, version, id, &answer)
        }
        Body::IncrementalAlterConfigs(r) => {
            encode_response(api, version, id, &h.incremental_alter_configs(r).await)
        }
        Body::AlterConfigs(r) => encode_response(api, version, id, &h.alter_configs(r).await),
        Body::DescribeCluster(r) => encode_response(api, version, id, &h.describe_cluster(r)),
        Body::ElectLeaders(r) => encode_response(api, version, id, &h.elect_leaders(r).await),
        Body::AlterPartitionReassignments(r) => {
            encode_response(api, version, id, &h.alter_partition_reassignments(r).await)
        }
        Body::ListPartitionReassignments(r) => {
            encode_response(api, version, id, &h.list_partition_reassignments(r))
        }
        Body::DeleteRecords(r) => encode_response(api, version, id, &h.delete_records(r).await),
        Body::ConsumerGroupDescribe(r) => {
            encode_response(api, version, id, &h.consumer_group_describe(r).await)
        }
        Body::AddPartitionsToTxn(r) => {
            encode_response(api, version, id, &h.add_partitions_to_txn(r).await)
        }
        Body::AddOffsetsToTxn(r) => {
            encode_response(api, version, id, &h.add_offsets_to_txn(r).await)
        }
        Body::EndTxn(r) => encode_response(api, version, id, &h.end_txn(r).await),
        Body::TxnOffsetCommit(r) => {
            encode_response(api, version, id, &h.txn_offset_commit(r).await)
        }
        Body::DescribeTransactions(r) => {
            encode_response(api, version, id, &h.describe_transactions(r).await)
        }
        Body::ListTransactions(r) => {
            encode_response(api, version, id, &h.list_transactions(r).await)
        }
    };
    metrics::counter!("tidelog_requests_total", &labels).increment(1);
    metrics::histogram!("tidelog_request_duration_seconds", &labels)
        .record(started.elapsed().as_secs_f64());
    encoded.map(Some)
}
