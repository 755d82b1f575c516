//! The checker: given what the clients saw (acknowledgements, consumed records, the
//! group's commit history) and what every replica holds once the brokers stopped, lists
//! every anomaly, Jepsen-style. Pure functions over plain data, so fabricated histories
//! prove each check fires (the tests below).
//!
//! Checks:
//! - every acknowledged record is on every in-sync replica, exactly at its acknowledged
//!   offset (`Lost`), and no value is stored twice in any replica (`Duplicate`);
//! - replicas are identical below the high watermark (`Divergent`);
//! - per partition, a writer's acknowledged records are in send order (`Reordered`);
//! - a consumer's offsets only grow within a member's session of a partition
//!   (`ConsumerWentBack`), and every record it read is the one stored at that offset
//!   (`ReadUncommitted`: it read something above the high watermark that was later
//!   truncated, or something that never existed);
//! - the group's committed offset of a partition never decreases in the commit log
//!   (`CommitRegressed`) and never passes the high watermark (`CommitBeyondHighWatermark`);
//! - the cluster returns to a full ISR after healing (`NotRecovered`).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

/// One acknowledged record: `w<writer>-<seq>` at `partition`@`offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    pub writer: u32,
    pub seq: u64,
    pub partition: u32,
    pub offset: i64,
}

/// One record a group member read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumed {
    pub member: u32,
    /// Which unbroken holding of the partition by the member it was read in.
    pub session: u64,
    pub partition: u32,
    pub offset: i64,
    pub value: String,
}

/// One replica of a partition, read from the stopped broker's files.
#[derive(Debug, Clone, Default)]
pub struct Replica {
    pub broker: i32,
    /// In the ISR when the brokers stopped.
    pub in_isr: bool,
    /// (offset, value), ascending.
    pub records: Vec<(i64, String)>,
}

/// Everything a run observed.
#[derive(Debug, Clone, Default)]
pub struct History {
    pub acks: Vec<Ack>,
    /// Per partition: its replicas.
    pub replicas: BTreeMap<u32, Vec<Replica>>,
    /// Per partition: the high watermark (the highest any replica or leader reported).
    pub high_watermarks: BTreeMap<u32, i64>,
    pub consumed: Vec<Consumed>,
    /// Per replica of the group's offsets partition: (broker, [(partition, offset)]) in
    /// log order.
    pub commits: Vec<(i32, Vec<(u32, i64)>)>,
    /// How long the cluster took to get every partition's full ISR back after healing;
    /// `None`: not within the bound.
    pub recovery: Option<Duration>,
    /// What was waited for, when it did not recover.
    pub recovery_note: String,
}

/// One violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Anomaly {
    Lost {
        value: String,
        partition: u32,
        offset: i64,
        broker: i32,
        found: Option<String>,
    },
    Duplicate {
        value: String,
        broker: i32,
        places: Vec<(u32, i64)>,
    },
    Divergent {
        partition: u32,
        offset: i64,
        broker: i32,
        theirs: Option<String>,
        reference_broker: i32,
        reference: Option<String>,
    },
    Reordered {
        writer: u32,
        partition: u32,
        earlier: (u64, i64),
        later: (u64, i64),
    },
    ConsumerWentBack {
        member: u32,
        partition: u32,
        from: i64,
        to: i64,
    },
    ReadUncommitted {
        member: u32,
        partition: u32,
        offset: i64,
        read: String,
        stored: Option<String>,
    },
    CommitRegressed {
        broker: i32,
        partition: u32,
        from: i64,
        to: i64,
    },
    CommitBeyondHighWatermark {
        partition: u32,
        offset: i64,
        high_watermark: i64,
    },
    NotRecovered(String),
}

impl Anomaly {
    /// The anomaly's class, for the summary.
    pub fn kind(&self) -> &'static str {
        match self {
            Anomaly::Lost { .. } => "lost",
            Anomaly::Duplicate { .. } => "duplicate",
            Anomaly::Divergent { .. } => "divergent",
            Anomaly::Reordered { .. } => "reordered",
            Anomaly::ConsumerWentBack { .. } => "consumer-went-back",
            Anomaly::ReadUncommitted { .. } => "read-uncommitted",
            Anomaly::CommitRegressed { .. } => "commit-regressed",
            Anomaly::CommitBeyondHighWatermark { .. } => "commit-beyond-hw",
            Anomaly::NotRecovered(_) => "not-recovered",
        }
    }
}

