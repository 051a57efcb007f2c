//! What the relay and consumer processes logged: their WARN and ERROR lines, read from the logs
//! the harness keeps for each process before the environment is removed.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

/// WARN and ERROR lines of one process's log.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LogLevels {
    pub warnings: u64,
    pub errors: u64,
    /// The first few of each.
    pub warning_examples: Vec<String>,
    pub error_examples: Vec<String>,
}

/// The WARN and ERROR lines of each log in `dir` (tracing's text format, colours and all).
pub fn read(dir: &Path) -> BTreeMap<String, LogLevels> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let mut levels = LogLevels::default();
        for line in text.lines() {
            let plain = strip_ansi(line);
            let level = plain.split_whitespace().nth(1).unwrap_or("");
            let (count, examples) = match level {
                "WARN" => (&mut levels.warnings, &mut levels.warning_examples),
                "ERROR" => (&mut levels.errors, &mut levels.error_examples),
                _ => continue,
            };
            *count += 1;
            if examples.len() < 5 {
                examples.push(plain.chars().take(300).collect());
            }
        }
        let _ = out.insert(entry.file_name().to_string_lossy().into_owned(), levels);
    }
    out
}

/// `line` without its terminal colour codes (ESC [ … m).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::strip_ansi;

    #[test]
    fn colour_codes_are_removed() {
        let line = "\u{1b}[2m2026-11-26T05:57:42Z\u{1b}[0m \u{1b}[33m WARN\u{1b}[0m relay: slow";
        assert_eq!(strip_ansi(line), "2026-11-26T05:57:42Z  WARN relay: slow");
    }
}
