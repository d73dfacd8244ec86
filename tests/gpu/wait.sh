#!/usr/bin/env bash
# On the GPU host: wait up to $1 seconds for the background campaign, show progress, copy results into $OUT.
# It returns at once where there is nothing to wait for: a host without the campaign (the lent one was taken back
# between two polls and this call started a fresh one: the 288d049 run waited 560 s there), or a campaign no longer running.
limit=${1:-540}; C=${CAMPAIGN:-/tmp/campaign}; t=0
POLL=${WAIT_POLL:-2}  # seconds between looks (the CPU tests look faster)
for _ in $(seq "${WAIT_GRACE:-5}"); do [ -d "$C" ] && break; sleep 1; done  # a campaign started a moment ago makes it at once
if [ ! -d "$C" ]; then
  echo "no campaign on this host ($C is missing): the host that ran it was given back and this is a fresh one;"
  echo "install vLLM again and start it again"; exit 3
fi
running() { [ ! -s "$C/pid" ] || kill -0 "$(cat "$C/pid")" 2>/dev/null; }  # campaign.sh writes its pid
n=0; while [ ! -f "$C/DONE" ] && [ "$t" -lt "$limit" ] && running; do sleep "$POLL"; n=$((n + 1)); t=$(awk "BEGIN {print int($n * $POLL)}"); done
echo "waited ${t}s; finished: $([ -f "$C/DONE" ] && echo yes || { running && echo no || echo "no (the campaign is not running)"; })"
cat "$C/steps.txt" 2>/dev/null
for f in "$C"/*.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error" "$f" | tail -30 | cut -c1-400; done
grep -h -A12 "^FAILED-NOW" "$C"/*.log 2>/dev/null | cut -c1-300 | tail -60  # failures' reasons as they happened
for d in online benchkd fp8 e2eds wrapper benchtrain onlinekd inproc; do  # what these long steps measured so far (report.json is written as they go)
  [ -f "$C/$d/report.json" ] && { echo "== $d/report.json"; head -c 1500 "$C/$d/report.json"; echo; }
done
for f in "$C"/*/jit_in_clock.txt; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
latest=$(ls -t "$C"/*.log 2>/dev/null | head -1); echo "== tail of $latest"; tail -n 25 "$latest" 2>/dev/null | cut -c1-300
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/campaign.tgz" -C "$(dirname "$C")" --exclude='*.safetensors' "$(basename "$C")" 2>/dev/null
  for d in suite suite2 suite3 suite4 direct copies draft aux depth online e2e e2eds wrapper benchtrain onlinekd inproc ckpt fp8 bench benchkd; do [ -f "$C/$d/report.json" ] && cp "$C/$d/report.json" "$OUT/$d-report.json"; done
  [ -f "$C/online/online-stacks.txt" ] && cp "$C/online/online-stacks.txt" "$OUT/" || true
fi
