//! `ragscope`: parse the configuration, start telemetry, run the subcommand.

use anyhow::Result;
use clap::Parser;
use llm::device;
use ragscope::config::{Cli, Command, ModelsAction, StoreAction};
use ragscope::{app, cli};

fn main() -> Result<()> {
    // Before any thread exists, so every thread allocates from the one tuned heap.
    device::keep_freed_memory();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(run());
    // A blocking task still running (a corpus ingest cut short by shutdown) must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

async fn run() -> Result<()> {
    let args = Cli::parse();
    let _telemetry = telemetry::init(&args.telemetry)?;
    match args.command {
        Command::Serve(serve) => app::serve(serve, app::shutdown_signal()).await,
        Command::Ingest(ingest) => cli::ingest(ingest).await,
        Command::Query(query) => cli::query(query).await,
        Command::Eval(eval) => ragscope::eval::run(eval).await,
        Command::Attribute(a) => ragscope::attribute::run(a).await,
        Command::Replay(r) => {
            let code = tokio::task::spawn_blocking(move || cli::replay(&r)).await?;
            std::process::exit(code)
        }
        Command::Models { action } => match action {
            ModelsAction::Fetch(m) => cli::fetch_models(&m),
            ModelsAction::Verify(m) => cli::verify_models(&m),
        },
        Command::Store {
            action: StoreAction::Audit(a),
        } => cli::audit_store(&a),
    }
}
