//! The gRPC codec of every service and client: tonic-prost's, except that the encoder
//! reserves a message's encoded length before writing it.
//!
//! tonic starts each message in a small buffer (8 KiB) and prost writes into it as it
//! goes, so a 1 MiB fetch response grew through about eight reallocations, each a copy
//! and each new allocation page-faulted in: about 13% of the server's CPU on a consume
//! run (`perf record`, docs/performance.md). One `encoded_len` walk of the message is
//! far cheaper.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::ProstDecoder;

/// tonic-prost's codec with an encoder that sizes its buffer first.
#[derive(Debug, Clone)]
pub struct SizedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SizedCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SizedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = SizedEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        SizedEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

/// Encodes a message into a buffer reserved for its whole length.
#[derive(Debug, Clone)]
pub struct SizedEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for SizedEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding a message: {e}")))
    }
}
