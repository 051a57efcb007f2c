#!/usr/bin/env bash
# Apache Kafka 4 (KRaft, one node: broker and controller in one JVM) for development:
#
#   scripts/kafka.sh start    fetches the jars when missing, starts the broker on 127.0.0.1:9092
#                             (KAFKA_PORT) and waits until it answers; leaves it running
#   scripts/kafka.sh stop     stops the broker `start` left running ($RUN_DIR/kafka.pid)
#   scripts/kafka.sh status   exit 0 when the broker answers a Metadata request, 3 when not
#   scripts/kafka.sh fetch    only fetches the jars (deploy/kafka/pom.xml) into the cache
#
# Then point the tests at it, e.g. KAFKA_BROKERS=127.0.0.1:9092 cargo test ... The other scripts
# start a broker themselves, or use one already listening on the port (and leave it running).
#
# Settings: those of the "Apache Kafka" section of scripts/lib.sh (KAFKA_PORT,
# KAFKA_CONTROLLER_PORT, KAFKA_CACHE, KAFKA_HEAP_OPTS, KAFKA_LOG_LEVEL, KAFKA_KEEP_DATA, ...) and
# RUN_DIR. KAFKA_BROKERS is ignored here: `start` always means a local broker.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,8s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
    exit 2
}

port="${KAFKA_PORT:-9092}"

case "${1:-}" in
start)
    unset KAFKA_BROKERS
    # A start that fails half-way stops what it started.
    trap 'status=$?; ((status == 0)) || stop_kafka; exit "$status"' EXIT
    ensure_kafka
    trap - EXIT
    if ((KAFKA_STARTED)); then
        log "left running; stop it with scripts/kafka.sh stop. Clients: KAFKA_BROKERS=$BROKER_HOST:$BROKER_PORT"
    fi
    ;;
stop)
    if pid=$(kafka_pid_from_file); then
        log "stopping Apache Kafka (pid $pid)"
        clean=0
        stop_pid kafka "$pid" "${KAFKA_STOP_SECONDS:-30}" && clean=1
        kafka_keep_class_archive "$clean"
        rm -f "$RUN_DIR/kafka.pid"
        log "stopped"
    else
        rm -f "$RUN_DIR/kafka.pid"
        log "no Kafka broker started by scripts/kafka.sh is running"
        if port_open "$BROKER_HOST" "$port"; then
            warn "something else listens on $BROKER_HOST:$port: left alone"
        fi
    fi
    ;;
status)
    if pid=$(kafka_pid_from_file); then
        who="Apache Kafka $(kafka_version) (pid $pid)"
    else
        who="a broker not started by scripts/kafka.sh"
    fi
    if kafka_metadata_ok "$BROKER_HOST" "$port"; then
        log "$BROKER_HOST:$port: $who answers"
        exit 0
    elif [[ -n ${pid:-} ]]; then
        log "Apache Kafka (pid $pid) runs but does not answer on $BROKER_HOST:$port yet (log: $RUN_DIR/kafka.log)"
    else
        log "no Kafka broker answers on $BROKER_HOST:$port"
    fi
    exit 3
    ;;
fetch)
    started=$SECONDS
    kafka_fetch
    log "jars in $(kafka_cache_dir) ($(human_duration $((SECONDS - started))))"
    ;;
*)
    usage
    ;;
esac
