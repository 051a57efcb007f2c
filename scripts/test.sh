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
# cargo test's whole output, kept so the end of the run can repeat what failed.
TEST_LOG="$RUN_DIR/cargo-test.log"
: >"$TEST_LOG"
# The short verification's output, kept so the end of the run can repeat why it failed.
VERIFY_LOG="$RUN_DIR/verify-short.log"
: >"$VERIFY_LOG"

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
        repeat_test_failures
        repeat_verify_failure
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
# Each failed test's name and output, from cargo test's log: the last lines of a long run are
# the ones a reader sees first.
repeat_test_failures() {
    [[ -s $TEST_LOG ]] || return 0
    grep -qE '^test .* \.\.\. FAILED$|^error: test failed' "$TEST_LOG" || return 0
    echo >&2
    warn "failed tests (the whole output: $TEST_LOG):"
    awk '
        /^     Running / { binary = $2 }
        / \.\.\. FAILED$/ { print "  " binary ": " $2 }
    ' "$TEST_LOG" >&2
    # Each failure'"'"'s captured output, at most 40 lines a test.
    awk '
        /^---- .* stdout ----$/ { shown = 0; printing = 1 }
        /^failures:$/ && printing { printing = 0 }
        /^test result: / { printing = 0 }
        printing && shown < 40 { print; shown++ }
    ' "$TEST_LOG" >&2
    grep -E '^error: test failed|^error: [0-9]+ targets? failed' "$TEST_LOG" >&2 || true
}
# The short verification's seed, errors and verdict, when it did not pass.
repeat_verify_failure() {
    [[ -s $VERIFY_LOG ]] || return 0
    grep -qE '^  result +PASSED$' "$VERIFY_LOG" && return 0
    echo >&2
    warn "the short verification did not pass (the whole output: $VERIFY_LOG):"
    grep -E '^  (seed|error|unplanned exit|result) |^  [a-z ,]*(lost|duplicate|reorder)' "$VERIFY_LOG" >&2 ||
        tail -n 20 "$VERIFY_LOG" >&2
    # What the faults did, and why the processes that exited unasked last said they stopped.
    grep -E '^\[verify [0-9:]+\] fault [0-9]+: ' "$VERIFY_LOG" | cut -c1-300 >&2 || true
    local logs label
    logs=$(sed -nE 's/.* logs in (.*)$/\1/p' "$VERIFY_LOG" | head -n1)
    for label in $(sed -nE 's/^  unplanned exit +([^ ]+) .*/\1/p' "$VERIFY_LOG"); do
        [[ -f $logs/$label.log ]] || continue
        echo "  -- $label: its last errors (the whole log: $logs/$label.log)" >&2
        grep -E ' (ERROR|WARN) |^Error|^Caused by|^ +[0-9]+: ' "$logs/$label.log" | tail -n 12 | cut -c1-300 >&2 || true
    done
    # PostgreSQL's own account of its restarts (crash recovery), from the server log.
    local pg_log
    pg_log=$(ls /var/log/postgresql/postgresql-*.log 2>/dev/null | head -n1)
    if [[ -n $pg_log ]]; then
        echo "  -- PostgreSQL's restarts ($pg_log):" >&2
        grep -E 'interrupted|redo (starts|done)|syncing data directory|ready to accept|did not start' "$pg_log" | tail -n 12 | cut -c1-200 >&2 || true
    fi
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

stage "[4/9] Toolchain (and the browser tests' chromium and npm packages)"
cargo --version
rustc --version
missing=()
cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
if ((${#missing[@]})); then
    log "installing rustup components: ${missing[*]}"
    rustup component add "${missing[@]}"
fi
# The web console's browser tests (tests/kit/tests/it/console.rs runs tests/console with node):
# Debian's chromium, and playwright-core from tests/console's lockfile (it downloads no browser).
ensure_chromium
if ! have npm; then
    log "installing Node.js and npm (the web console's browser tests)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
(cd tests/console && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)

stage "[5/9] cargo build --release --workspace --bins"
# A clean build (CI) keeps no incremental state: on a fresh machine it would only cost disk.
if [[ -n ${CI:-} ]]; then
    export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
fi
ensure_build_deps
cargo build --release --workspace --bins

stage "[6/9] cargo test --release --workspace"
# The libraries a service adds carry no demonstration and no command line: the outbox brings no
# HTTP server or client; the relay and the consumer runtime no clap or csv anywhere in their
# dependencies and no sha2 of their own (sqlx uses it for authentication), and their HTTP server
# is only their own operations endpoint. cargo tree of their normal dependencies, with default
# features.
library_lacks() {
    local package=$1 depth=$2 pattern=$3 found
    found=$(cargo tree -p "$package" -e normal --prefix none ${depth:+--depth "$depth"} |
        grep -E "^($pattern) " | cut -d' ' -f1 | sort -u || true)
    if [[ -n $found ]]; then
        warn "the $package library depends on: $(echo "$found" | tr '\n' ' ')"
        return 1
    fi
    log "the $package library depends on none of: ${pattern//|/, }${depth:+ (directly)}"
}
library_dependencies() {
    local status=0 package
    library_lacks outbox "" 'axum|hyper|reqwest|tower-http|actix-web|warp|ureq' || status=1
    for package in pipeline-core relay consumer; do
        library_lacks "$package" "" 'clap|csv|reqwest|demo-events|demo-orders|demo-groups' || status=1
        library_lacks "$package" 1 'sha2' || status=1
    done
    return $status
}
step "library dependencies" library_dependencies
# --no-fail-fast: every test binary runs, so one failure does not hide another.
cargo_test() {
    env DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable" \
        KAFKA_BROKERS="$(broker_list)" \
        PIPELINE_BIN_DIR="$TARGET_DIR/release" \
        PROMETHEUS_BIN="$(command -v prometheus)" \
        cargo test --release --workspace --no-fail-fast "$@" 2>&1 | tee "$TEST_LOG"
}
step "cargo test" cargo_test "$@"
# The coverage-guided fuzzer over the path from a raw Kafka record to its decision, bounded
# (FUZZ_SECONDS, default 60), after replaying every kept regression input; skipped like the
# verification run when extra cargo test arguments narrow the run.
if (($# == 0)); then
    step "fuzz (raw record to decision)" scripts/fuzz.sh "${FUZZ_SECONDS:-60}"
fi
# Under load and faults (it restarts PostgreSQL, so it runs once the tests are done with it);
# a few minutes, skipped when extra cargo test arguments narrow the run.
if (($# == 0)); then
    verify_short() {
        scripts/verify.sh --short --report "$RUN_DIR/verify-short.json" 2>&1 | tee "$VERIFY_LOG"
    }
    step "verify (short)" verify_short
fi

stage "[7/9] monitoring: promtool checks, alert unit tests, dashboard queries"
step "observability checks" scripts/check-observability.sh

stage "[8/9] cargo clippy --release --workspace --all-targets -- -D warnings"
step "clippy" cargo clippy --release --workspace --all-targets -- -D warnings

stage "[9/9] cargo fmt --all -- --check, cargo doc --no-deps"
step "rustfmt" cargo fmt --all -- --check
# The libraries' documentation (doctests ran with cargo test): no broken link, no warning.
step "rustdoc" env RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps -p pipeline-core -p outbox -p consumer -p relay -p payments-example -p pipeline-operator

((${#FAILED[@]} == 0)) || exit 1
