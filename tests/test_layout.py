"""The package's shape: no import cycles, imports flowing one way between subsystems, imports at
the top of modules (or a comment saying why not), and ruff clean at 100 columns."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "strategy"

# Each component may import only components of a lower layer (and itself). The same order is
# written in strategy/__init__.py and in each folder's docstring.
LAYERS = {
    "errors": 0,
    "dtypes": 1,
    "internals": 1,
    "log": 1,
    "dist": 2,
    "atomic_fs": 2,
    "config": 3,
    "agents": 3,  # agent files' base classes
    "tools": 4,  # tool calls through chat templates: a built-in agent
    "optim": 4,
    "checkpoint": 4,
    "sampler": 4,
    "metrics": 4,
    "lora": 4,
    "quant": 3,
    "ops": 4,
    "ema": 4,
    "attention": 4,
    "model": 5,
    "parallel": 6,
    "export": 7,
    "decode": 5.5,  # imports model; rollout uses it
    "rollout": 7.5,
    "engines": 7.6,
    "deepspeed_strategy": 8,
    "trainers": 9,
    "demos": 10,
    "cluster": 10.5,  # a Ray job's driver: runs the trainers' commands on Ray actors
    "cli": 11,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` refers to, or its nearest package that is one of ours."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """Our modules a file imports, plus the packages above each (importing ``a.b.c`` runs
    ``a/b/__init__``). Implied packages that already enclose the importing module are left out:
    Python runs those first, so they cannot close a cycle (an explicit import of one still can)."""
    own = _ancestors(module_name(path))
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _target(name, known)
            if target:
                found.add(target)
            found |= {package for package in _ancestors(target or "") if package not in own}
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 30 and any(graph.values()), "the graph is empty: the parser found nothing"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _component(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_imports_flow_one_way_between_layers():
    bad = []
    for module, targets in import_graph().items():
        own = _component(module)
        if not own:
            continue  # strategy/__init__.py re-exports the public API
        assert own in LAYERS, f"{module}: add its component {own!r} to LAYERS"
        for target in targets:
            other = _component(target)
            if other != own and LAYERS[other] >= LAYERS[own]:
                bad.append(f"{module} imports {target} (layer {LAYERS[other]} >= {LAYERS[own]})")
    assert not bad, "\n".join(bad)


def _function_imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    yield inner


def test_imports_inside_functions_say_why():
    """An import below the top of a module is allowed for an optional dependency or a heavy import
    on a rarely taken path, with a comment on its line saying which."""
    bare = []
    for path in modules().values():
        lines = path.read_text().splitlines()
        for node in _function_imports(ast.parse(path.read_text())):
            if "#" not in lines[node.lineno - 1]:
                bare.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                )
    assert not bare, "imports inside functions without a reason:\n" + "\n".join(bare)


def test_every_folder_says_what_it_may_import():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init.relative_to(ROOT)} needs a paragraph on what lives there"
        if init.parent != PACKAGE:
            assert "May import" in doc, f"{init.relative_to(ROOT)}: say what it may import"


@pytest.mark.skipif(
    shutil.which("ruff") is None and importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed (pip install -e .[dev])",
)
def test_ruff_clean():
    proc = subprocess.run(
        ["ruff", "check", "strategy", "tests", "examples", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# Inside trainers/, concerns import one way too: losses, then data, then the loop, then the
# wiring (run: it names no algorithm), then the algorithms and the package's public names.
TRAINER_LAYERS = {"config": 0, "losses": 1, "data": 2, "loop": 3, "run": 3.5, "algorithms": 4,
                  "recipe": 6}


def test_run_imports_no_algorithm():
    """``Run`` (flags to strategy, model, loaders) names no algorithm: a trainer's own configs,
    checks, loaders and extra models live with it."""
    targets = import_graph()["strategy.trainers.run"]
    assert targets, "the import graph found run.py's imports"
    assert not [t for t in targets if t.startswith("strategy.trainers.algorithms")], targets
    source = (PACKAGE / "trainers" / "run.py").read_text()
    for word in ("GRPO", "PPO", "DPO", "critic", "reward"):
        assert word not in source, f"run.py mentions {word}"


def test_trainer_concerns_import_one_way():
    bad = []
    for module, targets in import_graph().items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] != "trainers":
            continue
        own = parts[2]
        assert own in TRAINER_LAYERS, f"{module}: add {own!r} to TRAINER_LAYERS"
        for target in targets:
            other = target.split(".")
            if len(other) < 3 or other[1] != "trainers" or other[2] == own:
                continue
            if TRAINER_LAYERS[other[2]] >= TRAINER_LAYERS[own]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(bad)


BASE_LOOP = PACKAGE / "trainers" / "loop" / "trainer.py"


def base_trainer_private_names(source: str) -> set[str]:
    """Underscored members of ``Trainer``: its methods and the ``self._x`` it assigns."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    names = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self" and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses(source: str, private: set[str], where: str) -> list[str]:
    """Reads, writes or overrides of ``private`` names in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{where}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and item.name in private:
                    found.append(f"{where}:{item.lineno}: overrides {item.name}")
    return found


def test_private_access_detector_catches_a_planted_use():
    private = base_trainer_private_names(BASE_LOOP.read_text())
    assert {"_loss_scale", "_micro_counts", "_resume", "_after_step"} <= private
    planted = ("class GRPO(Trainer):\n    def _resume(self):\n        self._loss_scale = 2\n"
               "        return trainer._micro_counts\n")
    assert len(private_uses(planted, private, "planted")) == 3


def test_no_module_reaches_into_the_base_trainer():
    """Built-in trainers, examples and benchmarks use only the public Trainer API: nothing
    outside the base loop's module overrides or reads an underscored member of ``Trainer``."""
    private = base_trainer_private_names(BASE_LOOP.read_text())
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "examples").glob("*.py"),
             *(ROOT / "benchmarks").glob("*.py")]
    found = []
    for path in files:
        if path != BASE_LOOP:
            found += private_uses(path.read_text(), private, str(path.relative_to(ROOT)))
    assert not found, "private Trainer members used outside its module:\n" + "\n".join(found)
