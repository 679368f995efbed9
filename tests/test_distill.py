"""On-policy distillation (``DistillationTrainer``, ``strategy distill``): the generalized JSD
against TRL's ``GKDTrainer.generalized_jsd_loss`` on the same logits and by hand at its ends;
chunked over positions equal to whole, gradients included; at 2 ranks on the real engine, a
student that is its teacher has zero loss, ZeRO-3 (teacher partitioned or offloaded, small
chunks that leave a rank with empty calls) logs what ZeRO-0 does, on- and off-policy steps mix
as ``lmbda`` draws them, a resume is exact; a teacher of another tokenizer is refused before any
process group."""

from __future__ import annotations

import shutil

import pytest
import torch

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)


# ------------------------------------------------------------ pure


@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_matches_trl_gkd_on_the_same_logits(beta):
    from strategy.trainers.losses.distill import generalized_jsd
    from tests.support.peer_rl import trl_generalized_jsd_loss

    torch.manual_seed(0)
    student, teacher = torch.randn(3, 7, 11) * 2, torch.randn(3, 7, 11) * 2
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :3] = labels[2, 5:] = -100  # a prompt, padding
    mask = labels != -100
    ours = generalized_jsd(student.log_softmax(-1), teacher.log_softmax(-1), beta)[mask]
    theirs = trl_generalized_jsd_loss(student, teacher, labels, beta=beta,
                                      num_items_in_batch=int(mask.sum()))
    torch.testing.assert_close(ours.sum() / mask.sum(), theirs, rtol=1e-6, atol=1e-7)
    assert trl_generalized_jsd_loss(student, teacher, labels, beta=beta) == pytest.approx(
        float(ours.mean()), rel=1e-6)


def test_generalized_jsd_by_hand():
    from strategy.trainers.losses.distill import generalized_jsd

    s, t = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.1, 0.3, 0.6])
    forward = float((t * (t / s).log()).sum())  # KL(teacher || student)
    reverse = float((s * (s / t).log()).sum())
    got = [float(generalized_jsd(s.log(), t.log(), b)) for b in (0.0, 1.0, 0.5)]
    m = (s + t) / 2
    jsd = 0.5 * float((t * (t / m).log()).sum()) + 0.5 * float((s * (s / m).log()).sum())
    assert got == pytest.approx([forward, reverse, jsd], rel=1e-6)
    assert float(generalized_jsd(s.log(), s.log(), 0.3)) == pytest.approx(0.0, abs=1e-7)
    swapped = float(generalized_jsd(t.log(), s.log(), 0.7))  # beta <-> 1 - beta swaps roles
    assert swapped == pytest.approx(float(generalized_jsd(s.log(), t.log(), 0.3)), rel=1e-6)


def test_chunked_divergence_equals_the_whole_with_its_gradients(tmp_path):
    from transformers import AutoModelForCausalLM

    from strategy.demos.toy_task import make_tokenizer
    from strategy.trainers.losses.distill import chunked_jsd_sum, generalized_jsd
    from strategy.trainers.run import hf_config

    tok = make_tokenizer(str(tmp_path))
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama_student.json", tok))
    teacher = AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama.json", tok))
    ids = torch.randint(3, len(tok), (3, 9))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 7:] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    mask = labels[:, 1:] != -100
    whole = generalized_jsd(student(input_ids=ids).logits[:, :-1].float().log_softmax(-1),
                            teacher(input_ids=ids).logits[:, :-1].float().log_softmax(-1).detach(),
                            0.5)[mask].sum()
    whole.backward()
    want = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    tokens = int(mask.sum())
    for chunk, most in ((4, tokens), (1000, tokens), (5, tokens + 11)):  # + empty calls
        student.zero_grad()
        got = chunked_jsd_sum(student, teacher, batch, 0.5, chunk, most, len(tok))
        got.backward()
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)
        for n, p in student.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------ at 2 ranks


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strategy.trainers.run import hf_config
    from tests.support.helpers import save_tiny_llama, toy_root

    root = tmp_path_factory.mktemp("distill")
    tok = toy_root(root, n_train=45, n_test=13, model_dir="teacher")  # 2 steps of 16, 13 left
    other = AutoTokenizer.from_pretrained(str(root / "data" / "tokenizer"))
    other.add_tokens(["@"])
    save_tiny_llama(other, root / "other_teacher")
    assert len(other) == len(tok) + 1
    torch.manual_seed(1)  # a smaller student (ZeRO-3 builds a fresh one otherwise than ZeRO-0)
    AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama_student.json", tok)
                                     ).save_pretrained(root / "student")
    return root


def _argv(root, name: str, **extra) -> list[str]:
    args = {"zero_stage": 2, "micro_train_batch_size": 4, "train_batch_size": 16,
            "micro_eval_batch_size": 4, "max_new_tokens": 8, "max_len": 24,
            "learning_rate": 1e-3, "lr_warmup_ratio": 0.0, "max_steps": 4, "max_epochs": 3,
            "logging_steps": 1, "seed": 5, "lmbda": 0.5, "beta": 0.5,
            "pretrain": f"{root}/student", "tokenizer": f"{root}/data/tokenizer",
            "teacher_pretrain": f"{root}/teacher",
            "dataset": f"{root}/data/train.jsonl", "eval_dataset": f"{root}/data/test.jsonl",
            "save_path": f"{root}/{name}/model", "ckpt_path": f"{root}/{name}/ckpt",
            "log_dir": f"{root}/{name}/logs", **extra}
    flags = {True: "--{}", False: "--no-{}"}
    return [flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}"
            for k, v in args.items() if v is not None]


