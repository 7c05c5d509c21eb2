#!/usr/bin/env bash
# Installs every Debian package that building, running and testing numoe need, on Debian 12 (bookworm).
# Non-interactive and idempotent. It checks first and asks for root only when something is missing, so
# ./deploy/test.sh runs as any user on a machine that has everything; when something is missing and this
# is not root, it exits 1 with the exact apt-get line to run as root.
# CUDA 13 and NCCL are not installed here: they come from the machine (/usr/local/cuda) when present.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ pkg-config ccache git
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev libabsl-dev
  libboost1.74-dev libboost-system1.74-dev nlohmann-json3-dev libssl-dev openssl
  libgtest-dev libgmock-dev libbenchmark-dev
  libpcre2-dev libnuma-dev numactl libhwloc-dev hwloc-nox
  curl ca-certificates procps
  clang libclang-rt-14-dev  # deploy/fuzz.sh: clang with libFuzzer and the sanitizer runtimes
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps.sh: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

install_line="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps.sh: ${#missing[@]} of ${#PACKAGES[@]} packages are missing: ${missing[*]}" >&2
  echo "install-deps.sh: installing them needs root; run as root (or with sudo sh -c '...'):" >&2
  echo "  $install_line" >&2
  exit 1
fi
echo "install-deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
