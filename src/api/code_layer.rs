//! Gives every failed call a tidelog error code, including the failures tonic answers
//! itself before a handler runs: a message above the server's decoding limit
//! (`OUT_OF_RANGE`), bytes that are not the method's protobuf message (`INTERNAL`). Such
//! a status carries no `tidelog-error-code`;
//! [`CodeLayer`] adds one (and `tidelog-retriable`) to the response headers, so clients
//! see a coded refusal rather than what looks like a server fault.
//!
//! `UNIMPLEMENTED` (a service this port does not serve) stays uncoded: clients read an
//! uncoded `UNIMPLEMENTED` as "try another address" (a controller given as bootstrap for
//! a data call), and map it to `INVALID_REQUEST` themselves.
//!
//! Only trailers-only responses (the status in the headers, as tonic sends every unary
//! error) are touched; statuses that already carry a code pass unchanged.

use std::task::{Context, Poll};

use futures_util::future::{MapOk, TryFutureExt};
use tonic::codegen::http;
use tonic::{Code, Status};
use tower::{Layer, Service};

use super::status::{is_transport_failure, ERROR_CODE_KEY, RETRIABLE_KEY};
use crate::error_code::ErrorCode;

/// The code for a status the server produced without one (pure).
pub fn code_for_uncoded(code: Code, message: &str) -> ErrorCode {
    match code {
        // tonic: "decoded message length too large: found N bytes, the limit is: M bytes".
        Code::OutOfRange | Code::ResourceExhausted => ErrorCode::InvalidRequest,
        // tonic-prost: "failed to decode Protobuf message: ..."; tonic: "protocol error:
        // received message with invalid compression flag ...".
        Code::Internal
            if message.contains("failed to decode Protobuf message")
                || message.starts_with("protocol error") =>
        {
            ErrorCode::InvalidRequest
        }
        Code::InvalidArgument | Code::Unimplemented => ErrorCode::InvalidRequest,
        Code::DeadlineExceeded => ErrorCode::RequestTimedOut,
        // A node this server forwarded to did not answer (e.g. a controller forwarding
        // to a leader that just died, whose connection hyper reports as "operation was
        // canceled"): the client retries, as for its own connections.
        Code::Unavailable | Code::Cancelled => ErrorCode::NetworkException,
        Code::Unknown if is_transport_failure(message) => ErrorCode::NetworkException,
        _ => ErrorCode::UnknownServerError,
    }
}

/// Wraps a server's services with [`CodeUncoded`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CodeLayer;

impl<S> Layer<S> for CodeLayer {
    type Service = CodeUncoded<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CodeUncoded { inner }
    }
}

/// Adds a tidelog error code to failed responses that lack one.
#[derive(Debug, Clone)]
pub struct CodeUncoded<S> {
    inner: S,
}

type MapResponse<B> = fn(http::Response<B>) -> http::Response<B>;

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for CodeUncoded<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = MapOk<S::Future, MapResponse<ResBody>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        self.inner
            .call(request)
            .map_ok(add_code as MapResponse<ResBody>)
    }
}

fn add_code<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    if headers.contains_key(ERROR_CODE_KEY) {
        return response;
    }
    let Some(status) = Status::from_header_map(headers) else {
        return response;
    };
    if matches!(status.code(), Code::Ok | Code::Unimplemented) {
        return response;
    }
    let code = code_for_uncoded(status.code(), status.message());
    tracing::debug!(grpc_code = ?status.code(), message = status.message(), %code, "coded a transport-level refusal");
    headers.insert(
        ERROR_CODE_KEY,
        http::HeaderValue::from_static(code.as_str()),
    );
    let retriable = if code.is_retriable() { "true" } else { "false" };
    headers.insert(RETRIABLE_KEY, http::HeaderValue::from_static(retriable));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tonic_refusals_get_codes() {
        let cases = [
            (
                Code::OutOfRange,
                "Error, decoded message length too large: found 104857605 bytes, the limit is: 67108864 bytes",
                ErrorCode::InvalidRequest,
            ),
            (
                Code::Internal,
                "failed to decode Protobuf message: invalid wire type",
                ErrorCode::InvalidRequest,
            ),
            (Code::Unimplemented, "", ErrorCode::InvalidRequest),
            (Code::Internal, "boom", ErrorCode::UnknownServerError),
            (Code::DeadlineExceeded, "late", ErrorCode::RequestTimedOut),
            (
                Code::Unavailable,
                "Connection refused (os error 111)",
                ErrorCode::NetworkException,
            ),
            (
                Code::Cancelled,
                "operation was canceled",
                ErrorCode::NetworkException,
            ),
            (
                Code::Unknown,
                "operation was canceled",
                ErrorCode::NetworkException,
            ),
            (
                Code::Unknown,
                "h2 protocol error: error reading a body from connection",
                ErrorCode::NetworkException,
            ),
            (Code::Unknown, "boom", ErrorCode::UnknownServerError),
        ];
        for (code, message, want) in cases {
            assert_eq!(code_for_uncoded(code, message), want, "{code:?} {message}");
        }
    }

    #[test]
    fn uncoded_error_responses_gain_a_code_and_coded_ones_keep_theirs() {
        let uncoded: http::Response<()> =
            Status::internal("failed to decode Protobuf message: x").into_http();
        let r = add_code(uncoded);
        assert_eq!(r.headers()[ERROR_CODE_KEY], "INVALID_REQUEST");
        assert_eq!(r.headers()[RETRIABLE_KEY], "false");

        let coded: http::Response<()> =
            super::super::status::error_status(ErrorCode::NotController, "x", None).into_http();
        let r = add_code(coded);
        assert_eq!(r.headers()[ERROR_CODE_KEY], "NOT_CONTROLLER");

        let unserved: http::Response<()> = Status::unimplemented("").into_http();
        assert!(!add_code(unserved).headers().contains_key(ERROR_CODE_KEY));

        let ok = http::Response::new(());
        assert!(!add_code(ok).headers().contains_key(ERROR_CODE_KEY));
    }
}
