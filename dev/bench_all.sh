#!/usr/bin/env bash
# The benchmark run behind bench/results/h200.*, in one device call (about 7 minutes on an H200), after the
# peers are installed (dev/peers.sh): re-tune auto's table (fwd and bwd), use it, then the suite against
# every peer, then the masked attention-scores cases. Usage: bash dev/bench_all.sh "$OUT" [notune]
set -u
out=$1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/src PYTHONUNBUFFERED=1
if [ "${2:-}" != notune ]; then
    timeout 240 python3 -m fastsoftmax bench --tune "$out/nvidia_h200.json" --jobs 14 > "$out/tune.txt" 2>&1 \
        && cp "$out/nvidia_h200.json" src/fastsoftmax/tuning/nvidia_h200.json
    echo "tune rc=$?" >> "$out/tune.txt"
fi
timeout 240 python3 -m fastsoftmax bench --jobs 14 --json "$out/h200.json" --plot "$out/h200.png" > "$out/h200.txt" 2> "$out/bench_err.txt"
echo "bench rc=$?" >> "$out/h200.txt"
timeout 120 python3 -m fastsoftmax bench --masked --json "$out/h200_masked.json" > "$out/h200_masked.txt" 2>&1
echo "masked rc=$?" >> "$out/h200_masked.txt"
grep -E "geometric|host|rc=" "$out/h200.txt"; cat "$out/h200_masked.txt"
