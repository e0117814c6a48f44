#!/usr/bin/env bash
# The main job. Today: the ledger core's demo — the seed walk-throughs narrated event by
# event, then a multi-tenant metering workload with live progress, balances, the
# invariant check and the state hash. When the replicated node lands (issue 4) this
# script starts a local 3-node cluster and drives the same workload through it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/setup.sh
echo "building (first run compiles dependencies; later runs are incremental)..." >&2
cargo build --release --locked -q -p allot-statemachine --example demo
exec "$CARGO_TARGET_DIR/release/examples/demo"
