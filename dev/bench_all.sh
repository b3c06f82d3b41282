#!/usr/bin/env bash
# The benchmark runs behind bench/results/ (bench/results/README.md says which step made each file), after
# the peers are installed (dev/peers.sh). Commit the JSON and PNG (bench/results/README.md indexes them); the .txt files are console logs, not committed.
# Usage (device):  bash dev/bench_all.sh STEP "$OUT"
#   tune     re-tune auto's table (fwd and bwd; about 4 minutes): $OUT/nvidia_h200.json, also kept in
#            /tmp/fs_tuned.json for the next call on the same warm machine (the working tree is copied anew);
#            run it alone on its machine (beside other GPU work its timings came out up to 1.5x low)
#   suite    the shape suite against every peer (auto reads /tmp/fs_tuned.json when there), then the masked
#            attention-scores cases: $OUT/h200.{json,png,txt}, $OUT/h200_masked.{json,txt}
#   ce       cross-entropy against torch, torch.compile, Liger and QuACK: $OUT/h200_ce.{json,txt}
#   dist     the vocabulary-parallel run on every GPU of the host (NCCL; nvidia-h200-x2): $OUT/h200x2_dist.json
#   cuda     every CUDA variant beside the Triton backend and torch eager (dev/bench_cuda.py all)
#   lce      issue 40's measurements (about 6 minutes; no peers): the host's cost of an lce_sliced tile
#            launch by launch, where the loss's time goes (floor, memory= at CCE's peak, lce_fused, the skip,
#            the default; eager, host, CUDA-graph replay, kernels by kind), lce_fused's GEMM against cuBLAS,
#            and the loss tests on the GPU: $OUT/lce_tile_host.json, $OUT/lce_profile.json,
#            $OUT/lce_gemm_lse.json, $OUT/lce_tests.txt
#   lcebench bench --lce with every peer (the peers' wheels installed first: dev/peers.sh), logits of spread 1,
#            fastsoftmax_skip included, then spread 0.5 for the floor, CCE and ours at CCE's peak (about 8 minutes):
#            $OUT/h200_lce.{json,txt}, $OUT/h200_lce_s05.{json,txt}
#   train    the Hugging Face training step at 1x4096, 1x8192 and 8x1024, every variant (about 6 minutes on an
#            H200; eager attention at 8192 needs more than an H100's memory): $OUT/ts_<shape>.json, one per
#            shape, joined here by `python dev/train_step.py bench/results/h200_train_step.json --merge ts_*.json`
set -u
step=$1
out=$2
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/src PYTHONUNBUFFERED=1
# where the committed tuning tables live
tables=src/fastsoftmax/heuristics/tables
case "$step" in
tune)
    timeout 290 python3 -m fastsoftmax bench --tune "$out/nvidia_h200.json" --jobs 14 > "$out/tune.txt" 2>&1 \
        && cp "$out/nvidia_h200.json" /tmp/fs_tuned.json
    echo "tune rc=$?" >> "$out/tune.txt"
    tail -n 2 "$out/tune.txt"
    ;;
suite)
    [ -f /tmp/fs_tuned.json ] && cp /tmp/fs_tuned.json "$tables/nvidia_h200.json"
    timeout 300 python3 -m fastsoftmax bench --jobs 14 --json "$out/h200.json" --plot "$out/h200.png" \
        > "$out/h200.txt" 2> /tmp/fs_bench_err.txt  # the progress bar; the device tool returns few files
    echo "bench rc=$?" >> "$out/h200.txt"
    timeout 150 python3 -m fastsoftmax bench --masked --json "$out/h200_masked.json" > "$out/h200_masked.txt" 2>&1
    echo "masked rc=$?" >> "$out/h200_masked.txt"
    tail -n 4 /tmp/fs_bench_err.txt
    grep -E "geometric|host|rc=" "$out/h200.txt"
    tail -n 30 "$out/h200_masked.txt"
    ;;
ce)
    [ -f /tmp/fs_tuned.json ] && cp /tmp/fs_tuned.json "$tables/nvidia_h200.json"
    timeout 400 python3 -m fastsoftmax bench --ce --json "$out/h200_ce.json" > "$out/h200_ce.txt" 2>&1
    echo "ce rc=$?" >> "$out/h200_ce.txt"
    tail -n 30 "$out/h200_ce.txt"
    ;;
dist)
    # 1024 rows: the float64 references of 4096 rows do not fit in an H200's memory
    timeout 500 python3 dev/dist_nccl.py 1024 json="$out/h200x2_dist.json" > "$out/h200x2_dist.txt" 2>&1
    echo "dist rc=$?" >> "$out/h200x2_dist.txt"
    tail -n 14 "$out/h200x2_dist.txt"
    ;;
cuda)
    timeout 500 python3 dev/bench_cuda.py all > "$out/bench_cuda.txt" 2>&1
    echo "bench_cuda rc=$?" >> "$out/bench_cuda.txt"
    ;;
lce)
    timeout 60 python3 dev/lce_tile_host.py "$out/lce_tile_host.json" > "$out/lce_tile_host.txt" 2>&1
    timeout 200 python3 dev/lce_kernel_profile.py "$out/lce_profile.json" > "$out/lce_profile.txt" 2>&1
    timeout 100 python3 dev/lce_gemm_lse.py "$out/lce_gemm_lse.json" 8192x4096x128256 > "$out/lce_gemm_lse.txt" 2>&1
    timeout 150 python3 -m pytest tests/test_lce_sliced.py tests/test_lce_skip.py tests/test_lce.py tests/test_cross_entropy.py --device cuda \
        -q -n 8 --tb=line -p no:cacheprovider > "$out/lce_tests.txt" 2>&1
    echo "lce tests rc=$?" >> "$out/lce_tests.txt"
    cat "$out/lce_tile_host.txt"; grep -v -i warn "$out/lce_profile.txt"; tail -n 12 "$out/lce_tests.txt"
    ;;
lcebench)
    timeout 330 python3 -m fastsoftmax bench --lce --json "$out/h200_lce.json" > "$out/h200_lce.txt" 2>&1
    echo "lce rc=$?" >> "$out/h200_lce.txt"
    timeout 170 python3 -m fastsoftmax bench --lce --lce-spread 0.5 --impls floor,cce,fastsoftmax_mem,fastsoftmax_skip \
        --json "$out/h200_lce_s05.json" > "$out/h200_lce_s05.txt" 2>&1
    echo "lce spread 0.5 rc=$?" >> "$out/h200_lce_s05.txt"
    grep -E "^N,|skip|mem|cce |floor|rc=" "$out/h200_lce.txt" "$out/h200_lce_s05.txt"
    ;;
train)
    for s in 1x4096 1x8192 8x1024; do  # (a shape a run, its file written after every variant: a cap keeps what ran)
        timeout 175 python3 dev/train_step.py "$out/ts_$s.json" --shapes "$s" --timeout 80 \
            --variants unpatched fastsoftmax liger cce liger_all fastsoftmax_eager > "$out/ts_$s.txt" 2>&1
        echo "train $s rc=$?" >> "$out/ts_$s.txt"
        tail -n 3 "$out/ts_$s.txt"
    done
    ;;
*)
    echo "usage: $0 tune|suite|ce|dist|cuda|lce|lcebench|train OUT" >&2
    exit 2
    ;;
esac
