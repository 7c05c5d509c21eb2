#!/usr/bin/env bash
# Installs every Debian package that building, running and testing numoe need.
# Non-interactive and idempotent; run as root on Debian 12 (bookworm).
# CUDA 13 and NCCL are not installed here: they come from the machine (/usr/local/cuda) when present.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ pkg-config ccache git
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev libabsl-dev
  libboost1.74-dev libboost-system1.74-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libpcre2-dev libnuma-dev numactl libhwloc-dev hwloc-nox
  curl ca-certificates procps
)

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps.sh: run as root (apt-get install needs it)" >&2
  exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps.sh: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi
echo "install-deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
