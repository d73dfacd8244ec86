"""The repository's documents: every relative link resolves, and no tracked file outside the CHANGELOG names a
work session by number (a measured run is named by date, commit, hardware and vLLM version)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
SESSION = re.compile(r"session[\s_-]*\d", re.IGNORECASE)


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def broken_links(path: Path) -> list[str]:
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same file
            if not (path.parent / target.split("#")[0]).exists():
                bad.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    return bad


def test_every_relative_link_in_the_markdown_files_resolves():
    files = [ROOT / f for f in tracked() if f.endswith(".md")]
    assert len(files) > 5
    bad = [b for f in files for b in broken_links(f)]
    assert bad == []


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("[ok](a.md) [web](https://x.org) [here](#top)\n[gone](docs/none.md)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(tmp_path / "a.md") == ["a.md:2: docs/none.md"]
    finally:
        ROOT = saved


def test_no_tracked_file_outside_the_changelog_names_a_session_by_number():
    found = []
    for f in tracked():
        p = ROOT / f
        if "CHANGELOG" in p.name or not p.is_file() or p.suffix in (".png", ".gz"):
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{f}:{n}" for n, line in enumerate(text.splitlines(), 1) if SESSION.search(line)]
        if SESSION.search(f):
            found.append(f)
    assert found == [], found[:20]
    word = "sess" + "ion"  # spelled apart, so this file passes its own check
    assert (
        SESSION.search(f"in {word.title()} 12 we")
        and SESSION.search(f"baselines-{word}16")
        and not SESSION.search(f"a {word}'s time")
    )


def test_ci_runs_exactly_the_readme_s_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(scripts/setup-env && \S+.*?)\s+#", readme, re.M)
    assert len(commands) == 2 and "eagle3 demo" in commands[0] and commands[1].endswith("scripts/test"), commands
    script = (ROOT / "scripts/test").read_text()
    assert "ruff check" in script and "ruff format --check" in script and "pytest" in script
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("scripts/setup-env")]
    assert ci == [commands[1]]


# Words of how the project was built (machines borrowed for a time, their output folder), not of the software: a
# user has none of these. Spelled apart so this file passes its own check.
_L, _D, _O = "lea" + "se", "dev" + "ice", "$" + "OUT"
BUILD_WORDS = re.compile(
    rf"(?<![a-z]){_L}[sd]?(?![a-z])|{_D}[- ]time|{_D} machines?|\bgiven back\b|\bl" + r"ent\b|\bfl" + r"eet\b"
    rf"|{re.escape(_O)}\b|\bnext sess" + r"ion\b|\bthis sess" + r"ion's\b|\btak" + r"en back\b"
    r"|\bidle rel" + r"ease\b|\bs charg" + r"ed\b|\bgot no mach" + r"ine\b|\bloss of the mach" + r"ine\b",
    re.IGNORECASE,
)


def build_words(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if BUILD_WORDS.search(line)]


def test_no_tracked_file_speaks_of_the_machines_the_project_was_built_on():
    found = []
    for f in tracked():
        p = ROOT / f
        if not p.is_file() or p.suffix in (".png", ".gz", ".whl"):
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{f}:{n}" for n in build_words(text)] + ([f] if BUILD_WORDS.search(f) else [])
    assert found == [], f"{len(found)} lines, first: {found[:20]}"


@pytest.mark.parametrize(
    "line, hit",
    [
        (f"one {_L} of 1,800 s", True),
        (f"the {_L.title()}s were", True),
        (f"{_D.title()} time: 1,800 s", True),
        (f"copies results to {_O}/x", True),
        ("the machine was given " + "back", True),
        ("the host was tak" + "en back for other work", True),
        ("no H200 was l" + "ent", True),
        (f"def test_a_short_{_L}_measures_only(", True),  # inside a name, between underscores
        ("two runs lost to the idle rel" + "ease", True),
        ("the first call got no mach" + "ine (91 s charg" + "ed)", True),
        ("cut by the loss of the mach" + "ine during count", True),
        ("a machine without a GPU; the charged particle", False),
        ("the release of the lock", False),  # words that merely contain them
        ("a silent failure; the talent", False),
        ("a session's GIL sampler", False),
        ("the device's memory", False),
    ],
)
def test_the_build_word_check_sees_the_words_and_only_them(line, hit):
    assert bool(build_words(line)) == hit


def test_the_readme_fits_on_a_few_screens_and_gives_the_main_job_as_a_recipe():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    recipe = readme.split("## The main job", 1)[1].split("\n## ", 1)[0]
    for step in ("eagle3 extract", "--tp 8", "torchrun", "eagle3 train", "vllm serve", "eagle3 eval"):
        assert step in recipe, step


def long_markdown_lines(text: str) -> list[int]:
    """Lines over 120 characters outside tables and code, and table cells over 300 characters."""
    bad, fence = [], False
    for n, line in enumerate(text.splitlines(), 1):
        fence ^= line.startswith("```")
        if line.lstrip().startswith("|"):
            bad += [n] if any(len(cell) > 300 for cell in line.split("|")) else []
        elif len(line) > 120 and not fence:
            bad.append(n)
    return bad


def test_markdown_lines_are_at_most_120_characters_and_table_cells_at_most_300():
    files = [f for f in tracked() if f.endswith(".md") and not f.endswith("throughput.md")]  # bench report's output
    bad = [f"{f}:{n}" for f in files for n in long_markdown_lines((ROOT / f).read_text())]
    assert bad == []


def test_the_markdown_check_sees_long_lines_and_cells_but_not_code():
    assert long_markdown_lines("x" * 121 + "\n| " + "y" * 301 + " |\n```\n" + "z" * 200 + "\n```\n") == [1, 2]


FOLDER_OPTION = re.compile(r"--(gpu-out|target-model)[ \t]+[^\s`-]")  # a folder after a space, not after "="


def test_the_suite_s_folder_options_are_written_with_an_equals_sign():
    """`pytest -m gpu --gpu-out DIR`: pytest reads the command line before conftest.py declares the option, takes an
    existing DIR for a test path, finds no pyproject.toml above it and stops on "unrecognized arguments". Written
    `--gpu-out=DIR` it works. Run records under results/ and the CHANGELOG keep what was typed then."""
    history = (
        "results/",
        "CHANGELOG.md",
        "tests/MUTATIONS.md",
        "tests/unit/test_docs.py",
    )  # this file: the bug's words
    files = [f for f in tracked() if not f.startswith(history) and f.endswith((".md", ".py", ".sh", "steps"))]
    bad = [
        f"{f}:{n}: {line.strip()[:100]}"
        for f in files
        for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1)
        if FOLDER_OPTION.search(line)
    ]
    assert bad == [], "write --gpu-out=DIR and --target-model=PATH:\n" + "\n".join(bad)
