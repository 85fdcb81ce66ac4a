//! `POST /v1/documents` (ingest) and `DELETE /v1/documents/{id}`. A 200 means every chunk of
//! every listed document is durable in the store. Documents are checked in [`super::ask`].

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::ask::{self, check_id, DocumentBody};
use super::error::ApiError;
use super::json::{ValidJson, ValidPath};
use super::{AppState, RequestStage};

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    pub documents: Vec<DocumentBody>,
}

/// Ingests documents; durable when it returns.
#[utoipa::path(post, path = "/v1/documents", tag = "documents", request_body = CreateBody,
    responses((status = 200, description = "Per document: its id, chunks and what happened", body = super::schema::Ingested)))]
pub async fn create(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: axum::http::HeaderMap,
    ValidJson(body): ValidJson<CreateBody>,
) -> Result<Json<Value>, ApiError> {
    let pipeline = state.pipeline()?;
    let docs = ask::documents(body.documents)?;
    let faults = super::ask::request_faults(&state, &headers, &stage)?;
    let outcomes = pipeline.ingest(docs, faults, &stage).await?;
    Ok(Json(json!({"documents": outcomes})))
}

/// Removes a document's chunks.
#[utoipa::path(delete, path = "/v1/documents/{id}", tag = "documents",
    params(("id" = String, Path, description = "The document's id")),
    responses((status = 200, description = "What was removed", body = super::schema::Deleted)))]
pub async fn remove(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    ValidPath(id): ValidPath,
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
        .map_err(|e| ApiError::from(rag::pipeline::PipelineError::from(e)))?;
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
