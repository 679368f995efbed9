"""The API reference builds from the docstrings, and every documented name has one that says what
it takes, returns and raises (Google style). The HTML: the README's ``python -m pdoc -d google
strategy ... -o docs/api`` command (its module list is checked against ``PAGES`` here).

Rules, for each public (no leading ``_``) function, class and method of the surface below:

- a docstring; a method without one may inherit it from the ``strategy`` method it overrides;
- ``Args:`` naming exactly its parameters (``_``-prefixed ones may be left out); a class's
  ``__init__`` parameters go in the class or the ``__init__`` docstring;
- ``Returns:`` (or ``Yields:``) when it returns something other than None (by its annotation, or
  by its ``return`` statements without one); properties need neither section;
- ``Raises:`` when its body raises (a bare re-raise aside) or calls ``fail(``;
- a dataclass needs only the class docstring and a doc for each field: ``doc(...)``'s help text
  (configs), a string literal under the field, or an ``Attributes:`` entry.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
import warnings
from pathlib import Path

import pdoc
import pdoc.render
import pytest

# The documented surface: these modules' ``__all__`` (the trainers' hooks are the product), and
# the facade.
MODULES = ("strategy", "strategy.config", "strategy.optim", "strategy.checkpoint",
           "strategy.export", "strategy.trainers")
CLASSES = ("strategy.deepspeed_strategy.DeepSpeedStrategy",)
# pdoc follows ``__all__``, which names no submodules: each page is asked for by name
PAGES = (*MODULES, "strategy.deepspeed_strategy")
SECTION = re.compile(r"^(\s*)(Args|Arguments|Returns|Yields|Raises|Example|Examples|Note|Notes|"
                     r"Attributes|See Also|Warning|Warnings):\s*$")
ENTRY = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:")
NOT_A_VALUE = {"None", "NoReturn", "typing.NoReturn", "Never"}


def _resolve(dotted: str):
    """The object a dotted name means: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _surface() -> dict[str, object]:
    """Qualified name -> function, class or (class, name) method, each once."""
    objects = [getattr(importlib.import_module(m), n) for m in MODULES
               for n in importlib.import_module(m).__all__]
    objects += [_resolve(c) for c in CLASSES]
    out: dict[str, object] = {}
    for obj in objects:
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # constants such as OPTIMIZERS
        out[f"{obj.__module__}.{obj.__qualname__}"] = obj
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if not name.startswith("_") and _function(member) is not None:
                    out[f"{obj.__module__}.{obj.__qualname__}.{name}"] = (obj, name)
    return dict(sorted(out.items()))


def _function(member):
    """The plain function behind a method, static/class method or property; None otherwise."""
    if isinstance(member, property):
        return member.fget
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    return member if inspect.isfunction(member) else None


def _node(obj) -> ast.FunctionDef | ast.ClassDef:
    return ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]


def _own_doc(obj) -> str | None:
    """The docstring written in the source (``@dataclass`` invents one when there is none)."""
    doc = ast.get_docstring(_node(obj))
    return inspect.cleandoc(doc) if doc else None


def _method_doc(cls: type, name: str) -> str | None:
    """The method's docstring, or the one of the ``strategy`` method it overrides."""
    for base in cls.__mro__:
        member = vars(base).get(name)
        if member is not None and base.__module__.startswith("strategy"):
            doc = _own_doc(_function(member))
            if doc:
                return doc
    return None


def _sections(doc: str) -> dict[str, list[str]]:
    """Google sections: name -> the lines under it."""
    out: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        match = SECTION.match(line)
        if match:
            current = out.setdefault(match.group(2), [])
        elif current is not None and line.strip():
            if not line.startswith((" ", "\t")):
                current = None  # back to prose
            else:
                current.append(line)
    return out


def _documented_args(lines: list[str]) -> set[str]:
    if not lines:
        return set()
    indent = len(lines[0]) - len(lines[0].lstrip())
    names = set()
    for line in lines:
        match = ENTRY.match(line)
        if match and len(line) - len(line.lstrip()) == indent:
            names.add(match.group(1).lstrip("*"))
    return names


