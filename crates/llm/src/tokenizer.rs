//! The SmolLM2 tokenizer, rebuilt from GGUF metadata, and incremental UTF-8 decoding of tokens.
//!
//! The GGUF ships no `tokenizer.json`, and candle's own GGUF fallback adds a GPT-2 style prefix
//! space (`Ġsystem`), so we rebuild what the Hugging Face tokenizer does: byte-level BPE over
//! `tokenizer.ggml.{tokens,merges}`, digits split one by one, no prefix space, control tokens
//! special. [`TokenBytes`] + [`Utf8Stream`] turn generated ids into text one complete piece at a time.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use super::GenerateError;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

fn tok_err(e: impl std::fmt::Display) -> GenerateError {
    GenerateError::Tokenizer(e.to_string())
}

/// Reads the GGUF header of `path` and builds its tokenizer (the weights are not read).
pub fn from_gguf_file(path: &Path) -> Result<Tokenizer, GenerateError> {
    let mut file = std::fs::File::open(path)
        .map_err(|e| GenerateError::Load(format!("{}: {e}", path.display())))?;
    let content = gguf_file::Content::read(&mut file)
        .map_err(|e| GenerateError::Load(format!("{}: {e}", path.display())))?;
    from_gguf(&content)
}

/// Builds a byte-level BPE tokenizer equivalent to SmolLM2's `tokenizer.json` from GGUF metadata.
pub fn from_gguf(content: &gguf_file::Content) -> Result<Tokenizer, GenerateError> {
    let md = |key: &str| {
        content
            .metadata
            .get(key)
            .ok_or_else(|| GenerateError::Load(format!("GGUF metadata has no {key}")))
    };
    let model = md("tokenizer.ggml.model")?.to_string().map_err(tok_err)?;
    if model != "gpt2" {
        return Err(GenerateError::Load(format!(
            "tokenizer model {model:?} is not byte-level BPE (gpt2)"
        )));
    }
    let tokens: Vec<String> = md("tokenizer.ggml.tokens")?
        .to_vec()
        .map_err(tok_err)?
        .iter()
        .map(|v| v.to_string().cloned())
        .collect::<Result<_, _>>()
        .map_err(tok_err)?;
    let merges: Vec<(String, String)> = md("tokenizer.ggml.merges")?
        .to_vec()
        .map_err(tok_err)?
        .iter()
        .map(|v| {
            let m = v.to_string().map_err(tok_err)?;
            // Byte-level symbols never contain a literal space (it is `Ġ`), so the first space
            // is the separator.
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| tok_err(format!("malformed merge {m:?}")))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<_, GenerateError>>()?;
    // Missing types mean every token is normal.
    let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(tok_err)?
            .iter()
            .map(|t| t.to_i32())
            .collect::<Result<_, _>>()
            .map_err(tok_err)?,
        None => vec![1; tokens.len()],
    };

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut tokenizer = Tokenizer::new(bpe);
    // Same pre-tokenizer as the Hugging Face SmolLM2 tokenizer: digits one by one, then the GPT-2
    // regex split without a prefix space.
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    tokenizer.with_decoder(Some(ByteLevel::default()));

    let mut special = Vec::new();
    let mut added = Vec::new();
    for (token, &ty) in tokens.iter().zip(&types) {
        match ty {
            TOKEN_TYPE_CONTROL => special.push(AddedToken::from(token.clone(), true)),
            TOKEN_TYPE_USER_DEFINED => added.push(AddedToken::from(token.clone(), false)),
            _ => {}
        }
    }
    tokenizer.add_special_tokens(special).map_err(tok_err)?;
    tokenizer.add_tokens(added).map_err(tok_err)?;
    Ok(tokenizer)
}

/// Writes the tokenizer as a Hugging Face `tokenizer.json`.
pub fn save(tokenizer: &Tokenizer, path: &Path) -> Result<(), GenerateError> {
    tokenizer.save(path, false).map_err(tok_err)
}

