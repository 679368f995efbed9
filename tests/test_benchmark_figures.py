"""Figures the docs state come from a benchmark's results file (benchmarks/results/*.json,
written by the script), so a figure cannot go stale silently: each page's generated block equals
what the script renders from its file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_state_the_ray_figures_of_its_results_file():
    rows = json.loads((ROOT / "benchmarks" / "results" / "ray.json").read_text())
    for row in rows:  # the fields every results row holds
        assert {"figure", "value", "range", "rounds", "date", "commit", "machine"} <= set(row)
        assert row["range"][0] <= row["value"] <= row["range"][1], row["figure"]
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split("<!-- bench_ray: python benchmarks/bench_ray.py --table -->\n", 1)[1]
    assert block.split("<!-- end bench_ray -->", 1)[0] == _script("bench_ray").markdown(rows), (
        "run python benchmarks/bench_ray.py --table into docs/benchmarks.md")
