"""The GPU step runner's preamble (tests/gpu/settle.sh), run against a fake nvidia-smi."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SETTLE = Path(__file__).resolve().parents[1] / "gpu" / "settle.sh"

FAKE_SMI = """#!/bin/sh
# memory.used: 40000 MiB while the holder (its pid in $HOLDER) lives (a killed one not yet reaped is a zombie:
# it holds nothing), else 0; compute apps: the holder
alive=0; [ -s "$HOLDER" ] && ps -o stat= -p "$(cat "$HOLDER")" 2>/dev/null | grep -qv Z && alive=1
case "$*" in
  *memory.used*) [ $alive = 1 ] && echo 40000 || echo 0 ;;
  *compute-apps*) [ $alive = 1 ] && cat "$HOLDER" ;;
esac
"""


@pytest.mark.parametrize("held", [True, False], ids=["left-over-engine", "free"])
def test_a_step_s_left_over_gpu_process_is_killed_before_the_next_step(tmp_path, held):
    """A step that died of SIGSEGV left its engine process holding 43 GB (H200, the 73a4e94 run): the next two steps
    waited 120 s each and ran beside it. settle.sh waits its limit, then kills what still holds the GPU."""
    (tmp_path / "nvidia-smi").write_text(FAKE_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) if held else None
    (tmp_path / "holder").write_text(str(holder.pid) if held else "")
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", HOLDER=str(tmp_path / "holder"))
    try:
        out = subprocess.run(
            ["bash", str(SETTLE), "0"], capture_output=True, text=True, timeout=30, env=env, check=False
        )
        assert out.returncode == 0, out.stderr
        if held:
            assert holder.wait(timeout=5) == -9, "the left-over process was not killed"
            assert out.stdout.strip() == (
                f"GPU memory used before the step: 0 MiB (waited 0s; killed left-over processes {holder.pid})"
            )
        else:
            assert out.stdout.strip() == "GPU memory used before the step: 0 MiB (waited 0s)"
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
