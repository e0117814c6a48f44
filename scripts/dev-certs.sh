#!/usr/bin/env bash
# Writes a development CA and a node certificate for a local TLS cluster (loopback):
#   scripts/dev-certs.sh [DIR]          (default DIR: .cluster/certs)
# Then start nodes with --tls-cert DIR/node.pem --tls-key DIR/node-key.pem --tls-ca DIR/ca.pem
# (e.g. `scripts/cluster.sh up -- --tls-cert ...`) and clients with --tls-ca DIR/ca.pem.
# For development and tests only: the CA key is left next to the certificates.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
source "$here/env.sh"
out="${1:-$root/.cluster/certs}"
(cd "$root" && cargo build --locked -q -p allot-node --bin allot-node)
"$CARGO_TARGET_DIR/debug/allot-node" dev-certs --out "$out" --host 127.0.0.1 --host localhost
