//! Unary gRPC messages handled in pieces, for the two calls that carry record batches
//! (Produce requests and Fetch answers).
//!
//! tonic copies every message twice on top of what the socket needs: the sender encodes
//! it into one buffer, and the receiver gathers its HTTP/2 frames into one buffer before
//! decoding it. For a message that is almost all record batches, those copies were about
//! a tenth of both sides' CPU (docs/performance.md). Here:
//! - [`encode_nested`] writes a message of topics of partitions, each partition carrying
//!   one large `bytes` field, as small encoded pieces with each large field as its own
//!   piece, shared rather than copied. HTTP/2 writes such pieces to the socket as they
//!   are. Protobuf lets fields come in any order, so a partition's large field follows
//!   its other fields and any decoder reads the message unchanged.
//! - [`Frames`] reads received frames as one buffer, and [`decode_unary`] decodes a
//!   message from them in place: a `bytes` field inside one frame is a slice of it.
//!   Servers take frames up to [`super::HTTP2_FRAME_BYTES_MAX`] and clients up to
//!   [`super::HTTP2_RESPONSE_FRAME_BYTES_MAX`], so a piece usually arrives as one frame;
//!   a field split across frames is copied. Any encoding of the message decodes, whoever
//!   sent it.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;
use tonic::codegen::http;
use tonic::Status;

/// Length of a gRPC message's prefix: a compression flag and a big-endian length.
pub const GRPC_HEADER_LEN: usize = 5;

/// Large fields shorter than this are copied into the surrounding piece: a piece of its
/// own costs more than a small copy.
const SHARE_MIN_BYTES: usize = 4096;

/// Field numbers of a message of topics of partitions.
#[derive(Debug, Clone, Copy)]
pub struct NestedTags {
    /// The message's repeated topic field.
    pub topics: u32,
    /// A topic's repeated partition field.
    pub partitions: u32,
    /// A partition's large `bytes` field.
    pub bytes: u32,
}

/// Where a message of topics of partitions keeps them, and each partition its large
/// field.
pub struct Nested<O, T, P> {
    pub tags: NestedTags,
    pub topics: fn(&mut O) -> &mut Vec<T>,
    pub partitions: fn(&mut T) -> &mut Vec<P>,
    pub large: fn(&mut P) -> &mut Bytes,
}

/// `message` as one gRPC message (prefix included) in pieces, each partition's large
/// field of at least `SHARE_MIN_BYTES` a piece of its own, shared rather than copied.
/// The pieces concatenated decode to `message` (pure).
pub fn encode_nested<O: Message, T: Message, P: Message>(
    mut message: O,
    shape: &Nested<O, T, P>,
) -> Vec<Bytes> {
    // Each level without its children, so `encoded_len` and `encode` leave them out.
    let topics: Vec<(T, Vec<(P, Bytes)>)> = std::mem::take((shape.topics)(&mut message))
        .into_iter()
        .map(|mut t| {
            let partitions = std::mem::take((shape.partitions)(&mut t))
                .into_iter()
                .map(|mut p| {
                    let large = std::mem::take((shape.large)(&mut p));
                    (p, large)
                })
                .collect();
            (t, partitions)
        })
        .collect();
    let (outer, tags) = (&message, shape.tags);
    let partition_len = |p: &P, large: &Bytes| p.encoded_len() + large_field_len(tags, large);
    let topic_len = |(fields, partitions): &(T, Vec<(P, Bytes)>)| {
        fields.encoded_len()
            + partitions
                .iter()
                .map(|(p, large)| nested_len(tags.partitions, partition_len(p, large)))
                .sum::<usize>()
    };
    let total: usize = outer.encoded_len()
        + topics
            .iter()
            .map(|t| nested_len(tags.topics, topic_len(t)))
            .sum::<usize>();
    let shared: usize = topics
        .iter()
        .flat_map(|(_, partitions)| partitions)
        .map(|(_, large)| large.len())
        .filter(|&l| l >= SHARE_MIN_BYTES)
        .sum();
    let mut out = PiecesWriter::new(GRPC_HEADER_LEN + total - shared);
    out.head.put_u8(0);
    out.head
        .put_u32(u32::try_from(total).expect("messages are bounded far below 4 GiB"));
    outer
        .encode(&mut out.head)
        .expect("the buffer grows as needed");
    for topic in topics {
        encode_key(tags.topics, WireType::LengthDelimited, &mut out.head);
        encode_varint(topic_len(&topic) as u64, &mut out.head);
        let (fields, partitions) = topic;
        fields
            .encode(&mut out.head)
            .expect("the buffer grows as needed");
        for (partition, large) in partitions {
            encode_key(tags.partitions, WireType::LengthDelimited, &mut out.head);
            encode_varint(partition_len(&partition, &large) as u64, &mut out.head);
            partition
                .encode(&mut out.head)
                .expect("the buffer grows as needed");
            if !large.is_empty() {
                encode_key(tags.bytes, WireType::LengthDelimited, &mut out.head);
                encode_varint(large.len() as u64, &mut out.head);
                out.push(large);
            }
        }
    }
    out.finish()
}

