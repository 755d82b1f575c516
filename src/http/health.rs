//! Readiness of the roles a process runs, for `/health/ready`: a controller is ready when
//! its quorum has a leader; a broker when it is registered, unfenced, reaches the
//! controllers and has applied the metadata they last announced.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::broker::controller_link::{ControllerLink, LinkStatus};
use crate::broker::group::coordinator::GroupCoordinator;
use crate::broker::node::BrokerNode;
use crate::controller::ControllerNode;

/// The roles this process runs.
#[derive(Clone, Default)]
pub struct Roles {
    /// The controller, when this process is one.
    pub controller: Option<Arc<ControllerNode>>,
    /// The broker, when this process is one.
    pub broker: Option<BrokerRole>,
    /// The client listener's address, where the console reaches the cluster.
    pub client_address: Option<std::net::SocketAddr>,
    /// Host names the console answers besides IP literals and `localhost`.
    pub console_hosts: Vec<String>,
}

/// A broker's handles the HTTP port reads.
#[derive(Clone)]
pub struct BrokerRole {
    /// Partitions, metadata, groups.
    pub node: BrokerNode,
    /// Registration and heartbeats.
    pub link: Arc<ControllerLink>,
    /// The group coordinator.
    pub groups: Arc<GroupCoordinator>,
    /// The durable timers (delayed records).
    pub timers: Arc<crate::broker::timer::Timers>,
}

/// Whether a broker in `status` is ready, and why not (pure).
pub fn broker_ready(status: &LinkStatus) -> Result<(), &'static str> {
    if !status.registered {
        return Err("not registered with the controllers");
    }
    if status.fenced {
        return Err("fenced");
    }
    if !status.controllers_reachable {
        return Err("cut off from the controllers");
    }
    if status.metadata_version < status.controller_version {
        return Err("catching up with the metadata");
    }
    Ok(())
}

impl Roles {
    /// Ready when every role is; the detail names each role's state.
    pub async fn readiness(&self) -> (bool, Value) {
        let mut ready = true;
        let mut detail = serde_json::Map::new();
        if let Some(node) = &self.controller {
            let status = node.status().await;
            let ok = status.leader.is_some();
            ready &= ok;
            detail.insert(
                "controller".into(),
                json!({
                    "ready": ok,
                    "reason": if ok { Value::Null } else { json!("the quorum has no leader") },
                    "node_id": status.id,
                    "role": status.role,
                    "leader": status.leader,
                    "term": status.term,
                    "applied_index": status.applied_index,
                }),
            );
        }
        if let Some(broker) = &self.broker {
            let status = broker.link.status();
            let verdict = broker_ready(&status);
            ready &= verdict.is_ok();
            detail.insert(
                "broker".into(),
                json!({
                    "ready": verdict.is_ok(),
                    "reason": verdict.err(),
                    "broker_id": broker.node.id().0,
                    "registered": status.registered,
                    "fenced": status.fenced,
                    "controllers_reachable": status.controllers_reachable,
                    "metadata_version": status.metadata_version,
                    "controller_metadata_version": status.controller_version,
                    "offline_replicas": broker.node.partitions().offline_replicas().len(),
                }),
            );
        }
        detail.insert(
            "status".into(),
            json!(if ready { "ready" } else { "not_ready" }),
        );
        (ready, Value::Object(detail))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_is_ready_only_registered_unfenced_reachable_and_caught_up() {
        let ok = LinkStatus {
            registered: true,
            fenced: false,
            metadata_version: 10,
            controller_version: 10,
            controllers_reachable: true,
        };
        assert_eq!(broker_ready(&ok), Ok(()));
        for bad in [
            LinkStatus {
                registered: false,
                ..ok
            },
            LinkStatus { fenced: true, ..ok },
            LinkStatus {
                controllers_reachable: false,
                ..ok
            },
            LinkStatus {
                metadata_version: 9,
                ..ok
            },
        ] {
            assert!(broker_ready(&bad).is_err(), "{bad:?}");
        }
    }
}
