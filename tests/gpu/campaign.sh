#!/usr/bin/env bash
# The GPU campaign (run on the GPU host, in the background): contract tests, the GPU suite, then
# benchmarks + the end-to-end draft test in one session. Results under $1 (default /tmp/campaign).
set -u
OUT=${1:-/tmp/campaign}
SRC=/tmp/eagle3-src          # a private copy: the working tree may be re-synced while this runs
rm -rf "$SRC" && mkdir -p "$OUT/bench" && cp -r . "$SRC" && cd "$SRC"
export PYTHONPATH="$SRC:/tmp/site:/tmp/gpu:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
df -h /tmp > "$OUT/df.txt" 2>&1
python3 -m eagle3.cli doctor > "$OUT/doctor.txt" 2>&1
step() { local name=$1; shift; local t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?
         echo "$name rc=$rc seconds=$(( $(date +%s) - t0 ))" >> "$OUT/steps.txt"; }
step contract python3 -m pytest -p no:cacheprovider tests/unit/test_vllm_contract.py -v -rA
step suite python3 -m pytest -p no:cacheprovider -m gpu tests/gpu -v -rA --durations=25 --gpu-out "$OUT/suite"
step bench python3 -m pytest -p no:cacheprovider -m "benchmark or e2e" tests/gpu -v -rA --durations=25 \
     --gpu-out "$OUT/bench" --benchmark-json="$OUT/bench/benchmark.json" --benchmark-columns=median,rounds
step report python3 -m eagle3.cli bench report --history "$OUT/bench/benchmark.json" --out "$OUT/bench"
echo DONE > "$OUT/DONE"
