"""Deferred: a training run's first Ctrl-C / SIGTERM waits for the step in progress; a second acts at once; the
handlers are as before once the run leaves."""

import os
import signal

import pytest

from eagle3.interrupt import Deferred, Interrupted


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_is_held_the_second_acts_and_the_handlers_come_back(sig):
    def raising(signum, frame):
        raise Interrupted(signum)

    before = {s: signal.signal(s, raising) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Deferred() as stop:
            os.kill(os.getpid(), sig)
            assert stop.signum == sig  # held: the step goes on
            with pytest.raises(Interrupted) as e:
                os.kill(os.getpid(), sig)  # again: at once, through the handler that was there
            assert e.value.signum == sig
        assert signal.getsignal(signal.SIGINT) is raising and signal.getsignal(signal.SIGTERM) is raising
        with Deferred() as quiet:
            pass
        assert quiet.signum is None and signal.getsignal(signal.SIGINT) is raising
    finally:
        for s, h in before.items():
            signal.signal(s, h)
