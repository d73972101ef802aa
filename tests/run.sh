#!/usr/bin/env bash
# The whole test suite: installs what is missing, then format check, clippy
# with warnings as errors, the build, and every test (unit, property, store
# conformance on the embedded store and a real etcd, end-to-end with the real
# binaries, grpcurl and etcd, and the VM lane). Needs root: the end-to-end
# tests build network namespaces (they are #[ignore]d for a plain
# `cargo test`, and run here with --include-ignored). The VM lane runs
# beside clippy. At the end it prints where the time went: each phase, and
# each test binary's own time.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "tests/run.sh: run it as root (sudo ./tests/run.sh): it installs packages and its end-to-end tests build network namespaces" >&2
    exit 1
fi

started=$SECONDS
phases=()
phase() {
    local name=$1 t0=$SECONDS
    shift
    "$@"
    phases+=("$(printf '%5d s  %s' $((SECONDS - t0)) "$name")")
}
log=$(mktemp -t weft-tests.XXXXXX)
vm_pid=
# Ends the VM lane (run in the background, below) if the suite ends first.
end_vm() { if [ -n "$vm_pid" ]; then kill -- -"$vm_pid" 2>/dev/null || true; fi; }
report() {
    local rc=$?
    end_vm
    echo
    echo "tests/run.sh: where the time went ($((SECONDS - started)) s in all):"
    printf '  %s\n' "${phases[@]}"
    # Each test binary's own time, slowest first (cargo test prints it).
    awk '/^ +Running /{name=$2} /^test result:/{match($0, /finished in [0-9.]+s/);
         t = substr($0, RSTART + 12, RLENGTH - 13); if (t + 0 >= 1) printf "  %7.1f s  %s\n", t, name}' "$log" |
        sort -rn
    rm -f "$log"
    exit $rc
}
trap report EXIT

phase "setup (deploy/setup.sh)" deploy/setup.sh
phase "cargo fmt --check" cargo fmt --all -- --check
# The end-to-end tests run the workspace's binaries: build them first.
phase "cargo build" cargo build --workspace --all-targets

# The VM lane (tests/tests/vm.rs: QEMU guests under TCG, one at a time)
# runs beside clippy: the guest is busy for minutes while clippy checks,
# and neither depends on the other's timing (the guest measures its pace
# at boot and stretches its waits by it). The namespace tests, some of
# which bound outages, start only after both.
vm_exe=$(cargo test -p weft-tests --test vm --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "vm":
        print(m["executable"])')
vm_log=$(mktemp -t weft-vm.XXXXXX)
vm_t0=$SECONDS
# Its own process group, so that an early exit ends the guest with it.
setsid "$vm_exe" --include-ignored >"$vm_log" 2>&1 &
vm_pid=$!
phase "cargo clippy -D warnings (the VM lane beside it)" cargo clippy --workspace --all-targets -- -D warnings
vm_rc=0
wait_vm() {
    wait "$vm_pid" || vm_rc=$?
    vm_pid=
    echo "tests/run.sh: the VM lane took $((SECONDS - vm_t0)) s (beside clippy), exit $vm_rc"
}
phase "VM lane, what was left of it after clippy" wait_vm
run_tests() {
    local rc=0
    cargo test --workspace --no-fail-fast -- --include-ignored --skip vm_lane:: 2>&1 | tee "$log" || rc=$?
    # The VM lane's output goes with the rest, in the report too.
    echo "     Running tests/vm.rs (the VM lane, run beside clippy)" | tee -a "$log"
    tee -a "$log" <"$vm_log"
    rm -f "$vm_log"
    if [ "$vm_rc" != 0 ]; then
        echo "tests/run.sh: the VM lane failed (exit $vm_rc; its output is above)" >&2
        rc=1
    fi
    return $rc
}
phase "cargo test" run_tests
