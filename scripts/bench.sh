#!/usr/bin/env bash
# Benchmarks: the replicated benchmark (3 real nodes on loopback, fsync on), the ledger
# core (apply throughput on one core; memory per account) and the scheduler pass.
# Run on a quiet machine; figures are best-of and median-of repetitions.
#
#   scripts/bench.sh [replicated|ledger|scheduler|sim|backup|all] [-- extra args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
what="${1:-all}"
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
scripts/setup.sh
case "$what" in
  replicated)
    cargo build --release --locked -q -p allot-node --bins
    "$CARGO_TARGET_DIR/release/allot-bench" "$@" ;;
  ledger) cargo bench --locked -p allot-statemachine --bench ledger -- "$@" ;;
  scheduler) cargo bench --locked -p allot-statemachine --bench scheduler -- "$@" ;;
  sim) cargo run --release --locked -q -p allot-statemachine --features sim --bin allot-sim -- "$@" ;;
  backup) scripts/bench-backup.sh "$@" ;;
  all)
    cargo build --release --locked -q -p allot-node --bins
    "$CARGO_TARGET_DIR/release/allot-bench"
    cargo bench --locked -p allot-statemachine --bench ledger
    cargo bench --locked -p allot-statemachine --bench scheduler
    cargo run --release --locked -q -p allot-statemachine --features sim --bin allot-sim ;;
  *) echo "bench.sh: unknown benchmark $what" >&2; exit 2 ;;
esac
