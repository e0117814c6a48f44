#!/usr/bin/env bash
# Installs what building allot needs on a fresh Debian 12 machine, and nothing twice.
# - clang + libclang-dev: bindgen for RocksDB's C++ build (used by allot-node).
# - with --test: cargo-nextest (from crates.io), which runs the suite with the test
#   groups that keep the real-cluster tests one at a time (.config/nextest.toml); and a
#   Python venv for the Python client's tests (python3-venv from apt if `python3 -m venv`
#   does not work), path printed by `scripts/setup.sh --pyvenv`.
# - the Rust toolchain pinned in rust-toolchain.toml must already be present (rustup).
# .proto files are compiled with protox (pure Rust): no system protoc.
set -euo pipefail

need=()
for pkg in clang libclang-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "setup: installing ${need[*]} (apt)" >&2
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
fi

command -v cargo >/dev/null || {
  echo "setup: cargo not found: install the Rust toolchain first (https://rustup.rs), then re-run" >&2
  exit 1
}

if [ "${1:-}" = "--test" ] && ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: installing cargo-nextest (cargo install, a few minutes)" >&2
  cargo install --locked cargo-nextest
fi

# The Python client's venv (its tests run against a real cluster): created once, the
# package reinstalled from clients/python each time (its stubs are generated then).
pyvenv="${ALLOT_PYVENV:-$HOME/.cache/allot-pyvenv}"
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--pyvenv" ]; then
  if [ ! -x "$pyvenv/bin/pip" ]; then
    rm -rf "$pyvenv"
    if ! python3 -m venv "$pyvenv" >/dev/null 2>&1; then
      echo "setup: installing python3-venv (apt)" >&2
      sudo_cmd=()
      [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
      "${sudo_cmd[@]}" apt-get update -qq
      DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq python3-venv python3-pip >/dev/null
      rm -rf "$pyvenv"
      python3 -m venv "$pyvenv"
    fi
  fi
  root="$(cd "$(dirname "$0")/.." && pwd)"
  "$pyvenv/bin/pip" install -q --disable-pip-version-check "$root/clients/python[test]"
fi
