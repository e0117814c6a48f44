#!/usr/bin/env bash
# Benchmarks. Today: the ledger core (apply throughput on one core; memory per account).
# Run on a quiet machine; the figures are best-of and median-of repetitions.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/setup.sh
cargo bench --locked -p allot-statemachine --bench ledger -- "$@"
