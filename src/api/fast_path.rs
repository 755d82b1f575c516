//! Produce and Fetch without tonic's copies of their record batches.
//!
//! [`FastPath`] wraps the tonic Broker service and answers its two data calls itself
//! (`net::grpc_pieces` explains the copies it saves):
//! - **Produce**: the request is decoded from its HTTP/2 frames in place, so each
//!   partition's `record_batches` is a slice of the frame it arrived in rather than of a
//!   buffer the frames were first copied into.
//! - **Fetch**: the answer goes out in pieces, each partition's `record_batches` (read
//!   from the log) a piece of its own that HTTP/2 writes to the socket as it is.
//! - **Subscribe**: each pushed message's `record_batches` likewise.
//!
//! All three build the very messages the tonic handlers do
//! ([`BrokerService::produce_response`], [`BrokerService::fetch_response`],
//! [`BrokerService::subscribe_stream`]); errors are answered with the codes tonic gives
//! (refusals before the handler get their tidelog code from `CodeLayer`, as tonic's
//! did). Every other method goes to tonic.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use prost::Message;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::Status;
use tower::Service;

use super::broker_service::BrokerService;
use super::proto::subscribe_response::Message as Pushed;
use super::proto::{
    SubscribeRequest, SubscribeResponse, FETCH_PATH, FETCH_RESPONSE, PRODUCE_PATH, SUBSCRIBE_PATH,
};
use crate::net::grpc_pieces::{
    decode_unary, encode_nested, encode_whole, encode_wrapped, read_body, PiecesBody, StreamBody,
};

/// Field numbers of `SubscribeResponse.records` and `PushedRecords.record_batches`
/// (proto/tidelog/v1/broker.proto).
const SUBSCRIBE_RECORDS: u32 = 1;
const PUSHED_RECORD_BATCHES: u32 = 4;

/// A pushed message as one gRPC message in pieces, its record batches a piece of their
/// own (pure).
pub fn pushed_pieces(message: SubscribeResponse) -> Vec<Bytes> {
    match message.message {
        Some(Pushed::Records(mut records)) => {
            let batches = std::mem::take(&mut records.record_batches);
            encode_wrapped(
                &[SUBSCRIBE_RECORDS],
                &records,
                PUSHED_RECORD_BATCHES,
                batches,
            )
        }
        other => vec![encode_whole(&SubscribeResponse { message: other })],
    }
}

/// The Broker service with Produce and Fetch answered here; every other method (and
/// anything else on the Broker path) goes to `inner`, the tonic service.
#[derive(Clone)]
pub struct FastPath<S> {
    inner: S,
    service: Arc<BrokerService>,
    /// Largest request message accepted (the server's `max_request_bytes`).
    request_bytes_max: usize,
    /// Largest response message sent.
    response_bytes_max: usize,
}

impl<S> FastPath<S> {
    /// Wraps `inner`, the tonic server of `service`, with its message limits.
    pub fn new(
        inner: S,
        service: Arc<BrokerService>,
        request_bytes_max: usize,
        response_bytes_max: usize,
    ) -> Self {
        Self {
            inner,
            service,
            request_bytes_max,
            // Below what a gRPC prefix can declare, so encoding never meets a larger one.
            response_bytes_max: response_bytes_max.min(u32::MAX as usize),
        }
    }
}

impl<S: NamedService> NamedService for FastPath<S> {
    const NAME: &'static str = S::NAME;
}

