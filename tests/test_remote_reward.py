"""OpenRLHF's reward sources (``--remote_rm_url``, ``rewards.remote_reward``) and its reward
server (``python -m strategy.cli.serve_rm``): an OpenRLHF reward file equal to the toy task's
reward function; reward servers sharded, their answers joined in order, a dead or wrong server in
one line; GRPO at ZeRO-3 on 2 ranks scored by serve_rm equal to the same reward model in the
ranks."""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

REWARD_FILE = os.path.join(os.path.dirname(__file__), "data", "openrlhf_reward_func.py")


# ------------------------------------------------------------ the file form
def test_an_openrlhf_reward_file_scores_as_the_toy_reward_function():
    """OpenRLHF's reward_func file form (tensors, scores, a scalar extra log), with queries of
    prompt + completion + its end token when it ended and labels from ``--label_key``: the same
    rewards as ``strategy.demos.toy_task:exact_reward`` on the same samples; the scores and the
    extra log kept for the logs, the scalar counted for every query."""
    from strategy.demos.toy_task import exact_reward
    from strategy.trainers.algorithms.remote_reward import OpenRLHFReward

    reward = OpenRLHFReward(REWARD_FILE, "<eos>", "output")
    prompts = ["abc=", "abc=", "hello=", "x="]
    completions = ["cba", "cb", "olleh", "x"]
    rows = [{"output": "cba"}, {"output": "cba"}, {"output": "olleh"}, {"output": "x"}]
    ended = [True, True, False, True]
    got = reward(prompts, completions, rows, ended)
    assert got == [exact_reward(p, c, r) for p, c, r in zip(prompts, completions, rows)]
    assert got == [1.0, 0.0, 1.0, 1.0]
    assert reward.logs == {"score": got, "exact_accuracy": [0.75] * 4}
    assert OpenRLHFReward(REWARD_FILE, "<eos>", "missing")(prompts, completions, rows,
                                                           ended) == [0.0] * 4  # label ""


def test_a_reward_file_that_cannot_load_is_one_line(tmp_path):
    from strategy.errors import ConfigError
    from strategy.trainers.algorithms.remote_reward import check_remote

    bad = tmp_path / "no_func.py"
    bad.write_text("def other(queries, prompts, labels):\n    return {}\n")
    with pytest.raises(ConfigError, match="the file must define reward_func"):
        check_remote(str(bad))
    with pytest.raises(ConfigError, match="cannot load it"):
        check_remote(str(tmp_path / "absent.py"))
    with pytest.raises(ConfigError, match="http://HOST:PORT/PATH"):
        check_remote("localhost:5000/get_reward")


# ------------------------------------------------------------ reward servers
class _Server:
    """A reward server on 127.0.0.1 answering each POST with ``answer(body)``; ``bodies`` holds
    what it was sent."""

    def __init__(self, answer) -> None:
        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                data = json.dumps(answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _length_reward(body: dict) -> dict:
    rewards = [float(len(q)) for q in body["query"]]
    return {"rewards": rewards, "scores": [r / 10 for r in rewards],
            "extra_logs": {"label_ok": [float(lbl == "L") for lbl in body["labels"]]}}


def test_reward_servers_are_sharded_in_order_and_their_answers_joined():
    """Seven queries over three servers: contiguous shards of 3, 3 and 1 in OpenRLHF's body
    (query, prompts, labels), the rewards, scores and extra logs joined back in query order."""
    from strategy.trainers.algorithms.remote_reward import OpenRLHFReward

    servers = [_Server(_length_reward) for _ in range(3)]
    try:
        reward = OpenRLHFReward(",".join(s.url for s in servers), "<eos>", "label")
        prompts = [f"p{i}=" for i in range(7)]
        completions = ["a" * i for i in range(7)]
        rows = [{"label": "L" if i % 2 else "M"} for i in range(7)]
        got = reward(prompts, completions, rows, [i == 6 for i in range(7)])
    finally:
        for server in servers:
            server.close()
    assert got == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0 + 5]  # the last ended: "<eos>" added
    assert [len(s.bodies[0]["query"]) for s in servers] == [3, 3, 1]
    assert servers[1].bodies[0] == {"query": ["p3=aaa", "p4=aaaa", "p5=aaaaa"],
                                    "prompts": ["p3=", "p4=", "p5="], "labels": ["L", "M", "L"]}
    assert reward.logs["score"] == pytest.approx([g / 10 for g in got])
    assert reward.logs["label_ok"] == [float(i % 2) for i in range(7)]


