#!/usr/bin/env bash
# Runs the whole pipeline locally and puts a load through it:
#
#   scripts/run-pipeline.sh
#
# order service (producer) -> outbox in PostgreSQL -> relay -> Apache Kafka -> consumer groups
# inventory and notification. Waits until the outbox and both groups are drained, prints a report,
# then stops everything it started (PostgreSQL is left running).
#
# Settings (environment):
#   ORDERS=3000 RATE=500     orders the load generator sends, and at how many per second
#   PIPELINE_DB=pipeline     database the services use (created when missing)
#   PIPELINE_RESET=1         drop and recreate PIPELINE_DB first (0 = keep earlier runs' data)
#   READY_TIMEOUT=60         seconds to wait for the order service's /readyz
#   DRAIN_TIMEOUT=120        seconds to wait, after the load, for outbox and consumer lag to reach 0
#   STOP_TIMEOUT=30          seconds a service gets to exit after SIGTERM before SIGKILL
#   DIGEST_SCHEDULE='*/10 * * * * *'   the order service's recurring digest schedule (cron, UTC)
#   SCHEDULE_FLOOR='10 seconds'        this deployment's least time between two occurrences of a
#                                      schedule (outbox_schedule_floor), set before the services start
#   RUST_LOG=info LOG_JSON   the services' logging ($RUN_DIR/{producer,relay,consumer}.log)
#   KAFKA_BROKERS            an existing Kafka cluster to use instead of a local broker
#   RUN_DIR, KAFKA_*         see scripts/lib.sh
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

ORDERS="${ORDERS:-3000}"
RATE="${RATE:-500}"
DIGEST_SCHEDULE="${DIGEST_SCHEDULE:-*/10 * * * * *}"
SCHEDULE_FLOOR="${SCHEDULE_FLOOR:-10 seconds}"
PIPELINE_DB="${PIPELINE_DB:-pipeline}"
PIPELINE_RESET="${PIPELINE_RESET:-1}"
READY_TIMEOUT="${READY_TIMEOUT:-60}"
DRAIN_TIMEOUT="${DRAIN_TIMEOUT:-120}"
STOP_TIMEOUT="${STOP_TIMEOUT:-30}"

TOPIC=order-events
PARTITIONS=12
PRODUCTS=100
CONSUMER_GROUPS=(inventory notification)
ORDER_SERVICE_ADDR=127.0.0.1:8080
RELAY_METRICS_ADDR=127.0.0.1:9101
CONSUMER_METRICS_ADDR=127.0.0.1:9102
# Exports: a second consumer process runs the export group alone on its own topic.
EXPORT_TOPIC=export-jobs
EXPORT_METRICS_ADDR=127.0.0.1:9104
EXPORT_DIR="$RUN_DIR/exports"

BIN="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release"
GROUP_ARGS=()
for g in "${CONSUMER_GROUPS[@]}"; do GROUP_ARGS+=(--group "$g"); done

SERVICE_NAMES=()
SERVICE_PIDS=()
PROGRESS_OPEN=0

# ---------------------------------------------------------------------------------------------

end_progress_line() {
    if ((PROGRESS_OPEN)); then
        printf '\n' >&2
        PROGRESS_OPEN=0
    fi
}

# start_service NAME COMMAND... — runs a service in the background, output to $RUN_DIR/NAME.log.
start_service() {
    local name=$1
    shift
    "$@" >"$RUN_DIR/$name.log" 2>&1 </dev/null &
    local pid=$!
    SERVICE_NAMES+=("$name")
    SERVICE_PIDS+=("$pid")
    echo "$pid" >"$RUN_DIR/$name.pid"
    log "$name started (pid $pid, log $RUN_DIR/$name.log)"
}

# Dies when a service has exited, showing the end of its log.
check_services_alive() {
    local i name pid rc
    for i in "${!SERVICE_PIDS[@]}"; do
        name=${SERVICE_NAMES[i]} pid=${SERVICE_PIDS[i]}
        if ! pid_alive "$pid"; then
            end_progress_line
            rc=0
            wait "$pid" 2>/dev/null || rc=$?
            echo "---- last lines of $RUN_DIR/$name.log ----" >&2
            tail -n 30 "$RUN_DIR/$name.log" >&2 || true
            echo "----" >&2
            die "$name exited unexpectedly (status $rc)"
        fi
    done
}

