//! `POST /tokenize` and `POST /detokenize` with the generator's own tokenizer, so clients count
//! tokens exactly as the server does. Two dialects on the same paths, told apart by the body:
//! llama.cpp's server (`content`, answered with `tokens`; detokenize answers `content`) and
//! vLLM's (`model` with `prompt` or `messages`, answered with `count`, `max_model_len` and
//! `tokens`; detokenize with `model` answers `prompt`). Fields of the other dialect, or ones we
//! don't implement, are refused by name.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::fields::refuse_unhonoured;
use super::json::ValidJson;
use super::openai::{chat_messages, check_model, ChatMessageBody};
use super::AppState;
use llm::{GenerateError, Generator};
use rag::pipeline::{Pipeline, PipelineError};

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct TokenizeBody {
    /// llama.cpp: the text.
    pub content: Option<String>,
    /// llama.cpp: add the model's BOS/EOS. SmolLM2's tokenizer adds none, so either value
    /// gives the same tokens (as llama.cpp does for a model without `add_bos_token`).
    pub add_special: Option<bool>,
    /// llama.cpp: control-token text (`<|im_start|>`) becomes that token (default true).
    pub parse_special: Option<bool>,
    /// llama.cpp: tokens as `{id, piece}`.
    pub with_pieces: Option<bool>,
    /// vLLM: the model; its presence selects the vLLM dialect.
    pub model: Option<String>,
    /// vLLM: the text (control-token text is parsed, as vLLM's tokenizer does).
    pub prompt: Option<String>,
    /// vLLM: a conversation, tokenized as the chat template renders it.
    pub messages: Option<Vec<ChatMessageBody>>,
    /// vLLM: as `add_special`.
    pub add_special_tokens: Option<bool>,
    /// vLLM: end with the assistant's turn opening; only `true` (the default) is supported.
    pub add_generation_prompt: Option<bool>,
    /// vLLM: also return each token's text as `token_strs`.
    pub return_token_strs: Option<bool>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// Names the first field of `fields` that is set, for refusing the other dialect's fields.
fn refuse_set(fields: &[(&str, bool)], why: &str) -> Result<(), ApiError> {
    match fields.iter().find(|(_, set)| *set) {
        Some((name, _)) => Err(ApiError::field(name, why).with_code("unsupported_parameter")),
        None => Ok(()),
    }
}

/// The generator's tokenizer, in llama.cpp's shape or (with `model`) vLLM's.
#[utoipa::path(post, path = "/tokenize", tag = "tokenizer", request_body = TokenizeBody,
    responses((status = 200, description = "The tokens", body = super::schema::Tokenized)))]
