//! A JSON body extractor whose rejections name the field at fault: the body must be UTF-8,
//! within the size limit, and deserialize into `T`; serde's path to the failing field becomes
//! the error's `param`.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use super::error::ApiError;

pub struct ValidJson<T>(pub T);

impl<S, T> FromRequest<S> for ValidJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            let status = rejection.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    status,
                    "invalid_request_error",
                    "body: request body is too large",
                )
                .with_code("body_too_large")
            } else {
                ApiError::new(
                    status,
                    "invalid_request_error",
                    format!("body: {rejection}"),
                )
            }
        })?;
        parse(&bytes).map(ValidJson)
    }
}

/// A path's one parameter, as text; a segment that does not decode to UTF-8 is a JSON 400
/// naming `path`, like every other refusal (axum's own rejection is plain text).
pub struct ValidPath(pub String);

impl<S: Send + Sync> FromRequestParts<S> for ValidPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(p)) => Ok(ValidPath(p)),
            Err(e) => Err(ApiError::field("path", e.body_text())),
        }
    }
}

/// Parses a JSON body, naming the failing field in the error.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(ApiError::field(
            "body",
            format!("not valid UTF-8 (byte {})", e.valid_up_to()),
        ));
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::field("body", "empty; expected a JSON object"));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::field("body", format!("malformed JSON: {inner}"))
        } else if path == "." {
            // Serde reads a flattened part (the decoding settings) without its field's name.
            serde_json::from_slice(bytes)
                .ok()
                .and_then(|body| super::decoding::field_error(&body))
                .unwrap_or_else(|| ApiError::field("body", inner))
        } else {
            ApiError::field(&path, inner)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Q {
        query: String,
        top_k: Option<usize>,
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse::<Q>(br#"{"query": "x", "top_k": "ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_k"));
        assert!(
            e.message.starts_with("top_k: invalid type"),
            "{}",
            e.message
        );
        let e = parse::<Q>(br#"{"top_k": 1}"#).unwrap_err();
        assert!(e.message.contains("missing field `query`"), "{}", e.message);
        let e = parse::<Q>(b"{\"query\": \"\xff\"}").unwrap_err();
        assert!(
            e.message.starts_with("body: not valid UTF-8"),
            "{}",
            e.message
        );
        let e = parse::<Q>(b"{\"query\": ").unwrap_err();
        assert!(
            e.message.starts_with("body: malformed JSON"),
            "{}",
            e.message
        );
    }
}
