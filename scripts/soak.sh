#!/usr/bin/env bash
# Long soak runs, outside CI (each prints its figures at the end):
#   scripts/soak.sh fuzz [SECONDS] [SEED]   the hostile-input fuzz harness against a
#                                           secured 3-node cluster (default 1800 s)
# The suite runs the same harness for 15 s (`scripts/test.sh`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
what="${1:-fuzz}"
case "$what" in
  fuzz)
    secs="${2:-1800}"
    seed="${3:-$RANDOM$RANDOM}"
    echo "fuzz soak: ${secs} s, seed ${seed}"
    ALLOT_FUZZ_SECS="$secs" ALLOT_FUZZ_SEED="$seed" cargo nextest run --profile soak \
      -p allot-node --test hostile -E 'test(fuzz_every_service)' --no-capture
    ;;
  *)
    echo "usage: scripts/soak.sh fuzz [SECONDS] [SEED]" >&2
    exit 2
    ;;
esac
