# What building mrtr-gateway needs beyond Rust: cmake, which pingora's zlib-ng build
# calls. Sourced by ../demo.sh and tests/setup.sh; `ensure_cmake` makes a working cmake
# available, exporting CMAKE (which the cmake crate honours) when it is not the one on
# PATH, and says what it did on one line.

# need_rust: cargo must be there; if not, say how to get it.
need_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "mrtr-gateway needs Rust (cargo): install it from https://rustup.rs, then run this again" >&2
    return 1
  fi
}

# ensure_cmake ROOT: the cmake on PATH if it works; else apt-get's (as root); else one
# installed from PyPI into ROOT/target/tools/cmake (no root needed).
ensure_cmake() {
  local tools="$1/target/tools/cmake"
  if cmake --version >/dev/null 2>&1; then
    return 0
  fi
  if [ -x "$tools/bin/cmake" ] && "$tools/bin/cmake" --version >/dev/null 2>&1; then
    export CMAKE="$tools/bin/cmake"
    echo "build: cmake from $tools"
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "build: cmake is missing; apt-get install cmake"
    if apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake >/dev/null 2>&1 &&
      cmake --version >/dev/null 2>&1; then
      return 0
    fi
  fi
  if command -v python3 >/dev/null 2>&1; then
    echo "build: cmake is missing; installing it from PyPI into $tools"
    if python3 -m venv "$tools" >/dev/null 2>&1 &&
      "$tools/bin/pip" install --quiet --disable-pip-version-check cmake >/dev/null 2>&1 &&
      "$tools/bin/cmake" --version >/dev/null 2>&1; then
      export CMAKE="$tools/bin/cmake"
      return 0
    fi
  fi
  echo "mrtr-gateway's build needs cmake: install it (Debian: apt-get install cmake), then run this again" >&2
  return 1
}
