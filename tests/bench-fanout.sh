#!/usr/bin/env bash
# Reproduces the fan-out figures in docs/benchmarks.md: a release build, then
# weft-fanout for each agent count and store. Usage: tests/bench-fanout.sh [N ...]
# With REPLICAS=K (K > 1): K controller replicas on one etcd, the agents in
# worker processes, a replica killed and started again
# (REPLICAS=3 tests/bench-fanout.sh 50000).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh --tests  # etcd too
cargo build --release --workspace --bins
ulimit -n "$(ulimit -Hn)"
counts=("${@:-1000 10000}")
replicas="${REPLICAS:-1}"
for n in ${counts[@]}; do
  if [ "$replicas" -gt 1 ]; then
    ./target/release/weft-fanout --agents "$n" --replicas "$replicas" --store etcd
    continue
  fi
  for store in embedded etcd; do
    ./target/release/weft-fanout --agents "$n" --store "$store"
  done
done
