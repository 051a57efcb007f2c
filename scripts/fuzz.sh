#!/usr/bin/env bash
# Coverage-guided fuzzing of the consumer's path from a raw Kafka record to its decision
# (consumer/fuzz, target record_decision), for a bounded time:
#
#   scripts/fuzz.sh [SECONDS]        (default 60; FUZZ_SECONDS too)
#
# Installs cargo-fuzz (crates.io) when missing and builds with the nightly toolchain when one is
# installed, else with the stable one (RUSTC_BOOTSTRAP=1: cargo fuzz needs nightly flags). The
# corpus grows in consumer/fuzz/corpus (git-ignored). A crash stops the run with a non-zero
# status and leaves its input in consumer/fuzz/artifacts/record_decision/: replay it with
# `cargo fuzz run record_decision --features libfuzzer <file>` and keep it in
# consumer/fuzz/regressions/record_decision/, which the test command's tests replay
# (`cargo test --release -p consumer-fuzz` alone).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT/consumer/fuzz"

seconds="${1:-${FUZZ_SECONDS:-60}}"
[[ $seconds =~ ^[0-9]+$ ]] || die "usage: scripts/fuzz.sh [SECONDS]"

if ! cargo fuzz --version >/dev/null 2>&1; then
    log "cargo-fuzz not found: cargo install --locked cargo-fuzz"
    cargo install --locked cargo-fuzz
fi
toolchain=()
if rustup run nightly rustc --version >/dev/null 2>&1; then
    toolchain=(+nightly)
else
    log "no nightly toolchain: building with the stable one (RUSTC_BOOTSTRAP=1)"
    export RUSTC_BOOTSTRAP=1
fi

# The Rust code is safe (unsafe_code is forbidden), so the fuzzer runs without a sanitizer: the
# C libraries it links (librdkafka) are built as usual, and the run looks for panics and
# failed assertions.
fuzz=(cargo "${toolchain[@]}" fuzz run record_decision --features libfuzzer --sanitizer none --release)
mkdir -p corpus/record_decision
log "regressions: every input in regressions/record_decision"
"${fuzz[@]}" regressions/record_decision -- -runs=0
log "fuzzing record_decision for ${seconds}s"
"${fuzz[@]}" corpus/record_decision regressions/record_decision -- \
    -max_total_time="$seconds" -max_len=4096 -print_final_stats=1
