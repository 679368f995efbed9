"""One rank that resumes from CKPT_DIR, checks the checkpoint it got, then trains and saves in a
loop (the kill test in tests/test_checkpoint.py SIGKILLs it mid-save).

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 \
        PAUSE_AT=mid_publish python tests/scripts/ckpt_worker.py CKPT_DIR [MAX_SAVES]

Prints ``RESUMED <step>``, then ``SAVING <step>`` / ``SAVED <step> <seconds>`` per save, ``DONE``
at the end. Inside each save it prints ``MARK <name> <step>`` at five points: ``before_files``,
``mid_shard`` (one of DeepSpeed's files written, others not), ``shards_done`` (every rank's files
written, not yet marked complete), ``mid_publish`` (marked complete, not yet renamed into place)
and ``published`` (renamed, ``latest`` updated, retention not yet run). With ``PAUSE_AT=<name>``
the second save after the resume stops at that point and waits to be killed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def weights_digest(engine) -> str:
    from tests.support.helpers import gathered_state

    state = gathered_state(engine)
    h = hashlib.sha1()
    for name in sorted(state):
        h.update(state[name].numpy().tobytes())
    return h.hexdigest()


SAVES = {"count": 0}


def mark(name: str, step_of) -> None:
    print(f"MARK {name} {step_of()}", flush=True)
    if os.environ.get("PAUSE_AT") == name and SAVES["count"] == 2:
        print(f"PAUSED {name}", flush=True)
        time.sleep(3600)  # the test kills us here


def instrument(step_of) -> None:
    """Wrap the functions a save goes through so the markers print from inside it."""
    import torch

    from strategy.checkpoint import save

    def before(module, attr: str, name: str) -> None:
        original = getattr(module, attr)

        def wrapped(*args, **kwargs):
            mark(name, step_of)
            return original(*args, **kwargs)

        setattr(module, attr, wrapped)

    torch_save = torch.save

    def save_then_mark(*args, **kwargs):
        out = torch_save(*args, **kwargs)
        if not getattr(save_then_mark, "done", False):
            save_then_mark.done = True
            mark("mid_shard", step_of)
        return out

    def count_then_reset(*args, **kwargs):  # the first thing a save does
        SAVES["count"] += 1
        save_then_mark.done = False
        mark("before_files", step_of)
        return reset(*args, **kwargs)

    reset = save._reset_staging
    save._reset_staging = count_then_reset
    torch.save = save_then_mark
    before(save, "publish", "shards_done")
    before(save, "publish_dir", "mid_publish")
    before(save, "apply_retention", "published")


def main(ckpt_dir: str, max_saves: int) -> None:
    from transformers import LlamaConfig

    from strategy.checkpoint import Retention
    from tests.support.helpers import make_strategy
    from tests.support.models import VOCAB, token_batches

    s = make_strategy(2, micro=2, total=2)
    # big enough that a save takes a while (~40 MB of weights and Adam states), so kills land inside
    # it
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = s.from_pretrained(config)
    opt = s.create_optimizer(model)
    engine = s.prepare((model, opt, s.create_scheduler(opt, num_training_steps=10**6)))
    path, state = s.load_ckpt(engine, ckpt_dir)
    if path is not None:
        assert state["step"] == engine.global_steps, (state, engine.global_steps)
        assert state["digest"] == weights_digest(engine), (
            f"weights loaded from {path} are not the saved ones"
        )
    print(f"RESUMED {engine.global_steps}", flush=True)
    instrument(lambda: engine.global_steps)
    batches = token_batches(4, 2)
    for _ in range(max_saves):
        x = batches[engine.global_steps % len(batches)]
        loss = engine(input_ids=x, labels=x).loss
        s.backward(loss, engine)
        s.optimizer_step(engine)
        step, digest = engine.global_steps, weights_digest(engine)
        print(f"SAVING {step}", flush=True)
        t0 = time.perf_counter()
        s.save_ckpt(engine, ckpt_dir, client_state={"step": step, "digest": digest},
                    retention=Retention(max_num=2))
        print(f"SAVED {step} {time.perf_counter() - t0:.3f}", flush=True)
    s.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10**9)
