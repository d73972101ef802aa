#!/usr/bin/env bash
# The whole test suite: installs what is missing, then format check, clippy
# with warnings as errors, the build, and every test (unit, property, store
# conformance on the embedded store and a real etcd, end-to-end with the real
# binaries, grpcurl and etcd). Tests that need root are #[ignore]d: run as
# root, this runs them too; otherwise it says how many were not run (and
# under CI=true, fails: CI runs everything).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The end-to-end tests run the workspace's binaries: build them first.
cargo build --workspace --all-targets
if [ "$(id -u)" = 0 ]; then
    cargo test --workspace --no-fail-fast -- --include-ignored
else
    if [ "${CI:-}" = true ]; then
        echo "tests/run.sh: CI must run as root: the end-to-end tests build network namespaces" >&2
        exit 1
    fi
    cargo test --workspace --no-fail-fast
    echo "NOT RUN: the tests that need root (listed above as ignored); run tests/run.sh as root to run them" >&2
fi
