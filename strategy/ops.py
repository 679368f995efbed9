"""Build DeepSpeed's C++ ops once, ahead of a run: ``python -m strategy.ops``.

Otherwise they JIT-compile inside the first job that needs them (about a minute each on CPU).
"""

from __future__ import annotations

import time

from deepspeed.accelerator import get_accelerator


def build_ops() -> list[str]:
    # async_io: only where libaio exists
    names = ["CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder"]
    if get_accelerator().device_name() == "cpu":
        names.append("ShareMemCommBuilder")
    built = []
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue
        start = time.time()
        builder.load(verbose=False)
        built.append(f"{builder.NAME} ({time.time() - start:.0f}s)")
    return built


if __name__ == "__main__":
    print("DeepSpeed ops ready:", ", ".join(build_ops()))
