#!/usr/bin/env bash
# Proves the pipeline under failure:
#
#   scripts/verify.sh [--short|--long] [--broker nisshi|kafka] [--seed N] [--events N]
#                     [--faults N] --report PATH [...]
#
# Runs the real binaries under load in a world of their own (fresh databases, topic, consumer
# groups, and a broker of its own), injects a seeded schedule of faults (relay and consumer
# kills, crashes at exact points, broker and PostgreSQL restarts, rebalances, frozen consumers),
# then checks that every acknowledged event was applied exactly once and in order by each
# consumer group, and writes a JSON report. Exits non-zero unless the checks passed. --short (the
# default; the test suite runs it) takes a few minutes, --long 15 to 30.
# `target/release/verify --help` lists every flag.
#
# The broker (--broker, or VERIFY_BROKER):
#   nisshi (default)  one nisshi broker on durable PostgreSQL storage; the broker fault kills and
#                     restarts it
#   kafka             a three-node Apache Kafka cluster (KRaft; every node broker and controller
#                     voter; replication factor 3, min.insync.replicas 2, no unclean leader
#                     election) on 127.0.0.1:29092, 29192 and 29292 (--kafka-base-port), its
#                     nodes' data and logs in the run's directory. The broker faults kill the node
#                     leading most partitions of the run's topic and start it again with its data,
#                     and freeze one past its session (SIGSTOP, SIGCONT). Needs Java 17 and
#                     Kafka's jars: fetched like scripts/kafka.sh does (settings: the "Apache
#                     Kafka" section of scripts/lib.sh); the nodes take about 1.3 GiB of memory.
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

# --broker nisshi|kafka (or --broker=...) among the arguments, else VERIFY_BROKER.
broker="${VERIFY_BROKER:-nisshi}"
prev=''
for arg in "$@"; do
    case $arg in
    --broker=*) broker=${arg#--broker=} ;;
    *) [[ $prev == --broker ]] && broker=$arg ;;
    esac
    prev=$arg
done
broker_args=()
case $broker in
nisshi)
    section "PostgreSQL, nisshi, build dependencies"
    ensure_postgres
    ensure_nisshi
    broker_args=(--nisshi "$(command -v nisshi)")
    ;;
kafka)
    section "PostgreSQL, Apache Kafka (three nodes), build dependencies"
    ensure_postgres
    ensure_kafka_java
    kafka_fetch
    log "Apache Kafka $(kafka_version): jars in $(kafka_cache_dir), java: $KAFKA_JAVA_CMD"
    broker_args=(
        --kafka-java "$KAFKA_JAVA_CMD"
        --kafka-jars "$(kafka_cache_dir)"
        --kafka-config-dir "$KAFKA_DIR"
    )
    ;;
*) die "--broker $broker: expected nisshi (the default) or kafka" ;;
esac
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
    "${broker_args[@]}" \
    --work-dir "$RUN_DIR/verify" \
    "$@"
