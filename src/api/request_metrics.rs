//! Counts every gRPC call and times it until its response headers (for unary calls, the
//! whole call): `tidelog_requests_total`, `tidelog_request_duration_seconds` and, for a
//! failed call, `tidelog_request_errors_total` with its tidelog error code, each labelled
//! `protocol="grpc"` and `api` (the method name, e.g. `Produce`; `unknown` for a method
//! no service serves, so a client cannot create series at will). Per-partition errors
//! inside a successful answer are not counted here. Handles are cached per method.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use parking_lot::RwLock;
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
        let path = request.uri().path().to_owned();
        let started = Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let result = call.await;
            if let Ok(response) = &result {
                let status = Status::from_header_map(response.headers());
                // A method no service serves is one label, not one per path sent.
                let served = status
                    .as_ref()
                    .is_none_or(|s| s.code() != tonic::Code::Unimplemented);
                let handles = handles_of(if served { &path } else { "" });
                handles.requests.increment(1);
                handles.duration.record(started.elapsed().as_secs_f64());
                if let Some(code) = error_code(response.headers(), status) {
                    let [protocol, api] = handles.labels.clone();
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

/// Cached metric handles of one method.
struct Handles {
    labels: [(&'static str, String); 2],
    requests: metrics::Counter,
    duration: metrics::Histogram,
}

/// The handles of the method at `path` (`""`: a method no service serves).
fn handles_of(path: &str) -> Arc<Handles> {
    static CACHE: OnceLock<RwLock<HashMap<String, Arc<Handles>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(h) = cache.read().get(path) {
        return h.clone();
    }
    let labels = [
        ("protocol", "grpc".to_owned()),
        ("api", api_of(path).to_owned()),
    ];
    let handles = Arc::new(Handles {
        requests: metrics::counter!("tidelog_requests_total", &labels),
        duration: metrics::histogram!("tidelog_request_duration_seconds", &labels),
        labels,
    });
    cache
        .write()
        .entry(path.to_owned())
        .or_insert(handles)
        .clone()
}

/// The tidelog code of a failed trailers-only response, if it failed.
fn error_code(headers: &http::HeaderMap, status: Option<Status>) -> Option<String> {
    if let Some(code) = headers.get(ERROR_CODE_KEY).and_then(|v| v.to_str().ok()) {
        return Some(code.to_owned());
    }
    let status = status?;
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
