"""The suite's xdist workers, forked from a server that imported the heavy libraries once (tests/unit/warm_workers.py),
run their code as ``python -u -c CODE`` would: the stand-in's stdin, stdout, directory, environment and exit code."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from . import warm_workers

ROOT = Path(__file__).resolve().parents[2]

CODE = (
    "import os, sys, json; line = sys.stdin.readline(); "
    "print(json.dumps([os.getcwd(), os.environ.get('WARM_TEST'), line, sys.argv, 'decimal' in sys.modules])); "
    "sys.stderr.write('to stderr'); sys.exit(int(os.environ['WARM_CODE']))"
)


def _stand_in(spec: str, tmp_path, code: int, stdin: str = "a line\nand more\n"):
    python = shlex.split(spec.split("python=", 1)[1])
    env = dict(os.environ, WARM_TEST="from the stand-in", WARM_CODE=str(code))
    return subprocess.run(
        [*python, "-u", "-c", CODE], input=stdin, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=30
    )


@pytest.mark.parametrize("code", [0, 3])
def test_a_worker_runs_its_code_on_the_stand_in_s_stdio_directory_and_environment(tmp_path, code):
    specs, server = warm_workers.start(2, preload=("decimal",))
    try:
        assert len(specs) == 2 and specs[0] == specs[1]
        done = _stand_in(specs[0], tmp_path, code)
        again = _stand_in(specs[1], tmp_path, code)  # the server forks one worker per stand-in
    finally:
        warm_workers.stop(server)
    assert done.returncode == again.returncode == code, done.stderr
    cwd, env, line, argv, preloaded = json.loads(done.stdout)
    assert (cwd, env, line, argv) == (str(tmp_path), "from the stand-in", "a line\n", ["-c"])
    assert preloaded  # imported by the server before it forked
    assert done.stderr == "to stderr" and done.stdout == again.stdout
    assert server.returncode == 0 and not os.path.exists(server.folder)  # its socket's folder removed


def test_without_its_server_the_stand_in_runs_the_real_interpreter(tmp_path):
    done = _stand_in(warm_workers.spec(str(tmp_path / "no")), tmp_path, 5)
    assert done.returncode == 5 and done.stderr == "to stderr", done.stderr
    cwd, env, line, argv, preloaded = json.loads(done.stdout)
    assert (cwd, env, line, argv) == (str(tmp_path), "from the stand-in", "a line\n", ["-c"])
    assert not preloaded


def test_the_suite_runs_in_one_process_without_pytest_xdist():
    """`pytest -p no:xdist` (a debugger's run): the root conftest's hook for xdist's `-n auto` is optional there, not
    an unknown hook that stops pytest before any test."""
    argv = [
        "-m",
        "pytest",
        "-p",
        "no:xdist",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/unit/test_docs.py",
        "-k",
        "ci_runs",
    ]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
