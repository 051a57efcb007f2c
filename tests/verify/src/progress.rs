//! Progress lines on stderr.

/// A progress line on stderr.
pub fn say(what: &str) {
    eprintln!(
        "[verify {}] {what}",
        chrono::Local::now().format("%H:%M:%S")
    );
}
