#!/usr/bin/env bash
# The whole test suite: installs what is missing, then format check, clippy
# with warnings as errors, the build, and every test (unit, property, store
# conformance on the embedded store and a real etcd, end-to-end with the real
# binaries, grpcurl and etcd). Under CI=true a test that cannot run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The end-to-end tests run the workspace's binaries: build them first.
cargo build --workspace --all-targets
cargo test --workspace --no-fail-fast
