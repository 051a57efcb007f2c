#!/usr/bin/env bash
# Proves the pipeline under failure:
#
#   scripts/verify.sh [--short|--long] [--seed N] [--events N] [--faults N] --report PATH [...]
#
# Runs the real binaries under load in a world of their own (fresh databases, topic, consumer
# groups, and a nisshi broker of its own on durable PostgreSQL storage), injects a seeded
# schedule of faults (relay and consumer kills, crashes at exact points, broker and PostgreSQL
# restarts, rebalances, frozen consumers), then checks that every acknowledged event was applied
# exactly once and in order by each consumer group, and writes a JSON report. Exits non-zero
# unless the checks passed. --short (the default; the test suite runs it) takes a few minutes,
# --long 15 to 30. `target/release/verify --help` lists every flag.
#
# The PostgreSQL restarts stop the machine's shared cluster: run it when nothing else uses the
# server (scripts/test.sh runs it after the cargo tests). A cluster it stopped is always started
# again.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
FAULT_BIN_DIR="$RUN_DIR/fault-bins"

section "PostgreSQL, nisshi, build dependencies"
ensure_postgres
ensure_nisshi
ensure_build_deps

section "cargo build --release --workspace --bins"
cargo build --release --workspace --bins

# The fault-injection build writes target/release/{relay,consumer} with the crash points compiled
# in (inert without PIPELINE_CRASH_AT, but not what the other tools should run): copy them aside,
# then build the normal ones again, also when the fault build fails half-way.
restore_normal_binaries() {
    local status=$?
    trap - EXIT
    log "rebuilding the normal relay and consumer in $TARGET_DIR/release"
    cargo build --release --workspace --bins || status=1
    exit "$status"
}
trap restore_normal_binaries EXIT

section "fault-injection relay and consumer"
cargo build --release -p relay -p consumer --features relay/fault-injection,consumer/fault-injection
mkdir -p "$FAULT_BIN_DIR"
for bin in relay consumer; do
    # Copy, then rename: a copy still running from an earlier run keeps its file.
    cp "$TARGET_DIR/release/$bin" "$FAULT_BIN_DIR/.$bin.new"
    mv -f "$FAULT_BIN_DIR/.$bin.new" "$FAULT_BIN_DIR/$bin"
done
trap - EXIT
cargo build --release --workspace --bins
log "fault-injection binaries in $FAULT_BIN_DIR; normal ones back in $TARGET_DIR/release"

section "verify $*"
exec "$TARGET_DIR/release/verify" \
    --bin-dir "$TARGET_DIR/release" \
    --fault-bin-dir "$FAULT_BIN_DIR" \
    --nisshi "$(command -v nisshi)" \
    --work-dir "$RUN_DIR/verify" \
    "$@"
