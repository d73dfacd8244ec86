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


def test_recorded_states_are_the_backend_s_own_each_sample_its_own(tiny_kimi, small_data, tokenizer):
    """RecordedStates gives each sample exactly the states the hf backend gives it, whatever shares its batch and in
    whatever order it is asked, and asks the backend once per distinct sample."""
    import torch

    from eagle3.data.conversations import DataConfig, load_samples
    from eagle3.extract.hf_backend import HFBackend

    from .conftest import RecordedStates

    samples, _ = load_samples(DataConfig([str(small_data)], max_len=48, max_samples=5), tokenizer)
    backend = HFBackend(tiny_kimi, (2, 4, 5, 8), out_dtype="bfloat16")
    calls = []
    real = backend.capture
    backend.capture = lambda batch: calls.append(len(batch)) or real(batch)
    recorded = RecordedStates(backend)
    recorded.record(samples[:2])
    asked = [samples[4], samples[0], samples[4], samples[2], samples[1], samples[3]]
    got = recorded.capture(asked)
    want = real(asked)
    assert len({tuple(s.input_ids) for s in samples}) == 5  # distinct samples: a mix-up would show
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert calls == [2, 3] and recorded.asked == 6 and recorded.name == "hf"
    got[0].zero_()  # a caller's change is its own
    assert torch.equal(recorded.capture([samples[4]])[0], want[0])
