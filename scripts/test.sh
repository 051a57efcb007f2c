#!/usr/bin/env bash
# The test command (CI runs it through .ci/run):
#
#   scripts/test.sh [EXTRA CARGO TEST ARGS...]
#
# Brings up PostgreSQL (127.0.0.1:5432, Debian's packages) and Apache Kafka (KRaft, one node on
# 127.0.0.1:9092, its jars from Maven Central; or the cluster KAFKA_BROKERS names), installing
# what is missing (and Prometheus: prometheus, promtool), builds the binaries, runs
# the workspace's tests against them, fuzzes the consumer's record decoding for a minute
# (scripts/fuzz.sh), runs the short verification, checks the monitoring files
# (scripts/check-observability.sh), then clippy and rustfmt. Exits non-zero when any step fails.
# A broker it started is stopped at exit; PostgreSQL is left running. Extra arguments go to
# `cargo test`, e.g. `scripts/test.sh -p relay`.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
FAILED=()
STAGE=start

stage() {
    STAGE=$1
    section "$1"
}

finish() {
    local status=$?
    trap - EXIT INT TERM
    stop_broker
    echo >&2
    if ((status == 0)); then
        log "${_BOLD}all steps passed${_RESET} in $(human_duration "$SECONDS")"
    else
        if ((${#FAILED[@]})); then
            local list
            list=$(printf '%s, ' "${FAILED[@]}")
            log "${_RED}FAILED${_RESET}: ${list%, } (after $(human_duration "$SECONDS"))"
        else
            log "${_RED}FAILED${_RESET} in step $STAGE, status $status (after $(human_duration "$SECONDS"))"
        fi
    fi
    exit "$status"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# step NAME COMMAND... — runs a step, records its failure, and goes on.
step() {
    local name=$1
    shift
    local started=$SECONDS
    if "$@"; then
        log "$name passed ($(human_duration $((SECONDS - started))))"
    else
        local rc=$?
        warn "$name FAILED with status $rc ($(human_duration $((SECONDS - started))))"
        FAILED+=("$name")
    fi
}

stage "[1/9] PostgreSQL"
ensure_postgres

stage "[2/9] Apache Kafka"
ensure_broker # fetches Kafka's jars first (kafka_fetch) unless a broker already listens

stage "[3/9] Prometheus (prometheus, promtool)"
ensure_prometheus # the monitoring checks and the Prometheus end-to-end test need both

stage "[4/9] Toolchain"
cargo --version
rustc --version
missing=()
cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
if ((${#missing[@]})); then
    log "installing rustup components: ${missing[*]}"
    rustup component add "${missing[@]}"
fi

stage "[5/9] cargo build --release --workspace --bins"
# A clean build (CI) keeps no incremental state: on a fresh machine it would only cost disk.
if [[ -n ${CI:-} ]]; then
    export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
fi
ensure_build_deps
cargo build --release --workspace --bins

stage "[6/9] cargo test --release --workspace"
# The outbox library is what a service adds to append events: it must bring no HTTP server or
# client (cargo tree of its normal dependencies).
outbox_has_no_http() {
    local http
    http=$(cargo tree -p outbox -e normal --prefix none | grep -E '^(axum|hyper|reqwest|tower-http|actix-web|warp|ureq) ' || true)
    if [[ -n $http ]]; then
        warn "the outbox library depends on HTTP crates: $http"
        return 1
    fi
    log "the outbox library brings no HTTP server or client"
}
step "outbox dependencies" outbox_has_no_http
step "cargo test" env \
    DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable" \
    KAFKA_BROKERS="$(broker_list)" \
    PIPELINE_BIN_DIR="$TARGET_DIR/release" \
    PROMETHEUS_BIN="$(command -v prometheus)" \
    cargo test --release --workspace "$@"
# The coverage-guided fuzzer over the path from a raw Kafka record to its decision, bounded
# (FUZZ_SECONDS, default 60), after replaying every kept regression input; skipped like the
# verification run when extra cargo test arguments narrow the run.
if (($# == 0)); then
    step "fuzz (raw record to decision)" scripts/fuzz.sh "${FUZZ_SECONDS:-60}"
fi
# Under load and faults (it restarts PostgreSQL, so it runs once the tests are done with it);
# a few minutes, skipped when extra cargo test arguments narrow the run.
if (($# == 0)); then
    step "verify (short)" scripts/verify.sh --short --report "$RUN_DIR/verify-short.json"
fi

stage "[7/9] monitoring: promtool checks, alert unit tests, dashboard queries"
step "observability checks" scripts/check-observability.sh

stage "[8/9] cargo clippy --release --workspace --all-targets -- -D warnings"
step "clippy" cargo clippy --release --workspace --all-targets -- -D warnings

stage "[9/9] cargo fmt --all -- --check, cargo doc --no-deps"
step "rustfmt" cargo fmt --all -- --check
# The libraries' documentation (doctests ran with cargo test): no broken link, no warning.
step "rustdoc" env RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps -p outbox -p consumer -p relay -p payments-example -p pipeline-operator

((${#FAILED[@]} == 0)) || exit 1
