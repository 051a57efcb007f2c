#!/usr/bin/env bash
# The quick loop: one crate's or one test's tests against the local services, in seconds.
#
#   scripts/dev-test.sh -p relay                       # the relay's tests
#   scripts/dev-test.sh -p relay -- lease::            # one file's
#   scripts/dev-test.sh -p consumer --test it -- retention::a_runner_waits
#   scripts/dev-test.sh -p pipeline-testkit -- end_to_end::   # through the real binaries
#
# Uses PostgreSQL and the Kafka broker when they run (scripts/test.sh leaves PostgreSQL running;
# `scripts/kafka.sh start` starts a broker that stays), starts what is missing and leaves it
# running for the next loop. Builds incrementally only what the selected tests need, plus the
# binaries when the selection runs them (pipeline-testkit, demo-groups, demo-orders, pipeline-load:
# the tests that start the relay, the consumer or the order service), then runs the tests as
# scripts/test.sh does (scripts/run-tests.sh). No clippy, no verification run: scripts/test.sh
# before a change lands.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
(($#)) || die "usage: scripts/dev-test.sh -p PACKAGE [CARGO ARGS...] [-- TEST FILTER...]"

# The packages whose tests start the pipeline's binaries from target/release.
needs_binaries=0
previous=''
for arg in "$@"; do
    [[ $arg == -- ]] && break
    package=''
    case $arg in
    --package=*) package=${arg#--package=} ;;
    -p?*) package=${arg#-p} ;;
    *) [[ $previous == -p || $previous == --package ]] && package=$arg ;;
    esac
    case $package in
    pipeline-testkit | demo-groups | demo-orders | pipeline-load) needs_binaries=1 ;;
    esac
    previous=$arg
done

pg_accepting || ensure_postgres
ensure_broker
# A broker this script started stays up for the next loop (scripts/kafka.sh stop ends it).
BROKER_STARTED=0 KAFKA_STARTED=0

if ((needs_binaries)); then
    cargo build --release --workspace --bins
fi
exec env DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable" \
    KAFKA_BROKERS="$(broker_list)" \
    PIPELINE_BIN_DIR="$TARGET_DIR/release" \
    PROMETHEUS_BIN="$(command -v prometheus || true)" \
    TEST_JOBS="${TEST_JOBS:-2}" \
    scripts/run-tests.sh "$@"