/// A message whose one field is a chain of messages, field `wrappers[0]` outermost, the
/// innermost holding `fields` and the large field `large_tag` = `large`, as one gRPC
/// message (prefix included) in pieces: the large field, if at least `SHARE_MIN_BYTES`
/// long, is a piece of its own (pure).
pub fn encode_wrapped(
    wrappers: &[u32],
    fields: &impl Message,
    large_tag: u32,
    large: Bytes,
) -> Vec<Bytes> {
    let inner = fields.encoded_len()
        + if large.is_empty() {
            0
        } else {
            nested_len(large_tag, large.len())
        };
    // Each wrapper's length, innermost last.
    let mut lens = vec![inner; wrappers.len()];
    for i in (0..wrappers.len().saturating_sub(1)).rev() {
        lens[i] = nested_len(wrappers[i + 1], lens[i + 1]);
    }
    let total = match wrappers.first() {
        Some(&tag) => nested_len(tag, lens[0]),
        None => inner,
    };
    let copied = GRPC_HEADER_LEN + total
        - if large.len() >= SHARE_MIN_BYTES {
            large.len()
        } else {
            0
        };
    let mut out = PiecesWriter::new(copied);
    out.head.put_u8(0);
    out.head
        .put_u32(u32::try_from(total).expect("messages are bounded far below 4 GiB"));
    for (&tag, &len) in wrappers.iter().zip(&lens) {
        encode_key(tag, WireType::LengthDelimited, &mut out.head);
        encode_varint(len as u64, &mut out.head);
    }
    fields
        .encode(&mut out.head)
        .expect("the buffer grows as needed");
    if !large.is_empty() {
        encode_key(large_tag, WireType::LengthDelimited, &mut out.head);
        encode_varint(large.len() as u64, &mut out.head);
        out.push(large);
    }
    out.finish()
}

/// `message` as one gRPC message (prefix included) in one piece.
pub fn encode_whole(message: &impl Message) -> Bytes {
    let len = message.encoded_len();
    let mut out = BytesMut::with_capacity(GRPC_HEADER_LEN + len);
    out.put_u8(0);
    out.put_u32(u32::try_from(len).expect("messages are bounded far below 4 GiB"));
    message
        .encode(&mut out)
        .expect("the buffer grows as needed");
    out.freeze()
}

/// Encoded length of a large field holding `large` (nothing when empty, as proto3 leaves
/// out an empty field).
fn large_field_len(tags: NestedTags, large: &Bytes) -> usize {
    if large.is_empty() {
        0
    } else {
        nested_len(tags.bytes, large.len())
    }
}

/// Encoded length of a length-delimited field `tag` holding `len` bytes.
fn nested_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// The pieces of a message being written: encoded bytes go to `head`; a shared buffer
/// ends the current piece.
struct PiecesWriter {
    head: BytesMut,
    done: Vec<Bytes>,
}

impl PiecesWriter {
    fn new(copied: usize) -> Self {
        Self {
            head: BytesMut::with_capacity(copied),
            done: Vec::new(),
        }
    }

