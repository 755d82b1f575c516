//! Compiles `proto/` with protox (pure Rust: no system `protoc`) and generates the tonic
//! services, plus a descriptor set for gRPC server reflection.

use std::path::PathBuf;

use prost::Message;

const PROTOS: &[&str] = &[
    "proto/tidelog/v1/common.proto",
    "proto/tidelog/v1/admin.proto",
    "proto/tidelog/v1/controller_internal.proto",
    "proto/tidelog/v1/broker.proto",
    "proto/tidelog/v1/replication.proto",
    "proto/tidelog/v1/groups.proto",
    "proto/tidelog/v1/timer_internal.proto",
    "proto/tidelog/v1/transactions.proto",
    "proto/tidelog/v1/txn_internal.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(PROTOS, ["proto"])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("tidelog_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        // Sizes each message's buffer before encoding (src/api/codec.rs).
        .codec_path("crate::api::codec::SizedCodec")
        .btree_map(".")
        .bytes(".")
        .compile_fds(fds)?;
    Ok(())
}
