#!/usr/bin/env bash
# Reproduces the fan-out figures in docs/benchmarks.md: a release build, then
# weft-fanout for each agent count and store. Usage: tests/bench-fanout.sh [N ...]
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
cargo build --release --workspace --bins
ulimit -n "$(ulimit -Hn)"
counts=("${@:-1000 10000}")
for n in ${counts[@]}; do
  for store in embedded etcd; do
    ./target/release/weft-fanout --agents "$n" --store "$store"
  done
done
