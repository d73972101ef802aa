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
# The release's commit: its tag, or, in a checkout that has the history but
# not the tags (a branch pushed without --tags), the commit recorded in
# proto/baseline/COMMIT when the release was tagged.
recorded=$(cat proto/baseline/COMMIT 2>/dev/null || true)
have() { git cat-file -e "$1^{commit}" 2>/dev/null; }
if ! have "refs/tags/$tag" && ! { [ -n "$recorded" ] && have "$recorded"; } &&
    git remote get-url origin >/dev/null 2>&1; then
    # A shallow or tagless checkout: ask its origin, if it answers.
    timeout 120 git fetch -q --no-tags origin "+refs/tags/$tag:refs/tags/$tag" 2>/dev/null ||
        { [ -n "$recorded" ] && timeout 120 git fetch -q --no-tags origin "$recorded" 2>/dev/null; } || true
fi
if rev=$(git rev-parse -q --verify "refs/tags/$tag^{commit}"); then
    :
elif [ -n "$recorded" ] && have "$recorded"; then
    rev=$recorded
    echo "tests/prev-release.sh: no tag $tag here; building its commit $rev (proto/baseline/COMMIT)" >&2
else
    shallow=$(git rev-parse --is-shallow-repository 2>/dev/null || echo unknown)
    echo "tests/prev-release.sh: this checkout has neither the tag $tag (the last release) nor its commit ${recorded:-(proto/baseline/COMMIT is missing)} (shallow: $shallow); fetch them: git fetch --tags (or git fetch --unshallow)" >&2
    exit 1
fi
if ! git show "$rev:Cargo.toml" | grep -q "^version = \"$version\""; then
    echo "tests/prev-release.sh: commit $rev is not release $version (its Cargo.toml has another version); fix proto/baseline/COMMIT" >&2
    exit 1
fi
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
out=$target/prev-release
rm -rf "$out"
mkdir -p "$out/src" "$out/bin" "$out/ours"
git archive "$rev" | tar -x -C "$out/src"

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
