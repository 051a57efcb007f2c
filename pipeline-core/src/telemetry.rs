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

/// Installs the global `tracing` subscriber writing to stderr.
pub fn init(args: &LogArgs) {
    let filter = EnvFilter::try_new(&args.log).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
