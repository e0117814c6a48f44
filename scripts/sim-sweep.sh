#!/usr/bin/env bash
# Issue 25's targets over 24 traces (6 seeds × 4 load shapes) instead of the four
# canonical ones, with Fair, Fifo and StrictPriority on each (docs/DESIGN.md §24,
# "Many traces"). Deterministic; outside CI (~3 min on 2 cores).
#   scripts/sim-sweep.sh [--seeds 1-6] [--jobs 2] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --release --locked -q -p allot-statemachine --features sim --bin allot-sim
exec python3 scripts/sim-sweep.py --sim "$CARGO_TARGET_DIR/release/allot-sim" "$@"