impl fmt::Display for Anomaly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Anomaly::Lost {
                value,
                partition,
                offset,
                broker,
                found,
            } => write!(
                f,
                "lost: {value} acknowledged at {partition}@{offset} is not on in-sync broker {broker} (holds {found:?})"
            ),
            Anomaly::Duplicate {
                value,
                broker,
                places,
            } => write!(f, "duplicate: {value} stored at {places:?} on broker {broker}"),
            Anomaly::Divergent {
                partition,
                offset,
                broker,
                theirs,
                reference_broker,
                reference,
            } => write!(
                f,
                "divergent: {partition}@{offset} below the high watermark is {theirs:?} on broker {broker} but {reference:?} on broker {reference_broker}"
            ),
            Anomaly::Reordered {
                writer,
                partition,
                earlier,
                later,
            } => write!(
                f,
                "reordered: writer {writer} in partition {partition}: record {} at offset {} but record {} at offset {}",
                earlier.0, earlier.1, later.0, later.1
            ),
            Anomaly::ConsumerWentBack {
                member,
                partition,
                from,
                to,
            } => write!(
                f,
                "consumer went back: member {member} read partition {partition} offset {to} after {from} in one session"
            ),
            Anomaly::ReadUncommitted {
                member,
                partition,
                offset,
                read,
                stored,
            } => write!(
                f,
                "read uncommitted: member {member} read {read} at {partition}@{offset}, the log holds {stored:?}"
            ),
            Anomaly::CommitRegressed {
                broker,
                partition,
                from,
                to,
            } => write!(
                f,
                "commit regressed: partition {partition} committed {to} after {from} (offsets log on broker {broker})"
            ),
            Anomaly::CommitBeyondHighWatermark {
                partition,
                offset,
                high_watermark,
            } => write!(
                f,
                "commit beyond high watermark: partition {partition} committed {offset} > {high_watermark}"
            ),
            Anomaly::NotRecovered(what) => write!(f, "not recovered: {what}"),
        }
    }
}

/// Every anomaly in `h`.
pub fn check(h: &History) -> Vec<Anomaly> {
    let mut out = Vec::new();
    check_acks(h, &mut out);
    check_replicas(h, &mut out);
    check_order(h, &mut out);
    check_consumers(h, &mut out);
    check_commits(h, &mut out);
    if h.recovery.is_none() {
        out.push(Anomaly::NotRecovered(h.recovery_note.clone()));
    }
    out
}

fn value_at(r: &Replica, offset: i64) -> Option<&str> {
    r.records
        .binary_search_by_key(&offset, |(o, _)| *o)
        .ok()
        .map(|i| r.records[i].1.as_str())
}

fn check_acks(h: &History, out: &mut Vec<Anomaly>) {
    for a in &h.acks {
        let value = super::load::value_of(a.writer, a.seq);
        let replicas = h.replicas.get(&a.partition).map_or(&[][..], |v| &v[..]);
        if !replicas.iter().any(|r| r.in_isr) {
            out.push(Anomaly::Lost {
                value,
                partition: a.partition,
                offset: a.offset,
                broker: -1,
                found: None,
            });
            continue;
        }
        for r in replicas.iter().filter(|r| r.in_isr) {
            let found = value_at(r, a.offset);
            if found != Some(value.as_str()) {
                out.push(Anomaly::Lost {
                    value: value.clone(),
                    partition: a.partition,
                    offset: a.offset,
                    broker: r.broker,
                    found: found.map(str::to_owned),
                });
            }
        }
    }
}

fn check_replicas(h: &History, out: &mut Vec<Anomaly>) {
    // No value twice in any replica (across all partitions of the topic).
    let brokers: std::collections::BTreeSet<i32> = h
        .replicas
        .values()
        .flat_map(|rs| rs.iter().map(|r| r.broker))
        .collect();
    for broker in brokers {
        let mut places: HashMap<&str, Vec<(u32, i64)>> = HashMap::new();
        for (p, rs) in &h.replicas {
            for r in rs.iter().filter(|r| r.broker == broker) {
                for (o, v) in &r.records {
                    places.entry(v.as_str()).or_default().push((*p, *o));
                }
            }
        }
        let mut dups: Vec<(&str, Vec<(u32, i64)>)> =
            places.into_iter().filter(|(_, p)| p.len() > 1).collect();
        dups.sort();
        for (value, places) in dups {
            out.push(Anomaly::Duplicate {
                value: value.to_owned(),
                broker,
                places,
            });
        }
    }
    // Identical below the high watermark, against the in-sync replica holding the most.
    for (p, rs) in &h.replicas {
        let hw = h.high_watermarks.get(p).copied().unwrap_or(0);
        let Some(reference) = rs
            .iter()
            .filter(|r| r.in_isr)
            .max_by_key(|r| r.records.len())
        else {
            continue;
        };
        for r in rs
            .iter()
            .filter(|r| r.in_isr && r.broker != reference.broker)
        {
            // Report the first differing offset only: one divergence, not thousands.
            let first = (0..hw).find(|o| value_at(r, *o) != value_at(reference, *o));
            if let Some(offset) = first {
                out.push(Anomaly::Divergent {
                    partition: *p,
                    offset,
                    broker: r.broker,
                    theirs: value_at(r, offset).map(str::to_owned),
                    reference_broker: reference.broker,
                    reference: value_at(reference, offset).map(str::to_owned),
                });
            }
        }
    }
}