    fn push(&mut self, shared: Bytes) {
        if shared.len() < SHARE_MIN_BYTES {
            self.head.extend_from_slice(&shared);
            return;
        }
        if !self.head.is_empty() {
            self.done.push(self.head.split().freeze());
        }
        self.done.push(shared);
    }

    fn finish(mut self) -> Vec<Bytes> {
        if !self.head.is_empty() {
            self.done.push(self.head.freeze());
        }
        self.done
    }
}

/// An HTTP body of `pieces`, then `trailers` if any.
pub struct PiecesBody {
    pieces: VecDeque<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl PiecesBody {
    /// A request body: the pieces, no trailers.
    pub fn request(pieces: Vec<Bytes>) -> Self {
        Self {
            pieces: pieces.into(),
            trailers: None,
        }
    }

    /// A successful unary response body: the pieces, then `grpc-status: 0`.
    pub fn ok_response(pieces: Vec<Bytes>) -> Self {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        Self {
            pieces: pieces.into(),
            trailers: Some(trailers),
        }
    }
}

impl http_body::Body for PiecesBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        if let Some(piece) = self.pieces.pop_front() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(piece))));
        }
        Poll::Ready(
            self.trailers
                .take()
                .map(|t| Ok(http_body::Frame::trailers(t))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.pieces.is_empty() && self.trailers.is_none()
    }
}

/// A streaming gRPC response body: each message's pieces as the stream yields them, then
/// the stream's end as trailers (`grpc-status: 0`, or the error it ended with).
pub struct StreamBody<S> {
    messages: S,
    pending: VecDeque<Bytes>,
    ended: bool,
}

impl<S> StreamBody<S> {
    /// A body of the messages `messages` yields, each already in pieces.
    pub fn new(messages: S) -> Self {
        Self {
            messages,
            pending: VecDeque::new(),
            ended: false,
        }
    }
}

impl<S> http_body::Body for StreamBody<S>
where
    S: futures_util::Stream<Item = Result<Vec<Bytes>, Status>> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        loop {
            if let Some(piece) = self.pending.pop_front() {
                return Poll::Ready(Some(Ok(http_body::Frame::data(piece))));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let status = match std::task::ready!(Pin::new(&mut self.messages).poll_next(cx)) {
                Some(Ok(pieces)) => {
                    self.pending.extend(pieces);
                    continue;
                }
                Some(Err(status)) => status,
                None => Status::ok(""),
            };
            self.ended = true;
            let mut trailers = http::HeaderMap::new();
            if status.add_header(&mut trailers).is_err() {
                trailers.insert("grpc-status", http::HeaderValue::from_static("13"));
            }
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.pending.is_empty()
    }
}

/// Received frames shorter than this are copied together rather than kept one by one:
/// a peer sending a message as thousands of tiny frames must not make each cost a
/// `Bytes` (and pin the read buffer it points into).
const KEEP_FRAME_MIN_BYTES: usize = 16 * 1024;

/// Received frames read as one buffer; [`Buf::copy_to_bytes`] of a range inside one
/// frame shares it.
#[derive(Debug, Default)]
pub struct Frames {
    /// Never holds an empty frame.
    frames: VecDeque<Bytes>,
    /// Small frames received since the last kept one, copied together.
    small: BytesMut,
    remaining: usize,
}

impl Frames {
    /// Appends a received frame: kept as it is when large, else copied after the
    /// previous small ones. Call [`Frames::finish`] after the last.
    pub fn push(&mut self, frame: Bytes) {
        if frame.is_empty() {
            return;
        }
        self.remaining += frame.len();
        if frame.len() < KEEP_FRAME_MIN_BYTES {
            self.small.extend_from_slice(&frame);
            return;
        }
        self.flush_small();
        self.frames.push_back(frame);
    }

    /// Ends the frames: from here on they read as one buffer.
    pub fn finish(&mut self) {
        self.flush_small();
    }

    fn flush_small(&mut self) {
        if !self.small.is_empty() {
            self.frames.push_back(self.small.split().freeze());
        }
    }

