//! `ragscope-loadgen`: parse the command line, run the subcommand, exit non-zero on failure
//! (and, for `gate`, on a performance regression).

use std::process::ExitCode;

use clap::Parser;
use ragscope_loadgen::cli::Cli;
use ragscope_loadgen::commands;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match commands::dispatch(cli.command).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("ragscope-loadgen: {e:#}");
            ExitCode::from(2)
        }
    }
}
