#!/usr/bin/env bash
# The README's first command, `./demo.sh`, from a fresh clone on a machine where cmake is
# missing and apt-get cannot install it (a user without root): the script must provide
# cmake itself, build, and serve the demo, and the walkthrough it prints must work when
# pasted into a shell. cmake and apt-get are masked by failing stand-ins first on PATH.
# The build shares this checkout's target directory (CARGO_TARGET_DIR) to save time, but
# libz-ng-sys, the crate whose build runs cmake, is cleaned first so it is built again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

git clone -q "$root" "$work/clone"
mkdir "$work/masked"
for tool in cmake apt-get; do
  printf '#!/bin/sh\necho "%s: command not found" >&2\nexit 127\n' "$tool" >"$work/masked/$tool"
  chmod +x "$work/masked/$tool"
done
export CARGO_TARGET_DIR="$root/target"
cargo clean --quiet --release -p libz-ng-sys --manifest-path "$root/Cargo.toml"

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
listen=127.0.0.1:$(port)
admin=127.0.0.1:$(port)
demo=127.0.0.1:$(port)
PATH="$work/masked:$PATH" "$work/clone/demo.sh" --listen "$listen" --admin-listen "$admin" \
  --demo-listen "$demo" >"$work/demo.log" 2>&1 &
pid=$!

# Bounded wait for the build and the listener: 20 minutes at most.
ready=
for _ in $(seq 1 1200); do
  if curl -fsS -o /dev/null "http://$admin/readyz" 2>/dev/null; then
    ready=1
    break
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    break
  fi
  sleep 1
done
if [ -z "$ready" ]; then
  echo "demo_fresh: the demo did not come up; its output:" >&2
  tail -40 "$work/demo.log" >&2
  exit 1
fi
grep -q "cmake is missing; installing it from PyPI" "$work/demo.log" || {
  echo "demo_fresh: demo.sh did not provide cmake itself" >&2
  exit 1
}
# The walkthrough, as a newcomer pastes it: part 1 (MRTR) must end with the trip.
sed -n '/^GW=/,$p' "$work/demo.log" | sed '/^# Part 2/,$d' >"$work/walkthrough.sh"
out=$(bash "$work/walkthrough.sh")
if ! grep -q "Trip to Lisbon for 3 nights" <<<"$out"; then
  echo "demo_fresh: the walkthrough did not complete; it printed:" >&2
  echo "$out" >&2
  exit 1
fi
echo "demo_fresh: ./demo.sh built with cmake it installed itself, served the demo, and its walkthrough completed"