fn check_order(h: &History, out: &mut Vec<Anomaly>) {
    let mut by: BTreeMap<(u32, u32), Vec<(u64, i64)>> = BTreeMap::new();
    for a in &h.acks {
        by.entry((a.writer, a.partition))
            .or_default()
            .push((a.seq, a.offset));
    }
    for ((writer, partition), mut list) in by {
        list.sort();
        for w in list.windows(2) {
            if w[1].1 <= w[0].1 {
                out.push(Anomaly::Reordered {
                    writer,
                    partition,
                    earlier: w[0],
                    later: w[1],
                });
            }
        }
    }
}

fn check_consumers(h: &History, out: &mut Vec<Anomaly>) {
    let mut last: HashMap<(u32, u64, u32), i64> = HashMap::new();
    for c in &h.consumed {
        if let Some(prev) = last.insert((c.member, c.session, c.partition), c.offset) {
            if c.offset <= prev {
                out.push(Anomaly::ConsumerWentBack {
                    member: c.member,
                    partition: c.partition,
                    from: prev,
                    to: c.offset,
                });
            }
        }
        let reference = h.replicas.get(&c.partition).and_then(|rs| {
            rs.iter()
                .filter(|r| r.in_isr)
                .max_by_key(|r| r.records.len())
        });
        let stored = reference.and_then(|r| value_at(r, c.offset));
        if stored != Some(c.value.as_str()) {
            out.push(Anomaly::ReadUncommitted {
                member: c.member,
                partition: c.partition,
                offset: c.offset,
                read: c.value.clone(),
                stored: stored.map(str::to_owned),
            });
        }
    }
}