type Answer =
    Pin<Box<dyn std::future::Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<S> Service<http::Request<Body>> for FastPath<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Answer;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Answer {
        let service = self.service.clone();
        let limits = (self.request_bytes_max, self.response_bytes_max);
        let answer = match request.uri().path() {
            PRODUCE_PATH => Box::pin(async move {
                let (request_max, response_max) = limits;
                let request = read_request(request, request_max).await?;
                let response = service.produce_response(request).await?;
                check_size(response.encoded_len(), response_max)?;
                Ok(ok_response(vec![encode_whole(&response)]))
            }) as Pin<Box<dyn std::future::Future<Output = _> + Send>>,
            FETCH_PATH => Box::pin(async move {
                let (request_max, response_max) = limits;
                let request = read_request(request, request_max).await?;
                let response = service.fetch_response(request).await?;
                check_size(response.encoded_len(), response_max)?;
                Ok(ok_response(encode_nested(response, &FETCH_RESPONSE)))
            }),
            SUBSCRIBE_PATH => Box::pin(async move {
                let (request_max, response_max) = limits;
                check_identity(&request)?;
                let inbound = tonic::codec::Streaming::new_request(
                    tonic_prost::ProstDecoder::<SubscribeRequest>::default(),
                    request.into_body(),
                    None,
                    Some(request_max),
                );
                let pushed = service.subscribe_stream(inbound).await?;
                // A message above the limit ends the stream with its status, as tonic's
                // encoder did.
                let body = StreamBody::new(futures_util::StreamExt::map(pushed, move |m| {
                    let m = m?;
                    check_size(m.encoded_len(), response_max)?;
                    Ok(pushed_pieces(m))
                }));
                Ok(grpc_response(Body::new(body)))
            }),
            _ => return Box::pin(self.inner.call(request)),
        };
        Box::pin(async move { Ok(answer.await.unwrap_or_else(Status::into_http)) })
    }
}

/// The request message of a unary call, decoded from its frames in place.
async fn read_request<M: prost::Message + Default>(
    request: http::Request<Body>,
    message_max: usize,
) -> Result<M, Status> {
    check_identity(&request)?;
    let (frames, _trailers) = read_body(request.into_body(), message_max).await?;
    decode_unary(frames, message_max)
}

/// Refuses a compressed request as tonic does: this server accepts no compression.
fn check_identity(request: &http::Request<Body>) -> Result<(), Status> {
    match request.headers().get("grpc-encoding") {
        Some(encoding) if encoding != "identity" => {
            let mut status = Status::unimplemented(format!(
                "Content is compressed with `{}` which isn't supported",
                encoding.to_str().unwrap_or("?")
            ));
            status
                .metadata_mut()
                .insert("grpc-accept-encoding", "identity".parse().expect("ASCII"));
            Err(status)
        }
        _ => Ok(()),
    }
}

/// Refuses a message of `len` bytes above `max`, before it is encoded.
fn check_size(len: usize, max: usize) -> Result<(), Status> {
    if len > max {
        return Err(Status::out_of_range(format!(
            "Error, encoded message length too large: found {len} bytes, the limit is: {max} bytes"
        )));
    }
    Ok(())
}

/// A successful unary answer of `pieces`.
fn ok_response(pieces: Vec<Bytes>) -> http::Response<Body> {
    grpc_response(Body::new(PiecesBody::ok_response(pieces)))
}

