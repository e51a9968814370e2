//! The `wgfence` command line: parses it ([`cli::Cli`]), sets up logging, and runs the
//! subcommand.

mod cli;

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::Parser as _;
use tracing_subscriber::{fmt, EnvFilter};

use cli::{Cli, LogFormat};

fn init_logging(format: LogFormat, filter: &str) -> Result<()> {
    let filter = EnvFilter::try_new(filter).with_context(|| format!("log filter {filter:?}"))?;
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
    .map_err(|e| anyhow::anyhow!("{e}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_logging(cli.log_format, &cli.log) {
        eprintln!("error: {}", wgfence::error_chain(e.as_ref()));
        return ExitCode::from(2);
    }
    match cli.command.execute() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", wgfence::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