@pytest.mark.parametrize("answer,line", [
    (lambda body: {"scores": [1.0] * len(body["query"])}, "answered without 'rewards'"),
    (lambda body: {"rewards": [1.0]}, "returned 1 rewards for 3 queries"),
    (lambda body: {"rewards": [1.0, float("nan"), 0.0]}, "returned rewards value nan"),
    (None, "did not answer after 2 tries 0.05 s apart (last: URLError: [Errno 111] "
           "Connection refused)"),
])
def test_a_wrong_or_dead_reward_server_is_one_line(answer, line):
    from strategy.errors import DataError
    from strategy.trainers.algorithms.remote_reward import OpenRLHFReward

    server = _Server(answer) if answer is not None else None
    if server is None:
        from strategy.dist import free_port

        url = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
    else:
        url = server.url
    try:
        reward = OpenRLHFReward(url, "<eos>", None, tries=2, pause=0.05)
        with pytest.raises(DataError) as error:
            reward(["a=", "b=", "c="], ["a", "b", "c"], [{}] * 3)
    finally:
        if server is not None:
            server.close()
    message = str(error.value)
    assert "\n" not in message and line in message, message
    assert (url in message) if server is None else message.startswith(f"remote_rm_url={url!r}")


# ------------------------------------------------------------ serve_rm
@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    from strategy.trainers.run import hf_config
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("remote_reward")
    tok = toy_root(root, n_train=37, n_test=5, model_dir="init")
    torch.manual_seed(1)
    scorer = AutoModelForSequenceClassification.from_config(
        hf_config("configs/tiny_llama.json", tok, num_labels=1))
    scorer.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    scorer.config.mean, scorer.config.std = 0.25, 2.0  # as OpenRLHF's reward models save them
    scorer.save_pretrained(root / "rm_normalized")
    tok.save_pretrained(root / "rm_normalized")
    return root


