#!/usr/bin/env bash
# Quickstart: installs what is missing, builds weft, starts a site controller
# on the embedded store (no etcd needed) under ./.weft-quickstart/, and talks
# to it with grpcurl and weftctl. The controller keeps running; the script
# ends by printing how to use and stop it.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/setup.sh
cargo build --release --workspace --bins
BIN=$PWD/target/release
DATA=$PWD/.weft-quickstart/site-a
mkdir -p "$DATA"

if [ -f "$DATA/controller.pid" ] && kill -0 "$(cat "$DATA/controller.pid")" 2>/dev/null; then
  echo "quickstart: a controller is already running (pid $(cat "$DATA/controller.pid"))"
else
  "$BIN/weft-controller" --config deploy/examples/site-a.toml --data-dir "$DATA" \
    --listen 127.0.0.1:7443 >"$DATA/controller.log" 2>&1 &
  echo $! >"$DATA/controller.pid"
  for _ in $(seq 100); do [ -S "$DATA/admin.sock" ] && break; sleep 0.1; done
  [ -S "$DATA/admin.sock" ] || { cat "$DATA/controller.log"; exit 1; }
fi

set -x
grpcurl -plaintext -unix "$DATA/admin.sock" list
grpcurl -plaintext -unix "$DATA/admin.sock" weft.v1.AdminService/GetSite
"$BIN/weftctl" --controller "unix:$DATA/admin.sock" node add node-1 || true
"$BIN/weftctl" --controller "unix:$DATA/admin.sock" nodes
"$BIN/weftctl" --controller "unix:$DATA/admin.sock" plan-view --workload-cidr 10.1.0.0/16 --external-cidr 10.70.0.0/16
"$BIN/weftctl" --controller https://127.0.0.1:7443 --ca-file "$DATA/pki/ca.pem" \
  --cert "$DATA/pki/admin.pem" --key "$DATA/pki/admin.key" allocations
set +x
cat <<TXT

weft-controller for site-a is running (pid $(cat "$DATA/controller.pid")), log in $DATA/controller.log.
  export WEFT_CONTROLLER=unix:$DATA/admin.sock
  $BIN/weftctl site
Stop it with:  kill $(cat "$DATA/controller.pid")
TXT
