#!/usr/bin/env bash
# The backup benchmark (issue 23): a one-node cluster whose shard holds N accounts
# (default 1,000,000; built by statemachine/examples/big_backup.rs from real entries,
# with their audit rows) is restored from a generated backup, started, and backed up
# with `allotctl backup create`; then the copy is verified offline and restored again.
# Prints the time and peak RSS of each step, and the node's peak RSS during the backup
# (its high-water mark reset just before, via /proc/PID/clear_refs).
#
#   scripts/bench.sh backup [-- --accounts N --port P --dir D]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
accounts=1000000 port=7391 dir=$(mktemp -d /tmp/allot-bench-backup-XXXX)
while [ $# -gt 0 ]; do
  case "$1" in
    --accounts) accounts=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) echo "usage: scripts/bench.sh backup [-- --accounts N --port P --dir D]" >&2; exit 2 ;;
  esac
done
cargo build --locked -q -p allot-node -p allot-client --bins
cargo build --locked -q -p allot-statemachine --example big_backup
bin=$CARGO_TARGET_DIR/debug
node_pid=
trap '[ -n "$node_pid" ] && kill "$node_pid" 2>/dev/null; wait 2>/dev/null; true' EXIT
timed() { # label, command...: prints "label: S s, peak RSS M MiB"
  local label=$1; shift
  /usr/bin/time -f "%e %M" -o "$dir/time" "$@" > "$dir/out" 2>&1 || { cat "$dir/out"; exit 1; }
  read -r s kb < "$dir/time"
  printf '%-34s %7s s   peak RSS %6d MiB\n' "$label" "$s" $((kb / 1024))
}
timed "generate ($accounts accounts)" "$bin/examples/big_backup" --accounts "$accounts" \
  --member "1=127.0.0.1:$port" --out "$dir/set/shard-0.allot-backup"
timed "allot-node restore" "$bin/allot-node" restore --node-id 1 --data-dir "$dir/node" --backup "$dir/set"
"$bin/allot-node" run --node-id 1 --listen "127.0.0.1:$port" --data-dir "$dir/node" --shards 1 \
  --insecure-dev-mode > "$dir/node.log" 2>&1 &
node_pid=$!
for _ in $(seq 1 240); do
  "$bin/allotctl" --endpoints "127.0.0.1:$port" endpoint status -o json 2>/dev/null | grep -q '"leader": *1' && break
  sleep 0.5
done
echo 5 > "/proc/$node_pid/clear_refs"
before=$(awk '/VmRSS/{print $2}' "/proc/$node_pid/status")
timed "allotctl backup create" "$bin/allotctl" --endpoints "127.0.0.1:$port" backup create --out "$dir/copy"
peak=$(awk '/VmHWM/{print $2}' "/proc/$node_pid/status")
printf '%-34s %7s     resting %6d MiB, peak %d MiB during the backup\n' "node" "" $((before / 1024)) $((peak / 1024))
kill "$node_pid"; wait "$node_pid" 2>/dev/null || true; node_pid=
echo "backup file: $(stat -c %s "$dir/copy/shard-0.allot-backup") bytes"
timed "allotctl backup verify" "$bin/allotctl" backup verify "$dir/copy/shard-0.allot-backup"
timed "allot-node restore (the copy)" "$bin/allot-node" restore --node-id 1 --data-dir "$dir/again" --backup "$dir/copy"
rm -rf "$dir"
