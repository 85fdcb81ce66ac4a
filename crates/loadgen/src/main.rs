//! `ragscope-loadgen`: parse the command line, run the subcommand, exit non-zero on failure
//! (and, for `gate`, 1 on a performance regression, 3 when the evidence is inconclusive).

use std::process::ExitCode;

use clap::Parser;
use ragscope_loadgen::cli::Cli;
use ragscope_loadgen::commands;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match commands::dispatch(cli.command).await {
        Ok(status) => ExitCode::from(status),
        Err(e) => {
            eprintln!("ragscope-loadgen: {e:#}");
            ExitCode::from(2)
        }
    }
}
