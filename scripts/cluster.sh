#!/usr/bin/env bash
# A local allot cluster on loopback (127.0.0.1 only).
#
#   scripts/cluster.sh up     [--nodes 3] [--shards 4] [--dir DIR] [--port 7101] [-- EXTRA NODE FLAGS]
#   scripts/cluster.sh down   [--dir DIR]
#   scripts/cluster.sh status [--dir DIR]
#
# `up` builds allot-node (release) if needed, starts the nodes in the background (data,
# logs and pids under DIR), initialises every shard, waits until each shard has a leader
# and prints the endpoints. Node i listens on port+i-1 (gRPC) and 9100+i (/metrics).
# The nodes run in INSECURE DEV MODE (--insecure-dev-mode: calls without a token act as
# the identity they claim): a local sandbox. A secured cluster is initialised with
# `allotctl cluster init` (which installs an admin token); see README "Security".
# Peers share a secret generated into DIR/peer-secret (--peer-secret-file): nothing but
# the cluster's own nodes can send them Raft messages.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
source "$here/env.sh"

cmd="${1:-}"
[ $# -gt 0 ] && shift
nodes=3
shards=4
dir="${ALLOT_CLUSTER_DIR:-$root/.cluster}"
port=7101
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --shards) shards="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "cluster.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
profile="${ALLOT_PROFILE:-release}"
bin="$CARGO_TARGET_DIR/$profile/allot-node"

build() {
  if [ "$profile" = release ]; then
    (cd "$root" && cargo build --release --locked -p allot-node --bin allot-node)
  else
    (cd "$root" && cargo build --locked -p allot-node --bin allot-node)
  fi
}

endpoints() {
  [ -f "$dir/endpoints" ] || { echo "cluster.sh: no cluster in $dir" >&2; exit 1; }
  cat "$dir/endpoints"
}

case "$cmd" in
  up)
    build
    mkdir -p "$dir"
    : > "$dir/endpoints"
    # Peers authenticate to each other with a shared secret (kept with the cluster's
    # data), unless the extra flags set up TLS or a secret of their own.
    peer=()
    case " ${extra[*]-} " in
      *" --peer-secret-file "*|*" --tls-cert "*) ;;
      *)
        if [ ! -s "$dir/peer-secret" ]; then
          (umask 077 && head -c 32 /dev/urandom | base64 | tr -d '\n=' > "$dir/peer-secret")
        fi
        peer=(--peer-secret-file "$dir/peer-secret")
        ;;
    esac
    members=()
    for i in $(seq 1 "$nodes"); do
      members+=(--member "$i=127.0.0.1:$((port + i - 1))")
    done
    for i in $(seq 1 "$nodes"); do
      nd="$dir/node-$i"
      mkdir -p "$nd"
      if [ -f "$nd/pid" ] && kill -0 "$(cat "$nd/pid")" 2>/dev/null; then
        echo "node $i already running (pid $(cat "$nd/pid"))"
      else
        nohup "$bin" run --node-id "$i" --listen "127.0.0.1:$((port + i - 1))" \
          --metrics-listen "127.0.0.1:$((9100 + i))" --data-dir "$nd" --shards "$shards" \
          --insecure-dev-mode ${peer[@]+"${peer[@]}"} ${extra[@]+"${extra[@]}"} \
          >>"$nd/node.log" 2>&1 &
        echo $! > "$nd/pid"
      fi
      echo "127.0.0.1:$((port + i - 1))" >> "$dir/endpoints"
    done
    first="127.0.0.1:$port"
    for _ in $(seq 1 100); do
      if "$bin" init --insecure --endpoint "$first" "${members[@]}" >/dev/null 2>&1; then break; fi
      sleep 0.2
    done
    for ep in $(endpoints); do
      ok=0
      for _ in $(seq 1 300); do
        if "$bin" status --endpoint "$ep" --require-leaders >/dev/null 2>&1; then ok=1; break; fi
        sleep 0.2
      done
      [ "$ok" = 1 ] || { echo "cluster.sh: $ep has shards without a leader (see $dir/node-*/node.log)" >&2; exit 1; }
    done
    echo "allot cluster up: $nodes nodes, $shards shards, data in $dir (INSECURE DEV MODE: no tokens)"
    echo "endpoints: $(endpoints | paste -sd, -)"
    echo "metrics:   $(for i in $(seq 1 "$nodes"); do printf 'http://127.0.0.1:%s/metrics ' $((9100 + i)); done)"
    ;;
  down)
    for p in "$dir"/node-*/pid; do
      [ -f "$p" ] || continue
      pid="$(cat "$p")"
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$p"
    done
    echo "allot cluster in $dir stopped (data kept)"
    ;;
  status)
    [ -x "$bin" ] || build
    for ep in $(endpoints); do
      "$bin" status --endpoint "$ep" || echo "$ep: unreachable"
    done
    ;;
  *)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
