//! `bench`: measures the pipeline against its targets and writes a JSON report (see the
//! `pipeline_bench` library; `scripts/bench.sh` builds and runs it).

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use pipeline_bench::config::{BenchArgs, Settings};
use pipeline_bench::{run_and_clean_up, table};

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    let settings = Settings::resolve(BenchArgs::parse())?;
    // The harness finds the binaries through this variable. Set before the runtime starts any
    // thread, so nothing reads the environment concurrently.
    std::env::set_var("PIPELINE_BIN_DIR", &settings.bin_dir);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(run_and_clean_up(&settings));
    report.write(&settings.out)?;
    print!("{}", table::render(&report));
    println!("\nreport: {}", settings.out.display());
    Ok(if report.errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
