//! Forwarding of requests from a follower controller to the Raft leader.
//!
//! A forwarded request carries `tidelog-forwarded`; a node that receives one and is not the
//! leader answers NOT_CONTROLLER instead of forwarding again, so requests never loop.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Request, Status};

use super::status::FORWARDED_KEY;
use crate::net::node_auth::{internal_channel, ClusterSecret};

/// How long a forwarded call may take.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(15);

/// Lazily connected, authenticated channels to peer controllers' internal listeners, by
/// address.
pub struct PeerChannels {
    channels: Mutex<HashMap<String, Channel>>,
    secret: Arc<ClusterSecret>,
}

impl PeerChannels {
    /// Channels that authenticate with `secret`.
    pub fn new(secret: Arc<ClusterSecret>) -> Self {
        Self {
            channels: Mutex::default(),
            secret,
        }
    }

    /// The channel to `address`, created on first use.
    pub fn get(&self, address: &str) -> Result<Channel, Status> {
        let mut channels = self.channels.lock();
        if let Some(c) = channels.get(address) {
            return Ok(c.clone());
        }
        let channel = internal_channel(address, self.secret.clone(), Duration::from_secs(1))
            .map_err(|e| Status::internal(format!("bad peer address {address}: {e}")))?;
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }
}

/// Whether a request was already forwarded once.
pub fn is_forwarded<T>(request: &Request<T>) -> bool {
    request.metadata().contains_key(FORWARDED_KEY)
}

/// Wraps `message` as a forwarded request with a deadline.
pub fn forwarded<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert(FORWARDED_KEY, MetadataValue::from_static("1"));
    request.set_timeout(FORWARD_TIMEOUT);
    request
}
