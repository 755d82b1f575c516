//! Pure rule: which replica a consumer in a rack reads a partition from (KIP-392's
//! rack-aware selector). Used by the Rust consumer (from Metadata) and by the leader
//! answering Kafka clients (`preferred_read_replica`).

/// The in-sync follower a consumer in `rack` reads from: the first of `followers`
/// (in-sync replicas other than the leader, with their racks) in that rack. None (read
/// from the leader) when the consumer has no rack, the leader is in its rack, or no
/// in-sync follower is.
pub fn read_replica<'a, T>(
    rack: Option<&str>,
    leader_rack: Option<&str>,
    followers: impl IntoIterator<Item = (T, Option<&'a str>)>,
) -> Option<T> {
    let rack = rack.filter(|r| !r.is_empty())?;
    if leader_rack == Some(rack) {
        return None;
    }
    followers
        .into_iter()
        .find(|(_, r)| *r == Some(rack))
        .map(|(replica, _)| replica)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_reads_from_a_follower_in_its_rack_only_when_the_leader_is_elsewhere() {
        let followers = [(2, Some("b")), (3, None), (4, Some("c")), (5, Some("b"))];
        assert_eq!(read_replica(None, Some("a"), followers), None, "no rack");
        assert_eq!(
            read_replica(Some(""), Some("a"), followers),
            None,
            "no rack"
        );
        assert_eq!(
            read_replica(Some("a"), Some("a"), followers),
            None,
            "the leader is in the rack"
        );
        assert_eq!(read_replica(Some("b"), Some("a"), followers), Some(2));
        assert_eq!(read_replica(Some("c"), None, followers), Some(4));
        assert_eq!(
            read_replica(Some("d"), Some("a"), followers),
            None,
            "no replica in the rack"
        );
    }
}
