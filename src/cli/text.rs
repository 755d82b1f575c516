//! Printing record bytes: keys, values and headers are arbitrary bytes, and a terminal or a
//! script reading table output must be able to tell them apart from U+FFFD.
//!
//! Table output prints valid UTF-8 as is and every byte of an invalid sequence as `\xNN`
//! (`[0xff, b'a']` prints `\xffa`). JSON output prints valid UTF-8 as a string and anything
//! else as `{"base64": "..."}` (CLI.md).

use base64::Engine as _;
use bytes::Bytes;
use serde_json::{json, Value};

/// `bytes` for table output: UTF-8 as is, invalid bytes as `\xNN`; `null` for none.
pub fn table_text(bytes: Option<&[u8]>) -> String {
    let Some(bytes) = bytes else {
        return "null".to_owned();
    };
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// `bytes` for JSON output: a string when valid UTF-8, else `{"base64": "..."}`; `null`
/// for none.
pub fn json_bytes(bytes: Option<&[u8]>) -> Value {
    match bytes {
        None => Value::Null,
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => Value::String(s.to_owned()),
            Err(_) => json!({ "base64": base64::engine::general_purpose::STANDARD.encode(b) }),
        },
    }
}

/// Record headers for JSON output: a list of `{"key": .., "value": ..}` in record order,
/// duplicates kept (an object would drop all but one value of a repeated key).
pub fn headers_json(headers: &[(String, Option<Bytes>)]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|(k, v)| json!({"key": k, "value": json_bytes(v.as_deref())}))
            .collect(),
    )
}

/// Record headers for table output, like kafka-console-consumer's `print.headers`:
/// `k1:v1,k2:v2`, or `NO_HEADERS`.
pub fn headers_table(headers: &[(String, Option<Bytes>)]) -> String {
    if headers.is_empty() {
        return "NO_HEADERS".to_owned();
    }
    headers
        .iter()
        .map(|(k, v)| {
            format!(
                "{}:{}",
                table_text(Some(k.as_bytes())),
                table_text(v.as_deref())
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `n` and a noun in the right number: `1 partition`, `3 partitions`.
pub fn count(n: usize, singular: &str, plural: &str) -> String {
    if n == 1 {
        format!("1 {singular}")
    } else {
        format!("{n} {plural}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_text_escapes_invalid_utf8_instead_of_replacing_it() {
        assert_eq!(table_text(Some(b"plain")), "plain");
        assert_eq!(table_text(Some("h\u{e9}".as_bytes())), "h\u{e9}");
        assert_eq!(table_text(Some(&[0xff, b'a', 0xc3])), "\\xffa\\xc3");
        assert_eq!(
            table_text(Some(&[0x00, 0x9f, 0x92, 0x96])),
            "\u{0}\\x9f\\x92\\x96"
        );
        assert_eq!(table_text(None), "null");
        assert!(!table_text(Some(&[0xfe, 0xff])).contains('\u{fffd}'));
    }

    #[test]
    fn headers_keep_order_and_duplicates() {
        let h = vec![
            ("a".to_owned(), Some(Bytes::from_static(b"1"))),
            ("a".to_owned(), Some(Bytes::from_static(&[0xff]))),
            ("b".to_owned(), None),
        ];
        assert_eq!(
            headers_json(&h),
            json!([{"key": "a", "value": "1"}, {"key": "a", "value": {"base64": "/w=="}},
                   {"key": "b", "value": null}])
        );
        assert_eq!(headers_table(&h), "a:1,a:\\xff,b:null");
        assert_eq!(headers_table(&[]), "NO_HEADERS");
    }

    #[test]
    fn counts_agree_in_number() {
        assert_eq!(count(1, "partition", "partitions"), "1 partition");
        assert_eq!(count(0, "partition", "partitions"), "0 partitions");
        assert_eq!(count(3, "partition", "partitions"), "3 partitions");
    }
}
