//! Connections to a cluster from a bootstrap list, and the retry loop every client call
//! shares: a retriable failure moves to the leader hint the server gave, or to the next
//! bootstrap address, with a capped exponential backoff, until the call's deadline.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};

use super::error::ClientError;
use crate::api::status::{code_of, leader_hint_of};
use crate::error_code::ErrorCode;

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
    /// Deadline of one call, retries included.
    timeout: Duration,
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
            timeout,
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
        let endpoint = Endpoint::from_shared(format!("http://{address}")).map_err(|e| {
            ClientError::new(
                ErrorCode::InvalidRequest,
                format!("'{address}' is not a host:port address: {e}"),
            )
        })?;
        let channel = endpoint
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .connect_lazy();
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }

    fn order(&self) -> Vec<String> {
        let mut order = Vec::with_capacity(self.bootstrap.len() + 1);
        if let Some(p) = self.preferred.lock().clone() {
            order.push(p);
        }
        for a in &self.bootstrap {
            if !order.contains(a) {
                order.push(a.clone());
            }
        }
        order
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
                    (ClientError::new(code, describe(&address, &status)), hint)
                })
            }
            .await;
            match attempt {
                Ok(value) => {
                    *self.preferred.lock() = Some(address);
                    return Ok(value);
                }
                Err((e, _)) if !retry(e.code) => return Err(e),
                Err((e, hint)) => {
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
        format!("{address}: {} ({:?})", status.message(), status.code())
    }
}
