#!/usr/bin/env bash
# Quickstart: installs what is missing, builds weft, and brings up a working
# federation of two sites on this machine, each host a network namespace
# (weft-qs-*) on one bridge: per site a controller (embedded store, data under
# ./.weft-quickstart/), a gateway, a node and a workload behind the node. Both
# sites use the workload CIDR 10.1.0.0/16 — the two workloads even have the
# same address, 10.1.0.10. The sites peer from a token, each sees the other
# through a remapped local view, and a workload pings the other site's.
# Needs root (namespaces, links, nftables — all inside the namespaces).
#   deploy/quickstart.sh        start (or show, when already running)
#   deploy/quickstart.sh down   stop everything and remove it
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD/.weft-quickstart
P=weft-qs
LAN=192.168.77
BIN=$PWD/target/release

[ "$(id -u)" = 0 ] || { echo "quickstart: run as root (it creates network namespaces): sudo $0 $*" >&2; exit 1; }

down() {
  # Agents first, then remove what they applied, then the controllers.
  for pidfile in "$ROOT"/*/agent.pid "$ROOT"/*/controller.pid; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then kill "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done; fi
    rm -f "$pidfile"
  done
  for state in "$ROOT"/*/agent; do
    [ -d "$state" ] || continue
    host=$(basename "$(dirname "$state")")
    kind=$(cat "$state/../kind")
    [ -e "/run/netns/$P-$host" ] && nsenter --net="/run/netns/$P-$host" \
      "$BIN/weft-$kind-agent" --teardown --state-dir "$state" >/dev/null 2>&1 || true
  done
  for h in lan ctla ctlb gwa gwb na nb wa wb; do
    [ -e "/run/netns/$P-$h" ] && ip netns del "$P-$h"
  done
  rm -rf "$ROOT"
}

if [ "${1:-}" = "down" ]; then
  down
  echo "quickstart: stopped and removed"
  exit 0
fi

if [ -S "$ROOT/site-a/admin.sock" ] && [ -f "$ROOT/site-a/controller.pid" ] \
  && kill -0 "$(cat "$ROOT/site-a/controller.pid")" 2>/dev/null; then
  echo "quickstart: already running (deploy/quickstart.sh down removes it)"
else
  deploy/setup.sh
  cargo build --release --workspace --bins
  down # leftovers of an interrupted run
  mkdir -p "$ROOT"

  ns() { ip netns add "$P-$1"; ip -n "$P-$1" link set lo up; }
  for h in lan ctla ctlb gwa gwb na nb wa wb; do ns "$h"; done
  ip -n "$P-lan" link add br0 type bridge
  ip -n "$P-lan" link set br0 up
  i=0
  plug() { # host address
    ip -n "$P-lan" link add "p$i" type veth peer name eth0 netns "$P-$1"
    ip -n "$P-lan" link set "p$i" master br0 up
    ip -n "$P-$1" addr add "$2/24" dev eth0
    ip -n "$P-$1" link set eth0 up
    i=$((i + 1))
  }
  plug ctla $LAN.1; plug ctlb $LAN.2
  plug gwa $LAN.10; plug na $LAN.11
  plug gwb $LAN.20; plug nb $LAN.21
  # A workload behind each node, in the node's subnet (the first /24 of the
  # site's workload CIDR — the same on both sites).
  for pair in na:wa nb:wb; do
    node=${pair%:*} wl=${pair#*:}
    ip -n "$P-$node" link add wl0 type veth peer name eth0 netns "$P-$wl"
    ip -n "$P-$node" addr add 10.1.0.1/24 dev wl0
    ip -n "$P-$node" link set wl0 up
    ip netns exec "$P-$node" sysctl -qw net.ipv4.ip_forward=1
    ip -n "$P-$wl" addr add 10.1.0.10/24 dev eth0
    ip -n "$P-$wl" link set eth0 up
    ip -n "$P-$wl" route add default via 10.1.0.1
  done

  controller() { # site host address
    local data=$ROOT/$1
    mkdir -p "$data"
    nsenter --net="/run/netns/$P-$2" "$BIN/weft-controller" --site-id "$1" --pod-cidr 10.1.0.0/16 \
      --reserved-cidr $LAN.0/24 --data-dir "$data" --listen "$3:7443" --metrics-listen "$3:9100" \
      >"$data/controller.log" 2>&1 &
    echo $! >"$data/controller.pid"
    for _ in $(seq 100); do [ -S "$data/admin.sock" ] && break; sleep 0.1; done
    [ -S "$data/admin.sock" ] || { cat "$data/controller.log"; exit 1; }
  }
  controller site-a ctla $LAN.1
  controller site-b ctlb $LAN.2

  agent() { # kind site controller-address host address
    local dir=$ROOT/$4 t
    mkdir -p "$dir"
    echo "$1" >"$dir/kind"
    t=$("$BIN/weftctl" --controller "unix:$ROOT/$2/admin.sock" -o json token create --role "$1" --name "$4")
    local extra=()
    [ "$1" = gateway ] && extra=(--endpoint "$5:51820")
    nsenter --net="/run/netns/$P-$4" "$BIN/weft-$1-agent" --controller "https://$3:7443" --name "$4" \
      --underlay-ip "$5" --state-dir "$dir/agent" --metrics-listen "$5:9101" "${extra[@]}" \
      --token "$(echo "$t" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')" \
      --ca-fingerprint "$(echo "$t" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ca_fingerprint"])')" \
      >"$dir/agent.log" 2>&1 &
    echo $! >"$dir/agent.pid"
  }
  agent gateway site-a $LAN.1 gwa $LAN.10
  agent node site-a $LAN.1 na $LAN.11
  agent gateway site-b $LAN.2 gwb $LAN.20
  agent node site-b $LAN.2 nb $LAN.21
fi

A="$BIN/weftctl --controller unix:$ROOT/site-a/admin.sock"
B="$BIN/weftctl --controller unix:$ROOT/site-b/admin.sock"
for _ in $(seq 100); do
  $A -o json gateways | grep -q '"public_key": "[^"]' && $B -o json gateways | grep -q '"public_key": "[^"]' && break
  sleep 0.2
done

set -x
grpcurl -plaintext -unix "$ROOT/site-a/admin.sock" list
$A nodes
$A gateways
set +x
if ! $A -o json peerings | grep -q site-b; then
  token=$($B -o json peering token --ttl 10m | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
  echo "+ weftctl peering token                        (on site-b; the token is shown once)"
  echo "+ weftctl peering create --token <that token>  (on site-a)"
  $A peering create --token "$token"
fi
# The gateways build the tunnel and probe through it; wait until both
# sides see it answer (state "connected").
for _ in $(seq 100); do
  $A -o json peerings | grep -q '"state": "connected"' && $B -o json peerings | grep -q '"state": "connected"' && break
  sleep 0.2
done
set -x
$A peerings
$B peerings
set +x

# site-b's workload 10.1.0.10 as site-a sees it: the same host bits in the
# local view site-a negotiated for site-b's workload CIDR.
view=$($A -o json peerings | python3 -c '
import ipaddress, json, sys
p = [p for p in json.load(sys.stdin)["peerings"] if p["site_id"] == "site-b"][0]
v = [v for v in p["views"] if v["kind"] == "workload"][0]
real, local = ipaddress.ip_network(v["real_cidr"]), ipaddress.ip_network(v["local_cidr"])
print(local.network_address + (int(ipaddress.ip_address("10.1.0.10")) - int(real.network_address)))')
echo "+ ping from site-a's workload (10.1.0.10) to site-b's workload (10.1.0.10, seen from site-a as $view)"
ok=
for _ in $(seq 30); do
  if ip netns exec $P-wa ping -c 3 -i 0.3 -W 1 "$view"; then ok=1; break; fi
  sleep 1
done
[ -n "$ok" ] || { echo "quickstart: the ping across the sites failed; logs under $ROOT" >&2; exit 1; }

# The operator's view: one screen of the site, and a reachability matrix
# from node na's host and its workload to site-b's workload (by its own
# address; weftctl maps it to the local view).
set -x
$A status
ip netns exec $P-na $A test network --from host --from $P-wa --to site-b=10.1.0.10 --tcp-port 80
set +x

cat <<TXT

Two sites are running and peered, both on 10.1.0.0/16, in namespaces $P-*:
site-a (controller $LAN.1:7443) and site-b ($LAN.2:7443), each with a
gateway, a node and a workload. Each reaches the other through its own local
view (above); the WireGuard tunnel runs between the gateways.
  export WEFT_CONTROLLER=unix:$ROOT/site-a/admin.sock
  $BIN/weftctl peerings
  sudo ip netns exec $P-wa ping $view
  $BIN/weftctl status; $BIN/weftctl diagnose; $BIN/weftctl topology --format svg > weft.svg
Metrics: http://<host>:9100/metrics (controllers), :9101 (agents), e.g.
  sudo ip netns exec $P-gwa curl -s $LAN.10:9101/metrics | grep weft_peering
Logs: $ROOT/*/controller.log, $ROOT/*/agent.log
Tear down: deploy/quickstart.sh down
TXT
