//! Connections to a cluster from a bootstrap list, and the retry loop every client call
//! shares: a retriable failure moves to the leader hint the server gave, or to the next
//! bootstrap address, with a capped exponential backoff, until the call's deadline.
//!
//! The bootstrap list may name controllers: they serve Admin but not the data or group
//! services. When an address answers that it does not serve a call (`Unimplemented`),
//! the connection asks it for the cluster's live brokers (DescribeCluster) once per call
//! and tries those first from then on.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Response, Status};

use super::error::ClientError;
use crate::api::proto::admin_client::AdminClient as AdminGrpc;
use crate::api::proto::DescribeClusterRequest;
use crate::api::status::{code_of, leader_hint_of, retry_after_of, ERROR_CODE_KEY};
use crate::error_code::ErrorCode;
use crate::net::node_auth::{internal_channel, ClusterSecret};

/// First retry backoff; doubled per attempt up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest backoff between attempts.
const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// A set of cluster addresses and lazily opened channels to them.
pub struct Connection {
    bootstrap: Vec<String>,
    channels: Mutex<HashMap<String, Channel>>,
    /// The address that answered last (or the last leader hint): tried first.
    preferred: Mutex<Option<String>>,
    /// Brokers learned through a controller in the bootstrap list: tried next.
    discovered: Mutex<Vec<String>>,
    /// Addresses that said they serve no data services (controllers): tried last.
    not_brokers: Mutex<HashSet<String>>,
    /// Deadline of one call, retries included.
    timeout: Duration,
    /// Set for a node's connection to other nodes' internal listeners.
    node_secret: Option<Arc<ClusterSecret>>,
}

/// Splits `a,b,c` into addresses; fails when none is given.
pub fn parse_bootstrap(text: &str) -> Result<Vec<String>, ClientError> {
    let list: Vec<String> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if list.is_empty() {
        return Err(ClientError::new(
            ErrorCode::InvalidRequest,
            "--bootstrap lists no address",
        ));
    }
    Ok(list)
}

impl Connection {
    /// How long calls may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A connection to `bootstrap` whose calls give up after `timeout`.
    pub fn new(bootstrap: Vec<String>, timeout: Duration) -> Self {
        Self {
            bootstrap,
            channels: Mutex::new(HashMap::new()),
            preferred: Mutex::new(None),
            discovered: Mutex::new(Vec::new()),
            not_brokers: Mutex::new(HashSet::new()),
            timeout,
            node_secret: None,
        }
    }

    /// The same, to internal listeners: every connection authenticates as a cluster node
    /// with `secret` (for brokers and controllers; clients use the client ports).
    pub fn internal(bootstrap: Vec<String>, timeout: Duration, secret: Arc<ClusterSecret>) -> Self {
        Self {
            node_secret: Some(secret),
            ..Self::new(bootstrap, timeout)
        }
    }

    /// The bootstrap addresses.
    pub fn bootstrap(&self) -> &[String] {
        &self.bootstrap
    }

    /// The channel to `address`, created on first use.
    pub fn channel(&self, address: &str) -> Result<Channel, ClientError> {
        let mut channels = self.channels.lock();
        if let Some(c) = channels.get(address) {
            return Ok(c.clone());
        }
        if let Some(secret) = &self.node_secret {
            let channel = internal_channel(address, secret.clone(), Duration::from_secs(2))
                .map_err(|e| ClientError::new(ErrorCode::InvalidRequest, e))?;
            channels.insert(address.to_owned(), channel.clone());
            return Ok(channel);
        }
        let endpoint = Endpoint::from_shared(format!("http://{address}")).map_err(|e| {
            ClientError::new(
                ErrorCode::InvalidRequest,
                format!("'{address}' is not a host:port address: {e}"),
            )
        })?;
        let channel = crate::net::tune_endpoint(endpoint)
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }

    fn order(&self) -> Vec<String> {
        let not_brokers = self.not_brokers.lock().clone();
        let mut order = Vec::with_capacity(self.bootstrap.len() + 1);
        let preferred = self.preferred.lock().clone();
        let discovered = self.discovered.lock().clone();
        let candidates = preferred.iter().chain(&discovered).chain(&self.bootstrap);
        for a in candidates.clone().filter(|a| !not_brokers.contains(*a)) {
            if !order.contains(a) {
                order.push(a.clone());
            }
        }
        for a in candidates {
            if !order.contains(a) {
                order.push(a.clone());
            }
        }
        order
    }

