#!/usr/bin/env bash
# Static checks of the monitoring files (scripts/test.sh runs it after the cargo tests):
#
#   scripts/check-observability.sh
#
#   1. promtool check config  deploy/prometheus/prometheus.yml   (and the rule file it loads)
#   2. promtool check rules   deploy/prometheus/alerts.yml
#   3. promtool test rules    deploy/prometheus/alerts_test.yml  (the alerts' unit tests)
#   4. the Grafana dashboard deploy/grafana/pipeline-dashboard.json: valid JSON, unique panel ids,
#      the template variables it uses defined, and every panel query valid PromQL once the
#      Grafana variables are replaced ($group, $topic -> .*, $__rate_interval -> 1m): each one is
#      written as a recording rule into a scratch rule file that promtool parses.
#
# The end-to-end test tests/kit/tests/it/prometheus.rs goes further: a real Prometheus scrapes the
# running pipeline and evaluates every dashboard query and alert rule.
# Installs Debian's prometheus package (prometheus, promtool) when missing.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

PROM_DIR=deploy/prometheus
DASHBOARD=deploy/grafana/pipeline-dashboard.json

ensure_prometheus
have python3 || die "python3 is needed to read $DASHBOARD"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

failed=0
# check NAME COMMAND... — runs one check, prints its output, and records a failure.
check() {
    local name=$1
    shift
    if "$@"; then
        log "ok: $name"
    else
        warn "FAILED: $name"
        failed=1
    fi
}

check "promtool check config $PROM_DIR/prometheus.yml" promtool check config "$PROM_DIR/prometheus.yml"
check "promtool check rules $PROM_DIR/alerts.yml" promtool check rules "$PROM_DIR/alerts.yml"
check "promtool test rules $PROM_DIR/alerts_test.yml" promtool test rules "$PROM_DIR/alerts_test.yml"

# The dashboard's queries, as recording rules promtool can parse.
dashboard_rules() {
    python3 - "$DASHBOARD" "$scratch/dashboard-rules.yml" <<'PY'
import json, re, sys

path, out = sys.argv[1], sys.argv[2]
with open(path, encoding="utf-8") as f:
    dash = json.load(f)

errors = []
variables = {v.get("name") for v in dash.get("templating", {}).get("list", [])}
for needed in ("datasource", "group", "topic"):
    if needed not in variables:
        errors.append(f"template variable ${needed} is not defined")

def panels(items):
    for p in items:
        yield p
        yield from panels(p.get("panels", []))

# Grafana's variables, replaced the way the dashboard uses them: regex matchers (=~"$group")
# and range durations.
SUBST = [
    (r"\$__rate_interval|\$__interval|\$__range", "1m"),
    (r"\$\{?group\}?|\$\{?topic\}?", ".*"),
]

ids = set()
rules = []
for p in panels(dash.get("panels", [])):
    pid = p.get("id")
    if pid in ids:
        errors.append(f"panel id {pid} used twice")
    ids.add(pid)
    if p.get("type") == "row":
        continue
    targets = p.get("targets") or []
    if not targets:
        errors.append(f"panel {pid} {p.get('title')!r} has no query")
    for t in targets:
        expr = t.get("expr", "")
        if not expr.strip():
            errors.append(f"panel {pid} {p.get('title')!r} target {t.get('refId')} has no expr")
            continue
        for pattern, value in SUBST:
            expr = re.sub(pattern, value, expr)
        if "$" in expr:
            errors.append(f"panel {pid} {p.get('title')!r}: unknown variable left in {expr!r}")
            continue
        rules.append((f"dashboard:panel_{pid}_{t.get('refId', 'X')}", expr))

for v in dash.get("templating", {}).get("list", []):
    if v.get("type") == "query":
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", q or "")
        if not m:
            errors.append(f"variable ${v.get('name')}: not a label_values(selector, label) query: {q!r}")
        else:
            rules.append((f"dashboard:variable_{v['name']}", m.group(1)))

if errors:
    print("\n".join(errors), file=sys.stderr)
    sys.exit(1)

with open(out, "w", encoding="utf-8") as f:
    f.write("groups:\n  - name: dashboard\n    rules:\n")
    for name, expr in rules:
        f.write(f"      - record: {name}\n        expr: {json.dumps(expr)}\n")
print(f"{len(rules)} dashboard queries from {len(ids)} panels")
PY
}

check_dashboard() {
    dashboard_rules && promtool check rules --lint=none "$scratch/dashboard-rules.yml"
}
check "dashboard $DASHBOARD: JSON and every query's PromQL" check_dashboard

if ((failed)); then
    die "observability checks failed"
fi
log "observability checks passed"
