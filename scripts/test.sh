#!/usr/bin/env bash
# The whole test suite — the README's test command, and what .ci/run calls.
# Fails loudly on the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

step() { printf '\n== %s\n' "$*" >&2; }

step "setup (apt packages if missing)"
scripts/setup.sh

step "format"
cargo fmt --all -- --check

step "clippy (-D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "doc tests"
cargo test --workspace --locked --doc

# Last, so its summary is the closing line.
step "tests (nextest)"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
