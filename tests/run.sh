#!/usr/bin/env bash
# Runs every test of mrtr-gateway on a fresh machine: installs what is missing (cmake,
# the pinned npm and PyPI fixtures, Node 22), checks formatting and lints, then runs the
# unit tests, the integration tests against real MCP servers and clients, the conformance
# suite through the gateway, the benchmarks at smoke scale (the macro harness under cargo
# test), the deployment manifests and dashboard checks, the micro benchmarks with a short
# measurement, the README's demo command from a fresh clone, and the fuzz targets.
set -euo pipefail
cd "$(dirname "$0")/.."

bash tests/setup.sh
# The build's cmake: the system's, or the one setup installed (exported as CMAKE).
. scripts/build-deps.sh
ensure_cmake "$PWD"
echo "== cargo fmt --check"
cargo fmt --all -- --check
cargo fmt --all --manifest-path tests/fixtures/rmcp/Cargo.toml -- --check
cargo fmt --all --manifest-path fuzz/Cargo.toml -- --check
echo "== cargo clippy -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
echo "== cargo test"
cargo test --all-targets -- --nocapture 2>&1 | tee target/test-output.txt
echo "== deploy: manifests against the Kubernetes schemas, their configs, dashboard JSON"
MRTR_GATEWAY_BIN=target/debug/mrtr-gateway bash deploy/validate.sh
echo "== micro benchmarks, release, short measurement (full runs: benches/RESULTS.md)"
cargo bench --bench core -- --warm-up-time 0.2 --measurement-time 0.5
echo "== demo: ./demo.sh from a fresh clone with no cmake and no apt-get, and its walkthrough"
bash tests/demo_fresh.sh
echo "== fuzz (bounded: FUZZ_SECONDS per target, default 45, as many at once as cores)"
bash tests/fuzz.sh
