//! One record inside a batch: its wire encoding and its decoded, owned form.
//!
//! ```text
//! length          varint   bytes after this field
//! attributes      int8     unused, 0
//! timestamp_delta varlong  from the batch's base timestamp
//! offset_delta    varint   from the batch's base offset
//! key_length      varint   -1 for a null key
//! key             bytes
//! value_length    varint   -1 for a null value (a tombstone)
//! value           bytes
//! header_count    varint
//!   key_length    varint   header keys are UTF-8 strings
//!   key           bytes
//!   value_length  varint   -1 for a null header value
//!   value         bytes
//! ```

use bytes::Bytes;

use super::varint::{self, Reader};
use super::RecordError;

/// A record header: a UTF-8 key and a nullable value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Header name.
    pub key: String,
    /// Header value; `None` is a null value.
    pub value: Option<Bytes>,
}

/// A decoded record with its absolute offset and timestamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Absolute offset (`base_offset + offset_delta`).
    pub offset: i64,
    /// Absolute timestamp in milliseconds (`base_timestamp + timestamp_delta`).
    pub timestamp: i64,
    /// Key; `None` is a null key.
    pub key: Option<Bytes>,
    /// Value; `None` is a null value (a tombstone).
    pub value: Option<Bytes>,
    /// Headers in wire order.
    pub headers: Vec<Header>,
}

/// Borrowed input for encoding one record.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordRef<'a> {
    /// Timestamp in milliseconds.
    pub timestamp: i64,
    /// Key; `None` is a null key.
    pub key: Option<&'a [u8]>,
    /// Value; `None` is a null value.
    pub value: Option<&'a [u8]>,
    /// Headers as (key, nullable value).
    pub headers: &'a [(&'a str, Option<&'a [u8]>)],
}

/// A record decoded in place: every field borrows from the batch's records block.
///
/// Decoding a view checks the whole structure (lengths, header keys as UTF-8) without
/// copying or allocating, so validation on the append path costs no more than a walk.
#[derive(Debug, Clone, Copy)]
pub struct RecordView<'a> {
    /// Absolute offset.
    pub offset: i64,
    /// Absolute timestamp in milliseconds.
    pub timestamp: i64,
    /// Key; `None` is a null key.
    pub key: Option<&'a [u8]>,
    /// Value; `None` is a null value.
    pub value: Option<&'a [u8]>,
    header_count: usize,
    headers: &'a [u8],
}

impl<'a> RecordView<'a> {
    /// Decodes one record from the front of `buf`, returning it and the rest of `buf`.
    pub fn decode(
        buf: &'a [u8],
        base_offset: i64,
        base_timestamp: i64,
    ) -> Result<(Self, &'a [u8]), RecordError> {
        let mut outer = Reader::new(buf);
        let length = outer.varint("record.length")?;
        if length < 0 {
            return Err(RecordError::Malformed {
                field: "record.length",
                reason: format!("negative length {length}"),
            });
        }
        let body = outer.bytes(length as usize, "record.length")?;
        let rest = &buf[outer.position()..];

        let mut r = Reader::new(body);
        let _attributes = r.u8("record.attributes")?;
        let timestamp_delta = r.varlong("record.timestamp_delta")?;
        let offset_delta = r.varint("record.offset_delta")?;
        let key = r.nullable_bytes("record.key")?;
        let value = r.nullable_bytes("record.value")?;
        let header_count = r.varint("record.header_count")?;
        if header_count < 0 || header_count as usize > r.remaining() {
            return Err(RecordError::Malformed {
                field: "record.header_count",
                reason: format!(
                    "{header_count} headers cannot fit in {} bytes",
                    r.remaining()
                ),
            });
        }
        let headers_start = r.position();
        for _ in 0..header_count {
            next_header(&mut r)?;
        }
        if r.remaining() != 0 {
            return Err(RecordError::Malformed {
                field: "record.length",
                reason: format!("{} unread bytes at the end of the record", r.remaining()),
            });
        }
        let offset =
            base_offset
                .checked_add(i64::from(offset_delta))
                .ok_or(RecordError::Malformed {
                    field: "record.offset_delta",
                    reason: "offset overflows".into(),
                })?;
        let view = RecordView {
            offset,
            timestamp: base_timestamp.wrapping_add(timestamp_delta),
            key,
            value,
            header_count: header_count as usize,
            headers: &body[headers_start..],
        };
        Ok((view, rest))
    }

