//! How results are printed: tables for people, JSON for scripts.

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{ContentArrangement, Table};
use serde::Serialize;

/// A table with `header`, laid out to the terminal's width.
pub fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    let _ = table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(header.to_vec());
    table
}

/// `text` as a terminal may show it: every control character but the line break (an escape
/// sequence, a carriage return, a bell) written as `\u{1b}`. What the commands print comes
/// partly from the databases and Kafka, written by services and clients; values already escaped
/// (a dead letter's bytes) pass unchanged.
pub fn shown(text: &str) -> String {
    if !text.chars().any(|c| c.is_control() && c != '\n') {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' {
                format!("\\u{{{:x}}}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Adds a row of `cells` to `table`, each [`shown`] as a terminal may show it.
pub fn row<S: AsRef<str>>(table: &mut Table, cells: impl IntoIterator<Item = S>) {
    let _ = table.add_row(cells.into_iter().map(|c| shown(c.as_ref())));
}

/// Prints `value` as pretty JSON.
pub fn json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// An optional value for a table cell: `-` when absent.
pub fn cell<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// A count read with a cap: `≥cap` when it reached it.
pub fn capped(count: i64, cap: i64) -> String {
    if count >= cap {
        format!("≥{cap}")
    } else {
        count.to_string()
    }
}

/// A duration in seconds, short: 850ms, 12.3s, 4m05s, 2h13m.
pub fn age(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.0}ms", seconds * 1000.0)
    } else if seconds < 60.0 {
        format!("{seconds:.1}s")
    } else if seconds < 3600.0 {
        format!(
            "{}m{:02}s",
            (seconds / 60.0) as i64,
            (seconds % 60.0) as i64
        )
    } else {
        format!(
            "{}h{:02}m",
            (seconds / 3600.0) as i64,
            ((seconds % 3600.0) / 60.0) as i64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::shown;

    #[test]
    fn control_characters_are_shown_as_escapes_and_the_rest_as_is() {
        assert_eq!(shown("agg\u{1b}[31mRED\r"), "agg\\u{1b}[31mRED\\u{d}");
        assert_eq!(shown("a\nb"), "a\nb");
        assert_eq!(shown("\\xff\\xfe (2 bytes)"), "\\xff\\xfe (2 bytes)");
    }
}
