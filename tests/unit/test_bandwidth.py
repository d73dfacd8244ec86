"""What a disk can take from the store (eagle3/store/bandwidth.py, `eagle3 bench disk`)."""

import errno
import os
import re

import pytest

from eagle3 import cli
from eagle3.store import bandwidth

MiB = 1 << 20


def test_a_round_writes_each_writer_s_files_fsynced_or_not_and_leaves_none(tmp_path, monkeypatch):
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_size), real_fsync(fd))[1])
    assert bandwidth.write_round(tmp_path, True, writers=3, files=2, file_bytes=2 * MiB) == 3 * 2 * 2 * MiB
    assert synced == [2 * MiB] * 6  # every file whole when fsynced
    assert list(tmp_path.iterdir()) == []
    synced.clear()
    assert bandwidth.write_round(tmp_path, False, writers=2, files=1, file_bytes=MiB) == 2 * MiB
    assert synced == [] and list(tmp_path.iterdir()) == []


def test_a_writer_s_error_is_raised_and_no_file_is_left(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        bandwidth.write_round(tmp_path, True, writers=2, files=2, file_bytes=MiB)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="whole number of MiB"):
        bandwidth.write_round(tmp_path, False, file_bytes=MiB + 1)


def test_the_figure_is_the_median_of_the_timed_rounds_after_the_warm_up(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bandwidth, "write_round", lambda *a: calls.append(a) or 100)
    fig = bandwidth.measure(tmp_path, True, 2, 1, MiB, rounds=3, warmup=1)
    assert len(calls) == 4 and len(fig.seconds) == 3 and fig.round_bytes == 100
    assert bandwidth.DiskFigure(True, 100, [1.0, 4.0, 2.0]).bytes_per_s == 50.0


def test_cli_bench_disk_prints_each_limit_in_tokens_a_second(tmp_path, capsys):
    assert (
        cli.main(
            [
                "bench",
                "disk",
                "--dir",
                str(tmp_path),
                "--writers",
                "2",
                "--files",
                "1",
                "--file-mb",
                "1",
                "--rounds",
                "1",
                "--bytes-per-token",
                "28672",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("2 writers x 1 files x 1 MiB a round") == 2
    for name in ("fsync", "page cache"):
        m = re.search(rf"^{name} +([\d.,]+) GB/s = ([\d,]+) tok/s at 28,672 B a token", out, re.M)
        assert m, out
        gbs, tps = float(m[1].replace(",", "")), int(m[2].replace(",", ""))
        assert abs(tps - gbs * 1e9 / 28672) <= 0.006e9 / 28672 + 1, out  # the rate printed is the one converted
    assert list(tmp_path.iterdir()) == []


def test_cli_bench_disk_measures_each_kind_with_the_store_s_own_writers(tmp_path, monkeypatch, capsys):
    """A limit is read against the store that writes like it: fsynced with 4 threads, into the page cache with 8
    (store/writer.py: writer_threads); --writers N measures both with N."""
    calls = []
    monkeypatch.setattr(
        bandwidth,
        "measure",
        lambda d, fsync, writers, *a: calls.append((fsync, writers)) or bandwidth.DiskFigure(fsync, 10**9, [1.0]),
    )
    assert cli.main(["bench", "disk", "--dir", str(tmp_path)]) == 0
    assert calls == [(True, 4), (False, 8)]
    out = capsys.readouterr().out
    assert "4 writers x 4 files x 512 MiB a round (the store's writes, fsync)" in out
    assert "8 writers x 4 files x 512 MiB a round (the store's writes, page cache)" in out
    calls.clear()
    assert cli.main(["bench", "disk", "--dir", str(tmp_path), "--writers", "3"]) == 0
    assert calls == [(True, 3), (False, 3)]


def test_cli_bench_disk_refuses_what_cannot_run_naming_the_fix(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    assert cli.main(["bench", "disk", "--dir", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert cli.main(["bench", "disk", "--dir", str(tmp_path / "f")]) == 2
    assert "f: is a file; give a folder" in capsys.readouterr().err
    (tmp_path / "f").unlink()
    with pytest.raises(SystemExit) as e:  # refused by the argument parser, as every number out of range
        cli.main(["bench", "disk", "--dir", str(tmp_path), "--writers", "0"])
    assert e.value.code == 2 and "--writers: 0 is not a positive integer" in capsys.readouterr().err
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**30, 9 * 2**30, 2**30))
    assert cli.main(["bench", "disk", "--dir", str(tmp_path)]) == 2  # 8 x 512 MiB at once (page cache), 1 GiB free
    err = capsys.readouterr().err
    assert "8 writers x 512 MiB need 4.0 GiB at once and 1.0 GiB are free; give a smaller --file-mb" in err
    monkeypatch.undo()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert cli.main(["bench", "disk", "--dir", str(tmp_path), "--writers", "1", "--files", "1", "--file-mb", "1"]) == 2
    assert "No space left on device. Free space there" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_extraction_summary_says_its_write_rate_beside_the_disk_s():
    from eagle3.extract.extract import ExtractSummary

    lines = ExtractSummary("s", 2, 0, 2, 1000, 2.0, 3 * 10**9).lines()
    assert "bytes      2,861.0 MiB = 1.50 GB/s (`eagle3 bench disk` says what the disk can take)" in lines
    assert "bytes      2.9 MiB = 1.5 MB/s (" in ExtractSummary("s", 2, 0, 2, 1000, 2.0, 3 * 10**6).lines()[3]
