//! `tidelog topics create|list|describe|alter|delete`, like `kafka-topics.sh`.

use serde_json::{json, Value};

use super::client_args::{block_on, parse_pairs, ClientArgs};
use super::progress::{fraction, Progress};
use super::text::count;
use super::{CliError, OutputFormat};
use crate::api::proto::{
    AlterTopicRequest, PartitionReassignment, PartitionState, TopicDescription, TopicState,
};
use crate::client::AdminClient;
use crate::error_code::ErrorCode;

/// `tidelog topics ...`.
#[derive(Debug, clap::Args)]
pub struct TopicsArgs {
    #[command(subcommand)]
    command: TopicsCommand,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, clap::Subcommand)]
enum TopicsCommand {
    /// Create a topic.
    Create {
        /// The topic's name: [a-zA-Z0-9._-], 1 to 249 characters.
        #[arg(long)]
        topic: String,
        /// Number of partitions (default 1).
        #[arg(long)]
        partitions: Option<u32>,
        /// Replicas per partition (default 1).
        #[arg(long)]
        replication_factor: Option<u32>,
        /// A topic setting as key=value (repeatable), e.g. retention.ms=86400000.
        #[arg(long = "config")]
        config: Vec<String>,
        /// Succeed without changing anything when the topic already exists (its settings
        /// are not compared with the flags).
        #[arg(long)]
        if_not_exists: bool,
    },
    /// List topics.
    List,
    /// Describe one topic, or all.
    Describe {
        /// The topic (default: every topic).
        #[arg(long)]
        topic: Option<String>,
        /// Only partitions whose ISR is smaller than their replica set.
        #[arg(long, conflicts_with = "unavailable_partitions")]
        under_replicated_partitions: bool,
        /// Only partitions without a usable leader (none, or one whose copy is offline).
        #[arg(long)]
        unavailable_partitions: bool,
    },
    /// Add partitions or change settings.
    Alter {
        /// The topic.
        #[arg(long)]
        topic: String,
        /// The new partition count (it can only grow).
        #[arg(long)]
        partitions: Option<u32>,
        /// A setting to set, key=value (repeatable).
        #[arg(long = "config")]
        config: Vec<String>,
        /// A setting to remove, back to its default (repeatable).
        #[arg(long = "delete-config")]
        delete_config: Vec<String>,
        /// Move a partition to other brokers, PARTITION=BROKER,BROKER,... with the
        /// preferred leader first (repeatable). The new replicas catch up and join the ISR,
        /// then the others are removed.
        #[arg(long = "reassign", value_name = "P=B1,B2,...")]
        reassign: Vec<String>,
        /// With --reassign: wait until every reassigned partition has finished moving
        /// (progress on a terminal), at most this long in seconds (0: no limit).
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "0", requires = "reassign")]
        wait: Option<u64>,
    },
    /// Hand each partition's leadership back to its preferred (first) replica where that
    /// replica is alive and in sync.
    ElectLeaders {
        /// The topic (default: every topic).
        #[arg(long)]
        topic: Option<String>,
    },
    /// Delete a topic and its data.
    Delete {
        /// The topic.
        #[arg(long)]
        topic: String,
        /// Succeed when the topic does not exist.
        #[arg(long)]
        if_exists: bool,
    },
}

