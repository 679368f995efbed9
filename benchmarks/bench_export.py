"""Exports compared side by side: streamed against whole-state-dict, live and offline.

    flock /tmp/heavy.lock python benchmarks/bench_export.py live [--hidden 2048 --layers 8]
    flock /tmp/heavy.lock python benchmarks/bench_export.py offline [--hidden 2048 --layers 3]
    flock /tmp/heavy.lock python benchmarks/bench_export.py sync [--hidden 2048 --layers 8]

``live``: ``save_model`` from a ZeRO-3 engine at 2 ranks against what the anchors do
(``engine._consolidated_16bit_state_dict()`` then rank 0 ``save_pretrained``, its files then
fsynced as ``save_model`` fsyncs its shards: the same work), a ~1.07 GB bf16
LLaMA (largest tensor: the 131 MB embedding). Each path is timed on rank 0 between barriers while a
thread samples rank 0's RSS every ~1 ms; "growth" is the peak minus the RSS just before the save.
``--rounds`` rounds in one process, the order alternating (streamed first, then whole first, ...);
median and range per path.

``offline``: a real checkpoint written by ``save_ckpt`` at 2 ranks (bf16 training, one optimizer
step), ZeRO-3 and ZeRO-2, of a ~1.13 GB-in-fp32 LLaMA (3 wide layers; largest tensor the 262 MB
fp32 embedding), turned into fp32 safetensors of at most ``--shard`` each by
(a) ``python -m strategy.export`` and (b) DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
then ``save_pretrained`` of a model built on the meta device with those tensors assigned (no
second copy). Each run is a fresh process; the two alternate (first one, then the other first)
for ``--rounds`` rounds. Inside the child, after the imports, freed memory is trimmed, the peak
(``VmHWM``) is reset through ``/proc/self/clear_refs`` and the baseline RSS read; "growth" is the
final ``VmHWM`` minus that baseline, "time" the export alone. The bound the streamed export must
meet is one shard + the largest fp32 tensor + 10%. The outputs of (a) and (b) are checked equal.

``sync`` (vLLM installed: ``.ci/vllm_cpu``): the same ZeRO-3 engine and LLaMA as ``live``, a
colocated vLLM engine on each rank (``--rollout_engine vllm``, eager), and its weight sync two
ways: streamed (``VllmRollout.sync``: the export's units gathered one bounded group at a time,
fed to vLLM's in-place reload) against gathering everything (every rank gathers the whole model,
``GatheredParameters`` over all parameters, and feeds vLLM's reload every tensor from it, then
releases it). Both reset the prefix cache. Timed on rank 0 between barriers, RSS sampled as in
``live``; after each sync the engine's greedy tokens for 4 prompts are taken, and must be the
same for both paths (the same weights loaded). (Engines apart from training are Ray actors:
``benchmarks/bench_ray.py`` times their sync.)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1e6
PATHS = {"strategy": "python -m strategy.export", "deepspeed": "zero_to_fp32 + save_pretrained"}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def rank_env(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden,
                       intermediate_size=args.hidden * 43 // 16, num_hidden_layers=args.layers,
                       num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)


def make_strategy(stage: int):
    from strategy import DeepSpeedStrategy, StrategyConfig

    persistence = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    overrides = persistence if stage == 3 else {}
    cfg = StrategyConfig(zero_stage=stage, bf16=True, micro_train_batch_size=1, train_batch_size=2,
                         seed=1, ds_config_overrides=overrides)
    strategy = DeepSpeedStrategy(cfg)
    strategy.setup_distributed()
    return strategy


# ------------------------------------------------------------ live: save_model vs consolidated


class PeakRSS:
    """Samples this process's RSS on a thread; ``growth`` is the peak over the baseline."""

    def __enter__(self) -> PeakRSS:
        trim()
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.growth = self.peak - self.base


def measure(s, fn) -> tuple[float, int]:
    s.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        fn()
        s.barrier()
        wall = time.perf_counter() - t0
    return wall, mem.growth


