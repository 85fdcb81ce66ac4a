//! How an answer is decoded, as every request spells it: one set of fields flattened into each
//! HTTP dialect's body (`#[serde(flatten)]`), converted once from the gRPC request, checked
//! once (errors name the field) and resolved once into the sampler's settings. A decoding
//! setting lives in four files: its field here, its meaning, flag and span attribute in
//! `llm`'s sampler, its attribute's name in `telemetry::names`, and `proto/ragscope.proto`.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::proto::QueryRequest;
use llm::Sampling;

/// Most stop strings per request (OpenAI's bound), and their longest.
pub const MAX_STOP: usize = 4;
const MAX_STOP_CHARS: usize = 64;
/// The range OpenAI allows for `presence_penalty` and `frequency_penalty`.
const PENALTY_RANGE: std::ops::RangeInclusive<f64> = -2.0..=2.0;
const MAX_NGRAM: usize = 32;
/// Largest `copy_bias`: past this the answer is the context pasted whatever the model says.
const MAX_COPY_BIAS: f64 = 10.0;

/// The decoding settings of a request; every one optional, a missing one the server's default
/// for a RAG answer, or neutral for the generator alone.
#[derive(Debug, Default, Clone, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct Decoding {
    /// 0 to 2; 0 (the default) is greedy.
    pub temperature: Option<f64>,
    /// In (0, 1]: sample from the likeliest tokens whose probabilities first reach it.
    pub top_p: Option<f64>,
    /// The sampling seed; choice `i` of `n` samples with `seed + i`.
    pub seed: Option<u64>,
    /// A stop string or a list of up to 4: the answer ends before the first.
    #[schema(value_type = Option<super::schema::Stop>)]
    pub stop: Option<Value>,
    /// -2 to 2, subtracted once from the logit of each token already generated.
    pub presence_penalty: Option<f64>,
    /// -2 to 2, subtracted per time a token was generated.
    pub frequency_penalty: Option<f64>,
    /// HF / llama.cpp's repetition penalty: positive, 1 is off.
    pub repetition_penalty: Option<f64>,
    /// Never generate an n-gram of this many tokens twice (0 to 32; 0 is off).
    pub no_repeat_ngram_size: Option<usize>,
    /// The penalties and the n-gram block count the prompt's tokens too (HF, llama.cpp).
    pub penalize_prompt: Option<bool>,
    /// 0 to 10, added to the logit of each token that continues, in the context passages, the
    /// answer's last tokens (unset: the server's `--copy-bias`; 0 is off).
    pub copy_bias: Option<f64>,
    /// End the answer at its first finished paragraph (unset: the server's
    /// `--end-at-paragraph` for a RAG answer, off for the generator alone).
    pub end_at_paragraph: Option<bool>,
}

/// A request's decoding, checked and resolved.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub sampling: Sampling,
    pub stop: Vec<String>,
    /// `None`: the caller's default.
    pub end_at_paragraph: Option<bool>,
}

impl Decoding {
    /// The gRPC request's decoding fields: the one place they are read from protobuf.
    pub fn from_query(r: &QueryRequest) -> Decoding {
        let strings = r.stop.iter().cloned().map(Value::String).collect();
        Decoding {
            temperature: r.temperature,
            top_p: r.top_p,
            seed: r.seed,
            stop: (!r.stop.is_empty()).then_some(Value::Array(strings)),
            presence_penalty: r.presence_penalty,
            frequency_penalty: r.frequency_penalty,
            repetition_penalty: r.repetition_penalty,
            no_repeat_ngram_size: r.no_repeat_ngram_size.map(|n| n as usize),
            penalize_prompt: r.penalize_prompt,
            copy_bias: r.copy_bias,
            end_at_paragraph: r.end_at_paragraph,
        }
    }

