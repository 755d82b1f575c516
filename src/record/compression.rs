//! Compression codecs for a batch's records block, in the framing Kafka's clients use.
//!
//! - gzip: a gzip stream (RFC 1952).
//! - snappy: the xerial framing the Java client writes (a 16-byte header, then blocks of
//!   `u32` big-endian length + raw snappy); unframed raw snappy is accepted on decode.
//! - lz4: the LZ4 frame format.
//! - zstd: a zstd frame.
//!
//! Every decoder is bounded by a caller-given maximum output size, so a small malicious
//! batch cannot expand into gigabytes.

use std::io::{Read, Write};

use super::RecordError;

/// The codec of a batch's records block (attribute bits 0-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Compression {
    /// Records stored as-is.
    #[default]
    None,
    /// gzip (attribute 1).
    Gzip,
    /// snappy, xerial-framed (attribute 2).
    Snappy,
    /// LZ4 frame (attribute 3).
    Lz4,
    /// zstd frame (attribute 4).
    Zstd,
}

const XERIAL_MAGIC: [u8; 8] = [0x82, b'S', b'N', b'A', b'P', b'P', b'Y', 0];
const XERIAL_HEADER_LEN: usize = 16;
/// Block size the Java client's xerial stream uses.
const XERIAL_BLOCK_LEN: usize = 32 * 1024;
const ZSTD_LEVEL: i32 = 3;

impl Compression {
    /// All codecs, for tests and help text.
    pub const ALL: [Compression; 5] = [
        Compression::None,
        Compression::Gzip,
        Compression::Snappy,
        Compression::Lz4,
        Compression::Zstd,
    ];

    /// Decodes attribute bits 0-2.
    pub fn from_attribute(bits: i16) -> Result<Self, RecordError> {
        match bits {
            0 => Ok(Self::None),
            1 => Ok(Self::Gzip),
            2 => Ok(Self::Snappy),
            3 => Ok(Self::Lz4),
            4 => Ok(Self::Zstd),
            other => Err(RecordError::UnknownCompression(other)),
        }
    }

    /// Attribute bits 0-2 for this codec.
    pub fn attribute(self) -> i16 {
        match self {
            Self::None => 0,
            Self::Gzip => 1,
            Self::Snappy => 2,
            Self::Lz4 => 3,
            Self::Zstd => 4,
        }
    }

