//! Kafka's variable-length integers: zigzag-encoded signed varints (protobuf style).
//!
//! Kafka's record format writes every per-record length and delta as a zigzag varint:
//! `varint` for 32-bit values (at most 5 bytes) and `varlong` for 64-bit values (at most
//! 10 bytes). Decoding rejects values that run past the end of the buffer or use more
//! bytes than the type allows, so a corrupt record can never make a reader loop or panic.

use super::RecordError;

/// Appends `value` as a zigzag varint (at most 5 bytes).
pub fn put_varint(buf: &mut Vec<u8>, value: i32) {
    put_unsigned(buf, ((value << 1) ^ (value >> 31)) as u32 as u64);
}

/// Appends `value` as a zigzag varlong (at most 10 bytes).
pub fn put_varlong(buf: &mut Vec<u8>, value: i64) {
    put_unsigned(buf, ((value << 1) ^ (value >> 63)) as u64);
}

fn put_unsigned(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// Number of bytes `put_varint(value)` writes.
pub fn varint_len(value: i32) -> usize {
    unsigned_len(((value << 1) ^ (value >> 31)) as u32 as u64)
}

/// Number of bytes `put_varlong(value)` writes.
pub fn varlong_len(value: i64) -> usize {
    unsigned_len(((value << 1) ^ (value >> 63)) as u64)
}

fn unsigned_len(v: u64) -> usize {
    let bits = 64 - (v | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// A cursor over a byte slice that decodes Kafka's primitive types.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Starts reading at the beginning of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not yet consumed.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn unsigned(&mut self, max_bytes: usize, field: &'static str) -> Result<u64, RecordError> {
        let mut result = 0u64;
        for i in 0..max_bytes {
            let Some(&byte) = self.buf.get(self.pos) else {
                return Err(RecordError::Malformed {
                    field,
                    reason: "varint runs past the end of the record".into(),
                });
            };
            self.pos += 1;
            result |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(result);
            }
        }
        Err(RecordError::Malformed {
            field,
            reason: format!("varint longer than {max_bytes} bytes"),
        })
    }

    /// Reads a zigzag varint.
    pub fn varint(&mut self, field: &'static str) -> Result<i32, RecordError> {
        let raw = self.unsigned(5, field)?;
        if raw > u64::from(u32::MAX) {
            return Err(RecordError::Malformed {
                field,
                reason: "varint overflows 32 bits".into(),
            });
        }
        let raw = raw as u32;
        Ok(((raw >> 1) as i32) ^ -((raw & 1) as i32))
    }

    /// Reads a zigzag varlong.
    pub fn varlong(&mut self, field: &'static str) -> Result<i64, RecordError> {
        let raw = self.unsigned(10, field)?;
        Ok(((raw >> 1) as i64) ^ -((raw & 1) as i64))
    }

    /// Reads one byte.
    pub fn u8(&mut self, field: &'static str) -> Result<u8, RecordError> {
        Ok(self.bytes(1, field)?[0])
    }

    /// Reads exactly `len` bytes.
    pub fn bytes(&mut self, len: usize, field: &'static str) -> Result<&'a [u8], RecordError> {
        if len > self.remaining() {
            return Err(RecordError::Malformed {
                field,
                reason: format!(
                    "length {len} runs past the end of the record ({} bytes left)",
                    self.remaining()
                ),
            });
        }
        let out = &self.buf[self.pos..self.pos + len];
        self.pos += len;
        Ok(out)
    }

    /// Reads a varint length followed by that many bytes; length -1 means null.
    pub fn nullable_bytes(&mut self, field: &'static str) -> Result<Option<&'a [u8]>, RecordError> {
        let len = self.varint(field)?;
        match len {
            -1 => Ok(None),
            len if len < 0 => Err(RecordError::Malformed {
                field,
                reason: format!("negative length {len}"),
            }),
            len => self.bytes(len as usize, field).map(Some),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn varint_round_trips(v in any::<i32>()) {
            let mut buf = Vec::new();
            put_varint(&mut buf, v);
            prop_assert_eq!(buf.len(), varint_len(v));
            let mut r = Reader::new(&buf);
            prop_assert_eq!(r.varint("v").unwrap(), v);
            prop_assert_eq!(r.remaining(), 0);
        }

        #[test]
        fn varlong_round_trips(v in any::<i64>()) {
            let mut buf = Vec::new();
            put_varlong(&mut buf, v);
            prop_assert_eq!(buf.len(), varlong_len(v));
            let mut r = Reader::new(&buf);
            prop_assert_eq!(r.varlong("v").unwrap(), v);
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            let mut r = Reader::new(&bytes);
            let _ = r.varint("v");
            let mut r = Reader::new(&bytes);
            let _ = r.varlong("v");
            let mut r = Reader::new(&bytes);
            let _ = r.nullable_bytes("v");
        }
    }

    #[test]
    fn known_encodings_match_kafka() {
        // Values from Kafka's ByteUtilsTest.
        let cases: [(i32, &[u8]); 5] = [
            (0, &[0x00]),
            (-1, &[0x01]),
            (1, &[0x02]),
            (63, &[0x7e]),
            (-64, &[0x7f]),
        ];
        for (v, expected) in cases {
            let mut buf = Vec::new();
            put_varint(&mut buf, v);
            assert_eq!(buf, expected, "varint {v}");
        }
        let mut buf = Vec::new();
        put_varint(&mut buf, 64);
        assert_eq!(buf, [0x80, 0x01]);
    }

    #[test]
    fn overlong_varint_is_rejected() {
        let bytes = [0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert!(Reader::new(&bytes).varint("v").is_err());
    }
}
