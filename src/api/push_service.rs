//! `Broker.Subscribe`: push subscriptions over a bidirectional gRPC stream. The protocol
//! (start, credit, assignment changes, heartbeats) is translated to a
//! [`PushSession`]; see docs/api.md, "Push consumption".
//!
//! Two tasks serve a stream: one reads the client's messages (credit and assignment go
//! straight to the session's [`PushControl`]), the other runs the session's passes and
//! sends what they produce, with a heartbeat whenever an interval passes silently. The
//! stream ends when the client half-closes or goes away, breaks the protocol (a coded
//! error status), or says nothing for three heartbeat intervals.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::Stream;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Semaphore};
use tonic::{Status, Streaming};

use super::broker_service::{
    decode_records, parse_filter, read_committed_of, PARTITIONS_PER_REQUEST_MAX,
};
use super::proto::{
    subscribe_request, subscribe_response, FetchTopic, PushedPartitionError, PushedRecords,
    SubscribeHeartbeat, SubscribeRequest, SubscribeResponse, SubscribeStart,
};
use super::status::{error_status, to_wire};
use crate::broker::push::{
    PushControl, PushEvent, PushSession, PushWindow, HEARTBEAT_DEFAULT, HEARTBEAT_MAX,
    HEARTBEAT_MIN,
};
use crate::broker::{BrokerError, BrokerNode};
use crate::error_code::ErrorCode;

/// Most push subscriptions one broker serves at once.
pub const PUSH_SESSIONS_MAX: usize = 1024;
/// How long a new stream may take to send its SubscribeStart.
const START_WAIT: Duration = Duration::from_secs(10);
/// Pushed messages queued for the transport per stream.
const OUTBOUND_QUEUE: usize = 16;

/// The response stream of a subscription.
pub type PushStream = Pin<Box<dyn Stream<Item = Result<SubscribeResponse, Status>> + Send>>;

fn status_of(e: BrokerError) -> Status {
    error_status(e.code, e.message, None)
}

fn invalid(message: impl Into<String>) -> Status {
    error_status(ErrorCode::InvalidRequest, message, None)
}

/// A partition and the offset its stream starts at.
type Start = ((String, u32), u64);

/// The partitions and offsets of `topics`, checked.
fn positions_of(topics: &[FetchTopic]) -> Result<Vec<Start>, Status> {
    let count: usize = topics.iter().map(|t| t.partitions.len()).sum();
    if count > PARTITIONS_PER_REQUEST_MAX {
        return Err(invalid(format!(
            "a subscription names {count} partitions; at most {PARTITIONS_PER_REQUEST_MAX} per message"
        )));
    }
    let mut out = Vec::with_capacity(count);
    for t in topics {
        for p in &t.partitions {
            if p.fetch_offset < 0 {
                return Err(invalid(format!(
                    "{}-{}: fetch_offset must be >= 0, got {}",
                    t.topic, p.partition, p.fetch_offset
                )));
            }
            out.push(((t.topic.clone(), p.partition), p.fetch_offset as u64));
        }
    }
    Ok(out)
}

/// The start message's heartbeat interval, checked.
fn heartbeat_of(start: &SubscribeStart) -> Result<Duration, Status> {
    if start.heartbeat_interval_ms == 0 {
        return Ok(HEARTBEAT_DEFAULT);
    }
    let interval = Duration::from_millis(start.heartbeat_interval_ms.into());
    if !(HEARTBEAT_MIN..=HEARTBEAT_MAX).contains(&interval) {
        return Err(invalid(format!(
            "heartbeat_interval_ms must be {}..={}, got {}",
            HEARTBEAT_MIN.as_millis(),
            HEARTBEAT_MAX.as_millis(),
            start.heartbeat_interval_ms
        )));
    }
    Ok(interval)
}

/// Applies one client message after the start.
fn apply(control: &PushControl, message: SubscribeRequest) -> Result<(), Status> {
    use subscribe_request::Message;
    match message.message {
        Some(Message::Credit(c)) => control
            .give_back(c.records.into(), c.bytes)
            .map_err(status_of),
        Some(Message::Assign(a)) => {
            let positions = positions_of(&a.topics)?;
            let total = control.partition_count() + positions.len();
            if total > PARTITIONS_PER_REQUEST_MAX {
                return Err(invalid(format!(
                    "a subscription may hold at most {PARTITIONS_PER_REQUEST_MAX} partitions; this assign would make {total}"
                )));
            }
            control.assign(positions, a.assignment_id);
            Ok(())
        }
        Some(Message::Unassign(u)) => {
            let gone: Vec<(String, u32)> = u
                .topics
                .iter()
                .flat_map(|t| t.partitions.iter().map(|p| (t.topic.clone(), *p)))
                .collect();
            control.unassign(&gone);
            Ok(())
        }
        Some(Message::Heartbeat(_)) => Ok(()),
        Some(Message::Start(_)) => Err(invalid("a subscription has one SubscribeStart, first")),
        None => Err(invalid("empty SubscribeRequest")),
    }
}

/// A push that could not be encoded: the error to send instead, and what to undo.
struct Undelivered {
    response: SubscribeResponse,
    partition: (String, u32),
    assignment: u64,
    records: u64,
    bytes: u64,
}

