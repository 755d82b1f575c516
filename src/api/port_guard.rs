//! What a client port refuses: the internal services (Raft, broker lifecycle, replication)
//! answer `CLUSTER_AUTHORIZATION_FAILED` there instead of UNIMPLEMENTED, so a client that
//! tries them learns why. They are served only on the internal listener (see `net`).

use std::task::{Context, Poll};

use futures_util::future::Either;
use tonic::codegen::http;
use tower::{Layer, Service};

use super::status::error_status;
use crate::error_code::ErrorCode;

/// The gRPC services served only to authenticated nodes on the internal listener.
pub const INTERNAL_SERVICES: &[&str] = &[
    "tidelog.v1.Raft",
    "tidelog.v1.Controller",
    "tidelog.v1.Replication",
    "tidelog.v1.Timers",
    "tidelog.v1.TxnMarkers",
];

/// The internal service a request path (`/package.Service/Method`) names, if any.
pub fn internal_service(path: &str) -> Option<&'static str> {
    let service = path.strip_prefix('/')?.split('/').next()?;
    INTERNAL_SERVICES.iter().copied().find(|s| *s == service)
}

/// Wraps a client port's services with [`RefuseInternal`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RefuseInternalLayer;

impl<S> Layer<S> for RefuseInternalLayer {
    type Service = RefuseInternal<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RefuseInternal { inner }
    }
}

/// Answers calls to [`INTERNAL_SERVICES`] with `CLUSTER_AUTHORIZATION_FAILED`; passes the
/// rest on.
#[derive(Debug, Clone)]
pub struct RefuseInternal<S> {
    inner: S,
}

impl<S, B> Service<http::Request<B>> for RefuseInternal<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<std::future::Ready<Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match internal_service(request.uri().path()) {
            Some(service) => {
                let status = error_status(
                    ErrorCode::ClusterAuthorizationFailed,
                    format!(
                        "{service} is an internal service: it is served only on the internal listener, to nodes holding the cluster secret"
                    ),
                    None,
                );
                Either::Left(std::future::ready(Ok(status.into_http())))
            }
            None => Either::Right(self.inner.call(request)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_paths_are_recognized() {
        assert_eq!(
            internal_service("/tidelog.v1.Raft/AppendEntries"),
            Some("tidelog.v1.Raft")
        );
        assert_eq!(
            internal_service("/tidelog.v1.Controller/RegisterBroker"),
            Some("tidelog.v1.Controller")
        );
        assert_eq!(
            internal_service("/tidelog.v1.Replication/ReplicaFetch"),
            Some("tidelog.v1.Replication")
        );
        assert_eq!(internal_service("/tidelog.v1.Broker/Produce"), None);
        assert_eq!(internal_service("/tidelog.v1.RaftX/Vote"), None);
        assert_eq!(internal_service(""), None);
    }
}
