#!/usr/bin/env bash
# Before a step (tests/gpu/steps): wait up to ${1:-60} s for the previous step's processes to free the GPU's
# memory, then kill what still holds it. A step that dies (SIGSEGV) leaves its vLLM engine process behind with its
# memory: the 73a4e94 run's online step did, twice (43 GB each); the next steps waited 120 s and then ran beside them.
# Nothing else uses the GPU while the steps run. Prints the line for steps.txt.
limit=${1:-60}; t=0
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; }
while [ "$(used)" -gt 2048 ] 2>/dev/null && [ "$t" -lt "$limit" ]; do sleep 5; t=$((t + 5)); done
killed=""
if [ "$(used)" -gt 2048 ] 2>/dev/null; then
  killed=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | tr '\n' ' ')
  killed=${killed% }
  if [ -n "$killed" ]; then kill -9 $killed 2>/dev/null; sleep 2; fi
fi
echo "  GPU memory used before the step: $(used) MiB (waited ${t}s${killed:+; killed left-over processes $killed})"