# SIGTERM every service, wait up to STOP_TIMEOUT for them to exit, SIGKILL the rest (and say so).
stop_services() {
    ((${#SERVICE_PIDS[@]})) || return 0
    local i name pid rc
    log "sending SIGTERM to ${SERVICE_NAMES[*]}"
    for pid in "${SERVICE_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    local deadline=$((SECONDS + STOP_TIMEOUT))
    for i in "${!SERVICE_PIDS[@]}"; do
        name=${SERVICE_NAMES[i]} pid=${SERVICE_PIDS[i]}
        while pid_alive "$pid" && ((SECONDS < deadline)); do
            sleep 0.2
        done
        if pid_alive "$pid"; then
            warn "$name (pid $pid) did not exit within ${STOP_TIMEOUT}s of SIGTERM: sent SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rc=0
        wait "$pid" 2>/dev/null || rc=$?
        if ((rc == 0)); then
            log "$name stopped"
        else
            warn "$name exited with status $rc (log: $RUN_DIR/$name.log)"
        fi
        rm -f "$RUN_DIR/$name.pid"
    done
    SERVICE_NAMES=()
    SERVICE_PIDS=()
}

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    end_progress_line
    if ((${#SERVICE_PIDS[@]})) || ((BROKER_STARTED)); then
        section "Shutting down"
    fi
    stop_services
    stop_broker
    if ((status != 0)); then
        warn "run-pipeline failed (status $status) after $(human_duration "$SECONDS"); logs in $RUN_DIR"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# drain_status — reads `consumer report --json` on stdin; prints "DRAINED<TAB>PROGRESS TEXT", with
# DRAINED 1 when outbox_pending is 0 and every wanted group has lag 0 with no uncommitted partition
# (a group that has committed nothing yet also shows lag 0).
drain_status() {
    python3 -c '
import json, sys
wanted = sys.argv[1:]
try:
    report = json.load(sys.stdin)
except ValueError as e:
    print("0\tunreadable report (%s)" % e)
    sys.exit(0)
pending = report.get("outbox_pending")
groups = {g.get("group"): g for g in report.get("groups") or []}
show = lambda v: "?" if v is None else str(v)
done = pending == 0
parts = ["outbox pending " + show(pending)]
if report.get("outbox_failed"):
    parts.append("FAILED %s" % report["outbox_failed"])
for name in wanted:
    g = groups.get(name, {})
    lag, uncommitted = g.get("lag"), g.get("uncommitted_partitions") or 0
    done = done and lag == 0 and uncommitted == 0
    text = "%s lag %s" % (name, show(lag))
    if uncommitted:
        text += " (%d partitions uncommitted)" % uncommitted
    parts.append(text)
print("%d\t%s" % (done, ", ".join(parts)))
' "$@"
}

# show_export — submits an export of every order, waits for it (up to 60 s) and prints one
# line: rows, file, checksum, and the download's checksum checked against it.
show_export() {
    local job id state answer deadline=$((SECONDS + 60)) started=$SECONDS
    if ! job=$(curl -fsS --max-time 5 -X POST -H 'content-type: application/json' \
        -d '{}' "http://$ORDER_SERVICE_ADDR/exports"); then
        warn "export: POST /exports failed"
        return 0
    fi
    id=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])' <<<"$job")
    while :; do
        answer=$(curl -fsS --max-time 5 "http://$ORDER_SERVICE_ADDR/exports/$id" || true)
        state=$(python3 -c 'import json, sys; print(json.load(sys.stdin).get("state", ""))' <<<"$answer" 2>/dev/null || true)
        [[ $state == succeeded || $state == failed ]] && break
        if ((SECONDS >= deadline)); then
            warn "export $id: still ${state:-unknown} after 60 s (log: $RUN_DIR/export-consumer.log)"
            return 0
        fi
        sleep 0.2
    done
    if [[ $state == failed ]]; then
        warn "export $id failed: $answer"
        return 0
    fi
    local downloaded
    downloaded=$(curl -fsS --max-time 30 "http://$ORDER_SERVICE_ADDR/exports/$id/download" | sha256sum | cut -d' ' -f1)
    python3 -c '
import json, sys
job, downloaded, seconds = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
same = "matches the download" if job["checksum"] == downloaded else "DOES NOT MATCH the download (%s)" % downloaded
print("Export of every order: %s rows in %s s, GET /exports/%s/download, sha256 %s… %s" % (
    job["row_count"], seconds, job["id"], job["checksum"][:16], same))
' "$answer" "$downloaded" "$((SECONDS - started))"
}

# ---------------------------------------------------------------------------------------------

section "[1/9] Preflight"
for tool in curl python3 cargo; do
    have "$tool" || die "$tool is required"
done
require_free_port 127.0.0.1 8080 "the order service (producer serve --listen $ORDER_SERVICE_ADDR)"
require_free_port 127.0.0.1 9101 "the relay (--metrics-listen $RELAY_METRICS_ADDR)"
require_free_port 127.0.0.1 9102 "the consumer (--metrics-listen $CONSUMER_METRICS_ADDR)"
require_free_port 127.0.0.1 9104 "the export consumer (--metrics-listen $EXPORT_METRICS_ADDR)"
[[ $ORDERS =~ ^[0-9]+$ ]] || die "ORDERS must be a whole number"
[[ $RATE =~ ^[0-9]+([.][0-9]+)?$ ]] || die "RATE must be a number (orders per second; 0 = as fast as possible)"
log "logs and pid files in $RUN_DIR"

section "[2/9] PostgreSQL"
ensure_postgres

section "[3/9] Apache Kafka"
ensure_broker # fetches Kafka's jars first (kafka_fetch) unless a broker already listens

section "[4/9] cargo build --release --workspace --bins"
ensure_build_deps
cargo build --release --workspace --bins
for b in producer load relay consumer pipeline; do
    [[ -x $BIN/$b ]] || die "$BIN/$b was not built"
done

section "[5/9] Database $PIPELINE_DB, topic $TOPIC, seed data"
if [[ $PIPELINE_RESET == 1 ]]; then
    drop_database "$PIPELINE_DB"
fi
create_database "$PIPELINE_DB"
export DATABASE_URL="postgres://postgres@127.0.0.1:5432/$PIPELINE_DB?sslmode=disable"
if [[ -z ${KAFKA_BROKERS:-} ]]; then
    unset KAFKA_OPTIONS # settings for a remote cluster (SASL, TLS) would not suit the local broker
fi
KAFKA_BROKERS="$(broker_list)"
export KAFKA_BROKERS
export RUST_LOG="${RUST_LOG:-info}"
log "DATABASE_URL=$DATABASE_URL KAFKA_BROKERS=$KAFKA_BROKERS"
log "relay ensure-topics --topic $TOPIC --partitions $PARTITIONS"
"$BIN/relay" ensure-topics --topic "$TOPIC" --partitions "$PARTITIONS"
"$BIN/relay" ensure-topics --topic "$EXPORT_TOPIC" --partitions 3
rm -rf "$EXPORT_DIR"
mkdir -p "$EXPORT_DIR"
log "producer seed-catalog --products $PRODUCTS"
"$BIN/producer" seed-catalog --products "$PRODUCTS"
log "schedule floor: $SCHEDULE_FLOOR (outbox_schedule_floor)"
psql -w -X -q -v ON_ERROR_STOP=1 "$DATABASE_URL" \
    -c "UPDATE outbox_schedule_floor SET least_gap = interval '$SCHEDULE_FLOOR'"
log "consumer seed-stock --products $PRODUCTS --quantity 1000000"
"$BIN/consumer" seed-stock --products "$PRODUCTS" --quantity 1000000

section "[6/9] Starting order service, relay, consumer"
start_service producer "$BIN/producer" serve --listen "$ORDER_SERVICE_ADDR" \
    --export-dir "$EXPORT_DIR" --export-topic "$EXPORT_TOPIC" --digest-schedule "$DIGEST_SCHEDULE"
start_service relay "$BIN/relay" run --metrics-listen "$RELAY_METRICS_ADDR"
start_service consumer "$BIN/consumer" run "${GROUP_ARGS[@]}" --topic "$TOPIC" \
    --metrics-listen "$CONSUMER_METRICS_ADDR"
start_service export-consumer "$BIN/consumer" run --group export --topic "$EXPORT_TOPIC" \
    --metrics-listen "$EXPORT_METRICS_ADDR" --export-dir "$EXPORT_DIR"

log "waiting for http://$ORDER_SERVICE_ADDR/readyz and the relay and consumer metrics ports (up to ${READY_TIMEOUT}s)"
deadline=$((SECONDS + READY_TIMEOUT))
while :; do
    check_services_alive
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://$ORDER_SERVICE_ADDR/readyz" || true)
    waiting_for=()
    [[ $code == 200 ]] || waiting_for+=("order service /readyz (last status $code)")
    port_open "${RELAY_METRICS_ADDR%:*}" "${RELAY_METRICS_ADDR##*:}" || waiting_for+=("relay $RELAY_METRICS_ADDR")
    port_open "${CONSUMER_METRICS_ADDR%:*}" "${CONSUMER_METRICS_ADDR##*:}" || waiting_for+=("consumer $CONSUMER_METRICS_ADDR")
    port_open "${EXPORT_METRICS_ADDR%:*}" "${EXPORT_METRICS_ADDR##*:}" || waiting_for+=("export consumer $EXPORT_METRICS_ADDR")
    ((${#waiting_for[@]})) || break
    if ((SECONDS >= deadline)); then
        die "not ready after ${READY_TIMEOUT}s: $(IFS=,; echo "${waiting_for[*]}") — see the logs in $RUN_DIR"
    fi
    sleep 0.5
done
log "order service ready; relay and consumer metrics endpoints up"

# metric_sum ADDR NAME — the sum of a metric's samples on a /metrics page (empty when unreachable).
metric_sum() {
    curl -fsS --max-time 2 "http://$1/metrics" 2>/dev/null |
        awk -v m="$2" '$1 == m || index($1, m "{") == 1 { s += $NF; n++ } END { if (n) printf "%.0f\n", s }'
}

# The load starts once the relay is active and every group has its partitions: a message sent
# while the broker's first rebalance is still under way waits for it, and the summary would time
# the group's start-up instead of the pipeline.
want_partitions=$((${#CONSUMER_GROUPS[@]} * PARTITIONS))
log "waiting for the active relay and for the consumer groups to get their $want_partitions partitions (up to ${READY_TIMEOUT}s)"
assign_started=$SECONDS
deadline=$((SECONDS + READY_TIMEOUT))
while :; do
    check_services_alive
    active=$(metric_sum "$RELAY_METRICS_ADDR" relay_active)
    assigned=$(metric_sum "$CONSUMER_METRICS_ADDR" consumer_assigned_partitions)
    [[ ${active:-0} == 1 && ${assigned:-0} -ge $want_partitions ]] && break
    if ((SECONDS >= deadline)); then
        die "after ${READY_TIMEOUT}s: relay_active ${active:-?}, ${assigned:-0} of $want_partitions partitions assigned — see the logs in $RUN_DIR"
    fi
    sleep 0.2
done
log "relay active, $assigned partitions assigned after $(human_duration $((SECONDS - assign_started))) (the broker's first rebalance); starting the load"

section "[7/9] Load: $ORDERS orders at $RATE/s"
load_started=$SECONDS
load_status=0
"$BIN/load" --url "http://$ORDER_SERVICE_ADDR" --orders "$ORDERS" --rate "$RATE" \
    --summary-json "$RUN_DIR/load.json" || load_status=$?
if ((load_status == 0)); then
    log "load finished in $(human_duration $((SECONDS - load_started))) (summary: $RUN_DIR/load.json)"
else
    # Go on: what was accepted still has to drain, and the report shows where things stand.
    warn "load exited with status $load_status (some orders failed); waiting for the rest to drain"
fi

section "[8/9] Waiting for outbox and consumer groups to drain (up to ${DRAIN_TIMEOUT}s)"
drain_started=$SECONDS
deadline=$((SECONDS + DRAIN_TIMEOUT))
drained=0
status_line=''
last_printed=''
: >"$RUN_DIR/report.log"
while :; do
    check_services_alive
    if json=$("$BIN/consumer" report "${GROUP_ARGS[@]}" --topic "$TOPIC" --json 2>>"$RUN_DIR/report.log"); then
        IFS=$'\t' read -r drained status_line < <(drain_status "${CONSUMER_GROUPS[@]}" <<<"$json") || {
            drained=0
            status_line="could not read the report"
        }
    else
        drained=0
        status_line="consumer report failed (see $RUN_DIR/report.log)"
    fi
    line="[$(human_duration $((SECONDS - drain_started)))] $status_line"
    if [[ -t 2 ]]; then
        printf '\r\033[K%s' "$line" >&2
        PROGRESS_OPEN=1
    elif [[ $status_line != "$last_printed" ]]; then
        printf '%s\n' "$line" >&2
        last_printed=$status_line
    fi
    ((drained)) && break
    ((SECONDS < deadline)) || break
    sleep 1
done
end_progress_line
drain_seconds=$((SECONDS - drain_started))
if ((drained)); then
    log "drained $(human_duration "$drain_seconds") after the load finished"
else
    warn "not drained after ${DRAIN_TIMEOUT}s: $status_line"
fi

section "[9/9] Summary"
declare -A duplicates=()
if metrics=$(curl -fsS --max-time 5 "http://$CONSUMER_METRICS_ADDR/metrics"); then
    while read -r group count; do
        if [[ -n $group ]]; then
            duplicates[$group]=$count
        fi
    done < <(awk '
        /^consumer_messages_total\{/ && /outcome="duplicate"/ {
            if (match($0, /group="[^"]*"/)) {
                group = substr($0, RSTART + 7, RLENGTH - 8)
                value = $0
                sub(/^[^}]*\}[ \t]*/, "", value)
                split(value, fields, /[ \t]+/)
                sum[group] += fields[1]
            }
        }
        END { for (g in sum) printf "%s %.0f\n", g, sum[g] }' <<<"$metrics")
else
    warn "could not fetch http://$CONSUMER_METRICS_ADDR/metrics"
fi
"$BIN/consumer" report "${GROUP_ARGS[@]}" --topic "$TOPIC" || warn "consumer report failed"
echo
echo "Duplicates skipped (consumer_messages_total{outcome=\"duplicate\"}):"
for g in "${CONSUMER_GROUPS[@]}"; do
    printf '  %-14s %s\n' "$g" "${duplicates[$g]:-0}"
done
echo
printf 'Orders: %s at %s/s   load: %s   drain: %s   total: %s\n' "$ORDERS" "$RATE" \
    "$(human_duration $((drain_started - load_started)))" \
    "$(human_duration "$drain_seconds")$( ((drained)) || echo ' (NOT drained)')" \
    "$(human_duration "$SECONDS")"
echo "Logs: $RUN_DIR/{producer,relay,consumer,export-consumer,kafka}.log   load summary: $RUN_DIR/load.json"
echo
show_export
echo
echo "What an operator sees (pipeline status; pipeline trace <order id> follows one order):"
RUST_LOG=warn "$BIN/pipeline" status --group "$(IFS=,; echo "${CONSUMER_GROUPS[*]}")" --topic "$TOPIC" ||
    warn "pipeline status failed"
echo
echo "The recurring digest schedule (pipeline schedules show daily-digest):"
RUST_LOG=warn "$BIN/pipeline" schedules show daily-digest || warn "pipeline schedules show failed"

section "Shutting down"
stop_services
stop_broker
trap - EXIT INT TERM
if ((!drained)); then
    die "the pipeline did not drain within ${DRAIN_TIMEOUT}s"
fi
if ((load_status != 0)); then
    die "load reported failed orders (status $load_status); see its summary above"
fi
log "done in $(human_duration "$SECONDS")"