pub async fn tokenize(
    State(state): State<AppState>,
    ValidJson(body): ValidJson<TokenizeBody>,
) -> Result<Json<Value>, ApiError> {
    refuse_unhonoured(&body.extra, &[])?;
    let pipeline = state.pipeline()?;
    let generator = pipeline.generator.as_ref();
    let Some(model) = &body.model else {
        refuse_set(
            &[
                ("prompt", body.prompt.is_some()),
                ("messages", body.messages.is_some()),
                ("add_special_tokens", body.add_special_tokens.is_some()),
                (
                    "add_generation_prompt",
                    body.add_generation_prompt.is_some(),
                ),
                ("return_token_strs", body.return_token_strs.is_some()),
            ],
            "a vLLM field: send it with `model` (or send llama.cpp's `content` alone)",
        )?;
        let content = body
            .content
            .ok_or_else(|| ApiError::field("content", "missing: the text to tokenize"))?;
        let tokens = generator
            .tokenizer()
            .tokenize(&content, body.parse_special.unwrap_or(true))
            .map_err(model_error)?;
        if !body.with_pieces.unwrap_or(false) {
            return Ok(Json(json!({ "tokens": tokens })));
        }
        let pieces: Vec<Value> = tokens
            .iter()
            .map(|&id| json!({"id": id, "piece": piece(generator, id)}))
            .collect();
        return Ok(Json(json!({ "tokens": pieces })));
    };
    check_model(&pipeline, model)?;
    refuse_set(
        &[
            ("content", body.content.is_some()),
            ("add_special", body.add_special.is_some()),
            ("parse_special", body.parse_special.is_some()),
            ("with_pieces", body.with_pieces.is_some()),
        ],
        "a llama.cpp field: leave out `model` to use that dialect",
    )?;
    let tokens = match (body.prompt, body.messages) {
        (Some(prompt), None) => generator
            .tokenizer()
            .tokenize(&prompt, true)
            .map_err(model_error)?,
        (None, Some(messages)) => {
            if body.add_generation_prompt == Some(false) {
                return Err(ApiError::field(
                    "add_generation_prompt",
                    "only true is supported: the chat template always opens the assistant's turn",
                )
                .with_code("unsupported_parameter"));
            }
            if messages.is_empty() {
                return Err(ApiError::field(
                    "messages",
                    "must hold at least one message",
                ));
            }
            generator
                .tokenizer()
                .chat_prompt(&chat_messages(&messages)?)
                .map_err(model_error)?
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "messages",
                "send either `prompt` or `messages`, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::field(
                "prompt",
                "missing: send `prompt` (text) or `messages` (a conversation)",
            ))
        }
    };
    let mut out = json!({
        "count": tokens.len(),
        "max_model_len": generator.context_window(),
        "tokens": tokens,
    });
    if body.return_token_strs.unwrap_or(false) {
        let strs: Vec<String> = tokens
            .iter()
            .map(|&id| String::from_utf8_lossy(&generator.tokenizer().token_bytes(id)).into_owned())
            .collect();
        out["token_strs"] = json!(strs);
    }
    Ok(Json(out))
}

/// A token's text as llama.cpp's `with_pieces` gives it: a string when its bytes are UTF-8,
/// else the bytes (a character split across tokens).
fn piece(generator: &dyn Generator, id: u32) -> Value {
    let bytes = generator.tokenizer().token_bytes(id);
    match String::from_utf8(bytes) {
        Ok(s) => json!(s),
        Err(e) => json!(e.into_bytes()),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct DetokenizeBody {
    pub tokens: Vec<u32>,
    /// vLLM: its presence selects the vLLM answer `{prompt}` (llama.cpp's is `{content}`).
    pub model: Option<String>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// Token ids back to text (`{content}`, or with `model` vLLM's `{prompt}`).
#[utoipa::path(post, path = "/detokenize", tag = "tokenizer", request_body = DetokenizeBody,
    responses((status = 200, description = "The text", body = super::schema::Detokenized)))]
pub async fn detokenize(
    State(state): State<AppState>,
    ValidJson(body): ValidJson<DetokenizeBody>,
) -> Result<Json<Value>, ApiError> {
    refuse_unhonoured(&body.extra, &[])?;
    let pipeline = state.pipeline()?;
    if let Some(model) = &body.model {
        check_model(&pipeline, model)?;
    }
    check_token_ids(&pipeline, "tokens", &body.tokens)?;
    let text = pipeline
        .generator
        .tokenizer()
        .detokenize(&body.tokens)
        .map_err(model_error)?;
    let key = if body.model.is_some() {
        "prompt"
    } else {
        "content"
    };
    Ok(Json(json!({ key: text })))
}

/// A tokenizer failure, classified as any model error is.
pub fn model_error(e: GenerateError) -> ApiError {
    ApiError::from(PipelineError::from(e))
}

/// Refuses an id outside the vocabulary, naming it (`tokens[3]`).
pub fn check_token_ids(pipeline: &Pipeline, param: &str, tokens: &[u32]) -> Result<(), ApiError> {
    let vocab = pipeline.generator.tokenizer().vocab_size();
    match tokens.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(ApiError::field(
            &format!("{param}[{i}]"),
            format!(
                "token id {} is outside the vocabulary (0 to {})",
                tokens[i],
                vocab - 1
            ),
        )),
        None => Ok(()),
    }
}