    /// The message length a gRPC prefix at the start declares, once 5 bytes are in.
    fn declared_len(&self) -> Option<usize> {
        let mut prefix = [0u8; GRPC_HEADER_LEN];
        let mut filled = 0;
        for part in self.frames.iter().map(|f| &f[..]).chain([&self.small[..]]) {
            let n = part.len().min(GRPC_HEADER_LEN - filled);
            prefix[filled..filled + n].copy_from_slice(&part[..n]);
            filled += n;
            if filled == GRPC_HEADER_LEN {
                return Some(
                    u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize,
                );
            }
        }
        None
    }
}

impl Buf for Frames {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.frames.front().map_or(&[], |f| f)
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advance past the end of the frames");
        self.remaining -= cnt;
        while cnt > 0 {
            let front = self.frames.front_mut().expect("counted above");
            if front.len() > cnt {
                front.advance(cnt);
                return;
            }
            cnt -= front.len();
            self.frames.pop_front();
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        if let Some(front) = self.frames.front_mut() {
            if front.len() >= len {
                let out = front.split_to(len);
                if front.is_empty() {
                    self.frames.pop_front();
                }
                self.remaining -= len;
                return out;
            }
        }
        assert!(
            len <= self.remaining,
            "copy_to_bytes past the end of the frames"
        );
        let mut out = BytesMut::with_capacity(len);
        out.put((&mut *self).take(len));
        out.freeze()
    }
}

/// Reads `body` to its end: its data frames and its trailers. A message declared longer
/// than `message_max` is refused with tonic's `OUT_OF_RANGE` at once; a body longer than
/// one such message with `INTERNAL`.
pub async fn read_body<B>(
    mut body: B,
    message_max: usize,
) -> Result<(Frames, Option<http::HeaderMap>), Status>
where
    B: http_body::Body<Data = Bytes, Error = Status> + Unpin,
{
    let mut frames = Frames::default();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        match frame?.into_data() {
            Ok(data) => {
                frames.push(data);
                // Refused as soon as the prefix declares too much, as tonic does.
                if let Some(declared) = frames.declared_len().filter(|&l| l > message_max) {
                    return Err(too_large(declared, message_max));
                }
                if frames.remaining() > GRPC_HEADER_LEN + message_max {
                    return Err(Status::internal(format!(
                        "protocol error: a unary body holds more than one message of at most {message_max} bytes"
                    )));
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                }
            }
        }
    }
    frames.finish();
    Ok((frames, trailers))
}

/// The one gRPC message in `frames`, decoded; errors have the codes tonic gives the
/// same faults (pure).
pub fn decode_unary<M: Message + Default>(
    mut frames: Frames,
    message_max: usize,
) -> Result<M, Status> {
    frames.finish();
    if frames.remaining() < GRPC_HEADER_LEN {
        return Err(Status::internal("Missing message."));
    }
    let compressed = frames.get_u8();
    let len = frames.get_u32() as usize;
    if compressed != 0 {
        return Err(Status::internal(
            "protocol error: received message with compressed-flag but no grpc-encoding was specified",
        ));
    }
    if len > message_max {
        return Err(too_large(len, message_max));
    }
    if len != frames.remaining() {
        return Err(Status::internal(format!(
            "protocol error: a unary body of {} bytes holds a message of {len}",
            frames.remaining()
        )));
    }
    // prost's message reads "failed to decode Protobuf message: ...", as tonic's does.
    M::decode(&mut frames).map_err(|e| Status::internal(e.to_string()))
}