    /// Asks `address` (a controller) for the live brokers' addresses.
    async fn discover_brokers(&self, address: &str, within: Duration) -> Vec<String> {
        let Ok(channel) = self.channel(address) else {
            return Vec::new();
        };
        let mut admin = AdminGrpc::new(channel);
        let call = admin.describe_cluster(DescribeClusterRequest {});
        match tokio::time::timeout(within, call).await {
            Ok(Ok(r)) => r
                .into_inner()
                .brokers
                .into_iter()
                .filter_map(|b| b.broker)
                .filter(|b| b.state == "unfenced")
                .map(|b| b.address)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Runs `call` against the cluster, retrying retriable failures until the deadline.
    pub async fn call<T, F, Fut>(&self, what: &str, call: F) -> Result<T, ClientError>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        self.call_retrying(what, ErrorCode::is_retriable, call)
            .await
    }

    /// [`Connection::call`], retrying only the codes `retry` accepts.
    pub async fn call_retrying<T, F, Fut>(
        &self,
        what: &str,
        retry: impl Fn(ErrorCode) -> bool,
        call: F,
    ) -> Result<T, ClientError>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut backoff = BACKOFF_MIN;
        let mut order = self.order();
        let mut next = 0usize;
        let mut discovery_tried = false;
        loop {
            let address = order[next % order.len()].clone();
            let remaining = deadline.saturating_duration_since(Instant::now());
            let channel = self.channel(&address)?;
            let attempt = async {
                match tokio::time::timeout(remaining, call(channel)).await {
                    Ok(Ok(r)) => Ok(r.into_inner()),
                    Ok(Err(status)) => Err(status),
                    Err(_) => Err(Status::deadline_exceeded("timed out")),
                }
                .map_err(|status| (code_of(&status), status))
                .map_err(|(code, status)| {
                    let hint = leader_hint_of(&status);
                    let unserved = status.code() == Code::Unimplemented
                        && !status.metadata().contains_key(ERROR_CODE_KEY);
                    let mut e = ClientError::new(code, describe(&address, &status));
                    e.retry_after = retry_after_of(&status);
                    (e, hint, unserved)
                })
            }
            .await;
            match attempt {
                Ok(value) => {
                    *self.preferred.lock() = Some(address);
                    return Ok(value);
                }
                Err((e, _, true)) => {
                    // A controller: find the brokers through it, once per call.
                    self.not_brokers.lock().insert(address.clone());
                    let brokers = if discovery_tried {
                        Vec::new()
                    } else {
                        discovery_tried = true;
                        let left = deadline.saturating_duration_since(Instant::now());
                        self.discover_brokers(&address, left).await
                    };
                    if brokers.is_empty() {
                        return Err(ClientError::new(
                            e.code,
                            format!("{what}: {address} does not serve it (a controller?) and no live broker could be found through it; name a broker in --bootstrap ({})", e.message),
                        ));
                    }
                    tracing::debug!(%address, ?brokers, "{what}: found brokers through a controller");
                    *self.discovered.lock() = brokers;
                    order = self.order();
                    next = 0;
                    continue;
                }
                Err((e, _, false)) if !retry(e.code) => return Err(e),
                Err((e, hint, false)) => {
                    tracing::debug!(%address, error = %e, "{what}: retrying");
                    match hint {
                        Some(h) => {
                            order.retain(|a| *a != h);
                            order.insert(0, h.clone());
                            *self.preferred.lock() = Some(h);
                            next = 0;
                        }
                        None => next += 1,
                    }
                    if Instant::now() + backoff >= deadline {
                        return Err(ClientError::new(
                            e.code,
                            format!(
                                "{what} kept failing for {} ms; last error: {}",
                                self.timeout.as_millis(),
                                e.message
                            ),
                        ));
                    }
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }
}

fn describe(address: &str, status: &Status) -> String {
    if status
        .metadata()
        .contains_key(crate::api::status::ERROR_CODE_KEY)
    {
        status.message().to_owned()
    } else {
        // A transport failure: its root cause says what happened (refused, the node
        // handshake failed, ...).
        let mut root = std::error::Error::source(status);
        while let Some(next) = root.and_then(|e| e.source()) {
            root = Some(next);
        }
        let message = status.message();
        match root.map(|e| e.to_string()) {
            Some(cause) if !message.contains(&cause) => {
                format!("{address}: {message}: {cause} ({:?})", status.code())
            }
            _ => format!("{address}: {message} ({:?})", status.code()),
        }
    }
}
