#!/usr/bin/env bash
# Runs the workspace's test binaries, several at a time, and its doctests:
#
#   scripts/run-tests.sh [CARGO ARGS...] [-- TEST FILTER AND HARNESS ARGS...]
#
# What `cargo test --release --workspace --no-fail-fast` does, but with TEST_JOBS binaries
# (default 2) running at once instead of one after the other: most tests wait on PostgreSQL, Kafka
# and the binaries they start, and each has a database, topic and consumer groups of its own. It
# builds the tests first (nothing to do after scripts/test.sh's build), runs each binary from its
# package's folder as cargo does, the slowest first (by the last run's times, kept in
# target/test-times.txt, else by tests/test-times.txt, a run's times kept in the repository for a
# fresh clone), prints each binary's output whole when it ends, then a table of the slowest
# binaries. Exits non-zero when a binary failed.
#
# Cargo arguments narrow the binaries (`-p relay`, `--test it`); the harness arguments go to each
# of them (`-- lease::`, `-- --test-threads 4`). The services must be running: scripts/test.sh
# starts them, scripts/dev-test.sh checks them. Environment as for cargo test: DATABASE_URL,
# KAFKA_BROKERS, PIPELINE_BIN_DIR, PROMETHEUS_BIN.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
JOBS="${TEST_JOBS:-2}"
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || die "TEST_JOBS must be a positive number"

cargo_args=()
harness=()
while (($#)); do
    if [[ $1 == -- ]]; then
        shift
        harness=("$@")
        break
    fi
    cargo_args+=("$1")
    shift
done
# The whole workspace unless the arguments name packages.
selection=(--workspace)
for arg in "${cargo_args[@]}"; do
    case $arg in
    -p | --package | --package=* | -p?* | --manifest-path | --manifest-path=*) selection=() ;;
    esac
done

OUT="$RUN_DIR/tests"
rm -rf "$OUT"
mkdir -p "$OUT"
TIMES="$TARGET_DIR/test-times.txt"
KNOWN_TIMES="$REPO_ROOT/tests/test-times.txt"

# Each test binary as "label<TAB>package folder<TAB>executable", from cargo's build messages.
cargo test --release "${selection[@]}" --no-run --message-format=json-render-diagnostics "${cargo_args[@]}" >"$OUT/build.json"
binaries=$(grep '"reason":"compiler-artifact"' "$OUT/build.json" |
    grep -E '"profile":\{[^}]*"test":true' | grep -v '"executable":null' |
    sed -nE 's/.*"manifest_path":"([^"]*)\/Cargo\.toml".*"target":\{"kind":\["([^"]*)"\][^}]*"name":"([^"]*)".*"executable":"([^"]*)".*/\1\t\2\t\3\t\4/p' |
    while IFS=$'\t' read -r dir kind name exe; do
        printf '%s %s %s\t%s\t%s\n' "${dir#"$REPO_ROOT"/}" "$kind" "$name" "$dir" "$exe"
    done)
[[ -n $binaries ]] || die "cargo built no test binary"

# The slowest first: by the last run's seconds (this target folder's, else the repository's);
# binaries without a time before the others when they are integration tests (kind "test"), after
# them otherwise.
previous_time() {
    local label=$1 t='' file
    for file in "$TIMES" "$KNOWN_TIMES"; do
        [[ -z $t && -f $file ]] && t=$(awk -F'\t' -v l="$label" '$2 == l { print $1 }' "$file" | tail -n1)
    done
    if [[ -z $t ]]; then
        if [[ $label == *" test "* ]]; then t=100000; else t=0; fi
    fi
    printf '%s' "$t"
}
mapfile -t queue < <(while IFS=$'\t' read -r label dir exe; do
    printf '%s\t%s\t%s\t%s\n' "$(previous_time "$label")" "$label" "$dir" "$exe"
done <<<"$binaries" | sort -t$'\t' -k1,1nr | cut -f2-)
# The doctests, as one more job (rustdoc compiles each before it runs), unless the arguments pick
# test targets (`--test it`, `--lib`): cargo runs no doctests of a selection like that.
doctests=1
for arg in "${cargo_args[@]}"; do
    case $arg in
    --test | --test=* | --tests | --lib | --bin | --bin=* | --bins | --example | --example=* | --examples) doctests=0 ;;
    esac
done
if ((doctests)); then
    queue+=("doctests"$'\t'"$REPO_ROOT"$'\t'"")
fi

# run_one INDEX LABEL DIR EXE — one binary (or the doctests), its output in $OUT/INDEX.log, its
# exit status and seconds in $OUT/INDEX.status.
run_one() {
    local index=$1 label=$2 dir=$3 exe=$4 started=$SECONDS status=0
    if [[ -n $exe ]]; then
        (cd "$dir" && exec "$exe" "${harness[@]}") >"$OUT/$index.log" 2>&1 </dev/null || status=$?
    else
        cargo test --release "${selection[@]}" --doc "${cargo_args[@]}" -- "${harness[@]}" \
            >"$OUT/$index.log" 2>&1 </dev/null || status=$?
    fi
    printf '%s %s\n' "$status" $((SECONDS - started)) >"$OUT/$index.status.tmp"
    mv "$OUT/$index.status.tmp" "$OUT/$index.status"
}

declare -A running=() labels=() executables=()
failed=()
times_now=()
next=0
# Prints the output of every job that ended, and forgets it.
report_ended() {
    local index status seconds
    for index in "${!running[@]}"; do
        [[ -f $OUT/$index.status ]] || continue
        read -r status seconds <"$OUT/$index.status"
        unset "running[$index]"
        if [[ -n ${executables[$index]} ]]; then
            printf '     Running %s (%s)\n' "${labels[$index]}" "${executables[$index]#"$REPO_ROOT"/}"
        else
            printf '     Running the doctests\n'
        fi
        cat "$OUT/$index.log"
        if ((status != 0)); then
            printf 'test binary %s FAILED with status %s\n' "${labels[$index]}" "$status"
            failed+=("${labels[$index]}")
        fi
        times_now+=("$seconds"$'\t'"${labels[$index]}")
    done
}
started=$SECONDS
while ((next < ${#queue[@]} || ${#running[@]})); do
    while ((next < ${#queue[@]} && ${#running[@]} < JOBS)); do
        IFS=$'\t' read -r label dir exe <<<"${queue[$next]}"
        labels[$next]=$label
        executables[$next]=$exe
        running[$next]=1
        run_one "$next" "$label" "$dir" "$exe" &
        next=$((next + 1))
    done
    wait -n || true
    report_ended
done

# The times, for the next run's order, and the slowest of this one.
# (A filtered run's times are not the binaries' own: they are not kept.)
if ((${#harness[@]} == 0)); then
    {
        printf '%s\n' "${times_now[@]}"
        [[ -f $TIMES ]] && awk -F'\t' 'NR == FNR { seen[$2] = 1; next } !($2 in seen)' \
            <(printf '%s\n' "${times_now[@]}") "$TIMES"
    } >"$TIMES.new" || true
    mv "$TIMES.new" "$TIMES"
fi
echo
log "test binaries: ${#times_now[@]} in $(human_duration $((SECONDS - started))) ($JOBS at a time); the slowest:"
printf '%s\n' "${times_now[@]}" | sort -t$'\t' -k1,1nr | head -n 8 |
    awk -F'\t' '{ printf "  %5ss  %s\n", $1, $2 }' >&2
if ((${#failed[@]})); then
    warn "failed: ${failed[*]}"
    exit 1
fi
