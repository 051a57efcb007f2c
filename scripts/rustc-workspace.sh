#!/usr/bin/env bash
# The workspace's rustc wrapper (.cargo/config.toml: build.rustc-workspace-wrapper), which cargo
# runs as `rustc-workspace.sh RUSTC ARGS...` for the workspace's own crates:
#
# A test target (rustc --test: a crate's unit tests, an integration-test binary) is compiled
# without optimisation (opt-level 0) instead of at the profile's level. The tests call into the
# libraries and start the binaries, which keep the profile's settings (they are compiled without
# --test), so what the tests exercise is what ships; the test code itself, mostly waiting on
# PostgreSQL, Kafka and those binaries, builds in a fifth of the time. Every other compilation
# is rustc's, unchanged. TEST_OPT_LEVEL sets another level for the test targets.
set -euo pipefail
rustc=$1
shift
for arg in "$@"; do
    if [[ $arg == --test ]]; then
        args=()
        for a in "$@"; do
            [[ $a == opt-level=* ]] && a=opt-level=${TEST_OPT_LEVEL:-0}
            args+=("$a")
        done
        exec "$rustc" "${args[@]}"
    fi
done
exec "$rustc" "$@"
