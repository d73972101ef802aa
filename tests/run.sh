#!/usr/bin/env bash
# The whole test suite: installs what is missing, then format check, clippy
# with warnings as errors, the build, and every test (unit, property, store
# conformance on the embedded store and a real etcd, end-to-end with the real
# binaries, grpcurl and etcd). Needs root: the end-to-end tests build
# network namespaces (they are #[ignore]d for a plain `cargo test`, and run
# here with --include-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "tests/run.sh: run it as root (sudo ./tests/run.sh): it installs packages and its end-to-end tests build network namespaces" >&2
    exit 1
fi

deploy/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The end-to-end tests run the workspace's binaries: build them first.
cargo build --workspace --all-targets
cargo test --workspace --no-fail-fast -- --include-ignored
