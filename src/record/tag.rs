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
