//! `tidelog groups list|describe|reset-offsets|delete`, like `kafka-consumer-groups.sh`.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::client_args::{block_on, ClientArgs};
use super::{CliError, OutputFormat};
use crate::api::proto::CommittedOffset;
use crate::client::consumer::Consumer;
use crate::client::groups::GroupsAdmin;

/// `tidelog groups ...`.
#[derive(Debug, clap::Args)]
pub struct GroupsArgs {
    #[command(subcommand)]
    command: GroupsCommand,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, clap::Subcommand)]
enum GroupsCommand {
    /// List groups.
    List,
    /// Members, assignments, committed offsets and lag of a group.
    Describe {
        /// The group.
        #[arg(long)]
        group: String,
    },
    /// Set a group's committed offsets for a topic (only while it has no members).
    ResetOffsets {
        /// The group.
        #[arg(long)]
        group: String,
        /// The topic.
        #[arg(long)]
        topic: String,
        /// To each partition's log start.
        #[arg(long, conflicts_with_all = ["to_latest", "to_offset"])]
        to_earliest: bool,
        /// To each partition's end (high watermark).
        #[arg(long, conflicts_with = "to_offset")]
        to_latest: bool,
        /// To this offset in every partition.
        #[arg(long)]
        to_offset: Option<i64>,
    },
    /// Delete a group without members, and its committed offsets.
    Delete {
        /// The group.
        #[arg(long)]
        group: String,
    },
}

/// Runs `tidelog groups ...`.
pub fn run(args: &GroupsArgs) -> Result<(), CliError> {
    let bootstrap = args.client.addresses()?;
    let timeout = args.client.timeout();
    let output = args.client.output;
    let admin = GroupsAdmin::new(bootstrap.clone(), timeout);
    block_on(async move {
        match &args.command {
            GroupsCommand::List => {
                let groups = admin.list().await?;
                match output {
                    OutputFormat::Json => {
                        let list: Vec<Value> = groups
                            .iter()
                            .map(|g| json!({"group": g.group, "state": g.state, "members": g.members, "coordinator": g.coordinator_id}))
                            .collect();
                        println!("{}", json!({ "groups": list }));
                    }
                    OutputFormat::Table => {
                        for g in &groups {
                            println!("{}", g.group);
                        }
                    }
                }
            }
            GroupsCommand::Describe { group } => {
                let d = admin.describe(group).await?;
                let partitions: Vec<(String, u32)> = d
                    .offsets
                    .iter()
                    .map(|o| (o.topic.clone(), o.partition))
                    .collect();
                let ends = admin.log_ends(&partitions).await?;
                let offsets: Vec<Value> = d
                    .offsets
                    .iter()
                    .map(|o| {
                        let end = ends
                            .get(&(o.topic.clone(), o.partition))
                            .copied()
                            .unwrap_or(-1);
                        json!({"topic": o.topic, "partition": o.partition,
                               "committed_offset": o.offset, "log_end_offset": end,
                               "lag": (end - o.offset).max(0)})
                    })
                    .collect();
                match output {
                    OutputFormat::Json => {
                        let members: Vec<Value> = d
                            .members
                            .iter()
                            .map(|m| {
                                let assignment: Vec<Value> = m
                                    .assignment
                                    .iter()
                                    .map(|a| json!({"topic": a.topic, "partitions": a.partitions}))
                                    .collect();
                                json!({"member_id": m.member_id, "client_id": m.client_id,
                                       "instance_id": m.instance_id, "member_epoch": m.member_epoch,
                                       "assignment": assignment})
                            })
                            .collect();
                        println!(
                            "{}",
                            json!({"group": d.group, "state": d.state, "strategy": d.strategy,
                                   "broadcast": d.broadcast, "group_epoch": d.group_epoch,
                                   "members": members, "offsets": offsets})
                        );
                    }
                    OutputFormat::Table => {
                        println!(
                            "Group: {}\tState: {}\tStrategy: {}\tEpoch: {}\tMembers: {}",
                            d.group,
                            d.state,
                            d.strategy,
                            d.group_epoch,
                            d.members.len()
                        );
                        for m in &d.members {
                            let parts: Vec<String> = m
                                .assignment
                                .iter()
                                .map(|a| format!("{}:{:?}", a.topic, a.partitions))
                                .collect();
                            println!(
                                "\tMember: {}\tClient: {}\tEpoch: {}\tAssignment: {}",
                                m.member_id,
                                m.client_id,
                                m.member_epoch,
                                parts.join(" ")
                            );
                        }
                        println!("TOPIC\tPARTITION\tCOMMITTED\tLOG-END\tLAG");
                        for o in &offsets {
                            println!(
                                "{}\t{}\t{}\t{}\t{}",
                                o["topic"].as_str().unwrap_or_default(),
                                o["partition"],
                                o["committed_offset"],
                                o["log_end_offset"],
                                o["lag"]
                            );
                        }
                    }
                }
            }
            GroupsCommand::ResetOffsets {
                group,
                topic,
                to_earliest,
                to_latest,
                to_offset,
            } => {
                let at = match (to_earliest, to_latest, to_offset) {
                    (true, _, _) => -2,
                    (_, true, _) => -1,
                    (_, _, Some(o)) if *o >= 0 => *o,
                    (_, _, Some(o)) => {
                        return Err(CliError::new(
                            "INVALID_REQUEST",
                            format!("--to-offset must be >= 0, got {o}"),
                        ))
                    }
                    _ => {
                        return Err(CliError::new(
                            "INVALID_REQUEST",
                            "give --to-earliest, --to-latest or --to-offset",
                        ))
                    }
                };
                let consumer = Consumer::new(bootstrap, timeout);
                let count = consumer.partition_count(topic).await?;
                let mut offsets = Vec::new();
                let mut shown = BTreeMap::new();
                for p in 0..count {
                    let offset = if at >= 0 {
                        at
                    } else {
                        consumer.list_offset(topic, p, at).await?
                    };
                    shown.insert(p, offset);
                    offsets.push(CommittedOffset {
                        topic: topic.clone(),
                        partition: p,
                        offset,
                        metadata: String::new(),
                    });
                }
                admin.reset(group, offsets).await?;
                match output {
                    OutputFormat::Json => {
                        let list: Vec<Value> = shown
                            .iter()
                            .map(|(p, o)| json!({"topic": topic, "partition": p, "offset": o}))
                            .collect();
                        println!("{}", json!({"group": group, "offsets": list}));
                    }
                    OutputFormat::Table => {
                        for (p, o) in &shown {
                            println!("{topic}\t{p}\t{o}");
                        }
                    }
                }
            }
            GroupsCommand::Delete { group } => {
                admin.delete(group).await?;
                match output {
                    OutputFormat::Json => println!("{}", json!({"group": group, "deleted": true})),
                    OutputFormat::Table => println!("Deleted group {group}."),
                }
            }
        }
        Ok(())
    })?
}
