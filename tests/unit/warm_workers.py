"""pytest-xdist workers forked from one interpreter that has already imported the heavy libraries.

Each worker would otherwise import torch, transformers and speculators on its own, on a machine whose cores the other
workers need. Here a server imports them once; xdist starts each worker with this
file as its "python" (``--tx popen//python=...``): the stand-in sends its stdin, stdout and stderr and its
``-c`` code to the server, which forks a worker that runs the code on them as ``python -u -c`` would. The stand-in
waits and exits with the worker's code. Where the server cannot be reached, the stand-in runs the real interpreter.

POSIX (os.fork, socket.send_fds). The server ends when the test run closes its stdin.
"""

from __future__ import annotations

import os
import pickle
import shlex
import socket
import sys
import time

PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "transformers.models.llama.modeling_llama",
    "speculators.models.eagle3",
    "safetensors.torch",
    "datasets",
)  # not pytest's plugins (hypothesis, xdist...): a plugin imported before pytest starts keeps its asserts unrewritten


def start(n: int, preload: tuple[str, ...] = PRELOAD) -> tuple[list[str], object]:
    """The server started and bound: (n xdist ``--tx`` specs whose python is this file's stand-in, the server's
    Popen, to pass to ``stop``)."""
    import subprocess
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="warm-workers-"), "socket")
    server = subprocess.Popen(
        [sys.executable, __file__, "serve", path, *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    server.stdout.read(1)  # bound: a stand-in that connects now waits in the backlog while the imports run
    server.folder = os.path.dirname(path)
    return [spec(path)] * n, server


def spec(path: str) -> str:
    """The xdist ``--tx`` spec of a worker whose python is the stand-in for the server at ``path``."""
    return "popen//python=" + " ".join(shlex.quote(a) for a in (sys.executable, __file__, "connect", path))


def stop(server) -> None:
    import shutil

    server.stdin.close()
    server.wait()
    shutil.rmtree(server.folder, ignore_errors=True)


def _serve(path: str, preload: list[str]) -> None:
    """Bind, import the preload modules, then fork a worker per stand-in until stdin closes."""
    import importlib
    import select
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the run is its workers' to handle
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    os.write(1, b"b")
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    while True:
        ready = select.select([listener, 0], [], [])[0]
        if 0 in ready and not os.read(0, 1):  # the run closed our stdin: it has ended
            break
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:
            listener.close()
            _work(conn, fds, *pickle.loads(msg))
        conn.close()
        for fd in fds:
            os.close(fd)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap the workers that ended
                pass
        except ChildProcessError:
            pass
    deadline = time.monotonic() + 10  # the workers are ending with the run: wait, so that their time is counted
    while time.monotonic() < deadline:
        try:
            if not os.waitpid(-1, os.WNOHANG)[0]:
                time.sleep(0.05)
        except ChildProcessError:
            break


def _work(conn: socket.socket, fds: list[int], args: list[str], cwd: str, env: dict) -> None:  # pragma: no cover
    """In the forked worker: the stand-in's stdio and environment, then ``python -u -c CODE`` (args: -u, -c CODE)."""
    import atexit
    import io
    import signal
    import traceback
    import types

    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.dont_write_bytecode = "-B" in args
    sys.argv = ["-c"]
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    code = 0
    try:
        exec(compile(args[args.index("-c") + 1], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            f.flush()
        conn.send(bytes([code & 255]))
        os._exit(code)


def _connect(path: str, args: list[str]) -> None:
    """The stand-in: hand stdio and args to the server's worker and exit with its code; no server, the real python."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
    except OSError:
        os.execv(sys.executable, [sys.executable, *args])
    socket.send_fds(conn, [pickle.dumps((args, os.getcwd(), dict(os.environ)))], [0, 1, 2])
    for fd in (0, 1):  # the worker's pipes to the test run end with the worker, not with this process
        os.close(fd)
    code = conn.recv(1)
    sys.exit(code[0] if code else 1)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(sys.argv[2], sys.argv[3:])
    else:
        _connect(sys.argv[2], sys.argv[3:])