def test_serve_rm_normalizes_by_the_saved_mean_and_std_or_says_it_cannot(toy, capsys):
    from strategy.cli.serve_rm import Scorer, ServeRMConfig, main

    plain = Scorer(ServeRMConfig(reward_pretrain=str(toy / "rm"), param_dtype="fp32"))
    normalized = Scorer(ServeRMConfig(reward_pretrain=str(toy / "rm_normalized"),
                                      param_dtype="fp32", normalize_reward=True))
    queries = ["abc=cba<eos>", "a much longer query=" * 3, "x"]
    raw = plain(queries)
    assert len(set(raw)) == 3
    assert normalized(queries) == pytest.approx([(r - 0.25) / 2.0 for r in raw], abs=1e-6)
    job = subprocess.run([sys.executable, "-m", "strategy.cli.serve_rm",
                          "--reward.model_name_or_path", str(toy / "rm"),
                          "--reward.normalize_enable"], capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 2
    assert job.stderr.strip().splitlines() == [
        f"error: normalize_reward=True is invalid: {toy / 'rm'}/config.json holds no mean and "
        "std (OpenRLHF's reward models save them); drop the flag"]
    with pytest.raises(SystemExit):
        main(["--reward.model_name_or_path", str(toy / "rm"), "--ds.value_head_prefix", "value"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # a model that does not load: one line naming it
        main(["--reward.model_name_or_path", str(toy / "absent")])
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith(
        f"error: reward_pretrain='{toy / 'absent'}' is invalid: cannot load it ("), line
    assert line.endswith("; pass a reward model's directory"), line


def _grpo_history(root: str, name: str, reward: dict) -> list[dict]:
    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.algorithms.preference import reference_model
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.run import Run

    args = {"zero_stage": 3, "micro_train_batch_size": 8, "train_batch_size": 16,
            "group_size": 4, "max_new_tokens": 8, "max_len": 24, "learning_rate": 1e-3,
            "lr_warmup_ratio": 0.0, "kl_coef": 0.1, "max_steps": 2, "logging_steps": 1,
            "seed": 5, "pretrain": f"{root}/init", "dataset": f"{root}/data/train.jsonl",
            "save_path": f"{root}/{name}/model", "ckpt_path": f"{root}/{name}/ckpt",
            "log_dir": None, **reward}
    argv = [f"--{k}={v}" for k, v in args.items() if v is not None]
    with Run.from_args(argv, trainer=GRPOTrainer) as run:
        model, grpo = run.model(), run.config(GRPOConfig)
        trainer = run.trainer(GRPOTrainer, model, grpo=grpo, ref_model=reference_model(run, model),
                              reward=build_rewards(run, grpo))
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - what each rank saw, compared by the test
            return [{"error": f"{type(exc).__name__}: {exc}"}]
    return trainer.history


@pytest.fixture
def serve_rm(toy):
    """``python -m strategy.cli.serve_rm`` on a free port of 127.0.0.1, fp32, ended after."""
    from strategy.dist import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "strategy.cli.serve_rm",
                             "--reward.model_name_or_path", str(toy / "rm"), "--port", str(port),
                             "--ds.param_dtype", "fp32", "--data.max_len", "24",
                             "--batch_size", "5"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:  # its start line, printed once it listens
            if not select.select([proc.stdout], [], [], 1)[0]:
                continue
            line = proc.stdout.readline()
            if not line or line.startswith("serving "):
                break
            seen.append(line)
        assert line.startswith("serving "), "".join(seen)[-2000:]
        reader = threading.Thread(target=proc.stdout.read, daemon=True)  # never blocks it
        reader.start()
        yield f"http://127.0.0.1:{port}/get_reward"
    finally:
        proc.terminate()
        proc.wait(timeout=30)  # its output is the reader's (communicate would read it too)


@pytest.mark.slow
def test_grpo_scored_by_serve_rm_equals_the_reward_model_in_the_ranks(ranks, toy, serve_rm):
    """GRPO at ZeRO-3, 2 ranks, 2 steps: rewarded by serve_rm over HTTP (OpenRLHF's protocol)
    or by the same reward model in the ranks (``--reward_pretrain``): the same rewards, losses
    and KL each step. Then the server gone: every rank stops at the first rollout with the
    same line naming the URL."""
    remote = ranks.run(_grpo_history, str(toy), "remote", {"remote_rm_url": serve_rm})
    local = ranks.run(_grpo_history, str(toy), "local", {"reward_pretrain": str(toy / "rm")})
    assert "error" not in remote[0][0], remote[0]
    assert [r["step"] for r in remote[0]] == [r["step"] for r in local[0]] == [1, 2]
    for ours, theirs in zip(remote[0], local[0]):
        for key in ("reward", "loss", "kl", "reward_std"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), (ours["step"], key)
    assert remote[0][0]["reward_std"] > 0 and math.isfinite(remote[0][1]["loss"])
    from strategy.dist import free_port

    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    started = time.monotonic()
    failed = ranks.run(_grpo_history, str(toy), "dead", {"remote_rm_url": dead})
    assert failed[0] == failed[1]
    assert failed[0][0]["error"].startswith(  # rank 0's line, raised on every rank alike
        f"RankFailedError: rank 0: DataError: remote_rm_url: the reward server {dead} did not "
        "answer after 5 tries 1 s apart (last: URLError: [Errno 111] Connection refused)"), failed
    assert time.monotonic() - started < 120
