//! Third-party clients against the real server: the `openai` Python client and LangChain's
//! OpenAI integration run the scripts in `crates/server/tests/clients/` (every check an assert; a non-zero
//! exit fails the test). The Python comes from the venv scripts/test makes
//! (`~/.cache/ragscope/venv-clients`, or `RAGSCOPE_CLIENTS_PYTHON`); without it the test is
//! skipped with a message, unless `RAGSCOPE_REQUIRE_CLIENTS` is set (scripts/test sets it).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::helpers::{repo_dir, spawn_app};

/// The venv's python, if it can import both clients.
fn clients_python() -> Option<PathBuf> {
    let python = match std::env::var_os("RAGSCOPE_CLIENTS_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => {
            PathBuf::from(std::env::var_os("HOME")?).join(".cache/ragscope/venv-clients/bin/python")
        }
    };
    let imports = std::process::Command::new(&python)
        .args(["-c", "import openai, langchain_openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    imports.success().then_some(python)
}

/// Runs `crates/server/tests/clients/{script}` against a fresh real server; fails on a non-zero exit.
async fn run_client(script: &str) {
    let Some(python) = clients_python() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_CLIENTS").is_none(),
            "the clients' venv is missing, and scripts/test requires it"
        );
        println!(
            "SKIPPED: no python with openai and langchain-openai (scripts/test installs them)"
        );
        return;
    };
    let app = spawn_app().await;
    let run = tokio::process::Command::new(python)
        .arg(repo_dir().join("crates/server/tests/clients").join(script))
        .env("RAGSCOPE_BASE_URL", app.url("/v1"))
        // Nothing may be fetched from outside: a client that tries fails here, not later.
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap_or_else(|_| panic!("{script} ran past 120 s"))
        .expect("python runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("all checks passed"), "{stdout}\n{stderr}");
    app.stop().await;
}

#[tokio::test]
async fn openai_python_client_is_served() {
    run_client("openai_client.py").await;
}

#[tokio::test]
async fn langchain_chat_and_embeddings_are_served() {
    run_client("langchain_client.py").await;
}
