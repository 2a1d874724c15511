#!/usr/bin/env bash
# Fuzzes the code that reads untrusted input (the SSE parser, the token opener, the
# JSON-RPC classifier and validation, the MRTR translator, an upstream's HTTP response
# read as the exchange reads it: status line, headers, 1xx, framing, SSE; and sequences
# of events driving a bridged call's state machine, with its invariants) with
# cargo-fuzz / libFuzzer, each target for a bounded time (FUZZ_SECONDS, default 45)
# starting from the seeds checked in under fuzz/seeds, as many at once as there are
# cores. Fails when a target crashes, leaving the reproducer in fuzz/artifacts. Longer
# runs: FUZZ_SECONDS=3600 bash tests/fuzz.sh, or
# cargo +nightly fuzz run --dev TARGET fuzz/corpus/TARGET. The targets build in the dev
# profile at opt-level 1 (fuzz/Cargo.toml), with debug assertions and overflow checks:
# 12 minutes on 2 cores where a release build takes 17, for about nine tenths of its
# inputs a second; two at once, 45 s give each target about as many inputs as 30 s alone
# in a release build did.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-45}
cargo_fuzz_version=0.13.1

if ! cargo fuzz --version 2>/dev/null | grep -q " $cargo_fuzz_version"; then
  echo "fuzz: cargo install cargo-fuzz $cargo_fuzz_version"
  cargo install cargo-fuzz --locked --version "$cargo_fuzz_version" --quiet
fi
# libFuzzer's instrumentation needs unstable compiler flags: use nightly when installed,
# else let the stable compiler accept them.
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  fuzz() { cargo +nightly fuzz "$@"; }
  echo "fuzz: toolchain nightly"
else
  fuzz() { RUSTC_BOOTSTRAP=1 cargo fuzz "$@"; }
  echo "fuzz: toolchain stable (RUSTC_BOOTSTRAP=1)"
fi

fuzz build --dev

# One target: its seeds, then FUZZ_SECONDS of fuzzing on one core.
fuzz_one() {
  local target=$1 corpus=fuzz/corpus/$1 log=fuzz/$1.log runs
  mkdir -p "$corpus"
  cp fuzz/seeds/"$target"/* "$corpus"/
  if ! fuzz run --dev "$target" "$corpus" -- -max_total_time="$seconds" \
    -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz: $target FAILED; the reproducer is in fuzz/artifacts/$target" >&2
    return 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  echo "fuzz: $target ok: $runs inputs in ${seconds} s, corpus $(ls "$corpus" | wc -l) files"
}

# As many targets at once as there are cores (each fuzzes on one).
at_once=$(nproc)
running=0
failed=0
for target in $(fuzz list); do
  if [ "$running" -ge "$at_once" ]; then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$target" &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
  wait -n || failed=1
  running=$((running - 1))
done
exit "$failed"
