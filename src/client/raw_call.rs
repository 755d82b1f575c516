//! Produce and Fetch calls made by hand over the channel, without tonic's copies of
//! their record batches (`net::grpc_pieces` explains the copies saved):
//! - [`produce`] sends each partition's `record_batches` as a body piece of its own,
//!   straight from the producer's batch buffer;
//! - [`fetch`] decodes the answer from its HTTP/2 frames in place, so `record_batches`
//!   is a slice of the frame it arrived in.
//!
//! The requests and answers are the messages tonic would send and receive, so any broker
//! version serves them; errors are the statuses tonic's client would give.

use bytes::Bytes;
use prost::Message;
use tonic::codegen::http;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tower::{Service, ServiceExt};

use crate::api::proto::{
    FetchRequest, FetchResponse, ProduceRequest, ProduceResponse, FETCH_PATH, PRODUCE_PATH,
    PRODUCE_REQUEST,
};
use crate::net::grpc_pieces::{decode_unary, encode_nested, encode_whole, read_body, PiecesBody};

/// Largest produce answer accepted (a status per partition, at most 1,000 partitions).
const PRODUCE_RESPONSE_BYTES_MAX: usize = 4 * 1024 * 1024;

/// Sends `request` to the broker behind `channel`, its batches as pieces of their own.
pub async fn produce(channel: Channel, request: ProduceRequest) -> Result<ProduceResponse, Status> {
    unary(
        channel,
        PRODUCE_PATH,
        encode_nested(request, &PRODUCE_REQUEST),
        PRODUCE_RESPONSE_BYTES_MAX,
    )
    .await
}

/// Sends `request` to the broker behind `channel` and decodes its answer in place,
/// refusing one larger than `response_max` bytes.
pub async fn fetch(
    channel: Channel,
    request: FetchRequest,
    response_max: usize,
) -> Result<FetchResponse, Status> {
    unary(
        channel,
        FETCH_PATH,
        vec![encode_whole(&request)],
        response_max,
    )
    .await
}

/// One unary call of `path` with a request message in `pieces`.
async fn unary<M: Message + Default>(
    mut channel: Channel,
    path: &'static str,
    pieces: Vec<Bytes>,
    response_max: usize,
) -> Result<M, Status> {
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(path)
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(tonic::body::Body::new(PiecesBody::request(pieces)))
        .map_err(|e| Status::internal(format!("building a request: {e}")))?;
    let response = channel
        .ready()
        .await
        .map_err(|e| Status::from_error(e.into()))?
        .call(request)
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    let (parts, body) = response.into_parts();
    // A trailers-only answer (how servers send a failed unary call).
    let header_status = Status::from_header_map(&parts.headers);
    if let Some(status) = header_status.clone() {
        if status.code() != Code::Ok {
            return Err(status);
        }
    }
    if parts.status != http::StatusCode::OK {
        return Err(Status::new(
            code_of_http(parts.status),
            format!("HTTP status {} from the broker", parts.status),
        ));
    }
    let (frames, trailers) = read_body(body, response_max).await?;
    match trailers
        .as_ref()
        .and_then(Status::from_header_map)
        .or(header_status)
    {
        Some(status) if status.code() == Code::Ok => decode_unary(frames, response_max),
        Some(status) => Err(status),
        None => Err(Status::internal(
            "protocol error: the broker's answer ended without grpc-status",
        )),
    }
}

/// The gRPC code of a non-200 HTTP answer (gRPC's HTTP-to-status mapping, as tonic's).
fn code_of_http(status: http::StatusCode) -> Code {
    match status {
        http::StatusCode::BAD_REQUEST => Code::Internal,
        http::StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        http::StatusCode::FORBIDDEN => Code::PermissionDenied,
        http::StatusCode::NOT_FOUND => Code::Unimplemented,
        http::StatusCode::TOO_MANY_REQUESTS
        | http::StatusCode::BAD_GATEWAY
        | http::StatusCode::SERVICE_UNAVAILABLE
        | http::StatusCode::GATEWAY_TIMEOUT => Code::Unavailable,
        _ => Code::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_failures_map_to_grpcs_codes() {
        assert_eq!(
            code_of_http(http::StatusCode::NOT_FOUND),
            Code::Unimplemented
        );
        assert_eq!(
            code_of_http(http::StatusCode::SERVICE_UNAVAILABLE),
            Code::Unavailable
        );
        assert_eq!(code_of_http(http::StatusCode::BAD_REQUEST), Code::Internal);
        assert_eq!(code_of_http(http::StatusCode::IM_A_TEAPOT), Code::Unknown);
    }
}