def _params(node: ast.FunctionDef, method: bool, ignored: bool = False) -> list[str]:
    """The parameters to document (with ``ignored``: also those named ``_...``)."""
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    names += [a.arg for a in args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return [n for n in names if ignored or not n.startswith("_")]


def _raises(node: ast.AST) -> bool:
    """Its body raises an error of its own (a bare re-raise does not count) or calls ``fail``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Raise) and sub.exc is not None:
            return True
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "fail":
                return True
    return False


def _returns_value(node: ast.FunctionDef) -> str | None:
    """``Returns`` or ``Yields`` when the function gives back a value, else None."""
    body = [n for n in ast.walk(node) if n is not node]
    if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in body):
        yields_none = re.search(r"(Iterator|Generator)\[None\b", ast.unparse(node.returns or ""))
        return None if yields_none else "Yields"  # a context manager's bare ``yield``
    if node.returns is not None:
        text = ast.unparse(node.returns).strip("'\"")
        return None if text in NOT_A_VALUE else "Returns"
    values = [n.value for n in body if isinstance(n, ast.Return) and n.value is not None]
    return "Returns" if any(not (isinstance(v, ast.Constant) and v.value is None)
                            for v in values) else None


def _check_function(doc: str | None, node: ast.FunctionDef, method: bool,
                    is_property: bool = False) -> list[str]:
    if not doc:
        return ["no docstring"]
    sections, problems = _sections(doc), []
    if not is_property:
        params = _params(node, method)
        documented = _documented_args(sections.get("Args", sections.get("Arguments", [])))
        if params and not documented:
            problems.append(f"no Args: section for {', '.join(params)}")
        else:
            missing = [p for p in params if p not in documented]
            stale = sorted(documented - set(_params(node, method, ignored=True)))
            problems += [f"Args: lacks {', '.join(missing)}"] if missing else []
            problems += [f"Args: names {', '.join(stale)}, which it does not take"] if stale else []
        wanted = _returns_value(node)
        if wanted and not sections.get(wanted) and not sections.get("Returns"):
            problems.append(f"no {wanted}: section")
    if _raises(node) and not sections.get("Raises"):
        problems.append("no Raises: section (its body raises)")
    return problems


def _field_docs(cls: type) -> set[str]:
    """Fields followed by a string literal (pdoc shows it as the field's docstring)."""
    body = _node(cls).body
    return {stmt.target.id for stmt, after in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)}


def _check_class(cls: type) -> list[str]:
    doc = _own_doc(cls)
    if not doc:
        return ["no class docstring"]
    if dataclasses.is_dataclass(cls):
        documented = _field_docs(cls) | _documented_args(_sections(doc).get("Attributes", []))
        bare = [f.name for f in dataclasses.fields(cls)
                if f.init and not f.metadata.get("help") and f.name not in documented]
        return [f"undocumented fields (use doc(...), a docstring under the field or an "
                f"Attributes: entry): {', '.join(bare)}"] if bare else []
    init = vars(cls).get("__init__")
    if not inspect.isfunction(init):
        return []
    # __init__'s Args/Raises may sit in the class docstring or in __init__'s own
    init_doc = "\n\n".join(d for d in (doc, _own_doc(init)) if d)
    return [f"__init__: {p}" for p in _check_function(init_doc, _node(init), method=True)]


def _problems(obj) -> list[str]:
    if inspect.isclass(obj):
        return _check_class(obj)
    if isinstance(obj, tuple):
        cls, name = obj
        member = vars(cls)[name]
        return _check_function(_method_doc(cls, name), _node(_function(member)),
                               method=not isinstance(member, staticmethod),
                               is_property=isinstance(member, property))
    return _check_function(_own_doc(obj), _node(obj), method=False)


SURFACE = _surface()


@pytest.mark.parametrize("qualname", list(SURFACE))
def test_docstring(qualname):
    problems = _problems(SURFACE[qualname])
    assert not problems, f"{qualname}: {'; '.join(problems)}"


def test_api_reference_builds(tmp_path):
    """pdoc renders the surface's pages without a warning (unresolvable annotations, bad
    docstrings), one page per module the README's command names."""
    pdoc.render.configure(docformat="google", search=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*PAGES, output_directory=tmp_path)
    ours = [f"{w.category.__name__}: {w.message}" for w in caught
            if "pdoc" in Path(w.filename).parts]
    assert not ours, "pdoc warned:\n" + "\n".join(ours)
    pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    assert {m.replace(".", "/") + ".html" for m in PAGES} <= pages


def test_readme_command_builds_the_same_pages():
    """The README's API reference command names exactly the modules built here."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    command = re.search(r"python -m pdoc ([^`]*)-o docs/api", readme)
    assert command, "README.md lost its `python -m pdoc ... -o docs/api` line"
    assert command.group(1).replace("\\", " ").split() == ["-d", "google", *PAGES]


def test_docstring_references_resolve():
    """A ``strategy.x.y`` named in a documented docstring exists (a rename breaks the link)."""
    broken = []
    for qualname, obj in SURFACE.items():
        target = _function(vars(obj[0])[obj[1]]) if isinstance(obj, tuple) else obj
        for ref in re.findall(r"`(strategy(?:\.\w+)+)`", inspect.getdoc(target) or ""):
            try:
                _resolve(ref)
            except (ImportError, AttributeError):
                broken.append(f"{qualname}: {ref}")
    assert not broken, "docstrings name what does not exist:\n" + "\n".join(broken)
