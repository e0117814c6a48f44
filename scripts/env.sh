# Sourced by the scripts: one stable target directory outside the checkout, so repeated
# runs (and CI on the same machine) build incrementally instead of from scratch.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/allot-target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
