"""The house reads as the pipeline (issue 17): no import circles between eagle3's modules (counting imports
inside functions too), and every module imports on its own."""

import ast
import subprocess
import sys
from pathlib import Path

import eagle3

PKG = Path(eagle3.__file__).parent


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for f in sorted(PKG.glob("*.py")):
        name = f.stem
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3"):
                if node.module == "eagle3":
                    deps |= {a.name for a in node.names}
                else:
                    deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("eagle3.")}
        graph[name] = deps - {name}
    return graph


def cycles(graph):
    found, state = [], {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(path[path.index(m):] + [m])
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
    assert cycles(graph) == []


def test_every_module_imports_in_a_fresh_interpreter():
    mods = [f"eagle3.{f.stem}" for f in sorted(PKG.glob("*.py")) if f.stem != "__init__"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
