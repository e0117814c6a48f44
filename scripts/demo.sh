#!/usr/bin/env bash
# The main job: a local 3-node allot cluster (4 shards, real processes on 127.0.0.1), a
# simulated GPU fleet run by GPU agents (simulate mode), and a mixed multi-tenant
# workload for about a minute with a live progress view; ends with a summary table and an
# invariant check on every replica, and leaves the cluster running so it can be queried
# (allotctl).
#
#   scripts/demo.sh [--seconds 60] [--ledger]
#
# `--ledger` first narrates the seed's walk-throughs (a job preempted at 60% of its
# hold; a promo bucket expiring mid-run) event by event through the state machine.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
source scripts/env.sh
seconds=60
ledger=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --ledger) ledger=1; shift ;;
    *) echo "demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
scripts/setup.sh
echo "building (the first run compiles RocksDB from source: ~15 minutes on 2 cores; later runs are incremental)..." >&2
cargo build --release --locked -q -p allot-node --bins -p allot-client
if [ "$ledger" = 1 ]; then
  cargo build --release --locked -q -p allot-statemachine --example demo
  "$CARGO_TARGET_DIR/release/examples/demo"
fi
dir="$root/.cluster/demo"
scripts/cluster.sh down --dir "$dir" >/dev/null 2>&1 || true
rm -rf "$dir"
scripts/cluster.sh up --nodes 3 --shards 4 --dir "$dir"
endpoints="$(paste -sd, "$dir/endpoints")"
"$CARGO_TARGET_DIR/release/allot-demo" --endpoints "$endpoints" --shards 4 --seconds "$seconds"
cat <<MSG

The cluster is still running (data in $dir); its GPU agents stopped with the demo.
  export ALLOTCTL_ENDPOINTS=$endpoints
  $CARGO_TARGET_DIR/release/allotctl endpoint status       # leader, term, applied index per node × shard
  $CARGO_TARGET_DIR/release/allotctl queue                 # per tier: queued, oldest wait, running GPUs
  $CARGO_TARGET_DIR/release/allotctl balance --org 1 --project 11
  $CARGO_TARGET_DIR/release/allotctl job list --org 1 --state succeeded
  $CARGO_TARGET_DIR/release/allotctl audit --shard 1 --limit 20
  $CARGO_TARGET_DIR/release/allotctl shard hash --check    # replicas agree
  curl -s http://127.0.0.1:9101/metrics | grep ^allot_   # Prometheus metrics of node 1
  scripts/cluster.sh down --dir $dir            # stop it (SIGTERM; data kept)
MSG
