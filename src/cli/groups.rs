//! `tidelog groups list|describe|reset-offsets|delete|dlq`, like `kafka-consumer-groups.sh`.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};

use super::client_args::{block_on, ClientArgs, Isolation};
use super::dlq::DlqCommand;
use super::progress::Progress;
use super::{CliError, OutputFormat};
use crate::api::proto::CommittedOffset;
use crate::client::consumer::Consumer;
use crate::client::groups::GroupsAdmin;
use crate::error_code::ErrorCode;
use crate::time_text;

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
    /// Members, assignments, committed offsets and lag of a group. Lag is measured
    /// against the last stable offset when the group reads committed records (its members
    /// said so, or --isolation read_committed), else against the high watermark.
    Describe {
        /// The group.
        #[arg(long)]
        group: String,
        /// Measure lag as a consumer of this isolation level would see it (default: as
        /// the group's members declared; Kafka clients do not declare it).
        #[arg(long, value_enum)]
        isolation: Option<Isolation>,
    },
    /// Plan new committed offsets for a group and, with --execute, set them (only while
    /// the group has no members). Prints the plan: group, topic, partition, current and
    /// new offset. New offsets are kept within each partition's log start and end.
    ResetOffsets {
        /// The group.
        #[arg(long)]
        group: String,
        /// A topic, or a topic and some of its partitions: T or T:0,2 (repeatable).
        #[arg(long = "topic", value_name = "T[:P,P...]", required = true)]
        topics: Vec<String>,
        #[command(flatten)]
        to: ResetTarget,
        /// Set the offsets (default: only print the plan).
        #[arg(long)]
        execute: bool,
    },
    /// Delete a group without members, and its committed offsets.
    Delete {
        /// The group.
        #[arg(long)]
        group: String,
    },
    /// A group's dead letters: list, show, or replay them to their topics.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
}

