//! `verify`: runs the pipeline under load and faults, checks exactly-once and per-order order,
//! and writes a JSON report (see the `pipeline_verify` library; `scripts/verify.sh` builds and
//! runs it). Exits non-zero unless the checks passed and the run completed.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use pipeline_verify::config::{Settings, VerifyArgs};

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("verify: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    let settings = Settings::resolve(VerifyArgs::parse())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(pipeline_verify::run(&settings));
    report.write(&settings.report)?;
    print!("{}", report.table());
    println!("\nreport: {}", settings.report.display());
    Ok(if report.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