    /// Checks every setting (errors name the field) and resolves the sampler's: the request's
    /// where it gives them, else `base`'s (the server's RAG defaults, or the neutral ones).
    pub fn resolve(&self, base: Sampling) -> Result<Decoded, ApiError> {
        let temperature = self.temperature.unwrap_or(0.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::field(
                "temperature",
                format!("must be between 0 and 2, got {temperature}"),
            ));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::field(
                    "top_p",
                    format!("must be in (0, 1], got {p}"),
                ));
            }
        }
        let stop = stop_strings(self.stop.as_ref())?;
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = value.filter(|v| !PENALTY_RANGE.contains(v)) {
                return Err(ApiError::field(
                    name,
                    format!("must be between -2 and 2, got {v}"),
                ));
            }
        }
        if let Some(r) = self
            .repetition_penalty
            .filter(|r| !(*r > 0.0 && r.is_finite()))
        {
            return Err(ApiError::field(
                "repetition_penalty",
                format!("must be a positive number (1 is off), got {r}"),
            ));
        }
        if let Some(b) = self
            .copy_bias
            .filter(|b| !(0.0..=MAX_COPY_BIAS).contains(b))
        {
            return Err(ApiError::field(
                "copy_bias",
                format!("must be between 0 (off) and {MAX_COPY_BIAS}, got {b}"),
            ));
        }
        if let Some(n) = self.no_repeat_ngram_size.filter(|&n| n > MAX_NGRAM) {
            return Err(ApiError::field(
                "no_repeat_ngram_size",
                format!("must be between 0 (off) and {MAX_NGRAM}, got {n}"),
            ));
        }
        let float = |asked: Option<f64>, default: f32| asked.map_or(default, |v| v as f32);
        let sampling = Sampling {
            temperature,
            top_p: self.top_p,
            seed: self.seed.unwrap_or(0),
            presence_penalty: float(self.presence_penalty, base.presence_penalty),
            frequency_penalty: float(self.frequency_penalty, base.frequency_penalty),
            repetition_penalty: float(self.repetition_penalty, base.repetition_penalty),
            no_repeat_ngram: self.no_repeat_ngram_size.unwrap_or(base.no_repeat_ngram),
            penalize_prompt: self.penalize_prompt.unwrap_or(base.penalize_prompt),
            context_bias: base.context_bias,
            copy_bias: float(self.copy_bias, base.copy_bias),
        };
        Ok(Decoded {
            sampling,
            stop,
            end_at_paragraph: self.end_at_paragraph,
        })
    }
}

/// `stop` as the HTTP APIs take it: one string, or a list of them. An empty string or list
/// asks for none.
fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let stop: Vec<String> = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) if s.is_empty() => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::field(&format!("stop[{i}]"), "must be a string"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::field(
                "stop",
                "must be a string or an array of strings",
            ))
        }
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::field(
            "stop",
            format!("at most {MAX_STOP} stop strings, got {}", stop.len()),
        ));
    }
    for (i, s) in stop.iter().enumerate() {
        let chars = s.chars().count();
        if chars == 0 || chars > MAX_STOP_CHARS {
            return Err(ApiError::field(
                &format!("stop[{i}]"),
                format!("must be 1 to {MAX_STOP_CHARS} characters, got {chars}"),
            ));
        }
    }
    Ok(stop)
}

/// The decoding field of a JSON body that fails to deserialize. A body flattens [`Decoding`],
/// and serde reads a flattened part after the rest, without its field's name: this reads the
/// decoding fields alone to find it (the other fields are ignored here).
pub fn field_error(body: &Map<String, Value>) -> Option<ApiError> {
    let value = Value::Object(body.clone());
    match serde_path_to_error::deserialize::<_, Decoding>(value) {
        Ok(_) => None,
        Err(e) => {
            let path = e.path().to_string();
            Some(ApiError::field(&path, e.into_inner()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_resolve_over_the_base_and_bad_ones_are_named() {
        let base = Sampling {
            repetition_penalty: 1.1,
            copy_bias: 3.0,
            ..Sampling::default()
        };
        let asked = Decoding {
            temperature: Some(0.5),
            copy_bias: Some(0.0),
            stop: Some(Value::String("END".into())),
            ..Decoding::default()
        };
        let d = asked.resolve(base).unwrap();
        assert_eq!(d.sampling.temperature, 0.5);
        assert_eq!(d.sampling.copy_bias, 0.0, "the request's value wins");
        assert_eq!(
            d.sampling.repetition_penalty, 1.1,
            "the base's where it gives none"
        );
        assert_eq!(d.stop, ["END"]);
        assert_eq!(d.end_at_paragraph, None);
        for (bad, field) in [
            (r#"{"copy_bias": 11}"#, "copy_bias"),
            (r#"{"temperature": 3}"#, "temperature"),
            (r#"{"stop": ["a", 1]}"#, "stop[1]"),
            (r#"{"stop": ["a", "b", "c", "d", "e"]}"#, "stop"),
            (r#"{"no_repeat_ngram_size": 99}"#, "no_repeat_ngram_size"),
        ] {
            let d: Decoding = serde_json::from_str(bad).unwrap();
            let e = d.resolve(base).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{bad}");
        }
    }

    #[test]
    fn a_wrongly_typed_field_is_named() {
        let body: Map<String, Value> =
            serde_json::from_str(r#"{"query": "x", "copy_bias": "much"}"#).unwrap();
        let e = field_error(&body).expect("an error");
        assert_eq!(e.param.as_deref(), Some("copy_bias"));
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let fine: Map<String, Value> = serde_json::from_str(r#"{"query": 1, "seed": 3}"#).unwrap();
        assert!(
            field_error(&fine).is_none(),
            "only decoding fields are read"
        );
    }
}