fn too_large(found: usize, limit: usize) -> Status {
    Status::out_of_range(format!(
        "Error, decoded message length too large: found {found} bytes, the limit is: {limit} bytes"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tonic::Code;

    /// The gRPC message of `m` (a `bytes` field 1, google.protobuf.BytesValue), whole.
    fn wire(value: &[u8]) -> Vec<u8> {
        encode_whole(&Bytes::copy_from_slice(value)).to_vec()
    }

    fn frames_of(wire: &[u8], at: &[usize]) -> Frames {
        let mut at: Vec<usize> = at.iter().map(|&a| a.min(wire.len())).collect();
        at.extend([0, wire.len()]);
        at.sort_unstable();
        let mut frames = Frames::default();
        for w in at.windows(2) {
            frames.push(Bytes::copy_from_slice(&wire[w[0]..w[1]]));
        }
        frames
    }

    proptest! {
        /// Whatever the frame boundaries, the frames decode to the message sent.
        #[test]
        fn any_split_decodes_to_the_message(
            value in prop::collection::vec(any::<u8>(), 0..300),
            at in prop::collection::vec(0usize..400, 0..8),
        ) {
            let w = wire(&value);
            let decoded: Bytes = decode_unary(frames_of(&w, &at), 1 << 20).unwrap();
            prop_assert_eq!(&decoded[..], &value[..]);
        }
    }

    #[test]
    fn a_field_inside_one_large_frame_is_shared_not_copied() {
        let w = Bytes::from(wire(&[9; 20_000]));
        let mut frames = Frames::default();
        frames.push(w.slice(..3));
        let rest = w.slice(3..);
        frames.push(rest.clone());
        let decoded: Bytes = decode_unary(frames, 1 << 20).unwrap();
        assert_eq!(decoded.len(), 20_000);
        let inside = rest.as_ptr() as usize..rest.as_ptr() as usize + rest.len();
        assert!(inside.contains(&(decoded.as_ptr() as usize)));
    }

    #[test]
    fn tiny_frames_are_kept_together() {
        let w = wire(&[7; 3000]);
        let mut frames = Frames::default();
        for b in &w {
            frames.push(Bytes::copy_from_slice(&[*b]));
        }
        frames.finish();
        assert_eq!(frames.frames.len(), 1);
        let decoded: Bytes = decode_unary(frames, 1 << 20).unwrap();
        assert_eq!(&decoded[..], &[7; 3000][..]);
    }

    #[test]
    fn a_declared_length_above_the_limit_is_refused_before_the_body() {
        let w = wire(&[1; 100]);
        let mut frames = Frames::default();
        assert_eq!(frames.declared_len(), None);
        frames.push(Bytes::copy_from_slice(&w[..2]));
        assert_eq!(frames.declared_len(), None);
        frames.push(Bytes::copy_from_slice(&w[2..6]));
        assert_eq!(frames.declared_len(), Some(w.len() - GRPC_HEADER_LEN));
    }

    #[test]
    fn bad_bodies_are_refused_with_tonics_statuses() {
        let w = wire(&[1; 10]);
        let decode = |bytes: &[u8], max| {
            decode_unary::<Bytes>(frames_of(bytes, &[]), max).map_err(|s| s.code())
        };
        assert!(decode(&w, 1 << 20).is_ok());
        assert_eq!(decode(&w[..3], 1 << 20).unwrap_err(), Code::Internal);
        assert_eq!(
            decode(&w[..w.len() - 1], 1 << 20).unwrap_err(),
            Code::Internal
        );
        assert_eq!(decode(&w, 4).unwrap_err(), Code::OutOfRange);
        let mut compressed = w.clone();
        compressed[0] = 1;
        assert_eq!(decode(&compressed, 1 << 20).unwrap_err(), Code::Internal);
        let mut garbage = w.clone();
        garbage[5] = 0xff;
        garbage[6] = 0xff;
        assert_eq!(decode(&garbage, 1 << 20).unwrap_err(), Code::Internal);
    }

    #[test]
    fn a_body_ends_with_its_trailers() {
        use http_body::Body as _;
        let mut body =
            PiecesBody::ok_response(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"c")]);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut data = Vec::new();
        let mut trailers = None;
        while let Poll::Ready(Some(frame)) = Pin::new(&mut body).poll_frame(&mut cx) {
            match frame.unwrap().into_data() {
                Ok(d) => data.extend_from_slice(&d),
                Err(f) => trailers = f.into_trailers().ok(),
            }
        }
        assert_eq!(data, b"abc");
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
        assert!(body.is_end_stream());
    }
}
