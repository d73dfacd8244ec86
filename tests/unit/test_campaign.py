"""The GPU campaign's start (tests/gpu/campaign.sh): what a host kept from an earlier lease is not read as this run's."""

import os
import subprocess
from pathlib import Path

CAMPAIGN = Path(__file__).resolve().parents[1] / "gpu" / "campaign.sh"


def test_a_campaign_starts_on_an_empty_results_folder_and_keeps_the_old_one_aside(tmp_path):
    """Session 16: the H200 host had /tmp/campaign from a lease the day before (online/report.json,
    e2e/e2e_eval_seed1.json); this run's e2e folder held the old seed-1 and misaligned evals beside its own seed-0,
    and wait.sh returns any online/report.json as this run's. The old folder is moved aside, not deleted."""
    out, src, tree = tmp_path / "campaign", tmp_path / "src", tmp_path / "tree"
    (out / "online").mkdir(parents=True)
    (out / "online" / "report.json").write_text('{"old": true}')
    (out / "DONE").write_text("DONE")
    tree.mkdir()
    (tree / "marker").write_text("the working tree")
    env = dict(os.environ, CAMPAIGN_OUT=str(out), CAMPAIGN_SRC=str(src))
    r = subprocess.run(["bash", str(CAMPAIGN), "nostep"], cwd=tree, capture_output=True, text=True, timeout=120,
                       env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert not (out / "online").exists(), sorted(p.name for p in out.iterdir())
    assert (out / "DONE").read_text().strip() == "DONE" and (out / "host.txt").exists()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("campaign.")]
    assert len(kept) == 1 and (kept[0] / "online" / "report.json").read_text() == '{"old": true}'
    assert (src / "marker").read_text() == "the working tree"
