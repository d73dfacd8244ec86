#!/usr/bin/env bash
# tests/gpu/passed.sh LOG FILE: exit 0 when the step log's pytest summary (-rA) has FILE's tests PASSED and none of
# them FAILED or in ERROR; 1 otherwise (no log, none of FILE's tests in it, one failed). An online step
# asks it of a benchtrain step's varlen CUDA tests.
log=$1 file=$2
[ -f "$log" ] || exit 1
grep -q "^PASSED ${file}::" "$log" || exit 1
! grep -qE "^(FAILED|ERROR) ${file}::" "$log"