/// Loads a `tokenizer.json` (e.g. one written by [`save`]).
pub fn load(path: &Path) -> Result<Tokenizer, GenerateError> {
    Tokenizer::from_file(path).map_err(|e| GenerateError::Load(format!("{}: {e}", path.display())))
}

/// GPT-2's byte ↔ printable-char table: byte `b` is written as char `table[b]` in byte-level
/// BPE tokens.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("valid code point")
        };
    }
    table
}

/// The raw bytes behind every token id, so decoding a token is a slice lookup. Special tokens
/// map to no bytes: they are control signals, not text.
pub struct TokenBytes {
    bytes: Vec<u8>,
    /// `bytes[offsets[id]..offsets[id + 1]]` belongs to token `id`.
    offsets: Vec<usize>,
}

impl TokenBytes {
    /// Decodes every vocabulary entry once, at load time.
    pub fn new(tokenizer: &Tokenizer) -> TokenBytes {
        let table = bytes_to_unicode();
        let byte_of: HashMap<char, u8> = (0..=255u8).map(|b| (table[b as usize], b)).collect();
        let specials: std::collections::HashSet<u32> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        let n = tokenizer.get_vocab_size(true);
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        for id in 0..n as u32 {
            if !specials.contains(&id) {
                if let Some(token) = tokenizer.id_to_token(id) {
                    let start = bytes.len();
                    for c in token.chars() {
                        match byte_of.get(&c) {
                            Some(&b) => bytes.push(b),
                            None => {
                                // Not byte-level (a user-defined added token): its text as is,
                                // as the byte-level decoder does.
                                bytes.truncate(start);
                                bytes.extend_from_slice(token.as_bytes());
                                break;
                            }
                        }
                    }
                }
            }
            offsets.push(bytes.len());
        }
        TokenBytes { bytes, offsets }
    }

    /// The bytes of token `id` (empty for special or unknown ids).
    pub fn get(&self, id: u32) -> &[u8] {
        let id = id as usize;
        if id + 1 >= self.offsets.len() {
            return &[];
        }
        &self.bytes[self.offsets[id]..self.offsets[id + 1]]
    }
}

