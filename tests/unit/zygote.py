"""A zygote: a copy of the test process, forked before any test has run, that forks the suite's commands.

A command forked from the test process itself can hang on a lock another thread held at the fork (the tqdm lock,
CI 2026-12-04). A multiprocessing fork server has no such thread, but it imports torch and speculators again:
6.6 s of CPU in each pytest-xdist worker, on a machine whose cores the other workers keep busy. The zygote is
forked once per test process when collection ends: everything the tests imported is in it, and no test has started
a thread. Each command is its grandchild: the zygote forks a monitor per command; the monitor forks the command,
sends its pid, waits for it and sends its wait status. The zygote ends when the test process closes its end of the
socket (at exit, or ``close()``).

Requests are sent by one thread at a time. POSIX (os.fork, socket.send_fds).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct

_LEN = struct.Struct("!I")
_PID_STATUS = struct.Struct("!qq")  # (pid, wait status); the first message of a command carries status -1


def _exact(read, n: int) -> bytes:
    """n bytes from ``read(k)`` (a socket's recv, a pipe's os.read), however they arrive; EOFError at an end."""
    buf = b""
    while len(buf) < n:
        chunk = read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


class Child:
    """One command, as much of multiprocessing.Process as run_command uses: pid, join(timeout), is_alive(), kill(),
    exitcode (minus the signal's number when a signal ended it)."""

    def __init__(self, fd: int):
        self._fd = fd
        self.pid, _ = _PID_STATUS.unpack(_exact(lambda k: os.read(fd, k), _PID_STATUS.size))
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None:
            return
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return
        _, status = _PID_STATUS.unpack(_exact(lambda k: os.read(self._fd, k), _PID_STATUS.size))
        os.close(self._fd)
        self.exitcode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None

    def kill(self) -> None:
        if self.exitcode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """``start(target, *args) -> Child``: ``target(*args)`` in a grandchild of the zygote. ``target`` is a
    module-level function (sent by name; the zygote has its module) that ends its process with os._exit."""

    def __init__(self):
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote
            mine.close()
            _serve(theirs)
        theirs.close()
        self._sock, self.pid = mine, pid

    def start(self, target, *args, preload: tuple[str, ...] = ()) -> Child:
        """``preload``: modules the zygote imports before it forks (a run of one test file may not have), so that no
        command imports them on its own."""
        data = pickle.dumps((tuple(preload), target.__module__, target.__qualname__, args))
        self._sock.sendall(_LEN.pack(len(data)) + data)
        _, fds, _, _ = socket.recv_fds(self._sock, 1, 1)
        return Child(fds[0])

    def close(self) -> None:
        self._sock.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _serve(sock: socket.socket) -> None:  # pragma: no cover - runs in the zygote
    """Answer requests until the other end closes, then exit. Nothing of the test process's is used: stdin, stdout
    and stderr become /dev/null and every other inherited descriptor (pytest-xdist's channel) is closed."""
    import faulthandler
    import importlib

    code = 0
    try:
        faulthandler.disable()  # pytest's writes to a descriptor closed below, which a command's file may reuse
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        keep = sock.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, 65536)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run is the test process's to handle
        while True:
            try:
                (n,) = _LEN.unpack(_exact(sock.recv, _LEN.size))
                preload, module, name, args = pickle.loads(_exact(sock.recv, n))
            except EOFError:
                break
            for m in preload:
                importlib.import_module(m)
            target = importlib.import_module(module)
            for part in name.split("."):
                target = getattr(target, part)
            r, w = os.pipe()
            if os.fork() == 0:
                _monitor(sock, r, w, target, args)
            os.close(w)
            socket.send_fds(sock, [b"x"], [r])
            os.close(r)
            while True:  # reap the monitors that are done
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
    except BaseException:  # noqa: BLE001
        code = 3
    os._exit(code)


def _monitor(sock: socket.socket, r: int, w: int, target, args) -> None:  # pragma: no cover - a monitor
    sock.close()
    os.close(r)
    pid = os.fork()
    if pid == 0:
        os.close(w)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the command's own handlers are its to install
        try:
            target(*args)
        finally:
            os._exit(3)
    os.write(w, _PID_STATUS.pack(pid, -1))
    _, status = os.waitpid(pid, 0)
    os.write(w, _PID_STATUS.pack(pid, status))
    os._exit(0)
