#!/usr/bin/env bash
# The whole test suite — the README's test command, and what .ci/run calls.
# Fails loudly on the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

step() { printf '\n== %s\n' "$*" >&2; }

step "setup (apt packages and cargo-nextest if missing)"
scripts/setup.sh --test

step "format"
cargo fmt --all -- --check

step "clippy (-D warnings)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "simulator unit tests and smoke run (exits non-zero on any invariant violation)"
cargo test --locked -q -p allot-statemachine --features sim --bin allot-sim
cargo run --locked -q -p allot-statemachine --features sim --bin allot-sim -- --hours 0.25 --flood 100 >/dev/null
# The many-trace sweep (scripts/sim-sweep.sh) runs outside CI; its script must still parse.
python3 scripts/sim-sweep.py --help >/dev/null

step "doc tests"
cargo test --workspace --locked --doc

step "Python client (pytest against a real 3-node cluster)"
ALLOT_PROFILE=debug "${ALLOT_PYVENV:-$HOME/.cache/allot-pyvenv}/bin/pytest" -q clients/python/tests

# Last, so its summary is the closing line.
step "tests (nextest)"
cargo nextest run --workspace --locked --no-fail-fast
