//! The one place errors become HTTP responses and gRPC statuses. A [`PipelineError`] is
//! classified once, into an [`ApiError`] (an HTTP status, a kind, the field at fault); HTTP
//! renders it in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, gRPC as a
//! [`tonic::Status`] whose code follows from the HTTP status. Either way `message` starts with
//! the field at fault.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use llm::GenerateError;
use rag::embed::EmbedError;
use rag::ingest::IngestError;
use rag::pipeline::PipelineError;
use rag::retrieve::StoreError;

/// gRPC metadata key carrying [`ApiError::code`] (e.g. `queue_full`, `context_length_exceeded`).
pub const GRPC_ERROR_CODE_KEY: &str = "ragscope-error-code";

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

    /// Names the field at fault (the message already starts with it).
    pub fn with_param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_string());
        self
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

    /// A request that arrived after shutdown began (`SIGTERM`): the server finishes what it
    /// has and takes nothing new.
    pub fn draining() -> ApiError {
        ApiError {
            retry_after_s: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is shutting down and takes no new requests; retry on another replica",
            )
            .with_code("shutting_down")
        }
    }

    /// 503 for a connection past `--max-connections`: answered at once and closed, before any
    /// request on it is read into the router.
    pub fn too_many_connections(max: usize) -> ApiError {
        ApiError {
            retry_after_s: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("the server has its maximum of {max} open connections; retry shortly or reuse a connection"),
            )
            .with_code("too_many_connections")
        }
    }

    /// 401: no API key, or one this server does not know (OpenAI's shape and code).
    pub fn unauthenticated(message: &str) -> ApiError {
        ApiError {
            param: Some("authorization".into()),
            ..ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
                .with_code("invalid_api_key")
        }
    }

    /// 403: a valid API key without the admin scope the route needs.
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "permission_error", message)
            .with_code("insufficient_scope")
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

/// Seconds a client is told to wait after a vector store failure.
const STORE_RETRY_AFTER_S: u64 = 5;

