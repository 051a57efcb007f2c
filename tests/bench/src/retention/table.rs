//! The retention phase's part of the printed table.

use std::fmt::Write;

use super::histogram::HistogramFigures;
use super::sizes::TABLES;
use super::{RetentionResult, FLAT_GROWTH_PCT};
use crate::services::GROUPS;

const MIB: f64 = 1024.0 * 1024.0;

fn ms(x: Option<f64>) -> String {
    x.map_or("-".to_owned(), |v| format!("{v:.1}"))
}

fn p50_p99(h: &HistogramFigures) -> String {
    format!("{}/{}", ms(h.p50_ms), ms(h.p99_ms))
}

fn count(n: f64) -> String {
    let n = n.round() as i64;
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// The value of `name` in a series' labels (`metric{name="value"}`).
fn label<'a>(series: &'a str, name: &str) -> &'a str {
    let key = format!("{name}=\"");
    series
        .find(&key)
        .map(|i| &series[i + key.len()..])
        .and_then(|rest| rest.split('"').next())
        .unwrap_or("?")
}

/// Writes the section.
pub fn write(o: &mut String, r: &RetentionResult) -> std::fmt::Result {
    let h = &r.history;
    let (off, on) = (&r.off, &r.on);
    writeln!(
        o,
        "\n7. Retention: {} history events ({} orders, payload {} B, {} to {}) loaded in {:.0} s \
         + {:.0} s VACUUM ANALYZE; load {}/s",
        count(h.events as f64),
        count(h.orders as f64),
        h.payload_bytes,
        h.oldest.format("%Y-%m-%d %H:%M"),
        h.newest.format("%H:%M UTC"),
        h.insert_seconds,
        h.vacuum_seconds,
        off.rate
    )?;
    writeln!(o, "   relay (on): {}", on.relay_args.join(" "))?;
    writeln!(o, "   consumer (on): {}", on.consumer_args.join(" "))?;
    let steps: Vec<String> = r
        .steps
        .iter()
        .map(|(name, s)| format!("{name} {s:.0} s"))
        .collect();
    writeln!(o, "   steps: {}", steps.join(", "))?;
    writeln!(
        o,
        "   {:<44} {:>18} {:>18}",
        "",
        format!("off ({:.0} s)", off.measured_seconds),
        format!("on ({:.0} s)", on.measured_seconds)
    )?;
    let row = |o: &mut String, name: &str, a: String, b: String| {
        writeln!(o, "   {name:<44} {a:>18} {b:>18}")
    };
    for g in GROUPS {
        let lat = |s: &super::Segment| {
            s.latency.groups.get(g).map_or("-".to_owned(), |l| {
                format!("{:.1}/{:.1}", l.e2e_p50_ms, l.e2e_p99_ms)
            })
        };
        row(
            o,
            &format!("e2e p50/p99 ms, intended→applied [{g}]"),
            lat(off),
            lat(on),
        )?;
    }
    for g in GROUPS {
        let e2e = |s: &super::Segment| s.consumer_e2e.get(g).map_or("-".into(), p50_p99);
        row(
            o,
            &format!("  consumer histogram outbox→commit [{g}]"),
            e2e(off),
            e2e(on),
        )?;
    }
    for (name, s) in [("off", off), ("on", on)] {
        let minutes: Vec<String> = s
            .latency
            .by_minute
            .iter()
            .map(|m| format!("{:.0}/{:.0}", m.p50_ms, m.p99_ms))
            .collect();
        writeln!(
            o,
            "   e2e p50/p99 ms by minute, both groups, {name}: {}",
            minutes.join(" ")
        )?;
        for minute in &s.background {
            writeln!(o, "     background, {name}, {}", minute.summary())?;
        }
    }
    let stage = |s: &super::Segment, name: &str| {
        s.relay_stages.get(name).map_or("-".to_owned(), |h| {
            format!("{} ({})", p50_p99(h), ms(h.mean_ms))
        })
    };
    row(
        o,
        "relay claim p50/p99 (mean) ms",
        stage(off, "claim"),
        stage(on, "claim"),
    )?;
    row(
        o,
        "relay mark p50/p99 (mean) ms",
        stage(off, "mark"),
        stage(on, "mark"),
    )?;
    row(
        o,
        "relay stage outbox→published p50/p99 ms",
        format!(
            "{:.1}/{:.1}",
            off.latency.relay_p50_ms, off.latency.relay_p99_ms
        ),
        format!(
            "{:.1}/{:.1}",
            on.latency.relay_p50_ms, on.latency.relay_p99_ms
        ),
    )?;
    for g in GROUPS {
        let tx = |s: &super::Segment| s.consumer_transaction.get(g).map_or("-".into(), p50_p99);
        row(
            o,
            &format!("consumer transaction p50/p99 ms [{g}]"),
            tx(off),
            tx(on),
        )?;
    }
    for g in GROUPS {
        let eps = |d: &super::Drain| {
            d.groups.get(g).map_or("-".to_owned(), |x| {
                format!("{} ({:.0} s)", count(x.eps), x.seconds)
            })
        };
        row(
            o,
            &format!("consumer drain eps (to done) [{g}]"),
            eps(&r.drain_off),
            eps(&r.drain_on),
        )?;
    }
    row(
        o,
        "requests ok/s (failed)",
        format!(
            "{} ({})",
            count(off.requests.achieved_rps),
            off.requests.failed()
        ),
        format!(
            "{} ({})",
            count(on.requests.achieved_rps),
            on.requests.failed()
        ),
    )?;
    writeln!(o, "   CPU off: {}", off.cpu.summary())?;
    writeln!(o, "   CPU on:  {}", on.cpu.summary())?;
    writeln!(o, "   DB on:   {}", on.db_activity.summary(4))?;
    writeln!(o, "   server off: {}", off.server_writes.summary())?;
    writeln!(o, "   server on:  {}", on.server_writes.summary())?;
    let removed = |by_table: &std::collections::BTreeMap<String, f64>| {
        let parts: Vec<String> = by_table
            .iter()
            .filter(|(_, n)| **n > 0.0)
            .map(|(t, n)| format!("{t} {}", count(*n)))
            .collect();
        if parts.is_empty() {
            "none".to_owned()
        } else {
            parts.join(", ")
        }
    };
    writeln!(
        o,
        "   rows removed during the segment on: {}",
        removed(&on.rows_removed)
    )?;
    writeln!(
        o,
        "   rows removed since retention started (drain on + segment on): {}",
        removed(&on.rows_removed_since_start)
    )?;
    let ages: Vec<String> = on
        .retention_metrics
        .iter()
        .filter(|(k, _)| k.contains("retention_oldest_row_age_seconds"))
        .map(|(k, v)| format!("{} {v:.0}", label(k, "table")))
        .collect();
    let runs: Vec<String> = ["relay", "consumer"]
        .iter()
        .map(|p| {
            let get = |name: &str| {
                on.retention_metrics
                    .get(&format!("{p} {name}"))
                    .copied()
                    .unwrap_or(0.0)
            };
            let (n, secs) = (
                get("retention_run_duration_seconds_count"),
                get("retention_run_duration_seconds_sum"),
            );
            format!(
                "{p} {n:.0} runs, {secs:.0} s in all, {:.0} skipped",
                get("retention_runs_skipped_total")
            )
        })
        .collect();
    writeln!(
        o,
        "   at the end: oldest row age (s) {}; {}",
        ages.join(", "),
        runs.join("; ")
    )?;
    writeln!(
        o,
        "   sizes, MiB table+indexes (rows, estimated)   {:>20} {:>20} {:>20} {:>20}",
        "start", "off end", "on middle", "on end"
    )?;
    let snapshots = [
        &r.sizes_start,
        &r.sizes_off_end,
        &r.sizes_on_mid,
        &r.sizes_on_end,
    ];
    for table in TABLES {
        let cells: Vec<String> = snapshots
            .iter()
            .map(|s| {
                s.tables.get(table).map_or("-".to_owned(), |t| {
                    format!(
                        "{:.1} ({})",
                        t.bytes() as f64 / MIB,
                        count(t.live_rows as f64)
                    )
                })
            })
            .collect();
        writeln!(
            o,
            "     {table:<42} {:>20} {:>20} {:>20} {:>20}",
            cells[0], cells[1], cells[2], cells[3]
        )?;
    }
    let totals: Vec<String> = snapshots
        .iter()
        .map(|s| format!("{:.1}", s.total_bytes() as f64 / MIB))
        .collect();
    writeln!(
        o,
        "     {:<42} {:>20} {:>20} {:>20} {:>20}",
        "all", totals[0], totals[1], totals[2], totals[3]
    )?;
    writeln!(
        o,
        "   growth: off {:+.1}% (start → end), on {:+.1}% (middle → end; flat: at most +{FLAT_GROWTH_PCT}%)",
        r.growth_off_pct, r.growth_on_mid_to_end_pct
    )?;
    let trimmed: Vec<String> = r
        .trimmed_rows_on_mid_to_end()
        .iter()
        .map(|(t, n)| format!("{t} {n:+}"))
        .collect();
    writeln!(
        o,
        "   rows, middle → end of on (estimated; a trimmed table must not gain, the effect history no more than one partition's span of the load): {}",
        trimmed.join(", ")
    )?;

    writeln!(
        o,
        "   lock waits: longest ms | sampled every 50 ms: waits seen, ≥ 100 ms | server log{}: waits > 100 ms, longest, ERROR lines",
        r.server_log
            .as_ref()
            .map_or(" (not read)".to_owned(), |p| format!(" ({p})"))
    )?;
    let parts = [
        ("segment off", &r.off.lock_waits),
        ("drain off", &r.drain_off.lock_waits),
        ("drain on", &r.drain_on.lock_waits),
        ("segment on", &r.on.lock_waits),
    ];
    for (name, w) in parts {
        let logged = w.logged.as_ref().map_or("-".to_owned(), |l| {
            format!(
                "{}, {}, {}",
                l.still_waiting,
                l.longest_ms
                    .map_or("-".to_owned(), |v| format!("{v:.1} ms")),
                l.errors
            )
        });
        writeln!(
            o,
            "     {name:<12} {:>8.1} | {}, {} | {logged}",
            w.longest_ms(),
            w.sampled.waits,
            w.sampled.waits_over_logged_ms
        )?;
    }
    let (held, held_ms) = r.held_by_retention();
    writeln!(
        o,
        "     the pipeline's statements (retention's own waits left out): longest {:.1} ms with retention, {:.1} ms without; waits for a retention step: {held}, longest {held_ms:.1} ms",
        r.pipeline_longest_lock_wait_on(),
        r.pipeline_longest_lock_wait_off()
    )?;
    for (name, w) in parts {
        if w.sampled.retention_waits > 0 {
            writeln!(
                o,
                "     {name}: {} waits with a retention step on either side, longest {:.1} ms",
                w.sampled.retention_waits, w.sampled.retention_longest_ms
            )?;
        }
    }
    for (name, w) in parts {
        for (ms, what) in &w.sampled.long_waits {
            writeln!(o, "     {name}: {ms:.0} ms {what}")?;
        }
        if let Some(l) = &w.logged {
            for line in l.wait_examples.iter().chain(&l.error_examples) {
                writeln!(o, "     {name}, log: {line}")?;
            }
        }
    }
    for (file, l) in &r.process_logs {
        if l.warnings + l.errors == 0 {
            continue;
        }
        writeln!(o, "   {file}: {} WARN, {} ERROR", l.warnings, l.errors)?;
        for line in l.error_examples.iter().chain(&l.warning_examples).take(3) {
            writeln!(o, "     {line}")?;
        }
    }
    Ok(())
}