def distill(root: str, name: str, **extra) -> dict:
    """``strategy distill``'s run (``cli.train_distill.main``'s body), its logged steps kept."""
    from strategy.cli.trainers import command_argv
    from strategy.trainers import DistillationTrainer, DistillConfig
    from strategy.trainers.algorithms.distill import build_teacher
    from strategy.trainers.run import Run

    tokens = []

    class Counting(DistillationTrainer):
        def on_step_end(self, metrics):
            tokens.append(self.step_counts["tokens"])  # completion tokens of the step, all ranks

    argv = command_argv(_argv(root, name, **extra), "distill")
    with Run.from_args(argv, trainer=DistillationTrainer) as run:
        config = run.config(DistillConfig)
        trainer = run.trainer(Counting, run.model(), distill=config,
                              teacher=build_teacher(run, config))
        final = trainer.fit()
    return {"history": trainer.history, "final": final, "tokens": tokens}


KEYS = ("loss", "jsd", "on_policy", "grad_norm")


def test_a_student_that_is_its_teacher_has_zero_divergence(ranks, toy):
    out = ranks.run(distill, str(toy), "same", pretrain=f"{toy}/teacher",
                    zero_stage=3, lmbda=1.0, max_steps=1)[0]
    first = out["history"][0]
    assert first["on_policy"] == 1.0
    assert abs(first["loss"]) < 1e-6 and abs(first["jsd"]) < 1e-6, first
    assert out["final"]["jsd"] == pytest.approx(0.0, abs=1e-6)
    assert 0.0 <= out["final"]["exact_match"] <= 1.0


def test_zero3_offloaded_teacher_and_small_chunks_match_zero0(ranks, toy):
    """Off-policy (plain KD) and on-policy steps, two each, at ZeRO-0 and at ZeRO-3 with the
    teacher partitioned or offloaded and 5-position chunks (a rank runs empty calls when it has
    fewer tokens): the same losses and gradient norms."""
    tokens = {}
    for lmbda in (0.0, 1.0):
        outs = {name: ranks.run(distill, str(toy), f"{name}{lmbda}", lmbda=lmbda, max_steps=2,
                                **extra)[0]
                for name, extra in (("zero0", {"zero_stage": 0}),
                                    ("zero3", {"zero_stage": 3, "logits_chunk_size": 5}),
                                    ("offload", {"zero_stage": 3, "teacher_offload": True}))}
        runs = {name: out["history"] for name, out in outs.items()}
        tokens[lmbda] = outs["zero0"]["tokens"]
        want = runs["zero0"]
        assert [r["on_policy"] for r in want] == [lmbda] * 2
        assert all(r["loss"] > 0 for r in want) and want[1]["loss"] != want[0]["loss"]
        for name in ("zero3", "offload"):
            for w, g in zip(want, runs[name]):
                for key in KEYS:
                    assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-7), (lmbda, name,
                                                                                 key)
    assert tokens[1.0] != tokens[0.0]  # on-policy steps train the student's own completions


def test_mixed_steps_resume_exactly(ranks, toy):
    full = ranks.run(distill, str(toy), "mixed", max_steps=6, save_steps=2)
    rows = [[{k: r[k] for k in KEYS} for r in out["history"]] for out in full]
    assert rows[0] == rows[1]  # every rank logs the same reduced figures
    drawn = [r["on_policy"] for r in rows[0]]
    assert 0.0 in drawn and 1.0 in drawn, drawn  # lmbda 0.5 draws both kinds of step
    ckpt = toy / "mixed" / "ckpt"
    shutil.rmtree(ckpt / "global_step6")
    (ckpt / "latest").write_text("global_step2")
    resumed = ranks.run(distill, str(toy), "mixed", max_steps=6, save_steps=2,
                        load_checkpoint=True)[0]
    assert [{k: r[k] for k in KEYS} for r in resumed["history"]] == rows[0][2:]
    assert resumed["final"] == full[0]["final"]


REFUSED = [
    ({"teacher_pretrain": "OTHER"}, "teacher_pretrain='OTHER' is invalid: its tokenizer is not "
                                    "the student's"),
    ({"teacher_pretrain": None}, "teacher_pretrain=None is invalid: name the teacher"),
    ({"teacher_pretrain": "STUDENT"}, "teacher_pretrain='STUDENT' is invalid: no tokenizer "
                                      "loads from it"),
    ({"packing_samples": True}, "packing_samples=True is invalid: on-policy steps sample"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size=2 is invalid: distillation samples"),
    ({"lmbda": 1.5}, "lmbda=1.5 is invalid: use a value in [0, 1]"),
    ({"max_new_tokens": 24}, "max_new_tokens=24 is invalid: prompt and completion share"),
]


@pytest.mark.parametrize("change,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_bad_distill_settings_fail_before_process_group(toy, monkeypatch, change, message):
    from strategy.errors import ConfigError
    from strategy.trainers import DistillationTrainer
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch)
    where = {"OTHER": f"{toy}/other_teacher", "STUDENT": f"{toy}/student"}
    change = {k: where.get(v, v) for k, v in change.items()}
    for word, path in where.items():
        message = message.replace(word, path)
    with pytest.raises(ConfigError) as info:
        Run.from_args(_argv(toy, "refused", **change), trainer=DistillationTrainer)
    assert message in str(info.value) and "\n" not in str(info.value)
