//! Message filters, as RocketMQ offers them: tag expressions (`*`, `TagA || TagB`) and
//! SQL92-style expressions over a record's properties (`region = 'eu' AND amount > 100`).
//! Parsing refuses a bad expression with a message that points at the problem; matching
//! is pure and cheap. [`tag_hash`] is the hash the per-segment tag index stores, so a
//! fetch can skip records without decoding them.

pub mod sql;

use std::collections::BTreeSet;

use crate::record::tag::tag_of;
use crate::record::RecordView;

pub use sql::SqlFilter;

/// Longest filter expression accepted (bytes).
pub const EXPRESSION_BYTES_MAX: usize = 4096;
pub use crate::record::tag::{tag_hash, TAG_BYTES_MAX};

/// Why an expression was refused: what is wrong and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FilterError(pub String);

/// What a filtered fetch keeps: records whose tag passes a tag expression, or whose
/// properties pass a SQL expression.
#[derive(Debug, Clone)]
pub enum RecordFilter {
    /// A tag expression.
    Tag(TagFilter),
    /// A SQL92-style expression over properties (headers; `TAGS` is the tag).
    Sql(SqlFilter),
}

/// The property name a SQL filter uses for the record's tag, as in RocketMQ.
pub const TAGS_PROPERTY: &str = "TAGS";

impl RecordFilter {
    /// True when the filter keeps every record (`*`): a plain read serves it.
    pub fn keeps_everything(&self) -> bool {
        matches!(self, RecordFilter::Tag(TagFilter::All))
    }

    /// The tag hashes a tag-index scan looks for; `None` when records must be decoded
    /// to decide (SQL) or every record passes.
    pub fn tag_hashes(&self) -> Option<BTreeSet<u32>> {
        match self {
            RecordFilter::Tag(t) => t.hashes(),
            RecordFilter::Sql(_) => None,
        }
    }

    /// Whether a decoded record passes (exact: a tag-hash match is re-checked here).
    pub fn matches(&self, record: &RecordView<'_>) -> bool {
        match self {
            RecordFilter::Tag(t) => t.matches(tag_of(record.headers())),
            RecordFilter::Sql(sql) => sql.matches(|name| {
                let header = record
                    .headers()
                    .filter(|(k, _)| *k == name)
                    .last()
                    .and_then(|(_, v)| std::str::from_utf8(v?).ok());
                match header {
                    None if name == TAGS_PROPERTY => tag_of(record.headers()),
                    found => found,
                }
            }),
        }
    }
}

/// A tag expression: every record, or records whose tag is one of a set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TagFilter {
    /// `*` (or an empty expression): every record, tagged or not.
    All,
    /// `A || B || ...`: records tagged with one of these.
    AnyOf(BTreeSet<String>),
}

impl TagFilter {
    /// Parses `*`, `TagA` or `TagA || TagB || ...` (spaces around tags ignored).
    pub fn parse(text: &str) -> Result<Self, FilterError> {
        if text.len() > EXPRESSION_BYTES_MAX {
            return Err(FilterError(format!(
                "the tag expression is {} bytes; the limit is {EXPRESSION_BYTES_MAX}",
                text.len()
            )));
        }
        let trimmed = text.trim();
        if trimmed.is_empty() || trimmed == "*" {
            return Ok(TagFilter::All);
        }
        let mut tags = BTreeSet::new();
        for (i, part) in trimmed.split("||").enumerate() {
            let tag = part.trim();
            let why = if tag.is_empty() {
                Some("is empty (two || in a row, or one at an end?)".to_owned())
            } else if tag == "*" {
                Some("is `*`, which stands alone: `*` means every tag".to_owned())
            } else {
                crate::record::tag::check_tag(tag).err()
            };
            if let Some(why) = why {
                return Err(FilterError(format!(
                    "tag {} of '{trimmed}' ('{tag}') {why}",
                    i + 1
                )));
            }
            tags.insert(tag.to_owned());
        }
        Ok(TagFilter::AnyOf(tags))
    }

    /// Whether a record with `tag` (None: untagged) passes.
    pub fn matches(&self, tag: Option<&str>) -> bool {
        match self {
            TagFilter::All => true,
            TagFilter::AnyOf(tags) => tag.is_some_and(|t| tags.contains(t)),
        }
    }

    /// The hashes of the tags to match (None: every record matches), for an index scan;
    /// a hash match is re-checked with [`TagFilter::matches`].
    pub fn hashes(&self) -> Option<BTreeSet<u32>> {
        match self {
            TagFilter::All => None,
            TagFilter::AnyOf(tags) => Some(tags.iter().map(|t| tag_hash(t)).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tag_expressions() {
        assert_eq!(TagFilter::parse("*").unwrap(), TagFilter::All);
        assert_eq!(TagFilter::parse("  ").unwrap(), TagFilter::All);
        let f = TagFilter::parse("TagA || TagB||TagC").unwrap();
        assert!(f.matches(Some("TagB")) && !f.matches(Some("TagD")) && !f.matches(None));
        assert!(TagFilter::All.matches(None));
        for (bad, says) in [
            ("A ||", "tag 2"),
            ("|| A", "tag 1"),
            ("A || * ", "stands alone"),
            ("A B", "' '"),
            ("A|B", "'|'"),
        ] {
            let e = TagFilter::parse(bad).unwrap_err().0;
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert!(TagFilter::parse(&"x".repeat(EXPRESSION_BYTES_MAX + 1)).is_err());
        assert_eq!(f.hashes().unwrap().len(), 3);
        assert_ne!(tag_hash(""), 0);
    }

    proptest! {
        #[test]
        fn a_parsed_tag_list_matches_exactly_its_tags(
            tags in proptest::collection::btree_set("[A-Za-z0-9_.-]{1,12}", 1..6),
            other in "[A-Za-z0-9_.-]{1,12}",
        ) {
            let text = tags.iter().cloned().collect::<Vec<_>>().join(" || ");
            let f = TagFilter::parse(&text).unwrap();
            for t in &tags {
                prop_assert!(f.matches(Some(t)));
                prop_assert!(f.hashes().unwrap().contains(&tag_hash(t)));
            }
            prop_assert_eq!(f.matches(Some(&other)), tags.contains(&other));
        }

        #[test]
        fn any_text_parses_or_is_refused_without_panicking(text in ".{0,64}") {
            let _ = TagFilter::parse(&text);
        }
    }
}
