#!/usr/bin/env bash
# Benchmarks: the replicated benchmark (3 real nodes on loopback, fsync on), the same
# side by side with a 3-member etcd (etcd), a sustained run (sustained), the ledger core
# (apply throughput on one core; memory per account) and the scheduler pass.
# Run on a quiet machine; figures are best-of and median-of repetitions.
#
#   scripts/bench.sh [replicated|etcd|sustained|ledger|scheduler|sim|backup|all] [-- extra args]
#
# etcd: installs Debian's etcd-server if `etcd` is missing, then `allot-bench --vs-etcd`
# (clients 1, 64, 256; etcd 256-byte puts, allot 1 and 16 commands per RPC).
# sustained: `allot-bench --rate R --seconds 1800 --window 300` — pass `-- --rate R`
# (half of the peak `replicated` printed) and any other flags.
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
  etcd)
    if ! command -v etcd >/dev/null; then
      echo "bench: installing etcd-server (apt)" >&2
      sudo_cmd=()
      [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
      DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq etcd-server >/dev/null \
        || { "${sudo_cmd[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq etcd-server >/dev/null; }
    fi
    cargo build --release --locked -q -p allot-node --bins
    "$CARGO_TARGET_DIR/release/allot-bench" --vs-etcd "$@" ;;
  sustained)
    cargo build --release --locked -q -p allot-node --bins
    "$CARGO_TARGET_DIR/release/allot-bench" --seconds 1800 --window 300 "$@" ;;
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
