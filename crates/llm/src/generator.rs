//! The [`Llama`] as the traits the pipeline and the API use: a [`Generator`] whose tokenizer
//! and prefix cache are its own. Each method hands over to the part that does the work
//! ([`crate::generation`], [`crate::score`], [`crate::warm`]).

use crate::generation::TextGeneration;
use crate::llama::{encode, Llama, MODEL_ID};
use crate::{
    ChatMessage, ChatTokenizer, Flow, GenerateError, GenerateRequest, Generated, Generator, Piece,
    PrefixReuse, TokenLogprob, Warmed,
};
use telemetry::span::Stage;

impl Generator for Llama {
    fn model_id(&self) -> &str {
        MODEL_ID
    }

    fn context_window(&self) -> usize {
        self.context_window
    }

    fn tokenizer(&self) -> &dyn ChatTokenizer {
        self
    }

    fn set_speculation(&self, speculation: crate::speculate::Speculation) -> bool {
        Llama::set_speculation(self, speculation);
        true
    }

    fn prefix_cache(&self) -> Option<&dyn PrefixReuse> {
        self.prefix.enabled().then_some(self as &dyn PrefixReuse)
    }

    fn score(
        &self,
        prompt: &[u32],
        top: usize,
        stage: &Stage,
    ) -> Result<Vec<TokenLogprob>, GenerateError> {
        crate::score::score(self, prompt, top, stage)
    }

    fn generate(
        &self,
        req: GenerateRequest<'_>,
        stage: &Stage,
        on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<Generated, GenerateError> {
        TextGeneration::new(self, req, stage).run(on_token)
    }
}

impl ChatTokenizer for Llama {
    fn count_tokens(&self, text: &str) -> Result<usize, GenerateError> {
        Ok(encode(&self.content_tokenizer, text)?.len())
    }

    /// Renders ChatML as the GGUF's template does, tokenizing turn by turn: control tokens are
    /// inserted as ids and message text never turns into control tokens.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, GenerateError> {
        let mut ids = Vec::new();
        for (role, content) in self.template.turns(messages) {
            ids.push(self.im_start);
            // Role and content as one string, as in the rendered template, so BPE sees the
            // same pre-token split.
            ids.extend(encode(
                &self.content_tokenizer,
                &format!("{role}\n{content}"),
            )?);
            ids.push(self.im_end);
            ids.extend_from_slice(&self.newline);
        }
        ids.push(self.im_start);
        ids.extend(encode(&self.content_tokenizer, "assistant\n")?);
        Ok(ids)
    }

    fn tokenize(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, GenerateError> {
        match parse_special {
            true => encode(&self.tokenizer, text),
            false => encode(&self.content_tokenizer, text),
        }
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, GenerateError> {
        self.tokenizer
            .decode(tokens, false)
            .map_err(|e| GenerateError::Tokenizer(e.to_string()))
    }

    fn token_bytes(&self, token: u32) -> Vec<u8> {
        match self.token_bytes.get(token) {
            [] => self
                .tokenizer
                .id_to_token(token)
                .map(String::into_bytes)
                .unwrap_or_default(),
            bytes => bytes.to_vec(),
        }
    }

    fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

impl PrefixReuse for Llama {
    fn warm(
        &self,
        head: &[u32],
        stage: &Stage,
        proceed: &dyn Fn() -> bool,
    ) -> Result<Option<Warmed>, GenerateError> {
        crate::warm::warm(self, head, stage, proceed)
    }

    fn cached(&self, prompt: &[u32]) -> usize {
        self.prefix.peek(prompt)
    }
}
