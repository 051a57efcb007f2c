#!/usr/bin/env bash
# Peak memory of an order export, through the real binaries: for each N given, seeds N orders
# (half of them with two lines) into a fresh database, starts the order service, the relay and a
# consumer process running only the `export` group, submits an export of every order, waits for
# it to succeed, and prints the consumer process's peak RSS (VmHWM) before and after the export,
# the export's duration (the job's started_at to finished_at) and its row count; then downloads
# the file and prints the order service's peak RSS before and after the download.
#
#   scripts/export-memory.sh 10000 1000000
#
# Settings (environment): SKIP_BUILD=1 uses the binaries already in target/release;
# EXPORT_TIMEOUT (seconds one export may take, default 1800). Logs in $RUN_DIR/export-memory/.
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

(($# > 0)) || die "usage: $0 ORDERS [ORDERS...]   e.g. $0 10000 1000000"
for n in "$@"; do
    [[ $n =~ ^[0-9]+$ ]] || die "ORDERS must be whole numbers, got '$n'"
done
BIN="$REPO_ROOT/target/release"
OUT="$RUN_DIR/export-memory"
EXPORT_TIMEOUT="${EXPORT_TIMEOUT:-1800}"
mkdir -p "$OUT"

ensure_postgres
ensure_broker
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
    cargo build --release --workspace --bins
fi

PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do
        stop_pid "export-memory process" "$pid" 30 || true
    done
    PIDS=()
}
trap cleanup EXIT

# log_value FILE PHRASE — waits up to 30 s for PHRASE in FILE and prints the word after it.
log_value() {
    local file=$1 phrase=$2 deadline=$((SECONDS + 30)) value
    while ((SECONDS < deadline)); do
        value=$(grep -o "$phrase[^ \",]*" "$file" 2>/dev/null | tail -n1 | sed "s/^$phrase//" || true)
        [[ -n $value ]] && { echo "$value"; return 0; }
        sleep 0.2
    done
    die "no '$phrase' in $file after 30 s"
}

vm_kb() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }

results=()
for n in "$@"; do
    db="export_memory_$n"
    dir="$OUT/files-$n"
    topic="export-memory-$n-$(date +%s)"
    drop_database "$db"
    create_database "$db"
    rm -rf "$dir"
    mkdir -p "$dir"
    export DATABASE_URL="postgres://postgres@127.0.0.1:5432/$db?sslmode=disable"
    export KAFKA_BROKERS="$BROKER_HOST:$BROKER_PORT" RUST_LOG=info
    "$BIN/relay" ensure-topics --topic "$topic" --partitions 3 >/dev/null
    "$BIN/producer" seed-catalog --products 5 >/dev/null

    rm -f "$OUT"/*-"$n".log
    "$BIN/producer" serve --listen 127.0.0.1:0 --export-dir "$dir" --export-topic "$topic" \
        >"$OUT/producer-$n.log" 2>&1 &
    producer_pid=$!
    PIDS+=("$producer_pid")
    addr=$(log_value "$OUT/producer-$n.log" "order service listening on ")

    log "seeding $n orders"
    psql -w -X -q -v ON_ERROR_STOP=1 "$DATABASE_URL" <<SQL
INSERT INTO orders (order_id, customer_id, email, status, created_at, updated_at)
SELECT gen_random_uuid(), 'customer-' || (i % 1000), 'c' || i || '@example.com',
       (ARRAY['placed', 'paid', 'cancelled', 'shipped'])[1 + i % 4],
       now() - make_interval(secs => i), now()
FROM generate_series(1, $n) AS i;
INSERT INTO order_line (order_id, line_no, product_id, quantity)
SELECT order_id, l, 'sku-0000' || l, l FROM orders, generate_series(1, 2) AS l
WHERE customer_id < 'customer-5';
ANALYZE orders; ANALYZE order_line;
SQL

    "$BIN/relay" run --metrics-listen 127.0.0.1:0 >"$OUT/relay-$n.log" 2>&1 &
    PIDS+=($!)
    "$BIN/consumer" run --group export --topic "$topic" --group-prefix "mem-$n-" \
        --metrics-listen 127.0.0.1:0 --export-dir "$dir" >"$OUT/consumer-$n.log" 2>&1 &
    consumer_pid=$!
    PIDS+=("$consumer_pid")
    log_value "$OUT/consumer-$n.log" "consumer metrics listening on " >/dev/null
    before_kb=$(vm_kb "$consumer_pid" VmHWM)

    job=$(curl -fsS -X POST -H 'content-type: application/json' -d '{}' "http://$addr/exports")
    id=$(jq -r .id <<<"$job")
    log "export $id submitted; waiting for it (up to ${EXPORT_TIMEOUT}s)"
    deadline=$((SECONDS + EXPORT_TIMEOUT))
    while :; do
        state=$(curl -fsS "http://$addr/exports/$id" | jq -r .state)
        [[ $state == succeeded ]] && break
        [[ $state == failed ]] && die "export failed: $(curl -fsS "http://$addr/exports/$id")"
        ((SECONDS < deadline)) || die "export not done after ${EXPORT_TIMEOUT}s (state $state)"
        sleep 0.2
    done
    peak_kb=$(vm_kb "$consumer_pid" VmHWM)
    read -r rows seconds < <(psql -w -X -Atq -F ' ' "$DATABASE_URL" -c \
        "SELECT row_count, round(extract(epoch FROM finished_at - started_at)::numeric, 2)
         FROM export_job WHERE id = '$id'")
    size=$(stat -c %s "$dir/export-$id.csv")
    # The download streams the file: the order service's peak stays where it was too.
    producer_before_kb=$(vm_kb "$producer_pid" VmHWM)
    downloaded=$(curl -fsS "http://$addr/exports/$id/download" | wc -c)
    ((downloaded == size)) || die "downloaded $downloaded bytes of $size"
    producer_after_kb=$(vm_kb "$producer_pid" VmHWM)
    line="orders=$n rows=$rows file_bytes=$size export_seconds=$seconds consumer_peak_rss_before_mb=$((before_kb / 1024)) consumer_peak_rss_after_mb=$((peak_kb / 1024)) order_service_peak_rss_before_download_mb=$((producer_before_kb / 1024)) after_download_mb=$((producer_after_kb / 1024))"
    log "$line"
    results+=("$line")
    cleanup
    drop_database "$db"
    rm -rf "$dir"
done
printf '%s\n' "${results[@]}"
