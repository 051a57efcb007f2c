#!/usr/bin/env bash
# The benchmark command:
#
#   scripts/bench.sh [--out PATH] [--quick] [--keep] [BENCH FLAGS...]
#
# Brings up PostgreSQL (127.0.0.1:5432) and Apache Kafka (one KRaft node, 127.0.0.1:9092) as
# scripts/test.sh does (ensure_postgres, ensure_broker), builds the release binaries, then runs
# target/release/bench. In one run it measures the broker's ceiling (plain producer and
# consumer), the relay draining a preloaded outbox, each consumer group draining the relay's topic
# (batched and one message per transaction), end-to-end latency at fixed open-loop rates, the
# highest rate the whole pipeline sustains, and every process's CPU (the Kafka broker's too, and
# each phase's CPU per event, the broker's beside the pipeline's) and peak memory. It writes a
# JSON report to --out (default $RUN_DIR/bench.json) and prints a table with PASS/FAIL against the
# targets.
#
# Then, unless BENCH_WAL=0 or the flags choose --relay-source, it runs the relay's other source,
# the write-ahead log (--relay-source wal), on the phases BENCH_WAL_PHASES (idle,relay,latency,
# relay-cost: what each source adds to the server's CPU, measured apart)
# at the rates BENCH_WAL_RATES (100,1000), writes that report beside the first (<out>-wal.json)
# and prints the two sources side by side (scripts/bench-sources.py).
#
# --quick: smaller backlogs and shorter phases (a few minutes). --keep: leave the benchmark's
# databases, topics and logs (target/release/test-logs) in place. All flags, each with its
# environment fallback: target/release/bench --help.
#
# Settings (environment): KAFKA_BROKERS (a cluster to use instead of starting one; the broker's CPU
# is measured when its kafka.Kafka process runs on this machine), RUN_DIR, and those of
# scripts/lib.sh. A broker this script started is stopped at exit.
# Exit status: non-zero when a phase failed; a missed target is reported, not an error.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"

finish() {
    local status=$?
    trap - EXIT INT TERM
    stop_broker
    exit "$status"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Descriptors this script inherited (a flock(1) lock serialising heavy jobs, say) are closed, so
# that the servers it may start (PostgreSQL outlives it) do not keep them open.
close_inherited_fds

section "PostgreSQL and broker"
ensure_postgres
ensure_broker

# The whole workspace's binaries: the same build the tests use (a subset of packages would unify
# the dependencies' features differently and compile them again).
section "cargo build --release --workspace --bins"
ensure_build_deps
cargo build --release --workspace --bins

section "bench"
export BENCH_OUT="${BENCH_OUT:-$RUN_DIR/bench.json}"
# The report's path as the flags give it (the bench reads --out before BENCH_OUT).
prev=
for a in "$@"; do
    case $a in
        --out=*) BENCH_OUT=${a#--out=} ;;
        *) [[ $prev == --out ]] && BENCH_OUT=$a ;;
    esac
    prev=$a
done
started=$SECONDS
rc=0
env DATABASE_URL="postgres://postgres@${PG_HOST}:${PG_PORT}/postgres?sslmode=disable" \
    KAFKA_BROKERS="${KAFKA_BROKERS:-${BROKER_HOST}:${BROKER_PORT}}" \
    PIPELINE_BIN_DIR="$TARGET_DIR/release" \
    "$TARGET_DIR/release/bench" "$@" || rc=$?
# The relay's other source, the write-ahead log, on the phases that tell the two apart, unless
# the caller chose a source or turned it off (BENCH_WAL=0).
wal_rc=0
if ((rc == 0)) && [[ ${BENCH_WAL:-1} != 0 && " $* " != *" --relay-source"* ]]; then
    section "bench --relay-source wal (${BENCH_WAL_PHASES:-idle,relay,latency,relay-cost}, rates ${BENCH_WAL_RATES:-100,1000})"
    wal_out="${BENCH_OUT%.json}-wal.json"
    args=()
    skip=0
    for a in "$@"; do
        if ((skip)); then skip=0; continue; fi
        case $a in
            --out|--phases|--rates) skip=1 ;;
            --out=*|--phases=*|--rates=*) ;;
            *) args+=("$a") ;;
        esac
    done
    env DATABASE_URL="postgres://postgres@${PG_HOST}:${PG_PORT}/postgres?sslmode=disable" \
        KAFKA_BROKERS="${KAFKA_BROKERS:-${BROKER_HOST}:${BROKER_PORT}}" \
        PIPELINE_BIN_DIR="$TARGET_DIR/release" \
        "$TARGET_DIR/release/bench" "${args[@]}" --relay-source wal \
        --phases "${BENCH_WAL_PHASES:-idle,relay,latency,relay-cost}" --rates "${BENCH_WAL_RATES:-100,1000}" \
        --out "$wal_out" || wal_rc=$?
    if ((wal_rc == 0)); then
        section "the relay's sources side by side ($BENCH_OUT, $wal_out)"
        python3 scripts/bench-sources.py "$BENCH_OUT" "$wal_out"
    fi
fi
if ((rc == 0 && wal_rc == 0)); then
    log "benchmark done in $(human_duration $((SECONDS - started)))"
else
    warn "benchmark finished with status $rc/$wal_rc after $(human_duration $((SECONDS - started)))"
    ((rc != 0)) || rc=$wal_rc
fi
exit "$rc"
