//! The shapes of the JSON the handlers write with `json!`, for `/openapi.json`: documentation
//! types, never built (`Serialize` only carries the serde attributes utoipa reads). The
//! integration tests (`crates/server/tests/api/openapi.rs`) hold real answers to them, so a
//! handler and its shape cannot drift apart. Nothing here imports a handler, so every handler
//! can name its shapes.
#![allow(dead_code)]

use std::collections::HashMap;

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use rag::pipeline::{CacheUse, Source, Timings, Usage};

/// Every error, HTTP and inside streams: OpenAI's shape.
#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// Starts with the field at fault: `top_k: must be between 1 and 100, got 0`.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `rate_limit_error`, `server_error`, …).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code (`unknown_parameter`, `queue_full`, `context_length_exceeded`, …).
    pub code: Option<String>,
}

/// A stop string, or a list of up to 4.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Text, or the text parts of a content array.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<TextPart>),
}

#[derive(ToSchema, Serialize)]
pub struct TextPart {
    /// Only `text` parts are supported.
    #[serde(rename = "type")]
    #[schema(pattern = "^text$")]
    pub kind: String,
    pub text: String,
}

/// A string, a list of strings, a list of token ids, or a list of such lists.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// A string or a non-empty list of strings.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    One(String),
    Many(Vec<String>),
}

/// How a document's text is read.
#[derive(ToSchema, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DocumentFormat {
    Text,
    Markdown,
    Html,
}

#[derive(ToSchema, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
    Timeout,
}

/// A generated token's log-probability with its likeliest alternatives (native endpoints).
#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenLogprob {
    pub token: String,
    pub id: u32,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TopLogprob {
    pub token: String,
    pub id: u32,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The data of one `/v1/rag/query` stream event: `sources` (the passages), `token`…, then
/// `done` or `error`.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum RagEvent {
    Sources(Vec<Source>),
    Token(RagToken),
    Done(RagDone),
    Error(ErrorBody),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RagToken {
    pub text: String,
    #[serde(default)]
    pub logprobs: Vec<TokenLogprob>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RagDone {
    pub usage: Usage,
    pub timings: Timings,
    pub cache: CacheUse,
    pub finish_reason: FinishReason,
}

/// OpenAI's finish reasons (a client that left or a timeout reads as one of these).
#[derive(ToSchema, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpenAiFinish {
    Stop,
    Length,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletion {
    pub id: String,
    /// `chat.completion`
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// Extension: the passages the answer drew on.
    pub sources: Vec<Source>,
    /// Extension: milliseconds per stage.
    pub timings: Timings,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub finish_reason: OpenAiFinish,
    pub logprobs: Option<ChatLogprobs>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AssistantMessage {
    /// `assistant`
    pub role: String,
    pub content: String,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<String>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The data of one chat stream event; the stream ends with the event `data: [DONE]`.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum ChatStreamEvent {
    Chunk(ChatCompletionChunk),
    Error(ErrorBody),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// `chat.completion.chunk`
    pub object: String,
    pub created: u64,
    pub model: String,
    /// Empty in the last chunk of `stream_options.include_usage`.
    pub choices: Vec<ChunkChoice>,
    /// Present (null until the last chunk) with `stream_options.include_usage`.
    pub usage: Option<Usage>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub finish_reason: Option<OpenAiFinish>,
    pub logprobs: Option<ChatLogprobs>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatDelta {
    pub role: Option<String>,
    pub content: Option<String>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Completion {
    pub id: String,
    /// `text_completion`
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<LegacyLogprobs>,
    /// Null in every streamed chunk but the last of a choice.
    pub finish_reason: Option<OpenAiFinish>,
}

/// The legacy completions' log-probabilities, per position.
#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LegacyLogprobs {
    pub tokens: Vec<String>,
    /// Null for the prompt's first token (nothing predicts it).
    pub token_logprobs: Vec<Option<f32>>,
    /// Token text to log-probability, per position.
    pub top_logprobs: Vec<Option<HashMap<String, f32>>>,
    /// Characters into the choice's text.
    pub text_offset: Vec<u64>,
}

/// The data of one completions stream event; the stream ends with `data: [DONE]`.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum CompletionStreamEvent {
    Chunk(CompletionChunk),
    Error(ErrorBody),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Only in the last chunk of `stream_options.include_usage`.
    pub usage: Option<Usage>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingList {
    /// `list`
    pub object: String,
    pub data: Vec<Embedding>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Embedding {
    /// `embedding`
    pub object: String,
    pub index: u32,
    pub embedding: EmbeddingVector,
}

/// Floats, or with `encoding_format: "base64"` their little-endian f32 bytes in base64.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingUsage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<Model>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RerankResponse {
    pub model: String,
    /// Best first.
    pub results: Vec<RerankResult>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RerankResult {
    pub index: u32,
    pub relevance_score: f32,
    /// With `return_documents: true`.
    pub document: Option<RerankDocument>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RerankDocument {
    pub text: String,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Ingested {
    pub documents: Vec<IngestOutcome>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct IngestOutcome {
    pub id: String,
    pub chunks: u64,
    pub status: IngestStatus,
}

#[derive(ToSchema, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IngestStatus {
    Created,
    Unchanged,
    Replaced,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Deleted {
    pub id: String,
    pub deleted_chunks: u64,
}

/// llama.cpp's answer `{tokens: [id…]}` (with `with_pieces`, `{tokens: [{id, piece}…]}`), or
/// vLLM's (chosen by `model`).
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum Tokenized {
    Vllm(VllmTokens),
    Llama(LlamaTokens),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaTokens {
    pub tokens: Vec<LlamaToken>,
}

/// An id, or with `with_pieces` an id and its text.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum LlamaToken {
    Id(u32),
    Piece(TokenPiece),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenPiece {
    pub id: u32,
    pub piece: Piece,
}

/// A token's text, or its bytes when they are not whole UTF-8.
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum Piece {
    Text(String),
    Bytes(Vec<u8>),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VllmTokens {
    pub count: u64,
    pub max_model_len: u64,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// llama.cpp's `{content}`, or vLLM's `{prompt}` (with `model`).
#[derive(ToSchema, Serialize)]
#[serde(untagged)]
pub enum Detokenized {
    Llama(DetokenizedContent),
    Vllm(DetokenizedPrompt),
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizedContent {
    pub content: String,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizedPrompt {
    pub prompt: String,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// `ok`
    pub status: String,
}

/// `ready`, or (with 503) `loading`, `failed` or `draining`, with what the server knows.
#[derive(ToSchema, Serialize)]
pub struct Readiness {
    pub status: String,
    #[schema(value_type = Option<Object>)]
    pub models: Option<Value>,
    #[schema(value_type = Option<Object>)]
    pub store: Option<Value>,
    #[schema(value_type = Option<Object>)]
    pub corpus: Option<Value>,
    #[schema(value_type = Option<Object>)]
    pub queue: Option<Value>,
    pub error: Option<String>,
    pub in_flight: Option<u64>,
}

/// OTLP JSON, as the collector's file exporter writes it.
#[derive(ToSchema, Serialize)]
pub struct OtlpTraces {
    #[serde(rename = "resourceSpans")]
    #[schema(value_type = Vec<Object>)]
    pub resource_spans: Vec<Value>,
}

#[derive(ToSchema, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cleared {
    pub cleared: bool,
}
