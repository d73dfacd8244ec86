#!/usr/bin/env bash
# On the GPU host: wait up to $1 seconds for the background campaign, show progress, copy results into $OUT.
limit=${1:-540}; C=/tmp/campaign; t=0
while [ ! -f "$C/DONE" ] && [ "$t" -lt "$limit" ]; do sleep 10; t=$((t + 10)); done
echo "waited ${t}s; finished: $([ -f "$C/DONE" ] && echo yes || echo no)"
cat "$C/steps.txt" 2>/dev/null
for f in "$C"/*.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error" "$f" | tail -30 | cut -c1-400; done
grep -h -A12 "^FAILED-NOW" "$C"/*.log 2>/dev/null | cut -c1-300 | tail -60  # failures' reasons as they happened
for d in online benchkd fp8; do  # what these long steps measured so far (report.json is written as they go)
  [ -f "$C/$d/report.json" ] && { echo "== $d/report.json"; head -c 1500 "$C/$d/report.json"; echo; }
done
for f in "$C"/*/jit_in_clock.txt; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
latest=$(ls -t "$C"/*.log 2>/dev/null | head -1); echo "== tail of $latest"; tail -n 25 "$latest" 2>/dev/null | cut -c1-300
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/campaign.tgz" -C /tmp --exclude='*.safetensors' campaign 2>/dev/null
  for d in suite direct copies draft aux depth online e2e fp8 bench benchkd; do [ -f "$C/$d/report.json" ] && cp "$C/$d/report.json" "$OUT/$d-report.json"; done
  [ -f "$C/online/online-stacks.txt" ] && cp "$C/online/online-stacks.txt" "$OUT/" || true
fi