/// A gRPC response of `body`.
fn grpc_response(body: Body) -> http::Response<Body> {
    http::Response::builder()
        .header("content-type", "application/grpc")
        .body(body)
        .expect("static headers are valid")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::proto::broker_server::BrokerServer;
    use crate::api::proto::{
        AbortedTransaction, ConsumedRecord, FetchPartitionResponse, FetchResponse,
        FetchTopicResponse, Header, PartitionProduceData, ProduceRequest, TopicProduceData,
        PRODUCE_REQUEST,
    };
    use crate::net::grpc_pieces::{Frames, GRPC_HEADER_LEN};
    use proptest::prelude::*;
    use prost::Message;

    #[test]
    fn the_paths_are_the_broker_services() {
        let name = <BrokerServer<BrokerService> as NamedService>::NAME;
        assert_eq!(FETCH_PATH, format!("/{name}/Fetch"));
        assert_eq!(PRODUCE_PATH, format!("/{name}/Produce"));
        assert_eq!(SUBSCRIBE_PATH, format!("/{name}/Subscribe"));
    }

    #[test]
    fn compressed_requests_and_oversized_answers_are_refused_as_tonic_does() {
        let request = |encoding: Option<&str>| {
            let mut r = http::Request::builder().uri(FETCH_PATH);
            if let Some(e) = encoding {
                r = r.header("grpc-encoding", e);
            }
            r.body(Body::empty()).unwrap()
        };
        assert!(check_identity(&request(None)).is_ok());
        assert!(check_identity(&request(Some("identity"))).is_ok());
        let refused = check_identity(&request(Some("gzip"))).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unimplemented);
        assert_eq!(
            refused.metadata().get("grpc-accept-encoding").unwrap(),
            "identity"
        );
        assert!(check_size(100, 100).is_ok());
        let too_large = check_size(101, 100).unwrap_err();
        assert_eq!(too_large.code(), tonic::Code::OutOfRange);
        assert!(
            too_large.message().contains("101"),
            "{}",
            too_large.message()
        );
    }

    /// Record batches of lengths around the size from which they travel as pieces.
    fn batches() -> impl Strategy<Value = Bytes> {
        prop::sample::select(vec![0usize, 1, 100, 4095, 4096, 70_000])
            .prop_map(|len| Bytes::from((0..len).map(|i| i as u8).collect::<Vec<u8>>()))
    }

    fn fetch_partition() -> impl Strategy<Value = FetchPartitionResponse> {
        (
            any::<u32>(),
            any::<i64>(),
            "[a-z]{0,8}",
            prop::collection::vec(any::<u8>(), 0..3),
            batches(),
            prop::option::of(any::<i32>()),
            prop::collection::vec((any::<i64>(), any::<i64>()), 0..3),
        )
            .prop_map(|(partition, hw, message, keys, batches, leader, aborted)| {
                FetchPartitionResponse {
                    partition,
                    error_code: 0,
                    error_message: message,
                    high_watermark: hw,
                    log_start_offset: hw / 2,
                    log_end_offset: hw.saturating_add(1),
                    records: keys
                        .into_iter()
                        .map(|k| ConsumedRecord {
                            offset: k.into(),
                            key: Some(Bytes::from(vec![k; 3])),
                            headers: vec![Header {
                                key: "h".into(),
                                value: Some(Bytes::from_static(b"v")),
                            }],
                            ..Default::default()
                        })
                        .collect(),
                    record_batches: batches,
                    leader_id: leader,
                    leader_address: leader.map(|l| format!("127.0.0.1:{l}")),
                    next_fetch_offset: hw,
                    last_stable_offset: hw,
                    aborted_transactions: aborted
                        .into_iter()
                        .map(|(p, o)| AbortedTransaction {
                            producer_id: p,
                            first_offset: o,
                            last_offset: o,
                        })
                        .collect(),
                }
            })
    }

    fn fetch_response() -> impl Strategy<Value = FetchResponse> {
        prop::collection::vec(
            (
                "[a-z.]{0,12}",
                prop::collection::vec(fetch_partition(), 0..4),
            ),
            0..4,
        )
        .prop_map(|topics| FetchResponse {
            topics: topics
                .into_iter()
                .map(|(topic, partitions)| FetchTopicResponse { topic, partitions })
                .collect(),
        })
    }

    fn produce_request() -> impl Strategy<Value = ProduceRequest> {
        (
            prop::option::of(-1i32..2),
            any::<u32>(),
            prop::option::of("[a-z]{1,8}"),
            prop::collection::vec(
                (
                    "[a-z]{0,8}",
                    prop::collection::vec((any::<u32>(), batches(), 0i32..5), 0..4),
                ),
                0..3,
            ),
        )
            .prop_map(
                |(acks, timeout_ms, transactional_id, topics)| ProduceRequest {
                    acks,
                    timeout_ms,
                    transactional_id,
                    topics: topics
                        .into_iter()
                        .map(|(topic, partitions)| TopicProduceData {
                            topic,
                            partitions: partitions
                                .into_iter()
                                .map(|(partition, record_batches, compression)| {
                                    PartitionProduceData {
                                        partition,
                                        records: Vec::new(),
                                        record_batches,
                                        compression,
                                    }
                                })
                                .collect(),
                        })
                        .collect(),
                },
            )
    }

    /// `pieces` are one gRPC message of `m`'s length that decodes to `m`, whole and from
    /// frames cut anywhere, and each of `large` (batches of 4 KiB or more) is a piece of
    /// its own, not a copy.
    fn check_pieces<M: Message + Default + PartialEq + std::fmt::Debug>(
        m: &M,
        pieces: &[Bytes],
        large: Vec<Bytes>,
        cuts: &[prop::sample::Index],
    ) -> Result<(), TestCaseError> {
        let whole: Vec<u8> = pieces.iter().flat_map(|p| p.iter().copied()).collect();
        prop_assert_eq!(whole[0], 0);
        let len = u32::from_be_bytes(whole[1..5].try_into().unwrap()) as usize;
        prop_assert_eq!(len, whole.len() - GRPC_HEADER_LEN);
        prop_assert_eq!(len, m.encoded_len());
        prop_assert_eq!(&M::decode(&whole[GRPC_HEADER_LEN..]).unwrap(), m);
        for b in large.into_iter().filter(|b| b.len() >= 4096) {
            prop_assert!(
                pieces
                    .iter()
                    .any(|p| p.as_ptr() == b.as_ptr() && p.len() == b.len()),
                "a field of {} bytes was copied",
                b.len()
            );
        }
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(whole.len() + 1)).collect();
        at.extend([0, whole.len()]);
        at.sort_unstable();
        let mut frames = Frames::default();
        for w in at.windows(2) {
            frames.push(Bytes::copy_from_slice(&whole[w[0]..w[1]]));
        }
        prop_assert_eq!(&decode_unary::<M>(frames, 1 << 24).unwrap(), m);
        Ok(())
    }

    fn pushed() -> impl Strategy<Value = SubscribeResponse> {
        use crate::api::proto::{PushedPartitionError, PushedRecords, SubscribeHeartbeat};
        prop_oneof![
            (
                any::<u32>(),
                batches(),
                any::<i64>(),
                any::<u64>(),
                prop::collection::vec(any::<u8>(), 0..2)
            )
                .prop_map(|(partition, record_batches, offset, window_bytes, keys)| {
                    SubscribeResponse {
                        message: Some(Pushed::Records(PushedRecords {
                            topic: "t".into(),
                            partition,
                            records: keys
                                .into_iter()
                                .map(|k| ConsumedRecord {
                                    offset: k.into(),
                                    ..Default::default()
                                })
                                .collect(),
                            record_batches,
                            next_fetch_offset: offset,
                            high_watermark: offset,
                            record_count: partition,
                            window_bytes,
                            assignment_id: window_bytes,
                        })),
                    }
                }),
            any::<u32>().prop_map(|partition| SubscribeResponse {
                message: Some(Pushed::PartitionError(PushedPartitionError {
                    topic: "t".into(),
                    partition,
                    ..Default::default()
                })),
            }),
            Just(SubscribeResponse {
                message: Some(Pushed::Heartbeat(SubscribeHeartbeat::default())),
            }),
            Just(SubscribeResponse { message: None }),
        ]
    }

    proptest! {
        #[test]
        fn pushed_messages_in_pieces_decode_to_the_message(
            m in pushed(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let large = match &m.message {
                Some(Pushed::Records(r)) => vec![r.record_batches.clone()],
                _ => Vec::new(),
            };
            let pieces = pushed_pieces(m.clone());
            check_pieces(&m, &pieces, large, &cuts)?;
        }

        #[test]
        fn fetch_answers_in_pieces_decode_to_the_answer(
            r in fetch_response(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let large = r.topics.iter().flat_map(|t| &t.partitions).map(|p| p.record_batches.clone()).collect();
            let pieces = encode_nested(r.clone(), &FETCH_RESPONSE);
            check_pieces(&r, &pieces, large, &cuts)?;
        }

        #[test]
        fn produce_requests_in_pieces_decode_to_the_request(
            r in produce_request(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let large = r.topics.iter().flat_map(|t| &t.partitions).map(|p| p.record_batches.clone()).collect();
            let pieces = encode_nested(r.clone(), &PRODUCE_REQUEST);
            check_pieces(&r, &pieces, large, &cuts)?;
        }
    }
}
