"""Streamed ``save_model`` against the whole-state-dict export at 2 ranks, ZeRO-3.

    flock /tmp/heavy.lock python benchmarks/bench_export.py \
        [--hidden 2048 --layers 8 --shard 200MB]

The default model is a LLaMA of ~1.07 GB in bf16 (the largest tensor is the 131 MB embedding).
Each path is timed on rank 0 between barriers, while a thread samples rank 0's RSS every ~1 ms;
"growth" is the peak minus the RSS just before the save. The streamed path runs first, and
freed memory is trimmed back to the OS before each measurement, so neither path inherits the
other's heap. The whole-state-dict path is what the anchors do:
``engine._consolidated_16bit_state_dict()`` then rank 0 ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples this process's RSS on a thread; ``growth`` is the peak over the baseline."""

    def __enter__(self) -> PeakRSS:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
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
    del state


def rank_main(rank: int, port: int, args) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    from transformers import LlamaConfig

    from strategy import DeepSpeedStrategy, StrategyConfig
    from strategy.export import save_model
    from strategy.export.shards import parse_size

    cfg = StrategyConfig(
        zero_stage=3,
        bf16=True,
        micro_train_batch_size=1,
        train_batch_size=2,
        seed=1,
        ds_config_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    s = DeepSpeedStrategy(cfg)
    s.setup_distributed()
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 43 // 16,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    engine = s.prepare(s.from_pretrained(config))
    sizes = [p.ds_numel * p.element_size() for p in engine.module.parameters()]
    root = Path(args.out)
    streamed = measure(
        s, lambda: save_model(engine, None, root / "streamed", max_shard_size=args.shard)
    )
    whole = measure(s, lambda: whole_state_dict_save(engine, root / "whole", args.shard))
    s.close()
    if rank == 0:
        report(streamed, whole, sum(sizes), max(sizes), parse_size(args.shard), root)


def report(streamed, whole, total: int, largest: int, shard: int, root: Path) -> None:
    mb = 1e6
    print(
        f"model {total / mb:.0f} MB in bf16, largest tensor {largest / mb:.0f} MB, max_shard_size "
        f"{shard / mb:.0f} MB, 2 ranks, ZeRO-3"
    )
    for name, (wall, growth) in (("streamed save_model", streamed), ("whole state dict", whole)):
        print(f"{name:>20}: {wall:7.2f} s   peak rank-0 RSS growth {growth / mb:8.0f} MB")
    limit = (shard + largest) * 1.1
    print(
        f"ratios streamed/whole: time {streamed[0] / whole[0]:.2f}x, "
        f"RSS growth {streamed[1] / whole[1]:.2f}x"
    )
    print(
        f"target RSS growth <= {limit / mb:.0f} MB: {'met' if streamed[1] <= limit else 'MISSED'}; "
        f"target time <= 1.1x: {'met' if streamed[0] <= 1.1 * whole[0] else 'MISSED'}"
    )
    check_same(root / "streamed", root / "whole")


def check_same(a: Path, b: Path) -> None:
    """Both exports hold the same tensors (read one shard file at a time)."""
    from safetensors import safe_open

    def tensors(d: Path):
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as sf:
                for k in sf.keys():
                    yield k, sf.get_tensor(k)

    other = {}
    for f in sorted(b.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            other.update({k: f for k in sf.keys()})
    n = 0
    for k, v in tensors(a):
        with safe_open(other.pop(k), "pt") as sf:
            assert torch.equal(sf.get_tensor(k), v), k
        n += 1
    assert not other, f"only in the whole-state-dict export: {sorted(other)[:5]}"
    print(f"both exports hold the same {n} tensors")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shard", default="200MB")
    p.add_argument(
        "--out", default=None, help="where the two exports go (default: a temporary directory)"
    )
    args = p.parse_args()
    tmp = None
    if args.out is None:
        args.out = tmp = tempfile.mkdtemp(prefix="bench_export_")
    from strategy.dist import free_port

    try:
        mp.spawn(rank_main, args=(free_port(), args), nprocs=2, join=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
