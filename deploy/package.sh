#!/usr/bin/env bash
# Builds weft's Debian packages with cargo-deb (from crates.io, installed by
# `cargo install` when missing), from [package.metadata.deb] in
# controller/Cargo.toml and gateway-agent/Cargo.toml:
#   target/debian/weft-controller_VERSION-1_amd64.deb  weft-controller, weftctl, its unit
#   target/debian/weft-agent_VERSION-1_amd64.deb       weft-gateway-agent, weft-node-agent, their units
# and checks both with lintian where it is installed: any error fails.
#   deploy/package.sh                    release build, then the packages
#   deploy/package.sh --profile dev      package the test build (the suite's real-hosts lane)
#   deploy/package.sh --no-build         package what is built
# Needs no root.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=${2:?--profile takes release or dev}; shift 2 ;;
    --no-build) build=; shift ;;
    *) echo "package: unknown argument $1 (deploy/package.sh [--profile P] [--no-build])" >&2; exit 2 ;;
  esac
done

CARGO_DEB_VERSION=3.8.0
if ! cargo deb --version 2>/dev/null | grep -q "$CARGO_DEB_VERSION"; then
  echo "package: installing cargo-deb $CARGO_DEB_VERSION (cargo install)"
  cargo install --quiet --locked --no-default-features cargo-deb --version "$CARGO_DEB_VERSION"
fi

bins=(-p weft-controller -p weftctl -p weft-gateway-agent -p weft-node-agent)
if [ -n "$build" ]; then
  cargo build --profile "$profile" "${bins[@]}" --bins
fi
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
out=$target/debian
mkdir -p "$out"
# Only this version's packages: `apt install ./weft-agent_*.deb` must match one.
rm -f "$out"/weft-controller_*.deb "$out"/weft-agent_*.deb
# The test build's binaries are large (unoptimized): compress them quickly.
# (cargo-deb warns that it is meant for release builds; the suite packages
# its own build rather than build a second time.)
fast=()
[ "$profile" = release ] || fast=(--fast)
debs=()
for crate in weft-controller weft-gateway-agent; do
  debs+=("$(cargo deb --no-build --profile "$profile" "${fast[@]}" -p "$crate" --output "$out" | tail -1)")
done
printf 'package: %s\n' "${debs[@]}"
if command -v lintian >/dev/null; then
  # Errors fail; warnings are shown.
  lintian --fail-on error "${debs[@]}"
  echo "package: lintian found no errors"
else
  echo "package: lintian is not installed; the packages were not checked (apt-get install lintian)"
fi
