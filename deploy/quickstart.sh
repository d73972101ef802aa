#!/usr/bin/env bash
# Quickstart: installs what is missing, builds weft, and brings up a working
# federation of two (or more) sites on this machine, each host a network
# namespace (weft-qs-*) on one bridge: per site a controller (embedded store,
# data under ./.weft-quickstart/), a gateway, a node and a workload behind the
# node. Every site uses the workload CIDR 10.1.0.0/16 — the workloads even
# have the same address, 10.1.0.10. Every pair of sites peers from a token,
# each sees the others through remapped local views, and a workload pings
# another site's. Needs root (namespaces, links, nftables — all inside the
# namespaces).
#   deploy/quickstart.sh              start two sites (or show, when running)
#   deploy/quickstart.sh --sites 3    a mesh of three sites (2 to 9)
#   deploy/quickstart.sh down         stop everything and remove it
set -euo pipefail
started=$SECONDS
cd "$(dirname "$0")/.."
ROOT=$PWD/.weft-quickstart
P=weft-qs
LAN=192.168.77
# The quickstart's own build profile (Cargo.toml): unoptimized and without
# debug information, so the first build takes half the time of a release
# build. Real hosts run release builds (deploy/package.sh).
BIN=${CARGO_TARGET_DIR:-$PWD/target}/quickstart

N=2
if [ "${1:-}" = "--sites" ]; then
  N=${2:-}
  case "$N" in [2-9]) ;; *) echo "quickstart: --sites takes a number from 2 to 9" >&2; exit 2 ;; esac
  shift 2
fi
LETTERS=(a b c d e f g h i)
SITES=()
for ((k = 0; k < N; k++)); do SITES+=("${LETTERS[$k]}"); done

[ "$(id -u)" = 0 ] || { echo "quickstart: run as root (it creates network namespaces): sudo $0 $*" >&2; exit 1; }

down() {
  # The binaries the sites were started with (another CARGO_TARGET_DIR may
  # be set now): their --teardown removes what the agents made.
  local bin=$BIN
  [ -f "$ROOT/bin" ] && bin=$(cat "$ROOT/bin")
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
    [ -e "/run/netns/$P-$host" ] && { nsenter --net="/run/netns/$P-$host" \
      "$bin/weft-$kind-agent" --teardown --state-dir "$state" >/dev/null 2>&1 \
      || { echo "quickstart: --teardown on $host failed: $bin/weft-$kind-agent --teardown --state-dir $state" >&2; kept=1; }; }
  done
  if [ -n "${kept:-}" ]; then
    echo "quickstart: $ROOT is kept, with what the agents applied; run the command above again, then down" >&2
    exit 1
  fi
  for h in $(ip netns list | awk '{print $1}' | grep "^$P-"); do
    ip netns del "$h"
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
  N=$(cat "$ROOT/sites" 2>/dev/null || echo 2)
  SITES=("${LETTERS[@]:0:$N}")
  echo "quickstart: already running with $N sites (deploy/quickstart.sh down removes it)"
else
  t0=$SECONDS
  deploy/setup.sh
  t_setup=$((SECONDS - t0))
  t0=$SECONDS
  cargo build --profile quickstart -p weft-controller -p weftctl -p weft-gateway-agent -p weft-node-agent --bins
  t_build=$((SECONDS - t0))
  down # leftovers of an interrupted run
  mkdir -p "$ROOT"
  echo "$N" >"$ROOT/sites"
  echo "$BIN" >"$ROOT/bin"

  ns() { ip netns add "$P-$1"; ip -n "$P-$1" link set lo up; }
  ns lan
  for x in "${SITES[@]}"; do for h in ctl gw n w; do ns "$h$x"; done; done
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
  # Site number k (1-based): controller .k, gateway .10k, node .10k+1.
  k=0
  for x in "${SITES[@]}"; do
    k=$((k + 1))
    plug "ctl$x" "$LAN.$k"; plug "gw$x" "$LAN.$((10 * k))"; plug "n$x" "$LAN.$((10 * k + 1))"
    # A workload behind the node, in the node's subnet (the first /24 of
    # the site's workload CIDR — the same on every site).
    ip -n "$P-n$x" link add wl0 type veth peer name eth0 netns "$P-w$x"
    ip -n "$P-n$x" addr add 10.1.0.1/24 dev wl0
    ip -n "$P-n$x" link set wl0 up
    ip netns exec "$P-n$x" sysctl -qw net.ipv4.ip_forward=1
    ip -n "$P-w$x" addr add 10.1.0.10/24 dev eth0
    ip -n "$P-w$x" link set eth0 up
    ip -n "$P-w$x" route add default via 10.1.0.1
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
  agent() { # kind site controller-address host address
    local dir=$ROOT/$4 t
    mkdir -p "$dir"
    echo "$1" >"$dir/kind"
    t=$("$BIN/weftctl" --controller "unix:$ROOT/$2/admin.sock" -o json token create --role "$1" --name "$4")
    local extra=()
    # The first of the site's WireGuard ports (51820-51919 by default);
    # each peering listens on its own port of that range.
    [ "$1" = gateway ] && extra=(--endpoint "$5:51820")
    nsenter --net="/run/netns/$P-$4" "$BIN/weft-$1-agent" --controller "https://$3:7443" --name "$4" \
      --underlay-ip "$5" --state-dir "$dir/agent" --metrics-listen "$5:9101" "${extra[@]}" \
      --token "$(echo "$t" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')" \
      --ca-fingerprint "$(echo "$t" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ca_fingerprint"])')" \
      >"$dir/agent.log" 2>&1 &
    echo $! >"$dir/agent.pid"
  }
  k=0
  for x in "${SITES[@]}"; do
    k=$((k + 1))
    controller "site-$x" "ctl$x" "$LAN.$k"
    agent gateway "site-$x" "$LAN.$k" "gw$x" "$LAN.$((10 * k))"
    agent node "site-$x" "$LAN.$k" "n$x" "$LAN.$((10 * k + 1))"
  done
