//! What every dialect does with the fields of a request body: refuse, by name, a field it
//! does not implement (unless its value asks for nothing) or does not know, so that a client
//! never believes a setting was honoured when it was dropped.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};

use super::error::ApiError;

/// An OpenAI field this server does not implement: its name, the values that ask for nothing
/// (besides `null`, which always does) in words for the error, and the test for them.
pub(super) type Unsupported = (&'static str, &'static str, fn(&Value) -> bool);

pub(super) fn is_empty(v: &Value) -> bool {
    match v {
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// Refuses, naming it, the first field of `extra` (what the body's struct did not take): an
/// unsupported field with a value that asks for something, or a field nobody knows.
pub(super) fn refuse_unhonoured(
    extra: &Map<String, Value>,
    unsupported: &[Unsupported],
) -> Result<(), ApiError> {
    refuse_unhonoured_in("", extra, unsupported)
}

/// [`refuse_unhonoured`] for an object inside the body: errors name `{path}.{field}`.
pub(super) fn refuse_unhonoured_in(
    path: &str,
    extra: &Map<String, Value>,
    unsupported: &[Unsupported],
) -> Result<(), ApiError> {
    for (name, value) in extra {
        let param = match path {
            "" => name.clone(),
            _ => format!("{path}.{name}"),
        };
        match unsupported.iter().find(|(n, _, _)| n == name) {
            Some((_, _, neutral)) if value.is_null() || neutral(value) => {}
            Some((_, neutral, _)) => {
                return Err(ApiError::field(
                    &param,
                    format!("not supported by this server; leave it out or send {neutral}"),
                )
                .with_code("unsupported_parameter"))
            }
            None => {
                return Err(ApiError::field(&param, "unknown field").with_code("unknown_parameter"))
            }
        }
    }
    Ok(())
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