def whole_state_dict_save(engine, out: Path, shard: str) -> None:
    state = engine._consolidated_16bit_state_dict()  # every rank gathers; rank 0 keeps a full copy
    if torch.distributed.get_rank() == 0:
        engine.module.save_pretrained(str(out), state_dict=state, max_shard_size=shard)
        for path in out.iterdir():  # the same durability as save_model's: each file on disk
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    del state


def live_rank(rank: int, port: int, args) -> None:
    rank_env(rank, port)
    from strategy.export import save_model
    from strategy.export.shards import parse_size

    s = make_strategy(3)
    engine = s.prepare(s.from_pretrained(llama_config(args)))
    sizes = [p.ds_numel * p.element_size() for p in engine.module.parameters()]
    root = Path(args.out)
    paths = {"streamed save_model": lambda: save_model(engine, None, root / "streamed",
                                                       max_shard_size=args.shard),
             "whole state dict": lambda: whole_state_dict_save(engine, root / "whole", args.shard)}
    results = {name: [] for name in paths}
    for round_no in range(args.rounds):  # alternated: each path goes first in every other round
        for name in (list(paths) if round_no % 2 == 0 else list(reversed(paths))):
            results[name].append(measure(s, paths[name]))
    s.close()
    if rank == 0:
        live_report(results, sum(sizes), max(sizes), parse_size(args.shard), root)


def whole_sync(engine, rollout) -> None:
    """vLLM's weights from the whole gathered model: every rank holds it all during the reload."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        rollout.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": ((name, p.data) for name, p in params)})
    rollout.llm.reset_prefix_cache()


def whole_weights(engine, rollout):
    """The whole gathered model's tensors, an engine of its own's reload fed from them (its
    output layer untied, as ``sync`` sends it)."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        yield from rollout._untied([(name, param.data) for name, param in params])


def sync_rank(rank: int, port: int, args) -> None:
    rank_env(rank, port)
    from transformers import GenerationConfig

    from strategy.rollout.config import RolloutConfig

    s = make_strategy(3)
    engine = s.prepare(s.from_pretrained(llama_config(args)))
    sizes = [p.ds_numel * p.element_size() for p in engine.module.parameters()]
    rollout = s.rollout_engine(engine, "full", RolloutConfig(
        rollout_engine="vllm", vllm_enforce_eager=True), 32)
    prompts = torch.randint(1, 32000, (4, 8), generator=torch.Generator().manual_seed(rank))
    greedy = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    paths = {"streamed sync": rollout.sync,
             "whole-model sync": lambda: whole_sync(engine, rollout)}
    results, tokens = {name: [] for name in paths}, {name: [] for name in paths}
    for round_no in range(args.rounds + 1):  # round 0 warms both up
        for name in (list(paths) if round_no % 2 == 0 else list(reversed(paths))):
            timed = measure(s, paths[name])
            if round_no:
                results[name].append(timed)
            tokens[name].append(rollout.generate(prompts, torch.ones_like(prompts),
                                                 greedy).tolist())
    s.close()
    if rank == 0:
        same = tokens["streamed sync"] == tokens["whole-model sync"]
        sync_report(results, sum(sizes), max(sizes), same)


def sync_report(results: dict, total: int, largest: int, same: bool) -> None:
    rounds = len(next(iter(results.values())))
    where = "a colocated engine per rank"
    print(f"vLLM weight sync, model {total / MB:.0f} MB in bf16, largest tensor {largest / MB:.0f}"
          f" MB, 2 ranks, ZeRO-3, vllm-cpu eager, {where}, {rounds} rounds alternated after a "
          "warm-up each; median [min-max]")
    (t_s, g_s), (t_w, g_w) = _side_rows(results)
    ratios = [a[0] / b[0] for a, b in zip(*results.values())]
    print(f"streamed/whole time per round: {', '.join(f'{r:.2f}' for r in ratios)}; medians: "
          f"time {t_s / t_w:.2f}x, RSS growth {g_s / g_w:.2f}x; greedy tokens after each sync "
          f"{'the same' if same else 'DIFFERENT'} on both paths")


