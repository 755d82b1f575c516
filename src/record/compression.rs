//! Compression codecs for a batch's records block, in the framing Kafka's clients use.
//!
//! - gzip: a gzip stream (RFC 1952).
//! - snappy: the xerial framing the Java client writes (a 16-byte header, then blocks of
//!   `u32` big-endian length + raw snappy); unframed raw snappy is accepted on decode.
//! - lz4: the LZ4 frame format.
//! - zstd: a zstd frame.
//!
//! Every decoder is bounded by a caller-given maximum output size, so a small malicious
//! batch cannot expand into gigabytes: [`Compression::decoder`] streams the output in
//! chunks and fails with [`RecordError::DecompressedTooLarge`] (naming the limit and the
//! size reached) as soon as it passes the cap; snappy blocks are checked against the
//! remaining budget from their declared length before anything is allocated for them.

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
    /// Never holds more than `max_len + 1` decompressed bytes (plus one snappy block).
    pub fn decompress(self, input: &[u8], max_len: usize) -> Result<Vec<u8>, RecordError> {
        if self == Self::None {
            return Ok(input.to_vec());
        }
        let mut out = Vec::new();
        let mut decoder = self.decoder(input, max_len)?;
        loop {
            let n = decoder.read_some(&mut out, max_len, READ_CHUNK)?;
            if n == 0 {
                return Ok(out);
            }
        }
    }

    /// A streaming decoder of a compressed block with a hard cap: it yields the
    /// decompressed bytes in chunks and fails with [`RecordError::DecompressedTooLarge`]
    /// as soon as more than `max_len` bytes come out, so a small batch can never make its
    /// reader allocate more than the cap, whatever its compression ratio.
    pub fn decoder<'a>(
        self,
        input: &'a [u8],
        max_len: usize,
    ) -> Result<BoundedDecoder<'a>, RecordError> {
        let reader: Box<dyn Read + 'a> = match self {
            Self::None => Box::new(input),
            Self::Gzip => Box::new(flate2::read::GzDecoder::new(input)),
            Self::Snappy => Box::new(SnappyReader::new(input, max_len)?),
            Self::Lz4 => Box::new(lz4_flex::frame::FrameDecoder::new(input)),
            Self::Zstd => Box::new(zstd::stream::read::Decoder::new(input).map_err(|e| {
                RecordError::Compression {
                    codec: "zstd",
                    reason: e.to_string(),
                }
            })?),
        };
        Ok(BoundedDecoder {
            codec: self,
            reader: reader.take(max_len as u64 + 1),
            produced: 0,
        })
    }
}

/// Bytes a streaming decode reads per step.
pub(crate) const READ_CHUNK: usize = 64 * 1024;

/// A decompressing reader that refuses to produce more than a cap (see
/// [`Compression::decoder`]).
pub struct BoundedDecoder<'a> {
    codec: Compression,
    reader: std::io::Take<Box<dyn Read + 'a>>,
    produced: usize,
}

/// Marks the io::Error a snappy block larger than the remaining budget raises; holds the
/// decompressed size the block would have reached.
#[derive(Debug)]
struct OverBudget(usize);

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("block would pass the decompression limit")
    }
}

impl std::error::Error for OverBudget {}

