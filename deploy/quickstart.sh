#!/usr/bin/env bash
# Quickstart: installs what is missing, builds weft, and brings up two sites'
# controllers on this machine (embedded stores, under ./.weft-quickstart/),
# both using the workload CIDR 10.1.0.0/16. It peers them from a token and
# shows how each site sees the other: the overlapping CIDR is remapped to a
# local view on both sides.
#   deploy/quickstart.sh        start (or show, when already running)
#   deploy/quickstart.sh down   stop both controllers and remove their data
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD/.weft-quickstart

if [ "${1:-}" = "down" ]; then
  for site in site-a site-b; do
    pidfile=$ROOT/$site/controller.pid
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      kill "$(cat "$pidfile")"
      echo "stopped $site"
    fi
  done
  rm -rf "$ROOT"
  exit 0
fi

deploy/setup.sh
cargo build --release --workspace --bins
BIN=$PWD/target/release
mkdir -p "$ROOT"

start() { # site port
  local data=$ROOT/$1
  mkdir -p "$data"
  if [ -f "$data/controller.pid" ] && kill -0 "$(cat "$data/controller.pid")" 2>/dev/null; then
    echo "quickstart: $1 is already running (pid $(cat "$data/controller.pid"))"
    return
  fi
  "$BIN/weft-controller" --site-id "$1" --pod-cidr 10.1.0.0/16 --reserved-cidr 192.168.1.0/24 \
    --data-dir "$data" --listen "127.0.0.1:$2" >"$data/controller.log" 2>&1 &
  echo $! >"$data/controller.pid"
  for _ in $(seq 100); do [ -S "$data/admin.sock" ] && break; sleep 0.1; done
  [ -S "$data/admin.sock" ] || { cat "$data/controller.log"; exit 1; }
}
start site-a 7443
start site-b 7444
A="$BIN/weftctl --controller unix:$ROOT/site-a/admin.sock"
B="$BIN/weftctl --controller unix:$ROOT/site-b/admin.sock"

set -x
grpcurl -plaintext -unix "$ROOT/site-a/admin.sock" list
grpcurl -plaintext -unix "$ROOT/site-a/admin.sock" weft.v1.AdminService/GetSite
$A node add node-1 || true
$A nodes
set +x
if ! $A -o json peerings | grep -q site-b; then
  token=$($B -o json peering token --ttl 10m | sed -n 's/.*"token": "\(.*\)".*/\1/p')
  echo "+ weftctl peering token                        (on site-b; the token is shown once)"
  echo "+ weftctl peering create --token <that token>  (on site-a)"
  $A peering create --token "$token"
fi
set -x
$A peerings
$B peerings
$A allocations
set +x
cat <<TXT

Two sites are running and peered: site-a (127.0.0.1:7443) and site-b (127.0.0.1:7444),
both on 10.1.0.0/16; each reaches the other through its own local view (above).
  export WEFT_CONTROLLER=unix:$ROOT/site-a/admin.sock
  $BIN/weftctl site
Logs: $ROOT/site-*/controller.log
Tear down: deploy/quickstart.sh down
TXT
