//! `ragscope-lab stages`: the speed of every stage on this machine, printed as a table.
//! Measurements, not assertions: the README quotes its output with the command that produced it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use rand::{Rng, SeedableRng};

use crate::{median, percentile, stage, Setup};
use llm::{ChatMessage, Flow, GenerateRequest, Sampling};
use rag::pipeline::RagRequest;
use rag::retrieve::edge::EdgeStore;
use rag::retrieve::{Chunk, VectorStore};
use ragscope::app;

/// Embedding, retrieval (over the corpus and `synthetic_chunks` random vectors), prefill and
/// decode, and whole RAG requests through the pipeline.
pub fn run(args: &Setup, synthetic_chunks: usize, handle: &tokio::runtime::Handle) -> Result<()> {
    let rounds = args.rounds.max(1);
    // Every round prefills the same prompt: with prefix reuse on, all but the first would copy
    // it from the cache. The bench measures whole prefills, comparable across runs and peers.
    let mut load = args.load.clone();
    load.generator.prefix_cache_mb = 0;
    let pipeline = app::load_with_corpus(&load, &args.server)?;
    let questions =
        ragscope::eval::first_questions(std::path::Path::new("eval/questions.jsonl"), 10)
            .unwrap_or_else(|_| vec!["How do I undo the last commit?".to_string(); 10]);
    println!(
        "ragscope-lab stages ({} rounds, {} threads)",
        rounds,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("prefix cache off: every prefill computes its whole prompt");
    println!("{:<44} {:>12}", "measurement", "value");

    // Embedding: one query at a time, and batches of 32 passages.
    let e = &pipeline.embedder;
    let mut single = Vec::new();
    for _ in 0..rounds * 4 {
        for q in &questions {
            let t = Instant::now();
            e.embed(&[q], &stage())?;
            single.push(t.elapsed());
        }
    }
    println!(
        "{:<44} {:>9.2} ms",
        "embed batch 1, p50 latency",
        percentile(&mut single, 50.0)
    );
    println!(
        "{:<44} {:>9.1} /s",
        "embed batch 1, sentences/s",
        single.len() as f64 / single.iter().sum::<Duration>().as_secs_f64()
    );
    let passages: Vec<String> = (0..32)
        .map(|i| format!("Sentence {i}: git stash saves local modifications away and reverts the working directory to match the HEAD commit, so that you can switch branches and come back later to apply them again."))
        .collect();
    let refs: Vec<&str> = passages.iter().map(String::as_str).collect();
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        e.embed(&refs, &stage())?;
        rates.push(32.0 / t.elapsed().as_secs_f64());
    }
    println!(
        "{:<44} {:>9.1} /s",
        "embed batch 32 (~40-word passages), sentences/s",
        median(&mut rates)
    );

    // Retrieval at the corpus size and over synthetic chunks.
    let vectors: Vec<Vec<f32>> = questions
        .iter()
        .map(|q| e.embed(&[q], &stage()).map(|mut v| v.remove(0)))
        .collect::<Result<_, _>>()?;
    let mut lat = Vec::new();
    for _ in 0..rounds * 20 {
        for v in &vectors {
            let t = Instant::now();
            pipeline
                .store
                .search(v, args.load.pipeline.top_k, None, &stage())?;
            lat.push(t.elapsed());
        }
    }
    let corpus_size = pipeline.store.count()?;
    println!(
        "{:<44} {:>9.3} ms",
        format!(
            "retrieve top-{} at {corpus_size} chunks, p50",
            args.load.pipeline.top_k
        ),
        percentile(&mut lat, 50.0)
    );
    println!(
        "{:<44} {:>9.3} ms",
        format!(
            "retrieve top-{} at {corpus_size} chunks, p99",
            args.load.pipeline.top_k
        ),
        percentile(&mut lat, 99.0)
    );
    if synthetic_chunks > 0 {
        let dir = tempfile::tempdir()?;
        let store = EdgeStore::open(dir.path(), "synthetic", e.dimension())?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let t = Instant::now();
        for start in (0..synthetic_chunks).step_by(2000) {
            let n = 2000.min(synthetic_chunks - start);
            let chunks: Vec<Chunk> = (start..start + n)
                .map(|i| Chunk {
                    id: uuid::Uuid::from_u128(i as u128 + 1).to_string(),
                    doc_id: format!("doc-{}", i / 20),
                    text: format!("synthetic chunk {i}"),
                    source: "synthetic".into(),
                    position: (i % 20) as u32,
                    metadata: Default::default(),
                })
                .collect();
            let vecs: Vec<Vec<f32>> = (0..n)
                .map(|_| {
                    let v: Vec<f32> = (0..e.dimension())
                        .map(|_| rng.random::<f32>() - 0.5)
                        .collect();
                    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                    v.into_iter().map(|x| x / norm).collect()
                })
                .collect();
            store.upsert(&chunks, &vecs, &stage())?;
        }
        let upsert = t.elapsed();
        let t = Instant::now();
        store.build_index()?;
        let index = t.elapsed();
        let mut lat = Vec::new();
        for _ in 0..rounds * 20 {
            for v in &vectors {
                let t = Instant::now();
                store.search(v, args.load.pipeline.top_k, None, &stage())?;
                lat.push(t.elapsed());
            }
        }
        let n = synthetic_chunks;
        println!(
            "{:<44} {:>9.1} s",
            format!("upsert {n} synthetic chunks"),
            upsert.as_secs_f64()
        );
        println!(
            "{:<44} {:>9.1} s",
            format!("build HNSW over {n} chunks"),
            index.as_secs_f64()
        );
        println!(
            "{:<44} {:>9.3} ms",
            format!(
                "retrieve top-{} at {n} chunks, p50",
                args.load.pipeline.top_k
            ),
            percentile(&mut lat, 50.0)
        );
        println!(
            "{:<44} {:>9.3} ms",
            format!(
                "retrieve top-{} at {n} chunks, p99",
                args.load.pipeline.top_k
            ),
            percentile(&mut lat, 99.0)
        );
    }

    // Generation: a ~600-token RAG prompt, then 128 greedy tokens.
    let g = &pipeline.generator;
    let passage = "git rebase reapplies commits on top of another base tip. If the upstream is not given, the upstream configured in branch.<name>.remote and branch.<name>.merge options will be used. ";
    let mut context = String::new();
    while g.tokenizer().count_tokens(&context)? < 560 {
        context.push_str(passage);
    }
    let prompt = g.tokenizer().chat_prompt(&[
        ChatMessage::new("system", rag::prompt::SYSTEM),
        ChatMessage::new(
            "user",
            format!("Passages:\n[1] {context}\n\nQuestion: What does git rebase do?"),
        ),
    ])?;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let out = g.generate(
            GenerateRequest {
                prompt: &prompt,
                max_tokens: 128,
                sampling: Sampling::default(),
                token_trace: llm::TokenTrace::Off,
                deadline: None,
                ignore_eos: false,
                stop: &[],
                end_at_paragraph: false,
                logprobs: None,
                context_tokens: &[],
            },
            &stage(),
            &mut |_| Flow::Continue,
        )?;
        prefill.push(prompt.len() as f64 / out.prefill.as_secs_f64());
        decode.push(out.tokens.len().saturating_sub(1).max(1) as f64 / out.decode.as_secs_f64());
    }
    println!(
        "{:<44} {:>9.1} tok/s",
        format!("prefill ({}-token RAG prompt)", prompt.len()),
        median(&mut prefill)
    );
    println!(
        "{:<44} {:>9.1} tok/s",
        "decode (greedy, up to 128 tokens)",
        median(&mut decode)
    );

    // End to end through the pipeline.
    let mut e2e = Vec::new();
    let mut ttft = Vec::new();
    for q in questions.iter().take(5) {
        let root = Arc::new(stage());
        let req = RagRequest::with_defaults(q.clone(), &pipeline, args.server.request_timeout);
        let t = Instant::now();
        let a = handle.block_on(pipeline.start_query(req, &root, None)?)?;
        e2e.push(t.elapsed());
        ttft.push(Duration::from_secs_f64(a.timings.ttft_ms / 1e3));
    }
    println!(
        "{:<44} {:>9.0} ms",
        "end-to-end RAG query (5 questions), p50",
        percentile(&mut e2e, 50.0)
    );
    println!(
        "{:<44} {:>9.0} ms",
        "time to first token, p50",
        percentile(&mut ttft, 50.0)
    );
    Ok(())
}