impl From<PipelineError> for ApiError {
    fn from(e: PipelineError) -> ApiError {
        let message = e.to_string();
        match e {
            PipelineError::Overloaded(r) => ApiError {
                retry_after_s: Some(r.retry_after_s),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .with_code(r.reason.as_str())
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
            // The store is upstream: its failure is a 503 the client may retry. The cause
            // (which server, which peer, Qdrant's own words) is for the operator: it is on
            // the failing span and in the log, never in the body.
            PipelineError::Store(e) | PipelineError::Ingest(IngestError::Store(e)) => {
                tracing::warn!(error = %e, "vector store call failed");
                let (what, code) = match e {
                    StoreError::Unavailable(_) => ("unavailable", "store_unavailable"),
                    _ => ("failing", "store_error"),
                };
                ApiError {
                    retry_after_s: Some(STORE_RETRY_AFTER_S),
                    ..ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        format!("the vector store is {what}; retry after {STORE_RETRY_AFTER_S} s"),
                    )
                    .with_code(code)
                }
            }
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

impl ApiError {
    /// The gRPC status code for this error: the standard HTTP-to-gRPC correspondence.
    pub fn grpc_code(&self) -> tonic::Code {
        use tonic::Code;
        match self.status {
            StatusCode::BAD_REQUEST
            | StatusCode::UNPROCESSABLE_ENTITY
            | StatusCode::PAYLOAD_TOO_LARGE => Code::InvalidArgument,
            StatusCode::NOT_FOUND => Code::NotFound,
            StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
            StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
            StatusCode::GATEWAY_TIMEOUT => Code::DeadlineExceeded,
            StatusCode::UNAUTHORIZED => Code::Unauthenticated,
            StatusCode::FORBIDDEN => Code::PermissionDenied,
            _ => Code::Internal,
        }
    }
}

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> tonic::Status {
        let mut status = tonic::Status::new(e.grpc_code(), e.message);
        let metadata = status.metadata_mut();
        if let Some(code) = e.code {
            metadata.insert(
                GRPC_ERROR_CODE_KEY,
                tonic::metadata::MetadataValue::from_static(code),
            );
        }
        if let Some(s) = e.retry_after_s {
            metadata.insert("retry-after", s.into());
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rag::worker::{Refusal, Refused};
    use std::time::Duration;
    use tonic::Code;

    fn grpc(e: PipelineError) -> tonic::Status {
        ApiError::from(e).into()
    }

    #[test]
    fn pipeline_errors_map_to_grpc_codes_through_the_http_classification() {
        let full = grpc(PipelineError::Overloaded(Refused {
            reason: Refusal::MaxWait,
            wait: Duration::from_millis(7500),
            allowed: Duration::from_millis(5000),
            retry_after_s: 3,
        }));
        assert_eq!(full.code(), Code::ResourceExhausted);
        assert_eq!(
            full.metadata().get(GRPC_ERROR_CODE_KEY).unwrap(),
            "queue_wait"
        );
        assert_eq!(full.metadata().get("retry-after").unwrap(), "3");
        assert!(
            full.message()
                .contains("(7500 ms) is above what this server admits (5000 ms)"),
            "{}",
            full.message()
        );
        assert_eq!(
            grpc(PipelineError::Timeout(5.0)).code(),
            Code::DeadlineExceeded
        );
        assert_eq!(grpc(PipelineError::WorkerGone).code(), Code::Internal);
        let overflow = grpc(PipelineError::Generate(GenerateError::ContextOverflow {
            prompt: 3000,
            max_tokens: 100,
            window: 2048,
        }));
        assert_eq!(overflow.code(), Code::InvalidArgument);
        assert!(
            overflow.message().starts_with("max_tokens: "),
            "{}",
            overflow.message()
        );
        let empty = grpc(PipelineError::Ingest(IngestError::Empty("a".into())));
        assert_eq!(empty.code(), Code::InvalidArgument);
        assert!(empty.message().starts_with("documents: "));
    }

    /// A store failure, however it is worded upstream, reaches the client as a 503 to retry,
    /// without the cause's addresses or Qdrant's own text.
    #[test]
    fn store_failures_are_503s_that_name_no_upstream_detail() {
        let cause = "searching on Qdrant at http://10.1.2.3:6334: Internal: 1 of 1 read \
                     operations failed: tcp connect error 10.1.2.4:6335";
        type Kind = fn(String) -> StoreError;
        let kinds: [(Kind, &str); 2] = [
            (StoreError::Unavailable, "store_unavailable"),
            (StoreError::Backend, "store_error"),
        ];
        for (error, code) in kinds {
            for api in [
                ApiError::from(PipelineError::Store(error(cause.into()))),
                ApiError::from(PipelineError::Ingest(IngestError::Store(error(
                    cause.into(),
                )))),
            ] {
                assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE, "{api:?}");
                assert_eq!(api.code, Some(code));
                assert_eq!(api.retry_after_s, Some(STORE_RETRY_AFTER_S));
                assert!(!api.message.contains("10.1.2"), "{}", api.message);
                assert!(!api.message.contains("Qdrant"), "{}", api.message);
            }
        }
    }

    #[test]
    fn api_errors_keep_their_field_in_the_grpc_message() {
        let status: tonic::Status = ApiError::field("top_k", "must be between 1 and 100").into();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "top_k: must be between 1 and 100");
        let status: tonic::Status = ApiError::not_ready().into();
        assert_eq!(status.code(), Code::Unavailable);
        let status: tonic::Status = ApiError::unauthenticated("authorization: missing").into();
        assert_eq!(status.code(), Code::Unauthenticated);
        let status: tonic::Status = ApiError::forbidden("admin only").into();
        assert_eq!(status.code(), Code::PermissionDenied);
        let status: tonic::Status = ApiError::draining().into();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            status.metadata().get(GRPC_ERROR_CODE_KEY).unwrap(),
            "shutting_down"
        );
    }
}
