#!/usr/bin/env bash
# Proves the pipeline under failure:
#
#   scripts/verify.sh [--short|--long] [--seed N] [--events N] [--faults N] --report PATH [...]
#
# Runs the real binaries under load in a world of their own (a fresh database, topic and consumer
# groups, and a three-node Apache Kafka cluster of its own), injects a seeded plan of faults,
# then checks that every acknowledged event was applied exactly once and in order by each
# consumer group, that every event marked published is in the topic, and writes a JSON report.
# Exits non-zero unless the checks passed. --short (the default; the test suite runs it) injects
# one fault of each kind and takes about four minutes, --long several of each and about half an
# hour. `target/release/verify --help` lists every flag.
#
# The cluster: three nodes in KRaft combined mode (each a broker and a controller voter;
# replication factor 3, min.insync.replicas 2, no unclean leader election) on 127.0.0.1:29092,
# 29192 and 29292 (--kafka-base-port), configured from deploy/kafka/cluster.properties.in, their
# data and logs in the run's directory. The inventory group runs on one consumer group protocol
# and the notification group on the other (classic, and consumer: KIP-848), swapped with the
# seed's parity; each group has two consumer processes of its own.
#
# The faults: the active relay killed, crashed between its delivery acknowledgement and its mark,
# frozen past its lease; a member of each group killed, crashed between its database commit and
# its offset commit, frozen past its session, joined by a third member for a while; the database
# paths of the active relay and of a member of each group cut; PostgreSQL stopped (-m immediate)
# and started; the Kafka node leading most partitions killed and started again, or frozen past its
# session; the three nodes restarted one after the other (SIGTERM, back in every ISR before the
# next); two nodes killed at once, below min.insync.replicas, while the relay must mark nothing
# published, then started again one after the other.
#
# Needs Java 17 and Kafka's jars: fetched like scripts/kafka.sh does (settings: the "Apache Kafka"
# section of scripts/lib.sh); the nodes take about 1.3 GiB of memory. The PostgreSQL restarts
# stop the machine's shared cluster: run it when nothing else uses the server (scripts/test.sh
# runs it after the cargo tests). A cluster it stopped is always started again.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"

section "PostgreSQL, Apache Kafka (three nodes), build dependencies"
ensure_postgres
ensure_kafka_java
kafka_fetch
log "Apache Kafka $(kafka_version): jars in $(kafka_cache_dir), java: $KAFKA_JAVA_CMD"
ensure_build_deps

# Every binary the run starts, the crash-point relay and consumer (relay-crash-points,
# consumer-crash-points) among them: nothing to do after scripts/test.sh's build.
section "cargo build --release --workspace --bins"
cargo build --release --workspace --bins

section "verify $*"
exec "$TARGET_DIR/release/verify" \
    --bin-dir "$TARGET_DIR/release" \
    --kafka-java "$KAFKA_JAVA_CMD" \
    --kafka-jars "$(kafka_cache_dir)" \
    --kafka-config-dir "$KAFKA_DIR" \
    --kafka-class-archive "$(kafka_class_archive)" \
    --work-dir "$RUN_DIR/verify" \
    "$@"
