//! Validation of user input to topic admin: names, counts and configuration. Each error
//! names the field, the value and the limit.

use std::collections::BTreeMap;

use super::error::MetadataError;
use crate::error_code::ErrorCode;
use crate::topic_config::TopicConfig;

/// Longest topic name (Kafka's limit: a partition directory name must fit in 255 bytes).
pub const TOPIC_NAME_LEN_MAX: usize = 249;

/// Most partitions one topic may have.
pub const PARTITIONS_PER_TOPIC_MAX: u32 = 10_000;

/// Names starting with this are reserved for internal topics (`__consumer_offsets`, later
/// `__transaction_state`): only the brokers and controllers create, alter or delete them.
pub const RESERVED_TOPIC_PREFIX: &str = "__";

/// Whether `name` is reserved for an internal topic.
pub fn is_reserved_topic(name: &str) -> bool {
    name.starts_with(RESERVED_TOPIC_PREFIX)
}

/// Refuses a client's create, alter or delete (`action`) of a reserved internal topic.
pub fn check_client_may_change(name: &str, action: &str) -> Result<(), MetadataError> {
    if is_reserved_topic(name) {
        return Err(MetadataError::new(
            ErrorCode::InvalidTopic,
            format!(
                "cannot {action} topic '{name}': names starting with '{RESERVED_TOPIC_PREFIX}' are reserved for internal topics, which only the cluster itself manages"
            ),
        ));
    }
    Ok(())
}

/// Checks `min.insync.replicas` in `config` (when set) against the replication factor:
/// more would make every `acks=all` produce fail. A factor of 0 is left to
/// [`validate_replication_factor`].
pub fn validate_min_insync_replicas(
    config: &BTreeMap<String, String>,
    replication_factor: u32,
) -> Result<(), MetadataError> {
    if replication_factor == 0 {
        return Ok(());
    }
    let parsed = TopicConfig::from_pairs(config.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map_err(|e| MetadataError::new(ErrorCode::InvalidConfig, e.to_string()))?;
    if parsed.min_insync_replicas > replication_factor {
        return Err(MetadataError::new(
            ErrorCode::InvalidConfig,
            format!(
                "min.insync.replicas {} is larger than the replication factor {replication_factor}: every acks=all produce would fail",
                parsed.min_insync_replicas
            ),
        ));
    }
    Ok(())
}

/// Checks a topic name against `[a-zA-Z0-9._-]{1,249}`, excluding `.` and `..`.
pub fn validate_topic_name(name: &str) -> Result<(), MetadataError> {
    let invalid = |why: String| Err(MetadataError::new(ErrorCode::InvalidTopic, why));
    if name.is_empty() {
        return invalid("topic name must not be empty".to_owned());
    }
    if name.len() > TOPIC_NAME_LEN_MAX {
        return invalid(format!(
            "topic name is {} characters long; the limit is {TOPIC_NAME_LEN_MAX}",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return invalid(format!("topic name '{name}' is reserved"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return invalid(format!(
            "topic name '{}' contains {c:?}; allowed are ASCII letters, digits, '.', '_' and '-'",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// Checks a partition count for a new topic.
pub fn validate_partition_count(partitions: u32) -> Result<(), MetadataError> {
    if partitions == 0 || partitions > PARTITIONS_PER_TOPIC_MAX {
        return Err(MetadataError::new(
            ErrorCode::InvalidPartitions,
            format!(
                "partitions must be between 1 and {PARTITIONS_PER_TOPIC_MAX}, got {partitions}"
            ),
        ));
    }
    Ok(())
}

/// Checks a replication factor against the number of brokers that can take replicas.
pub fn validate_replication_factor(
    replication_factor: u32,
    unfenced_brokers: usize,
) -> Result<(), MetadataError> {
    if replication_factor == 0 {
        return Err(MetadataError::new(
            ErrorCode::InvalidReplicationFactor,
            "replication factor must be at least 1, got 0",
        ));
    }
    if replication_factor as usize > unfenced_brokers {
        return Err(MetadataError::new(
            ErrorCode::InvalidReplicationFactor,
            format!(
                "replication factor {replication_factor} is larger than the {unfenced_brokers} live (unfenced) brokers"
            ),
        ));
    }
    Ok(())
}

/// Checks every key and value of a topic configuration.
pub fn validate_topic_config(config: &BTreeMap<String, String>) -> Result<(), MetadataError> {
    TopicConfig::from_pairs(config.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map(|_| ())
        .map_err(|e| MetadataError::new(ErrorCode::InvalidConfig, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names() {
        for ok in ["a", "orders", "Orders.v2_eu-west", &"x".repeat(249)] {
            assert_eq!(validate_topic_name(ok), Ok(()), "{ok}");
        }
        for bad in ["", ".", "..", "a b", "a/b", "ä", "t\n", &"x".repeat(250)] {
            let err = validate_topic_name(bad).unwrap_err();
            assert_eq!(err.code, ErrorCode::InvalidTopic, "{bad:?}");
        }
        let err = validate_topic_name("a/b").unwrap_err();
        assert!(err.message.contains("'/'"), "{}", err.message);
    }

    #[test]
    fn clients_may_not_change_reserved_topics() {
        for name in ["__consumer_offsets", "__transaction_state", "__x"] {
            let e = check_client_may_change(name, "create").unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidTopic);
            assert!(e.message.contains("reserved"), "{}", e.message);
            assert!(e.message.contains(name), "{}", e.message);
        }
        for name in ["_x", "a__b", "consumer_offsets"] {
            assert_eq!(check_client_may_change(name, "create"), Ok(()), "{name}");
        }
    }

    #[test]
    fn min_insync_replicas_at_most_the_replication_factor() {
        let c = |v: &str| BTreeMap::from([("min.insync.replicas".to_owned(), v.to_owned())]);
        assert!(validate_min_insync_replicas(&c("3"), 3).is_ok());
        assert!(validate_min_insync_replicas(&BTreeMap::new(), 1).is_ok());
        let e = validate_min_insync_replicas(&c("4"), 3).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidConfig);
        assert!(e.message.contains("min.insync.replicas 4"), "{}", e.message);
        assert!(e.message.contains("replication factor 3"), "{}", e.message);
    }

    #[test]
    fn counts_and_factors() {
        assert!(validate_partition_count(1).is_ok());
        assert_eq!(
            validate_partition_count(0).unwrap_err().code,
            ErrorCode::InvalidPartitions
        );
        assert!(validate_partition_count(PARTITIONS_PER_TOPIC_MAX + 1).is_err());
        assert!(validate_replication_factor(3, 3).is_ok());
        let e = validate_replication_factor(4, 3).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidReplicationFactor);
        assert!(e.message.contains("3 live"), "{}", e.message);
        assert!(validate_replication_factor(0, 3).is_err());
    }

    #[test]
    fn config_keys_and_values() {
        let mut c = BTreeMap::new();
        c.insert("retention.ms".to_owned(), "60000".to_owned());
        assert!(validate_topic_config(&c).is_ok());
        c.insert("retention.ms".to_owned(), "soon".to_owned());
        let e = validate_topic_config(&c).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidConfig);
        assert!(e.message.contains("retention.ms"), "{}", e.message);
        let mut c = BTreeMap::new();
        c.insert("no.such.key".to_owned(), "1".to_owned());
        assert!(validate_topic_config(&c)
            .unwrap_err()
            .message
            .contains("no.such.key"));
    }
}
