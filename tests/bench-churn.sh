#!/usr/bin/env bash
# Reproduces the churn figures in docs/benchmarks.md: a release build, then
# weft-churn for each store — 1,000 connected simulated agents (heartbeats at
# the default 15 s agent TTL) while nodes join and leave at 10/s: a warm-up,
# then the measured churn; memory, descriptors and the embedded store's file
# and cache sampled. The warm-up is 600 s: at this rate the embedded store's
# cache reaches its 8 MiB bound only after some 550 s (measured: 6.7 MiB
# at 300 s, 7.9 MiB at 600 s), and a bounded cache filling is not a leak.
# Usage: tests/bench-churn.sh [MEASURED [WARMUP]]   (default 300s 600s)
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
cargo build --release --workspace --bins
ulimit -n "$(ulimit -Hn)"
for store in embedded etcd; do
  ./target/release/weft-churn --agents 1000 --duration "${1:-300s}" --warmup "${2:-600s}" --rate 10 --store "$store"
done