fn check_commits(h: &History, out: &mut Vec<Anomaly>) {
    for (broker, commits) in &h.commits {
        let mut last: BTreeMap<u32, i64> = BTreeMap::new();
        for &(p, o) in commits {
            if let Some(prev) = last.insert(p, o) {
                if o < prev {
                    out.push(Anomaly::CommitRegressed {
                        broker: *broker,
                        partition: p,
                        from: prev,
                        to: o,
                    });
                }
            }
        }
        for (p, o) in last {
            if let Some(&hw) = h.high_watermarks.get(&p) {
                if o > hw {
                    out.push(Anomaly::CommitBeyondHighWatermark {
                        partition: p,
                        offset: o,
                        high_watermark: hw,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clean history: two writers over two partitions, three in-sync replicas, a
    /// consumer that read everything, monotonic commits.
    fn clean() -> History {
        let mut h = History {
            recovery: Some(Duration::from_secs(1)),
            ..Default::default()
        };
        for p in 0..2u32 {
            let mut records = Vec::new();
            for i in 0..10u64 {
                let writer = (i % 2) as u32;
                let seq = i / 2 * 2 + u64::from(p);
                records.push((i as i64, super::super::load::value_of(writer, seq)));
                h.acks.push(Ack {
                    writer,
                    seq,
                    partition: p,
                    offset: i as i64,
                });
                h.consumed.push(Consumed {
                    member: 1,
                    session: 1,
                    partition: p,
                    offset: i as i64,
                    value: records.last().unwrap().1.clone(),
                });
            }
            h.replicas.insert(
                p,
                (1..=3)
                    .map(|broker| Replica {
                        broker,
                        in_isr: true,
                        records: records.clone(),
                    })
                    .collect(),
            );
            h.high_watermarks.insert(p, 10);
        }
        h.commits = (1..=3)
            .map(|b| (b, vec![(0, 3), (1, 2), (0, 7), (1, 10), (0, 10)]))
            .collect();
        h
    }

    fn kinds(h: &History) -> Vec<&'static str> {
        check(h).iter().map(Anomaly::kind).collect()
    }

    #[test]
    fn a_clean_history_has_no_anomalies() {
        assert_eq!(check(&clean()), vec![]);
    }

    #[test]
    fn a_lost_acknowledged_record_is_caught() {
        let mut h = clean();
        h.replicas.get_mut(&1).unwrap()[2].records.remove(4);
        let found = check(&h);
        assert!(
            found.iter().any(|a| matches!(
                a,
                Anomaly::Lost {
                    broker: 3,
                    partition: 1,
                    offset: 4,
                    ..
                }
            )),
            "{found:?}"
        );
        // The same gap on a replica outside the ISR is not a loss.
        let mut h = clean();
        let r = &mut h.replicas.get_mut(&1).unwrap()[2];
        r.records.truncate(3);
        r.in_isr = false;
        assert_eq!(check(&h), vec![]);
    }

    #[test]
    fn an_acknowledged_record_at_another_offset_is_caught() {
        let mut h = clean();
        h.acks[3].offset = 2;
        assert!(kinds(&h).contains(&"lost"));
    }

    #[test]
    fn a_duplicate_is_caught() {
        let mut h = clean();
        for r in h.replicas.get_mut(&0).unwrap() {
            let v = r.records[1].1.clone();
            r.records.push((10, v));
        }
        assert!(kinds(&h).contains(&"duplicate"));
    }

    #[test]
    fn divergent_replicas_below_the_high_watermark_are_caught() {
        let mut h = clean();
        h.replicas.get_mut(&0).unwrap()[1].records[9].1 = "w9-999".into();
        assert!(kinds(&h).contains(&"divergent"));
        // Above the high watermark, replicas may differ.
        let mut h = clean();
        for r in h.replicas.get_mut(&0).unwrap() {
            r.records.push((10, format!("w7-{}", r.broker)));
        }
        h.replicas.get_mut(&0).unwrap()[0].records.pop();
        assert_eq!(check(&h), vec![]);
    }

    #[test]
    fn reordered_acknowledgements_are_caught() {
        let mut h = clean();
        // Writer 0's records 0 and 2 in partition 0 swap offsets (replicas agree).
        let offset_first = h.acks[0].offset;
        h.acks[0].offset = h.acks[2].offset;
        h.acks[2].offset = offset_first;
        for r in h.replicas.get_mut(&0).unwrap() {
            let first = r.records[0].1.clone();
            r.records[0].1 = r.records[2].1.clone();
            r.records[2].1 = first;
        }
        for c in h.consumed.iter_mut().filter(|c| c.partition == 0) {
            c.value = value_at(&h.replicas[&0][0], c.offset).unwrap().to_owned();
        }
        assert_eq!(kinds(&h), vec!["reordered"]);
    }

    #[test]
    fn a_consumer_going_back_within_a_session_is_caught() {
        let mut h = clean();
        let again = h.consumed[2].clone();
        h.consumed.push(again.clone());
        assert_eq!(kinds(&h), vec!["consumer-went-back"]);
        // In a new session (the partition was reassigned), rereading is allowed.
        h.consumed.last_mut().unwrap().session = 2;
        assert_eq!(check(&h), vec![]);
    }

    #[test]
    fn reading_a_record_that_was_truncated_is_caught() {
        let mut h = clean();
        h.consumed.push(Consumed {
            member: 2,
            session: 9,
            partition: 0,
            offset: 10,
            value: "w5-1".into(),
        });
        assert_eq!(kinds(&h), vec!["read-uncommitted"]);
    }

    #[test]
    fn a_regressed_commit_is_caught() {
        let mut h = clean();
        h.commits[0].1.push((0, 4));
        let found = check(&h);
        assert_eq!(
            found,
            vec![Anomaly::CommitRegressed {
                broker: 1,
                partition: 0,
                from: 10,
                to: 4
            }]
        );
    }

    #[test]
    fn a_commit_beyond_the_high_watermark_is_caught() {
        let mut h = clean();
        h.commits[1].1.push((1, 11));
        assert_eq!(kinds(&h), vec!["commit-beyond-hw"]);
    }

    #[test]
    fn not_recovering_is_an_anomaly() {
        let mut h = clean();
        h.recovery = None;
        h.recovery_note = "ISR of nemesis-3 is [1, 2]".into();
        assert_eq!(kinds(&h), vec!["not-recovered"]);
    }
}
