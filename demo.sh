#!/usr/bin/env bash
# The demo on a fresh machine: checks for Rust, makes sure cmake is there (pingora's
# zlib-ng build needs it: installed with apt-get as root, else from PyPI into target/tools),
# then builds and runs `mrtr-gateway demo`, passing on any arguments (`--listen`, ...).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/build-deps.sh
need_rust
ensure_cmake "$PWD"
echo "build: cargo run --release -- demo (the first build takes a few minutes)"
exec cargo run --release -- demo "$@"
