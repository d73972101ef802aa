#!/usr/bin/env bash
# Builds the previous release's binaries from its git tag, for the upgrade
# lane (tests/e2e/upgrade.rs): the release proto/baseline/VERSION names,
# into <target>/prev-release/bin with a VERSION file, and prints that
# directory last. It builds in this workspace's target directory, so the
# dependencies both releases share are built once; the release's binaries
# land where this workspace's do, so ours are kept aside and put back.
# tests/run.sh runs it once per run (nothing is kept between runs).
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(cat proto/baseline/VERSION)
tag=v$version
if ! git rev-parse -q --verify "refs/tags/$tag^{commit}" >/dev/null; then
    echo "tests/prev-release.sh: this clone has no tag $tag (the last release); fetch it: git fetch --tags" >&2
    exit 1
fi
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
out=$target/prev-release
rm -rf "$out"
mkdir -p "$out/src" "$out/bin" "$out/ours"
git archive "$tag" | tar -x -C "$out/src"

bins=(weft-controller weftctl weft-node-agent weft-gateway-agent)
for b in "${bins[@]}"; do
    if [ -f "$target/debug/$b" ]; then mv "$target/debug/$b" "$out/ours/"; fi
done
put_back() {
    for b in "${bins[@]}"; do
        if [ -f "$out/ours/$b" ]; then mv -f "$out/ours/$b" "$target/debug/$b"; fi
    done
}
trap put_back EXIT
(cd "$out/src" && CARGO_TARGET_DIR=$target cargo build --locked --bins \
    -p weft-controller -p weftctl -p weft-node-agent -p weft-gateway-agent)
for b in "${bins[@]}"; do mv "$target/debug/$b" "$out/bin/"; done
echo "$version" >"$out/bin/VERSION"
rm -rf "$out/src"
echo "$out/bin"