    /// The headers, in wire order (already validated by [`RecordView::decode`]).
    pub fn headers(&self) -> impl Iterator<Item = (&'a str, Option<&'a [u8]>)> + 'a {
        let mut r = Reader::new(self.headers);
        (0..self.header_count).map_while(move |_| next_header(&mut r).ok())
    }

    /// An owned copy.
    pub fn to_record(&self) -> Record {
        self.build(Bytes::copy_from_slice)
    }

    /// A record whose key, value and header values share `owner`'s memory (no copy).
    ///
    /// # Panics
    /// If this view does not lie inside `owner` (it must be decoded from those bytes).
    pub fn to_shared_record(&self, owner: &Bytes) -> Record {
        self.build(|part| owner.slice_ref(part))
    }

    fn build(&self, bytes: impl Fn(&[u8]) -> Bytes) -> Record {
        Record {
            offset: self.offset,
            timestamp: self.timestamp,
            key: self.key.map(&bytes),
            value: self.value.map(&bytes),
            headers: self
                .headers()
                .map(|(key, value)| Header {
                    key: key.to_owned(),
                    value: value.map(&bytes),
                })
                .collect(),
        }
    }
}

fn next_header<'a>(r: &mut Reader<'a>) -> Result<(&'a str, Option<&'a [u8]>), RecordError> {
    let key = r
        .nullable_bytes("header.key")?
        .ok_or(RecordError::Malformed {
            field: "header.key",
            reason: "header key is null".into(),
        })?;
    let key = std::str::from_utf8(key).map_err(|_| RecordError::Malformed {
        field: "header.key",
        reason: "header key is not valid UTF-8".into(),
    })?;
    let value = r.nullable_bytes("header.value")?;
    Ok((key, value))
}

impl Record {
    /// Decodes one record from the front of `buf`, returning it and the rest of `buf`.
    pub fn decode(
        buf: &[u8],
        base_offset: i64,
        base_timestamp: i64,
    ) -> Result<(Record, &[u8]), RecordError> {
        let (view, rest) = RecordView::decode(buf, base_offset, base_timestamp)?;
        Ok((view.to_record(), rest))
    }
}

/// Appends the encoding of `record` (length prefix included) to `out`.
pub fn encode_record(
    out: &mut Vec<u8>,
    record: &RecordRef<'_>,
    offset_delta: i32,
    timestamp_delta: i64,
) {
    fn bytes_len(b: Option<&[u8]>) -> usize {
        match b {
            None => varint::varint_len(-1),
            Some(b) => varint::varint_len(b.len() as i32) + b.len(),
        }
    }
    fn put_bytes(out: &mut Vec<u8>, b: Option<&[u8]>) {
        match b {
            None => varint::put_varint(out, -1),
            Some(b) => {
                varint::put_varint(out, b.len() as i32);
                out.extend_from_slice(b);
            }
        }
    }
    let headers_len: usize = record
        .headers
        .iter()
        .map(|(k, v)| bytes_len(Some(k.as_bytes())) + bytes_len(*v))
        .sum();
    let body_len = 1
        + varint::varlong_len(timestamp_delta)
        + varint::varint_len(offset_delta)
        + bytes_len(record.key)
        + bytes_len(record.value)
        + varint::varint_len(record.headers.len() as i32)
        + headers_len;
    out.reserve(body_len + 5);
    varint::put_varint(out, body_len as i32);
    out.push(0);
    varint::put_varlong(out, timestamp_delta);
    varint::put_varint(out, offset_delta);
    put_bytes(out, record.key);
    put_bytes(out, record.value);
    varint::put_varint(out, record.headers.len() as i32);
    for (k, v) in record.headers {
        put_bytes(out, Some(k.as_bytes()));
        put_bytes(out, *v);
    }
}
