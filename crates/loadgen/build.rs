//! Generates the gRPC client for `ragscope.v1.Rag` from the server's `proto/ragscope.proto`
//! (one definition for both), with the protoc shipped in `protoc-bin-vendored`, as the server's
//! own build script does.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let well_known = protoc_bin_vendored::include_path()?;
    // Read by prost-build when it runs protoc; only this build script's process sees it.
    std::env::set_var("PROTOC", protoc);
    let proto = PathBuf::from("../../proto");
    println!("cargo:rerun-if-changed=../../proto/ragscope.proto");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&[proto.join("ragscope.proto")], &[proto, well_known])?;
    Ok(())
}
