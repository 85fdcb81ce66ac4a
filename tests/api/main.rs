//! Integration tests: the real server on port 0 with the real models and the embedded store.

mod attribution;
mod auth;
mod catalogue;
mod completions;
mod context;
mod coverage;
mod documents;
mod errors;
mod fakes;
mod faults;
mod grpc;
mod helpers;
mod metrics;
mod openai;
mod overload;
mod page;
mod prefix_cache;
mod profile;
mod qdrant_wire;
mod query;
mod receiver;
mod rotel;
mod stack;
mod stages;
mod store_conformance;
mod trace;
