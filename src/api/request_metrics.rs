//! Counts every gRPC call and times it until its response headers (for unary calls, the
//! whole call): `tidelog_requests_total`, `tidelog_request_duration_seconds` and, for a
//! failed call, `tidelog_request_errors_total` with its tidelog error code, each labelled
//! `protocol="grpc"` and `api` (the method name, e.g. `Produce`). Per-partition errors
//! inside a successful answer are not counted here.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::codegen::http;
use tonic::Status;
use tower::{Layer, Service};

use super::code_layer::code_for_uncoded;
use super::status::ERROR_CODE_KEY;

/// Wraps a server's services with [`Measured`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestMetricsLayer;

impl<S> Layer<S> for RequestMetricsLayer {
    type Service = Measured<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Measured { inner }
    }
}

/// Records request metrics around its inner service.
#[derive(Debug, Clone)]
pub struct Measured<S> {
    inner: S,
}

/// The method name of a gRPC path (`/tidelog.v1.Broker/Produce` -> `Produce`), or
/// `unknown` (pure; bounded label values come only from served paths).
pub fn api_of(path: &str) -> &str {
    match path.rsplit_once('/') {
        Some((service, method)) if !service.is_empty() && !method.is_empty() => method,
        _ => "unknown",
    }
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for Measured<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResBody: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let api = api_of(request.uri().path()).to_owned();
        let started = Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let result = call.await;
            let labels = [("protocol", "grpc".to_owned()), ("api", api)];
            metrics::counter!("tidelog_requests_total", &labels).increment(1);
            metrics::histogram!("tidelog_request_duration_seconds", &labels)
                .record(started.elapsed().as_secs_f64());
            if let Ok(response) = &result {
                if let Some(code) = error_code(response.headers()) {
                    let [protocol, api] = labels;
                    metrics::counter!(
                        "tidelog_request_errors_total",
                        &[protocol, api, ("code", code)]
                    )
                    .increment(1);
                }
            }
            result
        })
    }
}

/// The tidelog code of a failed trailers-only response, if it failed.
fn error_code(headers: &http::HeaderMap) -> Option<String> {
    if let Some(code) = headers.get(ERROR_CODE_KEY).and_then(|v| v.to_str().ok()) {
        return Some(code.to_owned());
    }
    let status = Status::from_header_map(headers)?;
    (status.code() != tonic::Code::Ok).then(|| {
        code_for_uncoded(status.code(), status.message())
            .as_str()
            .to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_names_come_from_the_path() {
        assert_eq!(api_of("/tidelog.v1.Broker/Produce"), "Produce");
        assert_eq!(api_of("/grpc.health.v1.Health/Check"), "Check");
        assert_eq!(api_of("/"), "unknown");
        assert_eq!(api_of("nonsense"), "unknown");
    }
}
