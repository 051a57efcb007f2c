// The pipeline console's script: fills and refreshes the overview from /api/overview, draws the
// throughput chart, and sorts tables by a click on a column's header. Served from /static/ (the
// content security policy allows no inline script); everything it writes goes through
// textContent or attributes, never innerHTML. It names no URL of its own: the page gives them
// (data-api, data-login), under the console's prefix.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2456a6", "#1e7b3c", "#9a6700", "#8e3bb4", "#b42318", "#0f7c8c"];

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) node.setAttribute(k, v);
    }
    for (const c of children || []) {
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "-";
    if (seconds < 1) return Math.round(seconds * 1000) + "ms";
    if (seconds < 60) return seconds.toFixed(1) + "s";
    if (seconds < 3600) return Math.floor(seconds / 60) + "m" + String(Math.floor(seconds % 60)).padStart(2, "0") + "s";
    return Math.floor(seconds / 3600) + "h" + String(Math.floor((seconds % 3600) / 60)).padStart(2, "0") + "m";
  }

  function capped(n) {
    return n >= 100000 ? "≥100000" : String(n);
  }

  function show(v) {
    return v === null || v === undefined ? "-" : String(v);
  }

  // A table whose cells carry a data-sort value where the shown text does not sort well.
  function table(id, columns, rows) {
    const head = el("tr", {}, columns.map((c) => el("th", { class: c.num ? "num" : null }, [c.title])));
    const body = el("tbody", {}, rows.map((r) => el("tr", r.attrs || {}, r.cells.map((cell, i) => {
      const td = el("td", { class: columns[i].num ? "num" : null }, [cell.text !== undefined ? cell.text : cell]);
      if (cell.sort !== undefined && cell.sort !== null) td.dataset.sort = cell.sort;
      if (cell.cls) td.classList.add(cell.cls);
      return td;
    }))));
    const t = el("table", { id: id, class: "sortable" }, [el("thead", {}, [head]), body]);
    return t;
  }

  function fill(panelId, ...nodes) {
    const content = document.querySelector("#" + panelId + " .content");
    if (content) content.replaceChildren(...nodes);
  }

  function kv(pairs) {
    const dl = el("dl", { class: "kv" });
    for (const [k, v, cls] of pairs) {
      dl.append(el("dt", {}, [k]), el("dd", { class: cls || null }, [v]));
    }
    return dl;
  }

  function relayPanel(status) {
    if (!status.relay.length) return fill("panel-relay", el("p", {}, ["No relay has run: the lease is vacant."]));
    const rows = status.relay.map((l) => {
      const state = l.held && l.holder_connected ? ["active", "state-good"]
        : l.held ? ["held, holder's session gone", "state-warn"]
        : l.holder_connected ? ["expired (holder frozen or cut off?)", "state-bad"]
        : ["vacant", "state-bad"];
      return { cells: [String(l.lease_key), String(l.epoch), show(l.holder) + (l.holder_pid ? " (pid " + l.holder_pid + ")" : ""),
        { text: state[0], cls: state[1] }, { text: l.renewed_seconds_ago === null ? "-" : age(l.renewed_seconds_ago) + " ago", sort: l.renewed_seconds_ago }] };
    });
    fill("panel-relay", table("relay", [{ title: "lease" }, { title: "epoch", num: true }, { title: "holder" }, { title: "state" }, { title: "last renewal" }], rows));
  }

  function outboxPanel(status) {
    const o = status.outbox;
    const next = o.next_delayed_in_seconds;
    fill("panel-outbox", kv([
      ["pending", capped(o.pending)],
      ["retrying", capped(o.retrying), o.retrying > 0 ? "state-warn" : null],
      ["failed", capped(o.failed), o.failed > 0 ? "state-bad" : null],
      ["oldest unpublished", age(o.oldest_unpublished_seconds)],
      ["delayed (scheduled)", capped(o.delayed) + " waiting, " + capped(o.delayed_due) + " due"],
      ["next delayed due", next === null ? "-" : next >= 0 ? "in " + age(next) : "overdue " + age(-next)],
      ["dead letters open", capped(status.groups.reduce((s, g) => s + g.dead_letters_open, 0)), null],
      ["orders parked", capped(status.groups.reduce((s, g) => s + g.orders_parked, 0)), null],
    ].concat((status.stream || []).flatMap(streamRows))));
  }

  // A relay streaming the outbox from the write-ahead log (--source wal): its slot and how far
  // behind it is.
  function streamRows(w) {
    const session = !w.slot_exists ? ["no slot", "state-bad"]
      : w.wal_status === "lost" ? ["slot lost: falling back to the queue", "state-bad"]
      : w.slot_active ? ["streaming", "state-good"]
      : [w.streaming ? "no session: nothing is published" : "no session", "state-bad"];
    return [
      ["write-ahead log (slot " + w.slot + ")", session[0] + (w.streaming ? "" : "; writers queue (fell back)"), session[1]],
      ["slot lag", bytes(w.lag_bytes) + ", " + capped(w.past_horizon) + " events past the horizon (" + age(w.horizon_seconds) + " ago)"],
      ["WAL the slot keeps", bytes(w.retained_bytes)],
    ];
  }

  function bytes(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let v = Math.max(0, n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : String(v)) + " " + units[i];
  }

  function groupsPanel(status) {
    const rows = status.groups.map((g) => ({
      attrs: { "data-group": g.group, "data-lag": show(g.lag_messages) },
      cells: [g.group,
        { text: show(g.state), cls: g.state === "paused" ? "state-warn" : null },
        show(g.members),
        { text: show(g.lag_messages), sort: g.lag_messages },
        { text: age(g.lag_seconds), sort: g.lag_seconds },
        show(g.uncommitted_partitions), g.rate_limit || "none",
        { text: capped(g.dead_letters_open), sort: g.dead_letters_open, cls: g.dead_letters_open > 0 ? "state-bad" : null },
        { text: capped(g.orders_parked), sort: g.orders_parked },
        waiting(g),
        g.kafka_error ? "Kafka did not answer: " + g.kafka_error : ""] }));
    fill("panel-groups", table("groups", [{ title: "group" }, { title: "state" }, { title: "members", num: true },
      { title: "lag (messages)", num: true }, { title: "lag (age)", num: true }, { title: "uncommitted partitions", num: true },
      { title: "rate limit" }, { title: "dead letters open", num: true }, { title: "orders parked", num: true }, { title: "waiting beside" }, { title: "note" }], rows));
  }

  // What the task beside a group has waiting (export jobs, say), where the program reads it.
  function waiting(g) {
    if (g.waiting_error) return { text: "unreadable: " + g.waiting_error, cls: "state-warn" };
    if (!g.waiting) return "-";
    const w = g.waiting;
    const text = w.count + " " + w.what + (w.oldest_seconds != null ? ", oldest " + age(w.oldest_seconds) : "");
    return { text: text, sort: w.count, cls: w.count > 0 ? "state-warn" : null };
  }

  function partitionsPanel(status) {
    const rows = [];
    for (const g of status.groups) {
      for (const p of g.partitions || []) {
        rows.push({ cells: [g.group, p.topic, { text: String(p.partition), sort: p.partition }, { text: show(p.committed), sort: p.committed },
          { text: String(p.end), sort: p.end }, { text: show(p.lag_messages), sort: p.lag_messages }, { text: age(p.lag_seconds), sort: p.lag_seconds }] });
      }
    }
    fill("panel-partitions", table("partitions", [{ title: "group" }, { title: "topic" }, { title: "partition", num: true },
      { title: "committed", num: true }, { title: "end", num: true }, { title: "lag (messages)", num: true }, { title: "lag (age)", num: true }], rows));
  }

  function chart(points) {
    if (points.length < 2) return fill("panel-throughput", el("p", { class: "muted" }, ["Sampling… the chart starts after two readings."]));
    const series = [{ name: "published", values: points.map((p) => p.published_per_second) }];
    const groups = new Set();
    points.forEach((p) => Object.keys(p.applied_per_second).forEach((g) => groups.add(g)));
    for (const g of [...groups].sort()) {
      series.push({ name: g + " applied", values: points.map((p) => p.applied_per_second[g] ?? null) });
    }
    const W = 800, H = 180, L = 48, B = 20;
    const t0 = Date.parse(points[0].at), t1 = Date.parse(points[points.length - 1].at);
    const max = Math.max(1, ...series.flatMap((s) => s.values.filter((v) => v !== null)));
    const x = (i) => L + ((Date.parse(points[i].at) - t0) / Math.max(1, t1 - t0)) * (W - L - 8);
    const y = (v) => 8 + (1 - v / max) * (H - B - 8);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "records per second over the last minutes");
    const add = (tag, attrs, text) => {
      const n = document.createElementNS(SVG, tag);
      for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
      if (text !== undefined) n.textContent = text;
      svg.append(n);
    };
    for (const f of [0, 0.5, 1]) {
      add("line", { x1: L, x2: W - 8, y1: y(max * f), y2: y(max * f), stroke: "#d8dde6" });
      add("text", { x: L - 6, y: y(max * f) + 4, "text-anchor": "end", "font-size": 11, fill: "#5d6676" }, (max * f).toFixed(max * f < 10 ? 1 : 0));
    }
    add("text", { x: L, y: H - 4, "font-size": 11, fill: "#5d6676" }, new Date(t0).toLocaleTimeString());
    add("text", { x: W - 8, y: H - 4, "font-size": 11, fill: "#5d6676", "text-anchor": "end" }, new Date(t1).toLocaleTimeString());
    series.forEach((s, k) => {
      const d = s.values.map((v, i) => (v === null ? null : x(i).toFixed(1) + "," + y(v).toFixed(1))).filter(Boolean).join(" ");
      // Published is drawn dashed and wider, so a group applying at the same rate shows it.
      add("polyline", k === 0
        ? { points: d, fill: "none", stroke: COLORS[0], "stroke-width": 4, "stroke-dasharray": "6 4" }
        : { points: d, fill: "none", stroke: COLORS[k % COLORS.length], "stroke-width": 2 });
    });
    const legend = el("div", { class: "legend" }, series.map((s, k) => {
      const last = s.values[s.values.length - 1];
      const sw = el("span", { class: "swatch" });
      sw.style.background = COLORS[k % COLORS.length];
      return el("span", {}, [sw, s.name + ": " + (last === null ? "-" : last.toFixed(1)) + "/s"]);
    }));
    fill("panel-throughput", el("div", { class: "chart" }, [svg, legend]));
  }

  // Sorting: a click on a header sorts by that column; the choice survives refreshes.
  const sorted = {};

  function sortTable(tableNode, col, dir) {
    const body = tableNode.tBodies[0];
    if (!body) return;
    const value = (tr) => {
      const td = tr.cells[col];
      if (!td) return "";
      const raw = td.dataset.sort !== undefined ? td.dataset.sort : td.textContent.trim();
      const n = Number(raw);
      return raw !== "" && raw !== "-" && !Number.isNaN(n) ? n : raw;
    };
    const rows = [...body.rows];
    rows.sort((a, b) => {
      const va = value(a), vb = value(b);
      const c = typeof va === "number" && typeof vb === "number" ? va - vb : String(va).localeCompare(String(vb));
      return dir === "asc" ? c : -c;
    });
    body.append(...rows);
    [...tableNode.tHead.rows[0].cells].forEach((th, i) => {
      th.classList.toggle("sorted-asc", i === col && dir === "asc");
      th.classList.toggle("sorted-desc", i === col && dir === "desc");
    });
  }

  document.addEventListener("click", (e) => {
    const th = e.target.closest("table.sortable thead th");
    if (!th || th.hasAttribute("data-nosort")) return;
    const tableNode = th.closest("table");
    const col = th.cellIndex;
    const key = tableNode.id || "";
    const prev = sorted[key];
    const dir = prev && prev.col === col && prev.dir === "asc" ? "desc" : "asc";
    sorted[key] = { col, dir };
    sortTable(tableNode, col, dir);
  });

  function resort() {
    for (const [id, s] of Object.entries(sorted)) {
      const t = document.getElementById(id);
      if (t) sortTable(t, s.col, s.dir);
    }
  }

  async function refresh(root) {
    const state = document.getElementById("overview-state");
    let delay = 3000;
    try {
      const response = await fetch(root.dataset.api, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 401) {
        window.location.assign(root.dataset.login);
        return;
      }
      const data = await response.json();
      delay = Math.max(1, data.refresh_seconds || 3) * 1000;
      const notes = [];
      if (data.status) {
        relayPanel(data.status);
        outboxPanel(data.status);
        groupsPanel(data.status);
        partitionsPanel(data.status);
        chart(data.throughput || []);
        resort();
        notes.push("Read at " + new Date(data.read_at).toLocaleTimeString() + "; refreshes every " + delay / 1000 + "s.");
      }
      if (data.error) {
        notes.push("The last reading failed (" + new Date(data.error_at).toLocaleTimeString() + "): PostgreSQL or Kafka did not answer: " + data.error);
      } else if (!data.status) {
        notes.push("Reading the status…");
      }
      state.textContent = notes.join(" ");
      state.className = data.error ? "error" : "muted";
      root.dataset.loaded = data.status ? "yes" : "no";
    } catch (err) {
      state.textContent = "The console did not answer: " + err;
      state.className = "error";
    }
    setTimeout(() => refresh(root), delay);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const root = document.getElementById("overview");
    if (root) refresh(root);
  });
})();