/// Turns a stream of bytes into complete UTF-8 text: a character split across tokens is held
/// back until its last byte arrives. Invalid sequences become U+FFFD exactly as
/// `String::from_utf8_lossy` would, so the pieces concatenate to the lossy decoding of all bytes.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
    piece: String,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Utf8Stream {
        Utf8Stream::default()
    }

    /// Appends `bytes` and returns the text that became complete (often empty mid-character).
    pub fn push(&mut self, bytes: &[u8]) -> &str {
        self.piece.clear();
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    self.piece.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    let ok = std::str::from_utf8(&self.pending[start..start + valid])
                        .expect("valid_up_to marks valid UTF-8");
                    self.piece.push_str(ok);
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            start += valid;
                            break;
                        }
                        Some(bad) => {
                            self.piece.push(char::REPLACEMENT_CHARACTER);
                            start += valid + bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        &self.piece
    }

    /// Ends the stream: any held-back partial character becomes U+FFFD.
    pub fn finish(&mut self) -> &str {
        self.piece.clear();
        if !self.pending.is_empty() {
            self.piece.push(char::REPLACEMENT_CHARACTER);
            self.pending.clear();
        }
        &self.piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tokenizer of the real GGUF, or `None` (with a note) when the model is not present.
    fn tokenizer() -> Option<Tokenizer> {
        let path = crate::testing::model_path()?;
        Some(from_gguf_file(&path).expect("tokenizer from GGUF"))
    }

    const TEXTS: &[&str] = &[
        "Hello world",
        " leading space and  double  spaces",
        "The year 2024 had 366 days; π ≈ 3.14159.",
        "line one\nline two\n\n\tindented\r\nend",
        "Ünïcödé: 日本語のテキスト, emoji 🦀🚀, Ελληνικά",
        "code: fn main() { println!(\"{}\", 42); }",
        "",
    ];

    #[test]
    fn round_trips_text_exactly() {
        let Some(tok) = tokenizer() else { return };
        for text in TEXTS {
            let enc = tok.encode(*text, false).unwrap();
            let back = tok.decode(enc.get_ids(), false).unwrap();
            assert_eq!(&back, text);
        }
    }

    #[test]
    fn splits_digits_and_adds_no_prefix_space() {
        let Some(tok) = tokenizer() else { return };
        let enc = tok.encode("system 12345", false).unwrap();
        let toks = enc.get_tokens();
        assert_eq!(toks[0], "system", "no GPT-2 style prefix space");
        let digits: Vec<&str> = toks[toks.len() - 5..].iter().map(String::as_str).collect();
        assert_eq!(digits, ["1", "2", "3", "4", "5"]);
    }

    #[test]
    fn control_tokens_are_single_special_ids() {
        let Some(tok) = tokenizer() else { return };
        let enc = tok.encode("<|im_start|>user<|im_end|>", false).unwrap();
        let ids = enc.get_ids();
        assert_eq!(ids[0], 1);
        assert_eq!(*ids.last().unwrap(), 2);
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
        assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
        // Specials vanish when decoding with skip_special_tokens.
        assert_eq!(tok.decode(ids, true).unwrap(), "user");
    }

    #[test]
    fn chatml_prompt_round_trips() {
        let Some(tok) = tokenizer() else { return };
        let prompt = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                      Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
                      <|im_start|>assistant\n";
        let ids = tok.encode(prompt, false).unwrap().get_ids().to_vec();
        assert_eq!(&ids[..1], &[1]);
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
        assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
        assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
        // "system" directly after <|im_start|> is one token without a leading Ġ.
        assert_eq!(tok.id_to_token(ids[1]).unwrap(), "system");
    }

    #[test]
    fn save_and_load_give_the_same_tokenizer() {
        let Some(tok) = tokenizer() else { return };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        save(&tok, &path).unwrap();
        let loaded = load(&path).unwrap();
        for text in TEXTS.iter().chain(&["<|im_start|>user\nhi 42<|im_end|>\n"]) {
            assert_eq!(
                tok.encode(*text, false).unwrap().get_ids(),
                loaded.encode(*text, false).unwrap().get_ids()
            );
        }
    }

    #[test]
    fn token_bytes_stream_to_the_decoded_text() {
        let Some(tok) = tokenizer() else { return };
        let bytes = TokenBytes::new(&tok);
        assert!(bytes.get(2).is_empty(), "special tokens carry no text");
        for text in TEXTS {
            let ids = tok.encode(*text, false).unwrap().get_ids().to_vec();
            let mut stream = Utf8Stream::new();
            let mut out = String::new();
            for &id in &ids {
                let piece = stream.push(bytes.get(id));
                assert!(!piece.contains('\u{FFFD}'));
                out.push_str(piece);
            }
            out.push_str(stream.finish());
            assert_eq!(&out, text);
            assert_eq!(out, tok.decode(&ids, true).unwrap());
        }
    }

    #[test]
    fn utf8_stream_holds_back_split_characters() {
        let mut s = Utf8Stream::new();
        let crab = "🦀".as_bytes();
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&crab[..1]), "");
        assert_eq!(s.push(&crab[1..3]), "");
        assert_eq!(s.push(&crab[3..]), "🦀");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn utf8_stream_matches_lossy_decoding_of_invalid_bytes() {
        let all: &[u8] = b"ok\xff\xfe mid \xe6\x97 end \xf0\x9f";
        let mut s = Utf8Stream::new();
        let mut out = String::new();
        for b in all.chunks(1) {
            out.push_str(s.push(b));
        }
        out.push_str(s.finish());
        assert_eq!(out, String::from_utf8_lossy(all));
    }

    #[test]
    fn byte_table_is_a_bijection() {
        let table = bytes_to_unicode();
        let set: std::collections::HashSet<char> = table.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
    }
}
