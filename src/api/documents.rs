//! `POST /v1/documents` (ingest) and `DELETE /v1/documents/{id}`. A 200 means every chunk of
//! every listed document is durable in the store. The gRPC `Ingest` checks documents here too.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::json::ValidJson;
use super::{AppState, RequestStage};
use crate::ingest::{Document, Format};

const MAX_DOCUMENTS: usize = 256;
const MAX_ID_CHARS: usize = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    pub documents: Vec<DocumentBody>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocumentBody {
    pub id: Option<String>,
    pub text: String,
    pub source: Option<String>,
    #[serde(default)]
    pub format: Format,
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

fn check_id(param: &str, id: &str) -> Result<(), ApiError> {
    if id.trim().is_empty() || id.chars().count() > MAX_ID_CHARS || id.chars().any(char::is_control)
    {
        return Err(ApiError::field(
            param,
            format!("must be 1 to {MAX_ID_CHARS} printable characters"),
        ));
    }
    Ok(())
}

pub async fn create(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    ValidJson(body): ValidJson<CreateBody>,
) -> Result<Json<Value>, ApiError> {
    let pipeline = state.pipeline()?;
    let docs = documents(body.documents)?;
    let outcomes = pipeline.ingest(docs, &stage).await?;
    Ok(Json(json!({"documents": outcomes})))
}

/// Checks documents to ingest (HTTP and gRPC) and fills in ids and sources. Errors name the
/// field, e.g. `documents[2].text`.
pub fn documents(bodies: Vec<DocumentBody>) -> Result<Vec<Document>, ApiError> {
    if bodies.is_empty() || bodies.len() > MAX_DOCUMENTS {
        return Err(ApiError::field(
            "documents",
            format!(
                "must hold 1 to {MAX_DOCUMENTS} documents, got {}",
                bodies.len()
            ),
        ));
    }
    let mut docs = Vec::with_capacity(bodies.len());
    for (i, d) in bodies.into_iter().enumerate() {
        if d.text.trim().is_empty() {
            return Err(ApiError::field(
                &format!("documents[{i}].text"),
                "must not be empty",
            ));
        }
        let id = match d.id {
            Some(id) => {
                check_id(&format!("documents[{i}].id"), &id)?;
                id
            }
            None => uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, d.text.as_bytes()).to_string(),
        };
        for (key, value) in &d.metadata {
            if value.is_object() || value.is_array() || value.is_null() {
                return Err(ApiError::field(
                    &format!("documents[{i}].metadata.{key}"),
                    "metadata values must be strings, numbers or booleans",
                ));
            }
        }
        docs.push(Document {
            source: d.source.unwrap_or_else(|| format!("api:{id}")),
            id,
            text: d.text,
            format: d.format,
            metadata: d.metadata,
        });
    }
    Ok(docs)
}

pub async fn remove(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let pipeline = state.pipeline()?;
    check_id("id", &id)?;
    let store = pipeline.store.clone();
    let doc = id.clone();
    // Blocking: a remote store waits for its server (on its own runtime, not this one).
    let deleted = tokio::task::spawn_blocking(move || store.delete_document(&doc, &stage))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            )
        })?
        .map_err(|e| ApiError::from(crate::pipeline::PipelineError::from(e)))?;
    if deleted == 0 {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("id: no document {id:?}"),
        )
        .with_code("not_found"));
    }
    Ok(Json(json!({"id": id, "deleted_chunks": deleted})))
}
