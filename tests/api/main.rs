//! Integration tests: the real server on port 0 with the real models and the embedded store.

mod documents;
mod errors;
mod helpers;
mod openai;
mod query;
mod receiver;
mod trace;
