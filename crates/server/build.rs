//! Generates the gRPC server and client code from `proto/ragscope.proto` into `OUT_DIR` (see
//! `src/api/proto.rs`). The protobuf compiler comes from the `protoc-bin-vendored` crate, so
//! building needs no `protoc` on the machine; the generated code never goes stale because it is
//! never committed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let well_known = protoc_bin_vendored::include_path()?;
    // Read by prost-build when it runs protoc; only this build script's process sees it.
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=../../proto/ragscope.proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        // For server reflection, so grpcurl and other tools work without the .proto file.
        .file_descriptor_set_path(out.join("ragscope_descriptor.bin"))
        .compile_protos(
            &[PathBuf::from("../../proto/ragscope.proto")],
            &[PathBuf::from("../../proto"), well_known],
        )?;
    Ok(())
}
