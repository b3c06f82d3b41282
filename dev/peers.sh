#!/usr/bin/env bash
# Liger-Kernel, QuACK and Cut Cross-Entropy for `fastsoftmax bench` (--lce too) on the device, which has no network (dev/README.md).
#   bash dev/peers.sh pack      here: download the wheels (Python 3.12, x86_64) into .wheels/ (git-ignored)
#                               and split the ~92 MB cu13 libs into two xz halves, each carryable in one call
#   bash dev/peers.sh install   on the device (after carrying .wheels/part-a, then .wheels/part-b, in two
#                               back-to-back calls: the machine keeps /root while warm): install into /tmp/site
#   then: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/src
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
pack)
    mkdir -p .wheels && cd .wheels
    pip download --no-deps --python-version 3.12 --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
        liger-kernel==0.8.5 cut-cross-entropy==25.1.1 quack-kernels nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base \
        nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext
    rm -rf cu13 part-a part-b && mkdir -p cu13 part-a part-b
    python3 -m zipfile -e nvidia_cutlass_dsl_libs_cu13-*.whl cu13
    tar -C cu13 -cf - . | xz -9e -T0 > cu13.tar.xz
    split -n 2 cu13.tar.xz cu13.tar.xz.
    mv cu13.tar.xz.aa part-a/ && mv cu13.tar.xz.ab part-b/
    mv ./*.whl part-a/ && mv part-a/nvidia_cutlass_dsl_libs_cu13-*.whl . && rm -rf cu13 cu13.tar.xz
    du -sh part-a part-b
    ;;
install)
    mkdir -p /tmp/site
    pip install --no-deps --target /tmp/site .wheels/part-a/*.whl
    cat .wheels/part-a/cu13.tar.xz.aa .wheels/part-b/cu13.tar.xz.ab | xz -d | tar -C /tmp/site -xf -
    ;;
*)
    echo "usage: $0 pack|install" >&2
    exit 2
    ;;
esac