def _side_rows(results: dict) -> list[tuple[float, float]]:
    """Print each side's time and RSS growth; their medians (time, growth), side by side."""
    for name, runs in results.items():
        print(f"{name:>20}: time {_median_range([r[0] for r in runs])} s   peak rank-0 RSS "
              f"growth {_median_range([r[1] for r in runs], MB, '{:.0f}')} MB")
    return [tuple(statistics.median(r[i] for r in runs) for i in (0, 1))
            for runs in results.values()]


def _median_range(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    values = [v / scale for v in values]
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} [{fmt.format(low)}-{fmt.format(high)}]"


def live_report(results: dict, total: int, largest: int, shard: int, root: Path) -> None:
    rounds = len(next(iter(results.values())))
    print(f"model {total / MB:.0f} MB in bf16, largest tensor {largest / MB:.0f} MB, "
          f"max_shard_size {shard / MB:.0f} MB, 2 ranks, ZeRO-3, {rounds} rounds alternated; "
          "median [min-max]")
    (t_s, g_s), (t_w, g_w) = _side_rows(results)
    limit = (shard + largest) * 1.1
    worst = max(r[1] for r in results["streamed save_model"])
    print(f"ratios streamed/whole (medians): time {t_s / t_w:.2f}x, RSS growth {g_s / g_w:.2f}x")
    print(f"target RSS growth <= {limit / MB:.0f} MB in every round: "
          f"{'met' if worst <= limit else 'MISSED'}; "
          f"target time <= 1.1x: {'met' if t_s <= 1.1 * t_w else 'MISSED'}")
    check_same(root / "streamed", root / "whole")


def check_same(a: Path, b: Path) -> None:
    """Both exports hold the same tensors (read one shard file at a time)."""
    from safetensors import safe_open

    other = {}
    for f in sorted(b.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            other.update({k: f for k in sf.keys()})
    count = 0
    for f in sorted(a.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                with safe_open(other.pop(k), "pt") as theirs:
                    assert torch.equal(theirs.get_tensor(k), sf.get_tensor(k)), k
                count += 1
    assert not other, f"only in {b}: {sorted(other)[:5]}"
    print(f"both exports hold the same {count} tensors")


# ------------------------------------------------------------ offline: checkpoint -> HF directory


def checkpoint_rank(rank: int, port: int, args, stage: int, ckpt: str) -> None:
    """One optimizer step (so Adam's moments are in the files too), then ``save_ckpt``."""
    rank_env(rank, port)
    s = make_strategy(stage)
    model = s.from_pretrained(llama_config(args))
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, None))
    ids = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(rank))
    s.backward(engine(input_ids=ids, labels=ids).loss, engine)
    s.optimizer_step(engine)
    s.save_ckpt(engine, ckpt, tag="bench")
    s.close()


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak() -> None:
    """Set ``VmHWM`` back to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def deepspeed_export(ckpt: str, out: str, shard: str) -> None:
    """DeepSpeed's recipe: the whole fp32 state dict, then ``save_pretrained``; the model is built
    on the meta device and takes the state dict's tensors, so nothing is held twice."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    tag = (Path(ckpt) / "latest").read_text().strip()
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=tag)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(Path(ckpt) / tag),
                                                 dtype=torch.float32)
    model.load_state_dict(state, assign=True)
    del state
    model.save_pretrained(out, max_shard_size=shard)


def child(path: str, ckpt: str, out: str, shard: str) -> None:
    """One measured export in this fresh process; the last line of stdout is the result."""
    import deepspeed.utils.zero_to_fp32  # noqa: F401 - both paths pay for the same imports
    import transformers  # noqa: F401

    from strategy.export.offline import main as strategy_export

    trim()
    reset_peak()
    base = status_kb("VmRSS")
    start = time.perf_counter()
    if path == "strategy":
        strategy_export([ckpt, out, "--max_shard_size", shard])
    else:
        deepspeed_export(ckpt, out, shard)
    wall = time.perf_counter() - start
    growth = (status_kb("VmHWM") - base) * 1024
    print("RESULT " + json.dumps({"wall": wall, "growth": growth}), flush=True)