fi

ctl() { echo "$BIN/weftctl --controller unix:$ROOT/site-$1/admin.sock"; }
for x in "${SITES[@]}"; do
  for _ in $(seq 100); do
    $(ctl "$x") -o json gateways | grep -q '"public_key": "[^"]' && break
    sleep 0.2
  done
done
A=$(ctl a)
set -x
grpcurl -plaintext -unix "$ROOT/site-a/admin.sock" list
$A nodes
$A gateways
set +x
# Every pair of sites peers: a token from the one, redeemed at the other.
for ((i = 0; i < N; i++)); do
  for ((j = i + 1; j < N; j++)); do
    x=${SITES[$i]} y=${SITES[$j]}
    $(ctl "$x") -o json peerings | grep -q "\"site-$y\"" && continue
    token=$($(ctl "$y") -o json peering token --ttl 10m | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
    echo "+ weftctl peering token                        (on site-$y; the token is shown once)"
    echo "+ weftctl peering create --token <that token>  (on site-$x)"
    $(ctl "$x") peering create --token "$token"
  done
done
# The gateways build the tunnels and probe through them; wait until every
# site sees every peering answer (state "connected").
for x in "${SITES[@]}"; do
  for _ in $(seq 150); do
    [ "$($(ctl "$x") -o json peerings | grep -c '"state": "connected"')" -ge $((N - 1)) ] && break
    sleep 0.2
  done
done
set -x
$A peerings
$(ctl b) peerings
set +x

# Each site names its workload; the controllers send the names to their
# peers, and every node's DNS responder answers NAME.SITE.weft.internal
# with the address in its own site's view.
for x in "${SITES[@]}"; do
  $(ctl "$x") -o json names | python3 -c 'import json,sys; sys.exit(any(n["name"] == "web" for n in json.load(sys.stdin)["published"]))' \
    && $(ctl "$x") name add web 10.1.0.10
done
# site-b's workload 10.1.0.10 as site-a sees it: the controller translates.
set -x
$A translate site-b 10.1.0.10
set +x
view=$($A -o json translate site-b 10.1.0.10 | python3 -c 'import json,sys; print(json.load(sys.stdin)["local_address"])')
if command -v dig >/dev/null; then
  # The name reaches site-a's nodes once site-b's controller sends it over
  # the peering's subscription (at once when that stream is up).
  for _ in $(seq 150); do
    [ "$(ip netns exec $P-wa dig @10.1.0.1 +short +time=1 +tries=1 web.site-b.weft.internal)" = "$view" ] && break
    sleep 0.2
  done
  echo "+ ip netns exec $P-wa dig @10.1.0.1 +short web.site-b.weft.internal   (site-a's node answers)"
  ip netns exec $P-wa dig @10.1.0.1 +time=1 +tries=1 web.site-b.weft.internal | grep -E 'status:|IN[[:space:]]+A[[:space:]]'
fi
echo "+ ping from site-a's workload (10.1.0.10) to site-b's workload (10.1.0.10, seen from site-a as $view)"
ok=
for _ in $(seq 30); do
  if ip netns exec $P-wa ping -c 3 -i 0.3 -W 1 "$view"; then ok=1; break; fi
  sleep 1
done
[ -n "$ok" ] || { echo "quickstart: the ping across the sites failed; logs under $ROOT" >&2; exit 1; }

# The operator's view: one screen of the site, and a reachability matrix
# from each site's node host and workload to every other site's workload
# (by its own address; weftctl maps it to the local view).
set -x
$A status
set +x
for x in "${SITES[@]}"; do
  to=()
  for y in "${SITES[@]}"; do [ "$y" = "$x" ] || to+=(--to "site-$y=10.1.0.10"); done
  echo "+ ip netns exec $P-n$x weftctl test network --from host --from $P-w$x ${to[*]} --tcp-port 80   (site-$x)"
  ip netns exec "$P-n$x" $(ctl "$x") test network --from host --from "$P-w$x" "${to[@]}" --tcp-port 80
done

cat <<TXT

$N sites are running and every pair is peered, all on 10.1.0.0/16, in
namespaces $P-*: site-a (controller $LAN.1:7443), site-b ($LAN.2:7443), …,
each with a gateway, a node and a workload. Each reaches the others through
its own local views (above); a WireGuard tunnel per peering runs between the
gateways, each on its own UDP port of 51820-51919.
  export WEFT_CONTROLLER=unix:$ROOT/site-a/admin.sock
  $BIN/weftctl peerings
  sudo ip netns exec $P-wa ping $view
  $BIN/weftctl status; $BIN/weftctl diagnose; $BIN/weftctl topology --format svg > weft.svg
  $BIN/weftctl ui     # a live page of site-a: open the one-time link it prints
Metrics: http://<host>:9100/metrics (controllers), :9101 (agents), e.g.
  sudo ip netns exec $P-gwa curl -s $LAN.10:9101/metrics | grep weft_peering
Logs: $ROOT/*/controller.log, $ROOT/*/agent.log
Tear down: deploy/quickstart.sh down
TXT
if [ -n "${t_build:-}" ]; then
  echo "quickstart: where the time went ($((SECONDS - started)) s in all):"
  printf '  %5d s  %s\n' "$t_setup" "setup (deploy/setup.sh: packages that were missing, grpcurl)" \
    "$t_build" "cargo build --profile quickstart (4 binaries)" \
    "$((SECONDS - started - t_setup - t_build))" "the sites: namespaces, controllers, agents, peerings, checks"
fi