    /// Kafka's name for the codec (`none`, `gzip`, `snappy`, `lz4`, `zstd`).
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Gzip => "gzip",
            Self::Snappy => "snappy",
            Self::Lz4 => "lz4",
            Self::Zstd => "zstd",
        }
    }

    /// Parses Kafka's codec name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Compresses a records block.
    pub fn compress(self, input: &[u8]) -> Result<Vec<u8>, RecordError> {
        let io = |e: std::io::Error| RecordError::Compression {
            codec: self.name(),
            reason: e.to_string(),
        };
        match self {
            Self::None => Ok(input.to_vec()),
            Self::Gzip => {
                let mut enc = flate2::write::GzEncoder::new(
                    Vec::with_capacity(input.len() / 2),
                    flate2::Compression::default(),
                );
                enc.write_all(input).map_err(io)?;
                enc.finish().map_err(io)
            }
            Self::Snappy => xerial_compress(input),
            Self::Lz4 => {
                let mut enc =
                    lz4_flex::frame::FrameEncoder::new(Vec::with_capacity(input.len() / 2));
                enc.write_all(input).map_err(io)?;
                enc.finish().map_err(|e| RecordError::Compression {
                    codec: "lz4",
                    reason: e.to_string(),
                })
            }
            Self::Zstd => zstd::bulk::compress(input, ZSTD_LEVEL).map_err(io),
        }
    }

    /// Decompresses a records block, failing if the output would exceed `max_len` bytes.
    pub fn decompress(self, input: &[u8], max_len: usize) -> Result<Vec<u8>, RecordError> {
        match self {
            Self::None => Ok(input.to_vec()),
            Self::Gzip => read_bounded(self, flate2::read::GzDecoder::new(input), max_len),
            Self::Snappy => xerial_decompress(input, max_len),
            Self::Lz4 => read_bounded(self, lz4_flex::frame::FrameDecoder::new(input), max_len),
            Self::Zstd => {
                let decoder = zstd::stream::read::Decoder::new(input).map_err(|e| {
                    RecordError::Compression {
                        codec: "zstd",
                        reason: e.to_string(),
                    }
                })?;
                read_bounded(self, decoder, max_len)
            }
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn read_bounded(
    codec: Compression,
    reader: impl Read,
    max_len: usize,
) -> Result<Vec<u8>, RecordError> {
    let mut out = Vec::new();
    reader
        .take(max_len as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| RecordError::Compression {
            codec: codec.name(),
            reason: e.to_string(),
        })?;
    if out.len() > max_len {
        return Err(RecordError::DecompressedTooLarge {
            codec: codec.name(),
            limit: max_len,
        });
    }
    Ok(out)
}

fn snappy_error(e: snap::Error) -> RecordError {
    RecordError::Compression {
        codec: "snappy",
        reason: e.to_string(),
    }
}

fn xerial_compress(input: &[u8]) -> Result<Vec<u8>, RecordError> {
    let mut out = Vec::with_capacity(XERIAL_HEADER_LEN + input.len() / 2 + 16);
    out.extend_from_slice(&XERIAL_MAGIC);
    out.extend_from_slice(&1i32.to_be_bytes()); // version
    out.extend_from_slice(&1i32.to_be_bytes()); // minimum compatible version
    let mut encoder = snap::raw::Encoder::new();
    for block in input.chunks(XERIAL_BLOCK_LEN) {
        let len_at = out.len();
        out.extend_from_slice(&[0; 4]);
        let max = snap::raw::max_compress_len(block.len());
        out.resize(len_at + 4 + max, 0);
        let written = encoder
            .compress(block, &mut out[len_at + 4..])
            .map_err(snappy_error)?;
        out.truncate(len_at + 4 + written);
        out[len_at..len_at + 4].copy_from_slice(&(written as u32).to_be_bytes());
    }
    Ok(out)
}

fn xerial_decompress(input: &[u8], max_len: usize) -> Result<Vec<u8>, RecordError> {
    let too_large = || RecordError::DecompressedTooLarge {
        codec: "snappy",
        limit: max_len,
    };
    let mut decoder = snap::raw::Decoder::new();
    if !input.starts_with(&XERIAL_MAGIC) {
        let len = snap::raw::decompress_len(input).map_err(snappy_error)?;
        if len > max_len {
            return Err(too_large());
        }
        return decoder.decompress_vec(input).map_err(snappy_error);
    }
    if input.len() < XERIAL_HEADER_LEN {
        return Err(RecordError::Compression {
            codec: "snappy",
            reason: "xerial header is truncated".into(),
        });
    }
    let mut rest = &input[XERIAL_HEADER_LEN..];
    let mut out = Vec::new();
    while !rest.is_empty() {
        if rest.len() < 4 {
            return Err(RecordError::Compression {
                codec: "snappy",
                reason: "xerial block length is truncated".into(),
            });
        }
        let block_len = u32::from_be_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        let block = rest
            .get(4..4 + block_len)
            .ok_or_else(|| RecordError::Compression {
                codec: "snappy",
                reason: format!("xerial block of {block_len} bytes runs past the end"),
            })?;
        let len = snap::raw::decompress_len(block).map_err(snappy_error)?;
        if out.len() + len > max_len {
            return Err(too_large());
        }
        let at = out.len();
        out.resize(at + len, 0);
        let written = decoder
            .decompress(block, &mut out[at..])
            .map_err(snappy_error)?;
        out.truncate(at + written);
        rest = &rest[4 + block_len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn every_codec_round_trips(data in proptest::collection::vec(any::<u8>(), 0..100_000)) {
            for codec in Compression::ALL {
                let packed = codec.compress(&data).unwrap();
                let unpacked = codec.decompress(&packed, data.len()).unwrap();
                prop_assert_eq!(&unpacked, &data, "codec {}", codec);
            }
        }

        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            for codec in Compression::ALL {
                let _ = codec.decompress(&data, 1 << 20);
            }
        }
    }

    #[test]
    fn decompression_is_bounded() {
        let data = vec![b'a'; 1 << 20];
        for codec in Compression::ALL.into_iter().skip(1) {
            let packed = codec.compress(&data).unwrap();
            let err = codec.decompress(&packed, 1000).unwrap_err();
            assert!(
                matches!(err, RecordError::DecompressedTooLarge { limit: 1000, .. }),
                "{codec}: {err}"
            );
        }
    }

    #[test]
    fn raw_snappy_without_xerial_framing_decodes() {
        let data = b"hello hello hello hello".repeat(10);
        let raw = snap::raw::Encoder::new().compress_vec(&data).unwrap();
        assert_eq!(Compression::Snappy.decompress(&raw, 1 << 20).unwrap(), data);
    }

    #[test]
    fn xerial_output_has_java_client_header() {
        let packed = Compression::Snappy.compress(b"abc").unwrap();
        assert_eq!(&packed[..8], &XERIAL_MAGIC);
        assert_eq!(&packed[8..16], &[0, 0, 0, 1, 0, 0, 0, 1]);
    }
}
