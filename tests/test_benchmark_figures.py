"""Figures the docs state come from a benchmark's results file (benchmarks/results/*.json,
written by the script), so a figure cannot go stale silently: each page's generated block equals
what the script renders from its file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES = [  # (results file, page, the block's first line, the script, what renders it)
    ("ray", "docs/benchmarks.md", "<!-- bench_ray: python benchmarks/bench_ray.py --table -->",
     "bench_ray", "markdown"),
    ("default", "README.md",
     "<!-- bench_default: python benchmarks/bench_default.py --readme -->", "bench_default",
     "readme"),
    ("ci", "README.md", "<!-- bench_ci: python benchmarks/bench_ci.py --readme -->", "bench_ci",
     "readme"),
    ("ci", "docs/ci.md", "<!-- bench_ci: python benchmarks/bench_ci.py --docs -->", "bench_ci",
     "docs"),
    ("run_grpo", "README.md",
     "<!-- bench_run_grpo: python benchmarks/bench_run_grpo.py --readme -->", "bench_run_grpo",
     "readme"),
    ("dynamic_batch", "docs/benchmarks.md",
     "<!-- bench_dynamic_batch: python benchmarks/bench_dynamic_batch.py --docs -->",
     "bench_dynamic_batch", "docs"),
]


@pytest.mark.parametrize("results, page, marker, script, render", PAGES,
                         ids=[p[0] + ":" + p[1] for p in PAGES])
def test_each_stated_figure_is_its_results_files(results, page, marker, script, render):
    """Each results row holds where and how it was measured; each page's block is what the
    script renders from the file (so a figure cannot be typed by hand, or go stale)."""
    rows = json.loads((ROOT / "benchmarks" / "results" / f"{results}.json").read_text())
    for row in rows:  # the fields every results row holds
        assert {"figure", "value", "range", "rounds", "date", "commit", "machine",
                "command"} <= set(row)
        assert row["range"][0] <= row["value"] <= row["range"][1], row["figure"]
    text = (ROOT / page).read_text()
    assert marker + "\n" in text, f"{page} has no block {marker}"
    block = text.split(marker + "\n", 1)[1].split(f"<!-- end {script} -->", 1)[0]
    flag = marker.split(f"{script}.py ", 1)[1].removesuffix(" -->")
    assert block == getattr(_script(script), render)(rows), (
        f"run python benchmarks/{script}.py {flag} into {page}")
