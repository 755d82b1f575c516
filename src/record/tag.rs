//! A record's tag (RocketMQ's message tag): one short string, stored as the reserved
//! header [`TAG_HEADER`], so any client (Kafka clients too) can set and read it. The gRPC
//! API and the Rust client show it as a field of its own.

/// The header that holds a record's tag.
pub const TAG_HEADER: &str = "tidelog.tag";
/// Longest tag (bytes).
pub const TAG_BYTES_MAX: usize = 256;

/// Whether `tag` is a valid tag: 1 to [`TAG_BYTES_MAX`] bytes without whitespace or `|`
/// (tag expressions separate tags with `||`). The error says which rule it breaks.
pub fn check_tag(tag: &str) -> Result<(), String> {
    if tag.is_empty() {
        return Err("is empty".into());
    }
    if tag.len() > TAG_BYTES_MAX {
        return Err(format!(
            "is {} bytes; the limit is {TAG_BYTES_MAX}",
            tag.len()
        ));
    }
    if let Some(c) = tag.chars().find(|c| c.is_whitespace() || *c == '|') {
        return Err(format!("holds {c:?}; tags hold no whitespace or '|'"));
    }
    Ok(())
}

/// The tag among `headers`: the value of the last [`TAG_HEADER`] header, when it is a
/// valid tag.
pub fn tag_of<'a>(
    headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
) -> Option<&'a str> {
    headers
        .into_iter()
        .filter(|(k, _)| *k == TAG_HEADER)
        .last()
        .and_then(|(_, v)| std::str::from_utf8(v?).ok())
        .filter(|t| check_tag(t).is_ok())
}

/// The hash of a tag kept in the per-segment tag index: CRC32C of its bytes, with 0
/// reserved (a tag hashing to 0 is stored as 1), so an all-zero index entry is never valid.
pub fn tag_hash(tag: &str) -> u32 {
    match crc32c::crc32c(tag.as_bytes()) {
        0 => 1,
        h => h,
    }
}

/// A tagged record found while validating a batch: which batch of the buffer, its offset
/// delta in that batch, and its tag's [`tag_hash`]. The segment turns these into tag-index
/// entries once the batch has its offsets and position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagMark {
    /// Index of the batch in the appended buffer.
    pub batch: u32,
    /// Offset delta of the record in its batch.
    pub offset_delta: u32,
    /// [`tag_hash`] of its tag.
    pub hash: u32,
}

/// The tag hash of a decoded record, if it carries a valid tag.
pub fn record_tag_hash(record: &super::RecordView<'_>) -> Option<u32> {
    tag_of(record.headers()).map(tag_hash)
}

/// Appends a [`TagMark`] (as batch `batch`) for every tagged record of `batch`: the
/// records are decoded (decompressed if need be, up to `max_uncompressed_bytes`).
pub fn collect_tag_marks(
    batch: &super::RecordBatch<'_>,
    index: u32,
    max_uncompressed_bytes: usize,
    out: &mut Vec<TagMark>,
) -> Result<(), super::RecordError> {
    let base = batch.header().base_offset;
    batch.for_each_record(max_uncompressed_bytes, |r| {
        if let Some(hash) = record_tag_hash(&r) {
            out.push(TagMark {
                batch: index,
                offset_delta: (r.offset - base) as u32,
                hash,
            });
        }
        Ok(())
    })?;
    Ok(())
}

/// Takes the tag out of a stored record's headers: the tag, and the headers without the
/// tag header (kept when it holds no valid tag, so nothing is lost).
pub fn split_tag(headers: Vec<super::Header>) -> (Option<String>, Vec<super::Header>) {
    let tag =
        tag_of(headers.iter().map(|h| (h.key.as_str(), h.value.as_deref()))).map(str::to_owned);
    let headers = if tag.is_some() {
        headers
            .into_iter()
            .filter(|h| h.key != TAG_HEADER)
            .collect()
    } else {
        headers
    };
    (tag, headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_checked_and_found() {
        assert!(check_tag("TagA").is_ok());
        assert!(check_tag("").unwrap_err().contains("empty"));
        assert!(check_tag("a b").unwrap_err().contains("' '"));
        assert!(check_tag("a||b").unwrap_err().contains("'|'"));
        assert!(check_tag(&"x".repeat(TAG_BYTES_MAX + 1)).is_err());
        let headers = [
            ("h", Some(&b"1"[..])),
            (TAG_HEADER, Some(&b"A"[..])),
            (TAG_HEADER, Some(&b"B"[..])),
        ];
        assert_eq!(tag_of(headers), Some("B"));
        assert_eq!(tag_of([(TAG_HEADER, None)]), None);
        assert_eq!(tag_of([(TAG_HEADER, Some(&b"not a tag"[..]))]), None);
        assert_eq!(tag_of([(TAG_HEADER, Some(&[0xff][..]))]), None);
        let h = |k: &str, v: &[u8]| super::super::Header {
            key: k.into(),
            value: Some(bytes::Bytes::copy_from_slice(v)),
        };
        let (tag, rest) = split_tag(vec![h("a", b"1"), h(TAG_HEADER, b"T")]);
        assert_eq!((tag.as_deref(), rest.len()), (Some("T"), 1));
        let (tag, rest) = split_tag(vec![h(TAG_HEADER, b"not a tag")]);
        assert_eq!((tag, rest.len()), (None, 1));
    }
}
