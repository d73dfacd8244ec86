"""The house reads as the pipeline (issue 17): eagle3's folders are its stages, imports go one way only
(a stage imports earlier stages, never later ones), no import circles between modules (counting imports inside
functions too), and every module imports on its own in a fresh interpreter."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import eagle3

PKG = Path(eagle3.__file__).parent
# the order a module may import in: base helpers, then the pipeline's stages, then the commands on top
ORDER = ["base", "data", "targets", "store", "extract", "train", "serve", "commands"]
BASE = {"preflight", "faults", "ownership", "interrupt", "machine"}
COMMANDS = {"cli", "doctor", "bench"}


def modules() -> dict[str, Path]:
    """Dotted module names under eagle3 (without the 'eagle3.' prefix) -> their files."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if parts:
            out[".".join(parts)] = f
    return out


def resolve(name: str, known) -> str | None:
    """The longest known module that a dotted import names (eagle3.store.folder.Store -> store.folder)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "eagle3":
                base = node.module.removeprefix("eagle3").lstrip(".")
                for a in node.names:  # `from eagle3.extract import selfcheck` names a module
                    hit = resolve(f"{base}.{a.name}".lstrip("."), mods) or resolve(base, mods)
                    if hit:
                        deps.add(hit)
            elif isinstance(node, ast.Import):
                deps |= {
                    resolve(a.name.removeprefix("eagle3."), mods) for a in node.names if a.name.startswith("eagle3.")
                } - {None}
        graph[name] = deps - {name}
    return graph


def stage(module: str) -> str:
    top = module.split(".")[0]
    if top in BASE:
        return "base"
    if top in COMMANDS:
        return "commands"
    assert top in ORDER, f"eagle3/{top}: a module outside the stage folders; put it in one (or in BASE/COMMANDS)"
    return top


def cycles(graph):
    found, state = [], {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(path[path.index(m) :] + [m])
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def test_no_import_circles():
    graph = import_graph()
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]  # the detector detects
    assert "store.folder" in graph["extract.extract"] and "extract.selfcheck" in graph["extract.extract"]
    assert cycles(graph) == []


def test_imports_go_from_later_stages_to_earlier_ones_only():
    graph = import_graph()
    back = sorted(
        f"{a} ({stage(a)}) imports {b} ({stage(b)})"
        for a, deps in graph.items()
        for b in deps
        if ORDER.index(stage(b)) > ORDER.index(stage(a))
    )
    assert back == []


def test_the_tree_is_the_pipeline():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ORDER) - {"base", "commands"}
    loose = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert loose == BASE | COMMANDS, loose


@pytest.fixture(scope="module")
def fresh_interpreter() -> dict:
    """One fresh interpreter: it imports every module, then resolves the worker extension by its dotted name as vLLM's
    spawned workers do. Returns {"imported": "ok" or the error, "extension": the class has eagle3_setup}."""
    from eagle3.extract.vllm_compat import WORKER_EXTENSION

    code = (
        "import importlib, json, sys, traceback\n"
        "try:\n    [importlib.import_module(m) for m in sys.argv[2:]]; imported = 'ok'\n"
        "except Exception:\n    imported = traceback.format_exc()\n"
        "mod, _, cls = sys.argv[1].rpartition('.')\n"
        "try:\n    extension = hasattr(getattr(importlib.import_module(mod), cls), 'eagle3_setup')\n"
        "except Exception:\n    extension = traceback.format_exc()\n"
        "print(json.dumps({'imported': imported, 'extension': extension}))"
    )
    mods = [f"eagle3.{m}" for m in modules()]
    out = subprocess.run(
        [sys.executable, "-c", code, WORKER_EXTENSION, *mods], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_every_module_imports_in_a_fresh_interpreter(fresh_interpreter):
    assert fresh_interpreter["imported"] == "ok", fresh_interpreter["imported"][-2000:]


def test_the_worker_extension_vllm_loads_by_name_resolves_in_a_fresh_interpreter(fresh_interpreter):
    """vLLM's spawned workers import WORKER_EXTENSION by its dotted name: after the move into eagle3/extract/, a
    stale string would only fail on the GPU."""
    assert fresh_interpreter["extension"] is True, fresh_interpreter["extension"]


# Modules nothing in the package imports, yet the product runs: the command line (the `eagle3` script) and
# vLLM's worker extension (its dotted name handed to vLLM, which imports it in each worker).
ENTRY_POINTS = {"cli": "eagle3.cli:main", "extract.vllm_worker": "eagle3.extract.vllm_worker."}


def imported_only_by_tests(graph: dict[str, set[str]]) -> list[str]:
    used = set().union(*graph.values())
    packages = {m for m, f in modules().items() if f.name == "__init__.py"}
    return sorted(m for m in graph if m not in used and m not in packages and m not in ENTRY_POINTS)


def test_every_package_module_is_used_by_the_package_not_only_by_tests():
    """Code that only tests and benchmarks use lives under tests/ (tests/perf/ for the benchmarks' helpers)."""
    assert imported_only_by_tests(import_graph()) == []
    sources = "".join(f.read_text() for f in modules().values()) + (PKG.parent / "pyproject.toml").read_text()
    assert all(name in sources for name in ENTRY_POINTS.values())  # each entry point is named where it is used
    assert imported_only_by_tests({"a": {"b"}, "b": set(), "c": set()}) == ["a", "c"]
