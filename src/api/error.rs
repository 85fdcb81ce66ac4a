//! The one place errors become HTTP responses. Every error body has the OpenAI shape
//! `{"error": {"message", "type", "param", "code"}}`, and `message` starts with the field at fault.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::embed::EmbedError;
use crate::generate::GenerateError;
use crate::ingest::IngestError;
use crate::pipeline::PipelineError;
use crate::retrieve::StoreError;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// 400 for a field: the message reads `field: problem`.
    pub fn field(param: &str, problem: impl std::fmt::Display) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: format!("{param}: {problem}"),
            param: Some(param.to_string()),
            code: None,
            retry_after_s: None,
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn not_ready() -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is still loading models; see GET /ready",
        )
        .with_code("not_ready")
    }

    /// The JSON body, also used for SSE `error` events.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

impl From<PipelineError> for ApiError {
    fn from(e: PipelineError) -> ApiError {
        let message = e.to_string();
        match e {
            PipelineError::QueueFull => ApiError {
                retry_after_s: Some(1),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .with_code("queue_full")
            },
            PipelineError::Timeout(_) => {
                ApiError::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message)
                    .with_code("timeout")
            }
            PipelineError::Generate(GenerateError::ContextOverflow { .. }) => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::field("max_tokens", message)
            },
            PipelineError::Ingest(IngestError::Empty(_)) => ApiError::field("documents", message),
            PipelineError::Store(StoreError::Unavailable(_))
            | PipelineError::Ingest(IngestError::Store(StoreError::Unavailable(_))) => ApiError {
                retry_after_s: Some(5),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                    .with_code("store_unavailable")
            },
            PipelineError::Embed(EmbedError::Tokenizer(_))
            | PipelineError::Generate(GenerateError::Tokenizer(_)) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request_error",
                message,
            ),
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message),
        }
    }
}
