"""Memory of the same LoRA fine-tune on a 4-bit (QLoRA) and a bf16 base, side by side.

    python benchmarks/bench_qlora.py [--hidden 1024 --layers 8 --rounds 3]

A LLaMA of ``--hidden``/``--layers`` (random weights, saved once) is loaded in a fresh process per
run, either with ``--load_in_4bit``'s ``BitsAndBytesConfig`` (NF4, double quantisation, bf16
compute and storage) or in bf16; both get the same LoRA (r 16 on every linear layer, PEFT's k-bit
preparation for the 4-bit one) and train 3 steps on the same batch with AdamW. Reported: the
base's weights in bytes (every parameter and buffer that is not LoRA: packed weights with their
quantisation state, embeddings, norms, head), those of the quantised linear layers alone, and the
process's peak RSS growth over its post-import baseline (``VmHWM`` reset through
``/proc/self/clear_refs``). The two kinds alternate for ``--rounds`` rounds; medians and ranges.
Target: the 4-bit base's weights <= 0.3x the bf16 base's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _vm(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def child(path: str, kind: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from strategy.quant import four_bit_config, prepare_four_bit

    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak to the current RSS
    baseline = _vm("VmRSS")
    if kind == "4bit":
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=four_bit_config(torch.bfloat16), dtype=torch.bfloat16)
        model = prepare_four_bit(model, gradient_checkpointing=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    linear = sum(t.numel() * t.element_size() for m in model.modules()
                 if type(m).__name__ in ("Linear4bit", "Linear") and m is not model.lm_head
                 for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
    quant_state = sum(s.absmax.numel() * s.absmax.element_size()
                      + (s.state2.absmax.numel() * 4 + 256 * 4 if s.nested else 0)
                      + s.code.numel() * 4
                      for m in model.modules() if type(m).__name__ == "Linear4bit"
                      for s in [m.weight.quant_state])
    base = sum(t.numel() * t.element_size()
               for t in list(model.parameters()) + list(model.buffers())) + quant_state
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (2, 64))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(json.dumps({"base_bytes": base, "linear_bytes": linear + quant_state,
                      "peak_growth": _vm("VmHWM") - baseline}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="bench_qlora_")
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    results: dict[str, list[dict]] = {"4bit": [], "bf16": []}
    for round_ in range(args.rounds):
        for kind in (["4bit", "bf16"] if round_ % 2 == 0 else ["bf16", "4bit"]):
            proc = subprocess.run([sys.executable, __file__, "_child", path, kind],
                                  capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            results[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    print(f"LLaMA hidden {args.hidden}, {args.layers} layers: {params / 1e6:.1f}M parameters; "
          f"LoRA r 16 on all linear layers; {args.rounds} rounds, alternated")
    median = {}
    for kind, runs in results.items():
        for key in ("base_bytes", "linear_bytes", "peak_growth"):
            values = [r[key] / 2**20 for r in runs]
            median[kind, key] = statistics.median(values)
            print(f"  {kind:<5} {key:<13} {median[kind, key]:8.1f} MiB "
                  f"(range {min(values):.1f}-{max(values):.1f})")
    for key in ("base_bytes", "linear_bytes", "peak_growth"):
        print(f"  4-bit / bf16 {key}: {median['4bit', key] / median['bf16', key]:.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
