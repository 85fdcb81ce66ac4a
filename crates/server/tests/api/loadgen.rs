//! The load generator against the real server in-process: a hot/cold/no-match mix whose
//! summary splits the caches by hit and miss from what the responses said, and a gRPC run.
//! (What a maximum connection age does to a gRPC load is an experiment, not a test:
//! docs/EXPERIMENTS.md, "Forced reconnects".)

use std::path::Path;

use clap::Parser;
use ragscope_loadgen::cli::{Cli, Command, RunArgs};
use ragscope_loadgen::commands::run_load;
use ragscope_loadgen::record::QueryKind;

use crate::helpers::spawn_app_with;

fn run_args(argv: &[&str], out: &Path, queries: &Path) -> RunArgs {
    let mut all = vec!["ragscope-loadgen", "run", "--quiet", "--mode", "closed"];
    all.extend_from_slice(argv);
    let (out, queries) = (out.display().to_string(), queries.display().to_string());
    all.extend(["--out", &out, "--queries", &queries]);
    match Cli::try_parse_from(all)
        .expect("valid loadgen flags")
        .command
    {
        Command::Run(a) => a,
        _ => unreachable!(),
    }
}

#[tokio::test]
async fn a_mixed_load_splits_hits_from_misses_and_a_grpc_run_reports_the_same() {
    let app = spawn_app_with(&["--http2-keepalive-interval-s", "0.2"]).await;
    app.ingest_fixtures().await;
    let tmp = tempfile::tempdir().unwrap();
    let queries = tmp.path().join("q.jsonl");
    std::fs::write(
        &queries,
        "{\"question\": \"What is the capital of Zorbia?\"}\n{\"question\": \"Who invented the flumox?\"}\n",
    )
    .unwrap();

    // Two hot questions, so repeats hit; cold ones never can.
    let flags = [
        "--url",
        &app.url(""),
        "--users",
        "1",
        "--requests",
        "14",
        "--max-tokens",
        "1",
        "--cold-share",
        "0.3",
        "--no-match-share",
        "0.2",
        "--perturb-rate",
        "0.2",
        "--seed",
        "3",
    ];
    let (summary, records) = run_load(&run_args(&flags, &tmp.path().join("mix"), &queries))
        .await
        .unwrap();
    assert!(records.iter().all(|r| r.ok), "{records:?}");
    let caches = summary.caches.expect("the server reports its caches");
    let embed = &caches.caches[0];
    assert_eq!(embed.cache, "query_embedding");
    assert_eq!(embed.known, records.len());
    // Every cold request missed; the server said so, not the client's guess.
    for r in records
        .iter()
        .filter(|r| r.query_kind == Some(QueryKind::Cold))
    {
        assert_eq!(r.embedding_cached, Some(false), "{r:?}");
    }
    let cold = records
        .iter()
        .filter(|r| r.query_kind == Some(QueryKind::Cold))
        .count();
    assert!(
        cold >= 1 && embed.hits >= 1 && embed.hits < embed.known,
        "{embed:?}"
    );
    assert!(embed.hit_ttft_ms.is_some() && embed.miss_ttft_ms.is_some());
    let names: Vec<&str> = caches.caches.iter().map(|c| c.cache.as_str()).collect();
    assert!(
        names.contains(&"prefix_kv") && names.contains(&"whole_prompt"),
        "{names:?}"
    );
    assert!(records.iter().all(|r| r.cached_tokens.is_some()));
    // The server says how many sentence vectors its context looked up and found cached.
    assert!(
        records.iter().all(|r| r.sentences_cached <= r.sentences),
        "{records:?}"
    );
    assert!(
        caches
            .state()
            .is_some_and(|s| s.starts_with("cache state: query_embedding")),
        "{caches:?}"
    );
    assert!(caches.kinds.iter().any(|k| k.kind == QueryKind::NoMatch));
    for r in records
        .iter()
        .filter(|r| r.query_kind == Some(QueryKind::NoMatch))
    {
        assert!(r.filter.is_some());
    }

    let grpc = app.grpc.clone();
    let flags = [
        "--url",
        &grpc,
        "--endpoint",
        "grpc",
        "--users",
        "2",
        "--requests",
        "8",
        "--max-tokens",
        "2",
    ];
    let (summary, records) = run_load(&run_args(&flags, &tmp.path().join("grpc"), &queries))
        .await
        .unwrap();
    assert_eq!(records.len(), 8);
    for r in &records {
        assert!(r.ok, "{r:?}");
        assert!(r.ttft_ms.is_some() && r.tokens >= 1, "{r:?}");
        assert!(r.server_timings.as_ref().unwrap()["prefill_ms"] > 0.0);
        assert!(r.embedding_cached.is_some() && r.cached_tokens.is_some());
    }
    // Two questions, 8 calls: at most the first call of each question per user misses.
    let caches = summary.caches.expect("gRPC's Done carries the caches too");
    let embed = &caches.caches[0];
    assert!(embed.known == 8 && embed.hits >= 4, "{embed:?}");
    assert_eq!(summary.steady.unwrap().ok, 8);
    app.stop().await;
}
