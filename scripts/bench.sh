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
started=$SECONDS
rc=0
env DATABASE_URL="postgres://postgres@${PG_HOST}:${PG_PORT}/postgres?sslmode=disable" \
    KAFKA_BROKERS="${KAFKA_BROKERS:-${BROKER_HOST}:${BROKER_PORT}}" \
    PIPELINE_BIN_DIR="$TARGET_DIR/release" \
    "$TARGET_DIR/release/bench" "$@" || rc=$?
if ((rc == 0)); then
    log "benchmark done in $(human_duration $((SECONDS - started)))"
else
    warn "benchmark finished with status $rc after $(human_duration $((SECONDS - started)))"
fi
exit "$rc"
