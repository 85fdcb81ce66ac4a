//! `ragscope bench --weight-formats`: prefill and decode speed of the generator in each
//! [`WeightFormat`] on the CPU, the measurement behind the table on [`WeightFormat`]. A
//! ~600-token RAG prompt, then 128 greedy decode steps (end tokens fed back like any other, so
//! every run decodes the same count), medians of 3 after a warm-up. Only on an idle machine:
//! candle's quantized matmuls wait for their workers in spin barriers, so on an oversubscribed
//! CPU the Q8_0 numbers collapse (seen: 4 tok/s).

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::median;
use crate::config::BenchArgs;
use crate::generate::llama::{Llama, WeightFormat};
use crate::generate::{ChatMessage, GenerateError, Generator};

/// Decode steps per run.
const DECODE: usize = 128;

/// What runs when no format is named.
const DEFAULT: [WeightFormat; 6] = [
    WeightFormat::Shipped,
    WeightFormat::Q8_0,
    WeightFormat::F32,
    WeightFormat::F32PrefillQ8Decode,
    WeightFormat::F32PrefillQ4Decode,
    WeightFormat::Bf16PrefillQ4Decode,
];

/// Measures the formats `names` (all of [`DEFAULT`] when empty) and prints one line each.
pub fn run(args: &BenchArgs, names: &[String]) -> Result<()> {
    let formats = select(names)?;
    let m = &args.models;
    let gen_dir = crate::models::resolve(&m.gen_model, &m.models_dir, &[], m.fetch_models)?;
    let gguf = std::fs::read_dir(&gen_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "gguf"))
        .with_context(|| format!("no .gguf file in {}", gen_dir.display()))?;
    let default_model = crate::app::load_generator(&gen_dir, &Device::Cpu, m.max_context)
        .with_context(|| format!("loading generator from {}", gen_dir.display()))?;
    let prompt = long_prompt(&default_model)?;
    for format in formats {
        let tokenizer = default_model.tokenizer().clone();
        let model = Llama::load_with_format(&gguf, tokenizer, &Device::Cpu, m.max_context, format)?;
        let once = || -> Result<(f64, f64)> {
            let (prefill, decode) = model.time_prefill_and_decode(&prompt, DECODE)?;
            Ok((
                prompt.len() as f64 / prefill.as_secs_f64(),
                DECODE as f64 / decode.as_secs_f64(),
            ))
        };
        once()?;
        let runs = (0..3).map(|_| once()).collect::<Result<Vec<_>>>()?;
        println!(
            "{format:?} ({} prefill): prompt {} tokens, prefill {:.0} tok/s, decode {:.1} tok/s (runs {runs:.1?})",
            model.prefill_kind().name(),
            prompt.len(),
            median(&mut runs.iter().map(|r| r.0).collect::<Vec<_>>()),
            median(&mut runs.iter().map(|r| r.1).collect::<Vec<_>>()),
        );
    }
    Ok(())
}

/// The formats `names` picks, in the order given; all of [`DEFAULT`] for none.
fn select(names: &[String]) -> Result<Vec<WeightFormat>> {
    if names.is_empty() {
        return Ok(DEFAULT.to_vec());
    }
    names
        .iter()
        .map(|name| match WeightFormat::named(name) {
            Some(f) => Ok(f),
            None => bail!(
                "unknown weight format {name:?}; the formats are {:?}",
                WeightFormat::ALL
            ),
        })
        .collect()
}

/// A RAG prompt of about 600 tokens: the same passage repeated until the rendered chat prompt
/// reaches 580 tokens. Also the chunked-prefill test's prompt (longer than one chunk).
pub(crate) fn long_prompt(model: &Llama) -> Result<Vec<u32>, GenerateError> {
    let passage = "The Great Barrier Reef is the world's largest coral reef system, composed \
                   of over 2,900 individual reefs and 900 islands stretching for over 2,300 \
                   kilometres over an area of approximately 344,400 square kilometres. The \
                   reef is located in the Coral Sea, off the coast of Queensland, Australia. ";
    let mut text = String::new();
    let mut i = 1;
    loop {
        text.push_str(&format!("Passage {i}: {passage}\n"));
        let msgs = [ChatMessage::new(
            "user",
            format!("{text}\nQuestion: How long is the reef?"),
        )];
        let ids = model.chat_prompt(&msgs)?;
        if ids.len() >= 580 {
            return Ok(ids);
        }
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_pick_formats_and_none_picks_the_default_set() {
        assert_eq!(select(&[]).unwrap(), DEFAULT.to_vec());
        let names = ["Q8_0".to_string(), "F32PrefillQ4Decode".to_string()];
        assert_eq!(
            select(&names).unwrap(),
            [WeightFormat::Q8_0, WeightFormat::F32PrefillQ4Decode]
        );
        assert!(select(&["q8".to_string()]).is_err());
    }
}
