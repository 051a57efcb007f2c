#!/usr/bin/env python3
"""The relay's two sources side by side, from two benchmark reports:

    scripts/bench-sources.py QUEUE.json WAL.json

QUEUE.json from a run with `--relay-source queue` (the default), WAL.json from one with
`--relay-source wal`; scripts/bench.sh writes both and calls this. Prints, for each mode: the
idle pipeline (the relays and PostgreSQL), the relay's drain of a backlog, and each latency
rate both ran (CPU per event by process, the relay's statements per event, outbox → published
and end to end), and the relay-cost phase (either report; it measures both sources: the server
CPU each source adds to one-event transactions written alone). A figure a report lacks (its
phase did not run) shows as "-".
"""

import json
import sys


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d or d[k] is None:
            return None
        d = d[k]
    return d


def relay_sessions(phase):
    """The server CPU of the relay's connections (its pool's and, streaming, the walsender's)
    over the phase, % of a core."""
    by = get(phase, "db_activity", "cpu_by_client")
    if by is None:
        return None
    return sum(v for k, v in by.items() if k.startswith("relay"))


def idle_rows(report):
    idle = report.get("idle")
    if not idle:
        return {}
    pct = get(idle, "cpu", "percent") or {}
    relays = sum(v for k, v in pct.items() if k.startswith("relay"))
    pipeline = sum(v for k, v in pct.items() if k not in ("bench", "broker"))
    relay_calls = get(idle, "statements", "by_client", "relay", "calls")
    seconds = get(idle, "measured_seconds") or 60.0
    return {
        "idle: pipeline + PostgreSQL, % of a core": fmt(pipeline, ".1f"),
        "idle: relays (active + standby), %": fmt(relays, ".1f"),
        "idle: PostgreSQL, %": fmt(pct.get("postgres"), ".1f"),
        "idle: relay statements a second": fmt(
            None if relay_calls is None else relay_calls / seconds, ".1f"
        ),
    }


def drain_rows(report):
    relay = report.get("relay")
    if not relay:
        return {}
    by = get(relay, "cpu", "per_event", "by_process_us") or {}
    return {
        "drain: events a second": fmt(relay.get("relay_drain_eps"), ",.0f"),
        "drain: PostgreSQL CPU of the relay's sessions, %": fmt(relay_sessions(relay), ".1f"),
        "drain: × the broker's relay-like produce": fmt(
            relay.get("relay_vs_broker_batched"), ".2f"
        ),
        "drain: CPU µs an event, relay / PostgreSQL": "%s / %s"
        % (fmt(by.get("relay"), ".1f"), fmt(by.get("postgres"), ".1f")),
    }


def latency_rows(report, rate):
    for run in report.get("latency") or []:
        if abs(run["rate"] - rate) < 0.5:
            break
    else:
        return {}
    pe = get(run, "cpu", "per_event") or {}
    by = pe.get("by_process_us") or {}
    events = pe.get("events") or 0
    relay_calls = get(run, "db_activity", "statements", "by_client", "relay", "calls")
    inv = get(run, "groups", "inventory") or {}
    r = "%g/s" % rate
    return {
        f"{r}: CPU µs an event, pipeline + PostgreSQL": fmt(pe.get("pipeline_us"), ",.0f"),
        f"{r}: CPU µs an event, PostgreSQL / relay": "%s / %s"
        % (fmt(by.get("postgres"), ",.0f"), fmt(by.get("relay"), ",.0f")),
        f"{r}: PostgreSQL CPU of the relay's sessions, %": fmt(relay_sessions(run), ".1f"),
        f"{r}: relay statements an event": fmt(
            None if relay_calls is None or not events else relay_calls / events, ".2f"
        ),
        f"{r}: outbox → published p50 / p99 ms": "%s / %s"
        % (fmt(inv.get("relay_p50_ms"), ".1f"), fmt(inv.get("relay_p99_ms"), ".1f")),
        f"{r}: e2e p50 / p99 ms (inventory)": "%s / %s"
        % (fmt(inv.get("e2e_p50_ms"), ".1f"), fmt(inv.get("e2e_p99_ms"), ".1f")),
    }


def cost_rows(queue, wal):
    """The relay-cost phase (one of the two reports has it; it measures both sources)."""
    cost = wal.get("relay_cost") or queue.get("relay_cost")
    if not cost:
        return []
    rows = []
    idle = {}
    for c in cost.get("idle") or []:
        if c.get("relay_percent"):
            n = len(c["relay_percent"])
            idle[c["case"]] = sum(c["relay_percent"]) / n + sum(c["sessions_percent"]) / n
    if idle:
        rows.append(
            (
                "relaying alone, idle: relay process + its sessions, % of a core",
                fmt(idle.get("queue"), ".2f"),
                fmt(idle.get("wal"), ".2f"),
            )
        )
    for r in cost.get("rates") or []:
        rate = "%g/s" % r["rate"]
        rows.append(
            (
                f"relaying alone {rate}: server CPU µs an event, the relay's sessions",
                fmt(r.get("queue_sessions_us"), ",.0f"),
                fmt(r.get("wal_sessions_us"), ",.0f"),
            )
        )
        rows.append(
            (
                f"relaying alone {rate}: walsender µs a transaction of another table",
                "-",
                fmt(r.get("wal_other_sessions_us"), ",.0f"),
            )
        )
    return rows


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: scripts/bench-sources.py QUEUE.json WAL.json")
    queue, wal = load(sys.argv[1]), load(sys.argv[2])
    rates = sorted(
        {run["rate"] for run in queue.get("latency") or []}
        & {run["rate"] for run in wal.get("latency") or []}
    )
    sections = [idle_rows, drain_rows] + [
        (lambda rate: lambda report: latency_rows(report, rate))(rate) for rate in rates
    ]
    rows = []
    for section in sections:
        q, w = section(queue), section(wal)
        for name in list(q) + [n for n in w if n not in q]:
            rows.append((name, q.get(name, "-"), w.get(name, "-")))
    rows.extend(cost_rows(queue, wal))
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"{'the relay, by source':<{width}}  {'queue':>16}  {'wal':>16}")
    for name, q, w in rows:
        print(f"{name:<{width}}  {q:>16}  {w:>16}")


if __name__ == "__main__":
    main()
