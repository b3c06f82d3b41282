#!/usr/bin/env bash
# A newer Triton than the device image's, packed to travel in one device call (under 64 MiB with the repo):
# the cp312 wheel unpacked, without its AMD backend, CUPTI, proton and the pre-sm_90 tools, libtriton.so
# stripped (500 -> 192 MB), as one xz tarball in .t39/ (git-ignored: add `/.t39/` to .git/info/exclude).
# Triton 3.9.0: 56 MB. On the device (carry .t39):
#   mkdir -p /tmp/site39 && tar xJf .t39/triton39.tar.xz -C /tmp/site39
#   PYTHONPATH=/tmp/site39:$PWD/src TRITON_BACKENDS_IN_TREE=1 python3 dev/host_calls.py OUT.json
# (TRITON_BACKENDS_IN_TREE=1: the image's Triton's entry points would name the AMD backend removed here.)
# Usage: bash dev/pack_triton.sh [VERSION]   (default 3.9.0)
set -euo pipefail
version=${1:-3.9.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 "triton==$version" -d "$work"
(cd "$work" && unzip -q triton-*.whl 'triton/*')
t=$work/triton
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" "$t/_C/libproton.so"
rm -f "$t/backends/nvidia/bin/ptxas" "$t/backends/nvidia/bin/cuobjdump" "$t/backends/nvidia/bin/nvdisasm"
strip "$t/_C/libtriton.so"  # (sm_90 and newer compile with ptxas-blackwell, which stays)
mkdir -p .t39
short=${version%.*}
tar cf - -C "$work" triton | xz -T2 -6 > ".t39/triton${short//./}.tar.xz"
ls -la ".t39/triton${short//./}.tar.xz"
