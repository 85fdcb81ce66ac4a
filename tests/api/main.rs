//! Integration tests: the real server on port 0 with the real models and the embedded store.

mod coverage;
mod documents;
mod errors;
mod fakes;
mod grpc;
mod helpers;
mod metrics;
mod openai;
mod profile;
mod query;
mod receiver;
mod rotel;
mod trace;