/// Where `groups reset-offsets` moves each partition: exactly one of these.
#[derive(Debug, Clone, clap::Args)]
#[group(required = true, multiple = false)]
struct ResetTarget {
    /// To each partition's log start.
    #[arg(long)]
    to_earliest: bool,
    /// To each partition's end (high watermark).
    #[arg(long)]
    to_latest: bool,
    /// To this offset in every partition.
    #[arg(long, value_name = "OFFSET", value_parser = clap::value_parser!(i64).range(0..))]
    to_offset: Option<i64>,
    /// To the first record at or after this time (RFC 3339, e.g. 2026-01-31T12:00:00Z);
    /// the end where none is.
    #[arg(long, value_name = "RFC3339", value_parser = time_text::parse_rfc3339_ms)]
    to_datetime: Option<i64>,
    /// Move each committed offset by N (negative: back); partitions need a committed offset.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    shift_by: Option<i64>,
    /// To the first record at or after now minus this duration (PT1H, P1DT2H, 1h, 30m).
    #[arg(long, value_name = "DURATION", value_parser = time_text::parse_duration_ms)]
    by_duration: Option<u64>,
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
                            .map(|g| json!({"group": g.group, "state": g.state, "members": g.members, "coordinator": g.coordinator_id, "group_type": g.group_type}))
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
            GroupsCommand::Describe { group, isolation } => {
                let d = admin.describe(group).await?;
                let isolation = isolation.unwrap_or(if d.isolation == "read_committed" {
                    Isolation::ReadCommitted
                } else {
                    Isolation::ReadUncommitted
                });
                let partitions: Vec<(String, u32)> = d
                    .offsets
                    .iter()
                    .map(|o| (o.topic.clone(), o.partition))
                    .collect();
                let (ends, stable) = tokio::try_join!(
                    admin.log_ends(&partitions, false),
                    admin.log_ends(&partitions, true)
                )?;
                let committed: BTreeMap<(String, u32), i64> = d
                    .offsets
                    .iter()
                    .map(|o| ((o.topic.clone(), o.partition), o.offset))
                    .collect();
                let retries =
                    super::dlq::retry_counts(&bootstrap, timeout, group, &committed).await?;
                let offsets: Vec<Value> = d
                    .offsets
                    .iter()
                    .map(|o| {
                        let key = (o.topic.clone(), o.partition);
                        let end = ends.get(&key).copied().unwrap_or(-1);
                        let last_stable = stable.get(&key).copied().unwrap_or(-1);
                        let to = match isolation {
                            Isolation::ReadCommitted => last_stable,
                            Isolation::ReadUncommitted => end,
                        };
                        json!({"topic": o.topic, "partition": o.partition,
                               "committed_offset": o.offset, "log_end_offset": end,
                               "last_stable_offset": last_stable,
                               "lag": (to - o.offset).max(0)})
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
                                       "read_committed": m.read_committed,
                                       "assignment": assignment})
                            })
                            .collect();
                        println!(
                            "{}",
                            json!({"group": d.group, "state": d.state, "strategy": d.strategy,
                                   "group_type": d.group_type, "isolation": isolation.name(),
                                   "broadcast": d.broadcast, "group_epoch": d.group_epoch,
                                   "members": members, "offsets": offsets,
                                   "retry": retries.to_json(group)})
                        );
                    }
                    OutputFormat::Table => {
                        println!(
                            "Group: {}\tState: {}\tStrategy: {}\tEpoch: {}\tMembers: {}\tType: {}\tIsolation: {}",
                            d.group,
                            d.state,
                            d.strategy,
                            d.group_epoch,
                            d.members.len(),
                            d.group_type,
                            isolation.name()
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
                        println!(
                            "Retries: {} scheduled, {} ready\tDead letters: {} ({} not replayed)",
                            retries.scheduled,
                            retries.ready,
                            retries.dead_letters,
                            retries.not_replayed
                        );
                        println!("TOPIC\tPARTITION\tCOMMITTED\tLOG-END\tLAG\tLAST-STABLE");
                        for o in &offsets {
                            println!(
                                "{}\t{}\t{}\t{}\t{}\t{}",
                                o["topic"].as_str().unwrap_or_default(),
                                o["partition"],
                                o["committed_offset"],
                                o["log_end_offset"],
                                o["lag"],
                                o["last_stable_offset"]
                            );
                        }
                    }
                }
            }
            GroupsCommand::ResetOffsets {
                group,
                topics,
                to,
                execute,
            } => {
                let consumer = Consumer::new(bootstrap, timeout);
                let plan = plan_reset(&admin, &consumer, group, topics, to).await?;
                if *execute {
                    let offsets = plan
                        .iter()
                        .map(|p| CommittedOffset {
                            topic: p.topic.clone(),
                            partition: p.partition,
                            offset: p.new,
                            metadata: String::new(),
                        })
                        .collect();
                    admin.reset(group, offsets).await?;
                }
                print_plan(output, group, &plan, *execute);
            }
            GroupsCommand::Dlq { command } => {
                super::dlq::run(command, bootstrap, timeout, output).await?;
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

/// One partition of a reset plan.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PlannedOffset {
    topic: String,
    partition: u32,
    /// The committed offset now, if any.
    current: Option<i64>,
    /// The offset to commit.
    new: i64,
}

/// Parses `T` or `T:P,P,...` into the topic and the chosen partitions (none: all).
fn parse_topic_selection(text: &str) -> Result<(String, Option<BTreeSet<u32>>), CliError> {
    let Some((topic, list)) = text.split_once(':') else {
        return Ok((text.to_owned(), None));
    };
    let partitions = list
        .split(',')
        .map(|p| p.trim().parse::<u32>())
        .collect::<Result<BTreeSet<_>, _>>()
        .map_err(|_| {
            CliError::new(
                "INVALID_REQUEST",
                format!(
                    "--topic '{text}': expected TOPIC or TOPIC:PARTITION,PARTITION,... e.g. t:0,2"
                ),
            )
        })?;
    Ok((topic.to_owned(), Some(partitions)))
}

use crate::broker::node::now_ms;

