//! The code generated from `proto/ragscope.proto` at build time (see `build.rs`): the gRPC
//! service and its messages.
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("ragscope.v1");

/// The encoded descriptors, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ragscope_descriptor");
