//! Logging set-up and shutdown signals shared by the binaries.

use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// Log settings shared by every binary.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct LogArgs {
    /// Log lines as JSON objects instead of text.
    #[cfg_attr(feature = "cli", arg(long, env = "LOG_JSON", default_value_t = false))]
    pub log_json: bool,
    /// Log filter, e.g. `info` or `relay=debug,info` (RUST_LOG syntax).
    #[cfg_attr(feature = "cli", arg(long, env = "RUST_LOG", default_value = "info"))]
    pub log: String,
}

impl Default for LogArgs {
    fn default() -> Self {
        LogArgs {
            log_json: false,
            log: "info".to_owned(),
        }
    }
}

/// PostgreSQL's notices (`relation "…" already exists, skipping` from every migration that
/// finds its table) are logged only from warnings up, unless the filter names them itself.
const NOTICES: &str = "sqlx::postgres::notice=warn";

/// The filter of `spec` (RUST_LOG syntax; `info` when it does not parse), with [`NOTICES`]
/// added unless `spec` says something of sqlx.
fn filter(spec: &str) -> EnvFilter {
    let spec = if EnvFilter::try_new(spec).is_ok() {
        spec
    } else {
        "info"
    };
    if spec.contains("sqlx") {
        EnvFilter::new(spec)
    } else {
        EnvFilter::new(format!("{spec},{NOTICES}"))
    }
}

/// Installs the global `tracing` subscriber writing to stderr, with terminal colours only when
/// stderr is a terminal (a log file gets plain text).
pub fn init(args: &LogArgs) {
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter(&args.log))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    // A second initialisation (in tests) is harmless: the first subscriber stays.
    let _ = if args.log_json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
}

/// A token cancelled on the first SIGINT or SIGTERM.
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received");
        trigger.cancel();
    });
    token
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::filter;

    #[test]
    fn notices_are_quiet_unless_asked_for() {
        assert_eq!(
            filter("info").to_string(),
            "sqlx::postgres::notice=warn,info"
        );
        assert_eq!(filter("debug,sqlx=info").to_string(), "sqlx=info,debug");
        assert_eq!(
            filter("not a filter [").to_string(),
            "sqlx::postgres::notice=warn,info"
        );
    }
}
