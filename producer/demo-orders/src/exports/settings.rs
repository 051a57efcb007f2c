//! Where the order service finds export files and where it records export events.

use std::path::PathBuf;

use demo_events::export_events::EXPORT_JOBS_TOPIC;

/// Where the order service finds export files and where it records export events
/// (`producer serve --export-dir … --export-topic …`).
#[derive(clap::Args, Debug, Clone)]
pub struct ExportSettings {
    /// Directory the `export` consumer group writes export files to, served from here: the two
    /// processes must see the same directory (a shared volume when they run on different hosts).
    #[arg(
        id = "export_dir",
        long = "export-dir",
        value_name = "DIR",
        env = "EXPORT_DIR",
        default_value = "exports"
    )]
    pub dir: PathBuf,
    /// Kafka topic of `export.requested` events, which only the `export` group consumes.
    #[arg(id = "export_topic", long = "export-topic", value_name = "TOPIC", env = "EXPORT_JOBS_TOPIC", default_value = EXPORT_JOBS_TOPIC,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub topic: String,
    /// Most export jobs pending or being written at once: a request for one more is refused
    /// with 429 until one finishes (each job reads orders and writes a file).
    #[arg(long = "export-max-pending", value_name = "N", env = "EXPORT_MAX_PENDING",
          default_value_t = DEFAULT_MAX_PENDING,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_pending: u32,
}

/// The default of [`ExportSettings::max_pending`].
const DEFAULT_MAX_PENDING: u32 = 64;

impl Default for ExportSettings {
    fn default() -> Self {
        ExportSettings {
            dir: PathBuf::from("exports"),
            topic: EXPORT_JOBS_TOPIC.to_owned(),
            max_pending: DEFAULT_MAX_PENDING,
        }
    }
}