/// Runs `tidelog topics ...`.
pub fn run(args: &TopicsArgs) -> Result<(), CliError> {
    let client = AdminClient::new(args.client.addresses()?, args.client.timeout());
    let output = args.client.output;
    block_on(async move {
        match &args.command {
            TopicsCommand::Create {
                topic,
                partitions,
                replication_factor,
                config,
                if_not_exists,
            } => {
                let config = parse_pairs("--config", config)?;
                match client
                    .create_topic(topic, *partitions, *replication_factor, config)
                    .await
                {
                    Ok(r) => print_summary(output, "Created", &r.topic.unwrap_or_default()),
                    Err(e) if *if_not_exists && e.code == ErrorCode::TopicAlreadyExists => {
                        let existing = client.describe_topics(vec![topic.clone()]).await?;
                        let t = existing
                            .topics
                            .into_iter()
                            .next()
                            .and_then(|d| d.topic)
                            .unwrap_or_default();
                        print_summary(output, "Kept existing", &t);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            TopicsCommand::List => {
                let r = client.list_topics().await?;
                match output {
                    OutputFormat::Json => {
                        let topics: Vec<Value> = r
                            .topics
                            .iter()
                            .map(|t| {
                                json!({"name": t.name, "id": t.id, "partitions": t.partitions,
                                       "replication_factor": t.replication_factor})
                            })
                            .collect();
                        println!("{}", json!({ "topics": topics }));
                    }
                    OutputFormat::Table => {
                        for t in &r.topics {
                            println!("{}", t.name);
                        }
                    }
                }
            }
            TopicsCommand::Describe {
                topic,
                under_replicated_partitions,
                unavailable_partitions,
            } => {
                let names = topic.iter().cloned().collect();
                let mut topics = client.describe_topics_with_offsets(names).await?;
                if *under_replicated_partitions {
                    topics = only_partitions(topics, |p| p.isr.len() < p.replicas.len());
                } else if *unavailable_partitions {
                    topics = only_partitions(topics, |p| {
                        p.leader.is_none_or(|l| p.offline_replicas.contains(&l))
                    });
                }
                print_descriptions(output, &topics);
            }
            TopicsCommand::Alter {
                topic,
                partitions,
                config,
                delete_config,
                reassign,
                wait,
            } => {
                if partitions.is_none()
                    && config.is_empty()
                    && delete_config.is_empty()
                    && reassign.is_empty()
                {
                    return Err(CliError::new(
                        "INVALID_REQUEST",
                        "nothing to alter: give --partitions, --config, --delete-config or --reassign",
                    ));
                }
                let reassignments = reassign
                    .iter()
                    .map(|r| parse_reassignment(r))
                    .collect::<Result<Vec<_>, _>>()?;
                let r = client
                    .alter_topic(AlterTopicRequest {
                        name: topic.clone(),
                        partitions: *partitions,
                        set_config: parse_pairs("--config", config)?,
                        delete_config: delete_config.clone(),
                        reassignments,
                    })
                    .await?;
                if let Some(limit) = wait {
                    let partitions: Vec<u32> = reassign
                        .iter()
                        .filter_map(|r| parse_reassignment(r).ok())
                        .map(|r| r.partition)
                        .collect();
                    wait_for_reassignment(&client, topic, &partitions, *limit).await?;
                }
                print_summary(output, "Altered", &r.topic.unwrap_or_default());
            }
            TopicsCommand::ElectLeaders { topic } => {
                let r = client
                    .elect_leaders(topic.iter().cloned().collect())
                    .await?;
                match output {
                    OutputFormat::Json => println!("{}", json!({"elected": r.elected})),
                    OutputFormat::Table => println!(
                        "Preferred leader elected for {}.",
                        count(r.elected as usize, "partition", "partitions")
                    ),
                }
            }
            TopicsCommand::Delete { topic, if_exists } => {
                let deleted = match client.delete_topic(topic).await {
                    Ok(_) => true,
                    Err(e) if *if_exists && e.code == ErrorCode::UnknownTopicOrPartition => false,
                    Err(e) => return Err(e.into()),
                };
                match (output, deleted) {
                    (OutputFormat::Json, _) => {
                        println!("{}", json!({"name": topic, "deleted": deleted}))
                    }
                    (OutputFormat::Table, true) => println!("Deleted topic {topic}."),
                    (OutputFormat::Table, false) => println!("Topic {topic} does not exist."),
                }
            }
        }
        Ok(())
    })?
}

/// One line about a created, kept or altered topic; JSON says `created` for `Created` and
/// `Kept existing` (`--if-not-exists`).
fn print_summary(output: OutputFormat, verb: &str, t: &TopicState) {
    match output {
        OutputFormat::Json => {
            let mut v = json!({"name": t.name, "id": t.id, "partitions": t.partitions.len(),
                   "replication_factor": replication_factor(t), "config": t.config});
            if verb != "Altered" {
                v["created"] = json!(verb == "Created");
            }
            println!("{v}")
        }
        OutputFormat::Table => println!(
            "{verb} topic {} ({}, replication factor {}).",
            t.name,
            count(t.partitions.len(), "partition", "partitions"),
            replication_factor(t)
        ),
    }
}

/// The replication factor a topic has now: its partitions' replica count, without the
/// replicas a running reassignment is removing (the topic's creation-time setting goes stale
/// once partitions are reassigned to more or fewer brokers).
pub fn replication_factor(t: &TopicState) -> u32 {
    t.partitions
        .iter()
        .map(|p| p.replicas.len().saturating_sub(p.removing_replicas.len()) as u32)
        .max()
        .unwrap_or(t.replication_factor)
}

/// `topics` with only the partitions that `keep` accepts; topics left without any dropped.
fn only_partitions(
    topics: Vec<TopicDescription>,
    keep: impl Fn(&PartitionState) -> bool,
) -> Vec<TopicDescription> {
    topics
        .into_iter()
        .filter_map(|mut d| {
            let t = d.topic.as_mut()?;
            t.partitions.retain(|p| keep(p));
            (!t.partitions.is_empty()).then_some(d)
        })
        .collect()
}

/// Polls the topic until none of `partitions` is still adding or removing replicas, or
/// `limit_secs` (0: no limit) pass; progress on a terminal.
async fn wait_for_reassignment(
    client: &AdminClient,
    topic: &str,
    partitions: &[u32],
    limit_secs: u64,
) -> Result<(), CliError> {
    let started = std::time::Instant::now();
    let mut progress = Progress::new();
    loop {
        let described = client.describe_topics(vec![topic.to_owned()]).await?;
        if !described
            .topics
            .iter()
            .any(|d| d.topic.as_ref().is_some_and(|t| t.name == topic))
        {
            progress.finish();
            return Err(CliError::new(
                "UNKNOWN_TOPIC_OR_PARTITION",
                format!("topic {topic} disappeared while its reassignment was awaited"),
            ));
        }
        let moving: Vec<u32> = described
            .topics
            .iter()
            .filter_map(|d| d.topic.as_ref())
            .flat_map(|t| &t.partitions)
            .filter(|p| partitions.contains(&p.partition))
            .filter(|p| !p.adding_replicas.is_empty() || !p.removing_replicas.is_empty())
            .map(|p| p.partition)
            .collect();
        if moving.is_empty() {
            progress.finish();
            return Ok(());
        }
        let done = (partitions.len() - moving.len()) as u64;
        progress.update(|| {
            format!(
                "reassignment of {topic}: {} partitions done, waiting for {:?} ({} s)",
                fraction(done, partitions.len() as u64),
                moving,
                started.elapsed().as_secs()
            )
        });
        if limit_secs > 0 && started.elapsed().as_secs() >= limit_secs {
            progress.finish();
            return Err(CliError::new(
                "REQUEST_TIMED_OUT",
                format!(
                    "the reassignment of {topic} partitions {moving:?} is still running after {limit_secs} s; \
                     it goes on in the cluster (tidelog topics describe --topic {topic} shows it)"
                ),
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Parses `P=B1,B2,...`.
fn parse_reassignment(text: &str) -> Result<PartitionReassignment, CliError> {
    let bad = |why: &str| {
        CliError::new(
            "INVALID_REQUEST",
            format!(
                "--reassign '{text}': {why}; expected PARTITION=BROKER,BROKER,... e.g. 0=1,2,3"
            ),
        )
    };
    let (partition, brokers) = text.split_once('=').ok_or_else(|| bad("no '='"))?;
    let partition = partition
        .trim()
        .parse::<u32>()
        .map_err(|_| bad("the partition is not a number >= 0"))?;
    let replicas = brokers
        .split(',')
        .map(|b| b.trim().parse::<i32>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| bad("a broker id is not a number"))?;
    if replicas.is_empty() || replicas.iter().any(|b| *b < 0) {
        return Err(bad("broker ids must be >= 0"));
    }
    Ok(PartitionReassignment {
        partition,
        replicas,
    })
}

fn ids(v: &[i32]) -> String {
    v.iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Prints topic descriptions in CLI.md's shape (JSON) or kafka-topics.sh's (table).
pub fn print_descriptions(output: OutputFormat, topics: &[TopicDescription]) {
    match output {
        OutputFormat::Json => {
            let topics: Vec<Value> = topics.iter().map(description_json).collect();
            println!("{}", json!({ "topics": topics }));
        }
        OutputFormat::Table => {
            for d in topics {
                let t = d.topic.clone().unwrap_or_default();
                let config = t
                    .config
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
                println!(
                    "Topic: {}\tTopicId: {}\tPartitionCount: {}\tReplicationFactor: {}\tScheduled: {}\tConfigs: {}",
                    t.name,
                    t.id,
                    t.partitions.len(),
                    replication_factor(&t),
                    scheduled_pending(d),
                    config
                );
                for p in &t.partitions {
                    let leader = p.leader.map_or("none".to_owned(), |l| l.to_string());
                    let mut line = format!(
                        "\tTopic: {}\tPartition: {}\tLeader: {}\tLeaderEpoch: {}\tReplicas: {}\tIsr: {}",
                        t.name,
                        p.partition,
                        leader,
                        p.leader_epoch,
                        ids(&p.replicas),
                        ids(&p.isr)
                    );
                    if !p.adding_replicas.is_empty() || !p.removing_replicas.is_empty() {
                        line.push_str(&format!(
                            "\tAdding: {}\tRemoving: {}",
                            ids(&p.adding_replicas),
                            ids(&p.removing_replicas)
                        ));
                    }
                    if !p.offline_replicas.is_empty() {
                        line.push_str(&format!("\tOffline: {}", ids(&p.offline_replicas)));
                    }
                    if let Some(o) = d.offsets.iter().find(|o| o.partition == p.partition) {
                        line.push_str(&format!(
                            "\tLogStart: {}\tHighWatermark: {}\tLogEnd: {}",
                            o.log_start_offset, o.high_watermark, o.log_end_offset
                        ));
                        // Only when a transaction holds read-committed readers back.
                        if o.last_stable_offset < o.high_watermark {
                            line.push_str(&format!("\tLastStable: {}", o.last_stable_offset));
                        }
                    }
                    println!("{line}");
                }
            }
        }
    }
}

fn description_json(d: &TopicDescription) -> Value {
    let t = d.topic.clone().unwrap_or_default();
    let partitions: Vec<Value> = t
        .partitions
        .iter()
        .map(|p| {
            let o = d.offsets.iter().find(|o| o.partition == p.partition);
            json!({
                "partition": p.partition,
                "leader": p.leader,
                "leader_epoch": p.leader_epoch,
                "replicas": p.replicas,
                "isr": p.isr,
                "adding_replicas": p.adding_replicas,
                "removing_replicas": p.removing_replicas,
                "offline_replicas": p.offline_replicas,
                "log_start_offset": o.map(|o| o.log_start_offset),
                "high_watermark": o.map(|o| o.high_watermark),
                "log_end_offset": o.map(|o| o.log_end_offset),
                "last_stable_offset": o.map(|o| o.last_stable_offset),
            })
        })
        .collect();
    json!({
        "name": t.name,
        "id": t.id,
        "replication_factor": replication_factor(&t),
        "partitions": partitions,
        "config": t.config,
        "scheduled_pending": scheduled_pending(d),
    })
}

/// Delayed records of the topic pending in the cluster's timers (summed over brokers).
fn scheduled_pending(d: &TopicDescription) -> u64 {
    d.scheduled.iter().map(|s| s.records).sum()
}
