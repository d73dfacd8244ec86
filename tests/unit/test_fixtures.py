"""The suite's own machinery that tests lean on (conftest): a fixture built once for every pytest-xdist worker."""

import os
import time
import types

import pytest

from .conftest import once_per_run


def test_a_fixture_built_once_per_run_is_built_once_however_many_workers_ask(tmp_path):
    """Three processes ask at once (as three workers do): one builds, all get its folder and value; a build that
    raised leaves nothing the next asker takes for done."""
    factory = types.SimpleNamespace(getbasetemp=lambda: tmp_path)
    log = tmp_path / "builds.log"

    def build(folder):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.3)  # the others ask meanwhile
        (folder / "x").write_text("made")
        return {"folder": folder}

    def ask() -> bool:
        got = once_per_run(factory, "thing", build)
        return (got["folder"] / "x").read_text() == "made"

    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - a child: exits 0 if what it got was right
            ok = False
            try:
                ok = ask()
            finally:
                os._exit(0 if ok else 1)
        children.append(pid)
    assert ask()
    assert [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in children] == [0, 0]
    assert log.read_text() == "built\n"

    def broken(folder):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        once_per_run(factory, "other", broken)
    assert once_per_run(factory, "other", lambda folder: 7) == 7


def _exit_with(code: int) -> None:  # pragma: no cover - in a grandchild of the zygote
    os._exit(code)


def _sleep_then_exit() -> None:  # pragma: no cover - in a grandchild of the zygote
    time.sleep(60)
    os._exit(0)


def _write_parent(path: str) -> None:  # pragma: no cover - in a grandchild of the zygote
    with open(path, "w") as f:
        f.write(str(os.getppid()))
    os._exit(0)


def test_the_zygote_reports_each_command_s_exit_and_kill(tmp_path):
    """run_command's children (tests/unit/zygote.py): the exit code comes back; a command killed comes back as minus
    the signal; two at once are each their own; the command is forked by the zygote's monitor, not by this process
    (what a lock held here would do: test_nothing_lost's test_a_lock_held_in_the_test_process_does_not_reach_...)."""
    import signal

    from .zygote import Zygote

    z = Zygote()
    try:
        slow, quick = z.start(_sleep_then_exit), z.start(_exit_with, 7)
        quick.join(30)
        assert quick.exitcode == 7 and slow.is_alive()
        slow.kill()
        slow.join(30)
        assert slow.exitcode == -signal.SIGKILL
        seen = tmp_path / "seen"
        z.start(_write_parent, str(seen)).join(30)
        assert int(seen.read_text()) not in (os.getpid(), z.pid)  # its monitor's child
    finally:
        z.close()
