//! A client that opens a stream and reads nothing: once the stream is more than
//! `--stream-buffer` events behind for `--stream-stall-timeout-ms`, the generation is
//! cancelled and the stall counter counts it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::AsyncWriteExt;

use crate::fakes::FakeGenerator;
use crate::helpers::{fake_pipeline, serve_state};

#[tokio::test]
async fn a_stream_nobody_reads_is_cancelled() {
    if let Some(provider) = telemetry::metrics::ensure_provider() {
        std::mem::forget(provider);
    }
    // 8 choices x 3,000 tokens of ~200-byte OpenAI chunks: ~5 MB, far more than the sockets
    // and the HTTP library buffer hold, generated in ~5 s if nothing stops it. (max_tokens
    // leaves room for the RAG prompt in the stand-in's 4,096-token window.)
    let mut pipeline = fake_pipeline(FakeGenerator {
        tokens: 3000,
        token_us: 200,
    });
    pipeline.defaults.stream_buffer = 8;
    pipeline.defaults.stream_stall_timeout_ms = 200;
    let state = ragscope::app::ready_state(pipeline, Duration::from_secs(60));
    let app = serve_state(state, 1 << 20, None).await;

    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let addr: SocketAddr = app.base.trim_start_matches("http://").parse().unwrap();
    let mut conn = socket.connect(addr).await.unwrap();
    let body = json!({"model": "ragscope", "stream": true, "n": 8, "max_tokens": 3000,
                      "messages": [{"role": "user", "content": "go on"}]})
    .to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();

    // Read nothing; the counter says when the generation gave up.
    let began = Instant::now();
    loop {
        let metrics = app.metrics_text().await;
        if metrics
            .lines()
            .any(|l| l.starts_with("ragscope_stream_stalls_total") && !l.ends_with(" 0"))
        {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "no stall counted in 20 s:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The counter moves only on the stall path, after the generation stopped. Hanging up
    // leaves the server serving. (The chat span's `rag.stream.stalled_ms` is not read back
    // here: this stand-in app records no spans in /debug/traces.)
    drop(conn);
    let (status, _) = app.get("/health").await;
    assert_eq!(status, 200);
}