def run_child(path: str, ckpt: Path, out: Path, shard: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, __file__, "_child", path, str(ckpt), str(out), shard],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{PATHS[path]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))


def model_sizes(ckpt: Path) -> tuple[int, int]:
    """(fp32 bytes of every tensor, of the largest), from the checkpoint's metadata alone."""
    from strategy.export.zero_reader import ZeroCheckpoint

    with ZeroCheckpoint(ckpt / "bench") as checkpoint:
        sizes = [info.numel * 4 for info in checkpoint.index.values()]
    return sum(sizes), max(sizes)


def offline(args) -> None:
    from strategy.dist import free_port
    from strategy.export.shards import parse_size

    root = Path(args.out)
    results = {}
    for stage in args.stages:
        ckpt = root / f"zero{stage}"
        mp.spawn(checkpoint_rank, args=(free_port(), args, stage, str(ckpt)), nprocs=2, join=True)
        runs = {path: [] for path in PATHS}
        for round_no in range(args.rounds):
            order = list(PATHS) if round_no % 2 == 0 else list(PATHS)[::-1]
            for path in order:
                runs[path].append(run_child(path, ckpt, root / f"out-{path}", args.shard))
            if round_no == 0:
                check_same(root / "out-strategy", root / "out-deepspeed")
            for path in PATHS:
                shutil.rmtree(root / f"out-{path}")
        results[stage] = (runs, *model_sizes(ckpt))
        shutil.rmtree(ckpt)
    offline_report(results, parse_size(args.shard), args.rounds)


def _median_spread(values: list[float], scale: float) -> str:
    values = [v / scale for v in values]
    return f"{statistics.median(values):8.1f} [{min(values):.1f}-{max(values):.1f}]"


def offline_report(results: dict, shard: int, rounds: int) -> None:
    print(f"\noffline export, fp32 output, max_shard_size {shard / MB:.0f} MB, {rounds} rounds "
          "each (fresh processes, alternated); median [min-max]")
    print(f"{'stage':<7}{'path':<33}{'time s':>22}{'peak RSS growth MB':>28}  bound MB  met")
    for stage, (runs, total, largest) in results.items():
        bound = (shard + largest) * 1.1
        print(f"ZeRO-{stage} model {total / MB:.0f} MB fp32, largest tensor {largest / MB:.0f} MB")
        for path, label in PATHS.items():
            walls = [run["wall"] for run in runs[path]]
            growths = [run["growth"] for run in runs[path]]
            met = "yes" if max(growths) <= bound else "NO"
            print(f"{'':<7}{label:<33}{_median_spread(walls, 1):>22}"
                  f"{_median_spread(growths, MB):>28}  {bound / MB:8.0f}  "
                  f"{met if path == 'strategy' else '-'}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(*sys.argv[2:6])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="live", choices=["live", "offline", "sync"])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=None, help="default: 8 live, 3 offline")
    p.add_argument("--shard", default="200MB")
    p.add_argument("--rounds", type=int, default=3, help="runs of each path (per stage offline)")
    p.add_argument("--stages", type=int, nargs="+", default=[3, 2], help="offline: ZeRO stages")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    args = p.parse_args()
    args.layers = args.layers or (3 if args.mode == "offline" else 8)
    tmp = None
    if args.out is None:
        args.out = tmp = tempfile.mkdtemp(prefix="bench_export_")
    from strategy.dist import free_port

    try:
        if args.mode in ("live", "sync"):
            mp.spawn(live_rank if args.mode == "live" else sync_rank, args=(free_port(), args),
                     nprocs=2, join=True)
        else:
            offline(args)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