impl BoundedDecoder<'_> {
    /// Decompressed bytes produced so far.
    pub fn produced(&self) -> usize {
        self.produced
    }

    /// Appends up to `chunk` more decompressed bytes to `out`; returns how many (0 at the
    /// end of the block). Fails once the total passes `max_len` (the decoder's cap).
    pub fn read_some(
        &mut self,
        out: &mut Vec<u8>,
        max_len: usize,
        chunk: usize,
    ) -> Result<usize, RecordError> {
        let at = out.len();
        out.resize(at + chunk, 0);
        let result = loop {
            match self.reader.read(&mut out[at..]) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        let n = match result {
            Ok(n) => n,
            Err(e) => {
                out.truncate(at);
                if let Some(OverBudget(reached)) = e
                    .get_ref()
                    .and_then(|inner| inner.downcast_ref::<OverBudget>())
                {
                    return Err(self.too_large(max_len, *reached));
                }
                return Err(RecordError::Compression {
                    codec: self.codec.name(),
                    reason: e.to_string(),
                });
            }
        };
        out.truncate(at + n);
        self.produced += n;
        if self.produced > max_len {
            return Err(self.too_large(max_len, self.produced));
        }
        Ok(n)
    }

    fn too_large(&self, max_len: usize, reached: usize) -> RecordError {
        RecordError::DecompressedTooLarge {
            codec: self.codec.name(),
            limit: max_len,
            reached,
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
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

/// Streams snappy: xerial-framed blocks one at a time, or one raw snappy block. Each
/// block's declared length is checked against the remaining budget before anything is
/// allocated for it.
struct SnappyReader<'a> {
    /// Undecoded xerial blocks (empty when raw or done).
    rest: &'a [u8],
    /// A raw (unframed) snappy block still to decode.
    raw: Option<&'a [u8]>,
    block: Vec<u8>,
    pos: usize,
    budget: usize,
    /// Decompressed bytes produced so far.
    produced: usize,
    decoder: snap::raw::Decoder,
}

impl<'a> SnappyReader<'a> {
    fn new(input: &'a [u8], max_len: usize) -> Result<Self, RecordError> {
        let mut reader = Self {
            rest: &[],
            raw: None,
            block: Vec::new(),
            pos: 0,
            // One byte over the cap, so the caller sees that the cap was passed.
            budget: max_len.saturating_add(1),
            produced: 0,
            decoder: snap::raw::Decoder::new(),
        };
        if !input.starts_with(&XERIAL_MAGIC) {
            reader.raw = Some(input);
        } else if input.len() < XERIAL_HEADER_LEN {
            return Err(RecordError::Compression {
                codec: "snappy",
                reason: "xerial header is truncated".into(),
            });
        } else {
            reader.rest = &input[XERIAL_HEADER_LEN..];
        }
        Ok(reader)
    }

    fn decode_block(&mut self, block: &[u8]) -> std::io::Result<()> {
        let invalid = |e: snap::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
        let len = snap::raw::decompress_len(block).map_err(invalid)?;
        if len > self.budget {
            return Err(std::io::Error::other(OverBudget(self.produced + len)));
        }
        self.budget -= len;
        self.produced += len;
        self.block.clear();
        self.block.resize(len, 0);
        let written = self
            .decoder
            .decompress(block, &mut self.block)
            .map_err(invalid)?;
        self.block.truncate(written);
        self.pos = 0;
        Ok(())
    }

    /// Decodes the next block; false at the end.
    fn next_block(&mut self) -> std::io::Result<bool> {
        if let Some(raw) = self.raw.take() {
            self.decode_block(raw)?;
            return Ok(true);
        }
        if self.rest.is_empty() {
            return Ok(false);
        }
        let bad = |reason: String| std::io::Error::new(std::io::ErrorKind::InvalidData, reason);
        if self.rest.len() < 4 {
            return Err(bad("xerial block length is truncated".into()));
        }
        let block_len = u32::from_be_bytes(self.rest[..4].try_into().expect("4 bytes")) as usize;
        let Some(block) = self.rest.get(4..4 + block_len) else {
            return Err(bad(format!(
                "xerial block of {block_len} bytes runs past the end"
            )));
        };
        self.rest = &self.rest[4 + block_len..];
        self.decode_block(block)?;
        Ok(true)
    }
}

impl Read for SnappyReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.block.len() {
            if !self.next_block()? {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.block.len() - self.pos);
        buf[..n].copy_from_slice(&self.block[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
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

        /// Decoding succeeds exactly when the data fits the cap, for every codec.
        #[test]
        fn the_cap_is_exact(len in 0usize..300_000, cap in 0usize..300_000, byte in any::<u8>()) {
            let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add((i % 7) as u8)).collect();
            for codec in Compression::ALL.into_iter().skip(1) {
                let packed = codec.compress(&data).unwrap();
                match codec.decompress(&packed, cap) {
                    Ok(out) => prop_assert!(len <= cap && out == data, "{}", codec),
                    Err(RecordError::DecompressedTooLarge { limit, reached, .. }) => {
                        prop_assert!(len > cap && limit == cap && reached > cap, "{}", codec);
                    }
                    Err(e) => prop_assert!(false, "{}: {}", codec, e),
                }
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

    /// 16 MiB of zeros compressed by each codec: a bomb of a few KB.
    fn bomb(codec: Compression) -> Vec<u8> {
        codec.compress(&vec![0u8; 16 << 20]).unwrap()
    }

    #[test]
    fn every_codec_stops_a_bomb_at_the_cap_without_inflating_it() {
        const CAP: usize = 1 << 20;
        for codec in Compression::ALL.into_iter().skip(1) {
            let packed = bomb(codec);
            // Snappy tops out near 21:1; the others shrink zeros far more.
            assert!(packed.len() < CAP, "{codec}: {} bytes", packed.len());
            let mut decoder = codec.decoder(&packed, CAP).unwrap();
            let mut out = Vec::new();
            let err = loop {
                match decoder.read_some(&mut out, CAP, READ_CHUNK) {
                    Ok(0) => panic!("{codec}: the bomb decoded whole"),
                    Ok(_) => assert!(out.len() <= CAP, "{codec}: holds {} bytes", out.len()),
                    Err(e) => break e,
                }
            };
            match err {
                RecordError::DecompressedTooLarge {
                    limit,
                    reached,
                    codec: name,
                } => {
                    assert_eq!((limit, name), (CAP, codec.name()));
                    // Stopped within one read (or one snappy block) of the cap.
                    assert!(
                        reached > CAP && reached <= CAP + READ_CHUNK.max(XERIAL_BLOCK_LEN),
                        "{codec}: reached {reached}"
                    );
                }
                other => panic!("{codec}: {other}"),
            }
            // The one-shot API refuses it too, and so does raw (unframed) snappy.
            assert!(matches!(
                codec.decompress(&packed, CAP),
                Err(RecordError::DecompressedTooLarge { .. })
            ));
        }
        let raw = snap::raw::Encoder::new()
            .compress_vec(&vec![0u8; 4 << 20])
            .unwrap();
        assert!(matches!(
            Compression::Snappy.decompress(&raw, CAP),
            Err(RecordError::DecompressedTooLarge { reached, .. }) if reached == 4 << 20
        ));
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