/// Works out the new offset of every selected partition; changes nothing.
async fn plan_reset(
    admin: &GroupsAdmin,
    consumer: &Consumer,
    group: &str,
    topics: &[String],
    to: &ResetTarget,
) -> Result<Vec<PlannedOffset>, CliError> {
    let committed = committed_offsets(admin, group).await?;
    let mut selected: BTreeMap<String, Option<BTreeSet<u32>>> = BTreeMap::new();
    for t in topics {
        let (topic, partitions) = parse_topic_selection(t)?;
        match (
            selected.entry(topic).or_insert(Some(BTreeSet::new())),
            partitions,
        ) {
            (all @ Some(_), None) => *all = None,
            (Some(chosen), Some(p)) => chosen.extend(p),
            (None, _) => {}
        }
    }
    let mut plan = Vec::new();
    let mut progress = Progress::new();
    let mut planned = 0u64;
    for (topic, chosen) in selected {
        let count = consumer.partition_count(&topic).await?;
        let partitions: Vec<u32> = match chosen {
            None => (0..count).collect(),
            Some(chosen) => {
                if let Some(p) = chosen.iter().find(|p| **p >= count) {
                    return Err(CliError::new(
                        "UNKNOWN_TOPIC_OR_PARTITION",
                        format!(
                            "topic {topic} has no partition {p} ({})",
                            super::text::count(count as usize, "partition", "partitions")
                        ),
                    ));
                }
                chosen.into_iter().collect()
            }
        };
        for partition in partitions {
            planned += 1;
            progress.update(|| format!("planning offsets: {planned} partitions ({topic})"));
            let current = committed.get(&(topic.clone(), partition)).copied();
            let earliest = consumer.list_offset(&topic, partition, -2).await?;
            let latest = consumer.list_offset(&topic, partition, -1).await?;
            let topic_ref = topic.as_str();
            let by_time = |ts: i64| async move {
                let o = consumer
                    .list_offset(topic_ref, partition, ts.max(0))
                    .await?;
                Ok::<_, CliError>(if o < 0 { latest } else { o })
            };
            let wanted = if to.to_earliest {
                earliest
            } else if to.to_latest {
                latest
            } else if let Some(o) = to.to_offset {
                o
            } else if let Some(ts) = to.to_datetime {
                by_time(ts).await?
            } else if let Some(d) = to.by_duration {
                by_time(now_ms().saturating_sub(d as i64)).await?
            } else if let Some(n) = to.shift_by {
                let Some(c) = current else {
                    return Err(CliError::new(
                        "INVALID_REQUEST",
                        format!(
                            "group {group} has no committed offset for {topic}-{partition} to shift; \
                             use --to-earliest, --to-latest, --to-offset or --to-datetime"
                        ),
                    ));
                };
                c.saturating_add(n)
            } else {
                unreachable!("clap requires one reset target")
            };
            plan.push(PlannedOffset {
                topic: topic.clone(),
                partition,
                current,
                new: wanted.clamp(earliest, latest.max(earliest)),
            });
        }
    }
    Ok(plan)
}

/// Prints a reset plan like kafka-consumer-groups.sh; says on stderr when it was a dry run.
fn print_plan(output: OutputFormat, group: &str, plan: &[PlannedOffset], executed: bool) {
    match output {
        OutputFormat::Json => {
            let offsets: Vec<Value> = plan
                .iter()
                .map(|p| {
                    json!({"topic": p.topic, "partition": p.partition,
                           "current_offset": p.current, "new_offset": p.new,
                           "offset": p.new})
                })
                .collect();
            println!(
                "{}",
                json!({"group": group, "executed": executed, "offsets": offsets})
            );
        }
        OutputFormat::Table => {
            println!("GROUP\tTOPIC\tPARTITION\tCURRENT-OFFSET\tNEW-OFFSET");
            for p in plan {
                let current = p.current.map_or("-".to_owned(), |c| c.to_string());
                println!(
                    "{group}\t{}\t{}\t{current}\t{}",
                    p.topic, p.partition, p.new
                );
            }
        }
    }
    if !executed {
        eprintln!("Dry run: nothing changed. Add --execute to set these offsets.");
    }
}

/// A group's committed offsets; none for a group that does not exist (yet).
pub async fn committed_offsets(
    admin: &GroupsAdmin,
    group: &str,
) -> Result<BTreeMap<(String, u32), i64>, CliError> {
    match admin.describe(group).await {
        Ok(d) => Ok(d
            .offsets
            .into_iter()
            .map(|o| ((o.topic, o.partition), o.offset))
            .collect()),
        Err(e) if e.code == ErrorCode::GroupIdNotFound => Ok(BTreeMap::new()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_selections() {
        assert_eq!(parse_topic_selection("t").unwrap(), ("t".to_owned(), None));
        assert_eq!(
            parse_topic_selection("t:0,2").unwrap(),
            ("t".to_owned(), Some([0, 2].into()))
        );
        assert!(parse_topic_selection("t:0,x").is_err());
        assert!(parse_topic_selection("t:").is_err());
    }
}
