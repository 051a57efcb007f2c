//! The report as a readable table for the terminal.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::cpuprofile::ProcessProfile;
use super::dbprofile::DbActivity;
use super::procstat::CpuUse;
use super::report::Report;
use super::statements::StatementProfile;

/// Renders `r` as text.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_report(&mut out, r);
    out
}

fn eps(x: f64) -> String {
    let n = x.round() as i64;
    let s = n.abs().to_string();
    let mut separated = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            separated.push(',');
        }
        separated.push(c);
    }
    if n < 0 {
        format!("-{separated}")
    } else {
        separated
    }
}

fn cpu(c: &CpuUse) -> String {
    format!("      CPU: {}", c.summary())
}

fn db(d: &DbActivity, cpu: &CpuUse) -> String {
    let mut out = format!("      DB connections busy (avg): {}", d.summary(4));
    if let Some(s) = &d.statements {
        out.push('\n');
        out.push_str(&statement_lines(s, cpu));
    }
    out
}

/// Each process's CPU profile: its busiest functions and the file with all of them.
fn profile_lines(profiles: &BTreeMap<String, ProcessProfile>) -> String {
    profiles
        .iter()
        .map(|(process, p)| {
            let top: Vec<String> = p
                .top
                .iter()
                .take(4)
                .map(|(percent, _, function)| {
                    let short: String = function.chars().take(60).collect();
                    format!("{percent:.0}% {short}")
                })
                .collect();
            format!(
                "      CPU profile, {process} ({} samples, {}): {}",
                eps(p.samples as f64),
                p.file.display(),
                top.join("; ")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A statement profile: per event by client, then the statements with the most time.
fn statement_lines(s: &StatementProfile, cpu: &CpuUse) -> String {
    let events = cpu.per_event.as_ref().map_or(0, |p| p.events);
    let mut lines: Vec<String> = Vec::new();
    if events > 0 {
        lines.extend(
            s.client_lines(events)
                .into_iter()
                .map(|l| format!("      statements, {l}")),
        );
    } else {
        for (client, c) in s.by_client.iter().filter(|(c, _)| c.as_str() != "other") {
            lines.push(format!(
                "      statements, {client}: {} statements (round trips), {} commits, {} plans, {:.0} ms planning + {:.0} ms executing, in {:.0} s",
                c.calls, c.commits, c.plans, c.plan_ms, c.exec_ms, cpu.seconds
            ));
        }
    }
    lines.push("      top statements by planning + execution time:".to_owned());
    lines.extend(s.top_lines(6).into_iter().map(|l| format!("        {l}")));
    lines.join("\n")
}

fn write_report(o: &mut String, r: &Report) -> std::fmt::Result {
    let s = &r.settings;
    writeln!(o)?;
    writeln!(
        o,
        "Pipeline benchmark ({}) — {} cores, load {} (at the end {}) — {} — {} partitions, {} products — {}",
        if s.quick { "quick" } else { "full" },
        r.host.cores,
        r.host.load_average,
        r.host.load_average_end,
        broker(r),
        s.partitions,
        s.products,
        r.host.git_revision,
    )?;
    if let Some(idle) = &r.idle {
        writeln!(
            o,
            "\n0. Idle: every service running, no traffic, {:.0} s (an active and a standby relay)",
            idle.measured_seconds
        )?;
        writeln!(o, "      CPU: {}", idle.cpu.fine_summary())?;
        if let Some(st) = &idle.statements {
            writeln!(o, "{}", statement_lines(st, &idle.cpu))?;
        }
        if !idle.cpu_profiles.is_empty() {
            writeln!(o, "{}", profile_lines(&idle.cpu_profiles))?;
        }
    }
    if let Some(b) = &r.broker {
        writeln!(
            o,
            "\n1. Broker ceiling: {} messages of {} B avg (payload {} B) over {} orders",
            eps(b.messages as f64),
            b.message_bytes,
            b.payload_bytes,
            eps(b.orders as f64)
        )?;
        let config: Vec<String> = b
            .producer_config
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        writeln!(
            o,
            "   producer (the relay's settings): {}",
            config.join(" ")
        )?;
        writeln!(
            o,
            "   broker_produce_eps  {:>10}   ({:.2} s; median of {} rounds after a warm-up: {})",
            eps(b.produce_eps),
            b.produce_seconds,
            b.produce_rounds_eps.len(),
            b.produce_rounds_eps
                .iter()
                .map(|r| eps(*r))
                .collect::<Vec<_>>()
                .join(", ")
        )?;
        writeln!(o, "{}", cpu(&b.cpu_produce))?;
        writeln!(
            o,
            "   broker_consume_eps  {:>10}   ({:.2} s)",
            eps(b.consume_eps),
            b.consume_seconds
        )?;
        writeln!(o, "{}", cpu(&b.cpu_consume))?;
        writeln!(o, "   produce, relay-like {:>9}   ({:.2} s; batches of {}, each waiting for all its acks)", eps(b.produce_batched_eps), b.produce_batched_seconds, s.relay_batch_size)?;
        writeln!(o, "{}", cpu(&b.cpu_produce_batched))?;
    }
    if let Some(d) = &r.database {
        writeln!(
            o,
            "\n1b. PostgreSQL ceiling: rows of {} B jsonb (identity key, unique uuid), nothing else running",
            d.payload_bytes
        )?;
        writeln!(
            o,
            "   pg_commit_tps       {:>10}   (one row per transaction, {} connections, {:.1} s)",
            eps(d.commit_tps),
            d.commit_connections,
            d.commit_seconds
        )?;
        writeln!(o, "{}", cpu(&d.cpu_commit))?;
        writeln!(
            o,
            "   pg_batch_rows_per_s {:>10}   ({} rows per transaction, {} connections, {:.1} s)",
            eps(d.batch_rows_per_s),
            d.batch_rows,
            d.batch_connections,
            d.batch_seconds
        )?;
        writeln!(o, "{}", cpu(&d.cpu_batch))?;
        let p = &d.paced;
        writeln!(
            o,
            "   paced, {} tx/s from one connection ({:.0} s each): server CPU per transaction {:.0} µs for one statement, {:.0} µs for twenty round trips ({:.1} µs each after the first), {:.0} µs for a one-row commit",
            p.rate, p.seconds, p.one_statement_us, p.twenty_round_trips_us, p.round_trip_us, p.one_row_commit_us
        )?;
    }
    if let Some(x) = &r.relay {
        writeln!(
            o,
            "\n2. Relay drain: {} events ({} orders, payload {} B), preloaded in {:.1} s; relay {}",
            eps(x.events as f64),
            eps(x.orders as f64),
            x.payload_bytes,
            x.preload_seconds,
            x.relay_args.join(" ")
        )?;
        writeln!(
            o,
            "   relay_drain_eps     {:>10}   (backlog committed → all published, relay running: {:.2} s; relay start to active {:.2} s)",
            eps(x.relay_drain_eps),
            x.drain_seconds,
            x.startup_seconds
        )?;
        writeln!(
            o,
            "   relay_active_eps    {:>10}   ({:.2} s first → last published_at)",
            eps(x.relay_active_eps),
            x.active_seconds
        )?;
        let vs = x
            .relay_vs_broker
            .map_or("n/a".to_owned(), |v| format!("{v:.3}"));
        let vs_batched = x
            .relay_vs_broker_batched
            .map_or("n/a".to_owned(), |v| format!("{v:.3}"));
        writeln!(
            o,
            "   relay_vs_broker     {vs:>10}   (vs the relay-like batched produce: {vs_batched})"
        )?;
        writeln!(
            o,
            "   {} batches, avg {} events in {} ms",
            x.batches, x.avg_batch_size, x.avg_batch_ms
        )?;
        writeln!(o, "{}", cpu(&x.cpu))?;
        writeln!(o, "{}", db(&x.db_activity, &x.cpu))?;
    }
    if !r.consumer.is_empty() {
        writeln!(o, "\n3. Consumer drain of the relay's topic, one group at a time (eps = processed / seconds from the first processed event to lag zero)")?;
        writeln!(
            o,
            "   {:<13} {:>10} {:>12} {:>10} {:>12} {:>7}",
            "group", "batched", "(w/ start)", "per-msg", "(w/ start)", "ratio"
        )?;
        for g in &r.consumer {
            let partial = if g.per_message.complete { "" } else { " *" };
            writeln!(
                o,
                "   {:<13} {:>10} {:>12} {:>10} {:>12} {:>7.1}{partial}",
                g.group,
                eps(g.batched.eps),
                eps(g.batched.eps_from_start),
                eps(g.per_message.eps),
                eps(g.per_message.eps_from_start),
                g.batched_vs_per_message
            )?;
        }
        for g in &r.consumer {
            for (mode, run) in [("batched", &g.batched), ("per-message", &g.per_message)] {
                writeln!(o, "   {} {mode} (--max-batch {}): {} of {} events in {:.1} s, start-up {:.1} s, avg batch {} in {} ms, {} partition batches per transaction", g.group, run.max_batch, eps(run.processed as f64), eps(run.events as f64), run.seconds, run.startup_seconds, run.avg_batch_size, run.avg_batch_ms, run.avg_partition_batches_per_transaction)?;
                writeln!(o, "{}", cpu(&run.cpu))?;
                writeln!(o, "{}", db(&run.db_activity, &run.cpu))?;
            }
        }
        if r.consumer.iter().any(|g| !g.per_message.complete) {
            writeln!(
                o,
                "   * per-message run stopped at its time limit; rate over what it processed"
            )?;
        }
    }
    if !r.latency.is_empty() {
        writeln!(
            o,
            "\n4. End-to-end latency, open loop (intended send → group's applied_at), ms"
        )?;
        writeln!(
            o,
            "   {:>6} {:<13} {:>8} {:>8} {:>8} {:>8}  {:>15} {:>15} {:>15}  {:>9}",
            "rate",
            "group",
            "p50",
            "p99",
            "p99.9",
            "max",
            "service p50/99",
            "relay p50/99",
            "out→app p50/99",
            "ok/s"
        )?;
        for run in &r.latency {
            for (group, l) in &run.groups {
                writeln!(
                    o,
                    "   {:>6} {:<13} {:>8.1} {:>8.1} {:>8.1} {:>8.1}  {:>15} {:>15} {:>15}  {:>9}",
                    run.rate,
                    group,
                    l.e2e_p50_ms,
                    l.e2e_p99_ms,
                    l.e2e_p999_ms,
                    l.e2e_max_ms,
                    format!("{:.1}/{:.1}", l.service_p50_ms, l.service_p99_ms),
                    format!("{:.1}/{:.1}", l.relay_p50_ms, l.relay_p99_ms),
                    format!(
                        "{:.1}/{:.1}",
                        l.outbox_to_applied_p50_ms, l.outbox_to_applied_p99_ms
                    ),
                    eps(run.requests.achieved_rps)
                )?;
            }
            writeln!(o, "   {:>6} requests: {} ok, {} failed, response p50/p99 {:.1}/{:.1} ms, timetable lag p99 {:.1} ms", "", run.requests.ok, run.requests.failed(), run.requests.response_p50_ms, run.requests.response_p99_ms, run.requests.timetable_lag_p99_ms)?;
            writeln!(o, "{}", cpu(&run.cpu))?;
            writeln!(o, "{}", db(&run.db_activity, &run.cpu))?;
            if !run.cpu_profiles.is_empty() {
                writeln!(o, "{}", profile_lines(&run.cpu_profiles))?;
            }
            if let Some(b) = &run.broker {
                writeln!(o, "   {:>6} broker alone, same rate (relay's producer settings, {} plain readers, no database): read p50/p99/p99.9 {:.1}/{:.1}/{:.1} ms, ack p50/p99 {:.1}/{:.1} ms, ack p50 by fifth of the run {}", "", b.readers, b.read_p50_ms, b.read_p99_ms, b.read_p999_ms, b.ack_p50_ms, b.ack_p99_ms, fifths(&b.ack_p50_by_part_ms))?;
                writeln!(o, "{}", cpu(&b.cpu))?;
            }
        }
    }
    if let Some(sus) = &r.sustained {
        writeln!(o, "\n5. Sustained: {} events/s held (steps of {} s after {} s warm-up; bound {} s of events)", eps(sus.events_per_s), s.sustain_duration.as_secs(), s.warmup.as_secs(), sus.lag_bound_seconds)?;
        for st in &sus.steps {
            let lags: Vec<String> = st
                .end
                .lag
                .iter()
                .map(|(g, l)| format!("{g} {}", l.map_or("?".into(), |l| eps(l as f64))))
                .collect();
            writeln!(
                o,
                "   {:>6}/s {:<5} ok/s {:>6}  end: outbox {} lag {}  resp p99 {:.0} ms",
                st.rate,
                if st.held { "held" } else { "NOT" },
                eps(st.requests.achieved_rps),
                eps(st.end.outbox as f64),
                lags.join(", "),
                st.requests.response_p99_ms
            )?;
            for reason in &st.reasons {
                writeln!(o, "           - {reason}")?;
            }
            writeln!(o, "{}", cpu(&st.cpu))?;
            writeln!(o, "{}", db(&st.db_activity, &st.cpu))?;
        }
    }
    if let Some(sc) = &r.delayed {
        writeln!(
            o,
            "\nDelayed events: claim of {} among {} pending events, median/p95 {:.1}/{:.1} ms with none \
             delayed, {:.1}/{:.1} ms with {} delayed a day ahead; release with nothing due {:.1}/{:.1} ms, \
             of {} due events {:?} ms (five in a row)",
            sc.claim_batch,
            sc.pending_events,
            sc.claim_without_delayed_ms.0,
            sc.claim_without_delayed_ms.1,
            sc.claim_with_delayed_ms.0,
            sc.claim_with_delayed_ms.1,
            eps(sc.delayed_events as f64),
            sc.release_nothing_due_ms.0,
            sc.release_nothing_due_ms.1,
            sc.claim_batch,
            sc.release_full_batch_ms
        )?;
    }
    if let Some(ret) = &r.retention {
        crate::retention::table::write(o, ret)?;
    }
    if let Some(cost) = &r.relay_cost {
        crate::relay_cost::write_table(o, cost)?;
    }
    if !r.peak_rss_mb.is_empty() {
        let peaks: Vec<String> = r
            .peak_rss_mb
            .iter()
            .map(|(n, mb)| format!("{n} {mb:.0}"))
            .collect();
        writeln!(
            o,
            "\n6. Peak resident memory (VmHWM, MiB, max over phases): {}",
            peaks.join(", ")
        )?;
    }
    if !r.vs_database.is_empty() {
        writeln!(o, "\nAgainst PostgreSQL's ceiling of the same shape")?;
        for (name, v) in &r.vs_database {
            writeln!(o, "   {name:<58} {v:>8.3}")?;
        }
    }
    writeln!(o, "\nTargets")?;
    for t in &r.targets {
        let verdict = match t.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "n/a ",
        };
        let value = t
            .value
            .map_or("not measured".to_owned(), |v| format!("{v}"));
        writeln!(
            o,
            "   {verdict}  {:<58} {:>12}  (target {})",
            t.name, value, t.target
        )?;
        if let Some(why) = &t.bound_by {
            writeln!(o, "         ↳ {why}")?;
        }
    }
    for (title, items) in [("Notes", &r.notes), ("Errors", &r.errors)] {
        if !items.is_empty() {
            writeln!(o, "\n{title}")?;
            for n in items {
                writeln!(o, "   - {n}")?;
            }
        }
    }
    Ok(())
}

/// The broker: Apache Kafka's version, the cluster's brokers, the process measured.
fn broker(r: &Report) -> String {
    let h = &r.host;
    let brokers = h.kafka_cluster_brokers.map_or("? brokers".to_owned(), |n| {
        format!("{n} broker{}", if n == 1 { "" } else { "s" })
    });
    match &h.broker {
        Some(b) => format!(
            "Apache Kafka {} at {}, {brokers} (pid {}{})",
            b.version.as_deref().unwrap_or("(version unknown)"),
            h.kafka_brokers,
            b.pid,
            h.broker_peak_rss_mb
                .map_or(String::new(), |mb| format!(", peak RSS {mb:.0} MiB"))
        ),
        None => format!(
            "Kafka at {}, {brokers} (no broker process found here: its CPU is not measured)",
            h.kafka_brokers
        ),
    }
}

/// Values in ms joined with arrows, in order.
fn fifths(ms: &[f64]) -> String {
    ms.iter()
        .map(|v| format!("{v:.1}"))
        .collect::<Vec<_>>()
        .join(" → ")
}