/// The wire form of one pass's event.
fn to_proto(event: PushEvent, raw: bool) -> Result<SubscribeResponse, Box<Undelivered>> {
    use subscribe_response::Message;
    let message = match event {
        PushEvent::Records {
            topic,
            partition,
            batches,
            records,
            from,
            next_offset,
            high_watermark,
            assignment,
        } => {
            let decoded = if raw || batches.is_empty() {
                Ok(Vec::new())
            } else {
                decode_records(&batches, from, &Default::default())
            };
            match decoded {
                Ok(decoded) => Message::Records(PushedRecords {
                    topic,
                    partition,
                    records: decoded,
                    window_bytes: batches.len() as u64,
                    record_batches: if raw { batches } else { Default::default() },
                    next_fetch_offset: next_offset as i64,
                    high_watermark: high_watermark.as_i64(),
                    record_count: records as u32,
                    assignment_id: assignment,
                }),
                Err(e) => {
                    let response = SubscribeResponse {
                        message: Some(Message::PartitionError(partition_error(
                            topic.clone(),
                            partition,
                            e,
                            assignment,
                        ))),
                    };
                    return Err(Box::new(Undelivered {
                        response,
                        partition: (topic, partition),
                        assignment,
                        records,
                        bytes: batches.len() as u64,
                    }));
                }
            }
        }
        PushEvent::Failed {
            topic,
            partition,
            error,
            assignment,
        } => Message::PartitionError(partition_error(topic, partition, error, assignment)),
    };
    Ok(SubscribeResponse {
        message: Some(message),
    })
}

fn partition_error(
    topic: String,
    partition: u32,
    e: BrokerError,
    assignment: u64,
) -> PushedPartitionError {
    let (leader_id, leader_address) = match e.leader {
        Some((id, address)) => (Some(id.0), Some(address)),
        None => (None, None),
    };
    PushedPartitionError {
        topic,
        partition,
        error_code: to_wire(e.code),
        error_message: e.message,
        leader_id,
        leader_address,
        assignment_id: assignment,
    }
}

/// Serves one Subscribe call: reads its start message, then runs the session until the
/// stream ends.
pub async fn subscribe(
    node: BrokerNode,
    sessions: Arc<Semaphore>,
    mut inbound: Streaming<SubscribeRequest>,
) -> Result<PushStream, Status> {
    let first = tokio::time::timeout(START_WAIT, inbound.message())
        .await
        .map_err(|_| {
            error_status(
                ErrorCode::RequestTimedOut,
                format!("no SubscribeStart within {} s", START_WAIT.as_secs()),
                None,
            )
        })??;
    let start = match first.and_then(|m| m.message) {
        Some(subscribe_request::Message::Start(s)) => s,
        _ => {
            return Err(invalid(
                "the first message of a subscription must be a SubscribeStart",
            ))
        }
    };
    let window = PushWindow::new(start.window_records, start.window_bytes).map_err(status_of)?;
    let filter = parse_filter(start.filter.as_ref())?;
    let heartbeat = heartbeat_of(&start)?;
    let positions = positions_of(&start.topics)?;
    let raw = start.raw_batches;
    let read_committed = read_committed_of("SubscribeStart", start.isolation)?;
    // Taken once the start is valid, so clients slow to open cannot hold the slots.
    let permit = sessions.try_acquire_owned().map_err(|_| {
        error_status(
            ErrorCode::PushSessionLimitExceeded,
            format!("this broker serves {PUSH_SESSIONS_MAX} push subscriptions already"),
            None,
        )
    })?;
    let (mut session, control) = PushSession::new(node, window, filter, read_committed);
    control.assign(positions, start.assignment_id);

    let (tx, rx) = mpsc::channel::<Result<SubscribeResponse, Status>>(OUTBOUND_QUEUE);
    let last_heard = Arc::new(Mutex::new(Instant::now()));
    let writer_control = control.clone();
    let reader = {
        let tx = tx.clone();
        let last_heard = last_heard.clone();
        tokio::spawn(async move {
            // Ends on the client's half-close, a broken transport, or a protocol error.
            while let Ok(Some(message)) = inbound.message().await {
                *last_heard.lock() = Instant::now();
                if let Err(status) = apply(&control, message) {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            }
        })
    };
    tokio::spawn(async move {
        let _permit = permit;
        let silence_max = heartbeat * 3;
        let mut last_sent = Instant::now();
        'serve: loop {
            if reader.is_finished() {
                break;
            }
            if last_heard.lock().elapsed() > silence_max {
                let status = error_status(
                    ErrorCode::RequestTimedOut,
                    format!(
                        "no message from the client in {} ms (3 heartbeat intervals)",
                        silence_max.as_millis()
                    ),
                    None,
                );
                let _ = tx.send_timeout(Err(status), silence_max).await;
                break;
            }
            let events = tokio::select! {
                events = session.next(heartbeat) => events,
                _ = tx.closed() => break,
            };
            for event in events {
                let response = to_proto(event, raw).unwrap_or_else(|u| {
                    writer_control.fail(&u.partition, u.assignment, u.records, u.bytes);
                    u.response
                });
                // A client that reads nothing for 3 heartbeat intervals is gone.
                if tx.send_timeout(Ok(response), silence_max).await.is_err() {
                    break 'serve;
                }
                last_sent = Instant::now();
            }
            if last_sent.elapsed() >= heartbeat {
                let beat = SubscribeResponse {
                    message: Some(subscribe_response::Message::Heartbeat(
                        SubscribeHeartbeat {},
                    )),
                };
                if tx.send_timeout(Ok(beat), silence_max).await.is_err() {
                    break;
                }
                last_sent = Instant::now();
            }
        }
        reader.abort();
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    Ok(Box::pin(stream))
}
