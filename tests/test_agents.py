"""Multi-turn episodes (``--agent_func_path``): a 3-turn episode's tokens and trained positions
exactly, feedback cut at max_len, episodes batched per turn, the per-token estimators skipping
feedback, agent files refused in one line; at 2 ranks on the real engine (GRPO, PPO; ZeRO-2 and
ZeRO-3): the step's gradient equal to one by hand from the model tokens' log-probs, feedback
carrying no loss, batched greedy episodes equal to one-at-a-time ones, an OpenRLHF-style agent
file training and resuming exactly, and an environment that raises or hangs stopping every rank
in one line."""

from __future__ import annotations

import os
import shutil
import types

import pytest
import torch

AGENTS = os.path.join(os.path.dirname(__file__), "data", "agents")
THREE = os.path.join(AGENTS, "three_turns.py")
OPENRLHF_STYLE = os.path.join(AGENTS, "openrlhf_style.py")
FAULTY = os.path.join(AGENTS, "faulty.py")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from strategy.demos.toy_task import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def solo():
    """One process's collectives (no process group: each is the identity)."""
    from strategy import dist

    return types.SimpleNamespace(checked=dist.checked, all_reduce=dist.all_reduce,
                                 all_gather_object=dist.all_gather_object)


class Scripted:
    """A policy that says the given turns, in order, for every episode (and records what it was
    shown): the runner's bookkeeping is under test here, the engine is at 2 ranks below."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.turns = [tok(t, add_special_tokens=False)["input_ids"] for t in turns]
        self.calls: list[list[list[int]]] = []

    def __call__(self, rows, max_new):
        turn = self.turns[min(len(self.calls), len(self.turns) - 1)]
        self.calls.append(rows)
        return [turn[:max_new] for _ in rows], None


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # as GRPO hands its own


def runner(tok, path=THREE, max_turns=8, max_new=8, max_len=64):
    from strategy.agents import load_agent
    from strategy.trainers.algorithms.episodes import EpisodeRunner

    return EpisodeRunner(load_agent(path), f"agent_func_path={path!r}", tok, max_turns, max_new,
                         max_len, 5.0, solo(), SAMPLING)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_three_turn_episode_tokens_and_trained_positions_exactly(tok):
    from strategy.trainers.algorithms.completions import completion_batch, token_layout
    from strategy.trainers.algorithms.episodes import turn_values
    from strategy.trainers.losses import IGNORE, scored_mask

    policy = Scripted(tok, ["cb<eos>", "cba<eos>", "c<eos>"])
    prompt = ids(tok, "<user>abc=<assistant>")
    [e] = runner(tok).run(["<user>abc=<assistant>"], [prompt], [{"output": "cba"}], "output",
                          policy)
    want = ids(tok, "cb<eos><user>aa=<assistant>cba<eos><user>aaa=<assistant>c<eos>")
    assert e.tokens == want
    model = [1] * 3 + [0] * 5 + [1] * 4 + [0] * 6 + [1] * 2
    assert e.model == [bool(m) for m in model]
    assert e.turn_ends == [2, 11, 19] and e.done
    assert e.rewards == pytest.approx([2 / 3, 1.0, 1 / 3]) and e.reward == pytest.approx(2.0)
    assert e.logs == {"right": 1.0}
    # the engine saw each turn's whole context: prompt, turns and feedback so far
    assert policy.calls[1] == [prompt + want[:8]] and policy.calls[2] == [prompt + want[:18]]

    batch = completion_batch([prompt], [e.tokens], tok.pad_token_id, [e.model])
    n = len(prompt)
    assert batch["labels"][0, :n].eq(IGNORE).all()
    trained = [n + k - 1 for k, m in enumerate(model) if m]  # the position predicting token k
    assert scored_mask(batch)[0].nonzero().flatten().tolist() == trained
    labels = batch["labels"][0, n:].tolist()
    assert [t for t, m in zip(labels, model) if not m] == [IGNORE] * 11
    rewards = token_layout([prompt], turn_values([e]), batch["input_ids"].shape[1])[0]
    assert rewards.nonzero().flatten().tolist() == [n + 2 - 1, n + 11 - 1, n + 19 - 1]
    assert rewards.sum().item() == pytest.approx(2.0)


def test_feedback_is_cut_at_max_len_and_turns_at_max_turns(tok):
    prompt = ids(tok, "<user>abc=<assistant>")  # 6 tokens
    [cut] = runner(tok, max_len=6 + 3 + 3).run(["<user>abc=<assistant>"], [prompt],
                                               [{"output": "cba"}], "output",
                                               Scripted(tok, ["cb<eos>"]))
    assert cut.tokens == ids(tok, "cb<eos><user>aa") and not cut.done  # no room for a turn
    assert cut.model == [True] * 3 + [False] * 3 and len(cut.rewards) == 1
    [two] = runner(tok, max_turns=2).run(["<user>abc=<assistant>"], [prompt],
                                         [{"output": "cba"}], "output",
                                         Scripted(tok, ["cb<eos>"]))
    assert len(two.turn_ends) == 2 and not two.done
    [short] = runner(tok, max_new=2).run(["<user>abc=<assistant>"], [prompt],
                                         [{"output": "cba"}], "output",
                                         Scripted(tok, ["cba<eos>"]))
    assert short.tokens[:2] == ids(tok, "cb")  # a turn's tokens at most --max_new_tokens


def test_live_episodes_share_each_generate_call(tok):
    """Episodes of one rollout: one generate call per turn, with only the live ones."""
    path = OPENRLHF_STYLE
    prompts = ["<user>ab=<assistant>", "<user>abc=<assistant>", "<user>abcd=<assistant>"]
    import random

    from strategy.trainers.algorithms.episodes import python_rng

    policy = Scripted(tok, ["ba<eos>"])
    torch.manual_seed(0)
    with python_rng(int(torch.randint(0, 2**62, (1,)))):  # what each AgentInstance will draw
        rounds = [random.randint(1, 3) for _ in prompts]
    torch.manual_seed(0)
    episodes = runner(tok, path=path).run(prompts, [ids(tok, p) for p in prompts],
                                          [{"output": "ba"}] * 3, "output", policy)
    assert [len(e.turn_ends) for e in episodes] == [r + 1 for r in rounds]
    live = [sum(r + 1 > turn for r in rounds) for turn in range(max(rounds) + 1)]
    assert [len(rows) for rows in policy.calls] == live  # the ended ones are not generated
    assert all(e.done for e in episodes)
    assert [e.reward for e in episodes] == [1.0, 1.0, 1.0]  # right at the end
    assert [e.logs for e in episodes] == [{"rounds": float(r)} for r in rounds]


def test_episodes_equal_openrlhfs_multi_turn_executor(tok):
    """The same agent file, prompts and policy through OpenRLHF's ``MultiTurnAgentExecutor``
    (transcribed): the same tokens, the model's turns where its ``action_ranges`` say, the same
    rewards. (OpenRLHF has no per-turn cap or feedback cut; the budgets here reach neither.)"""
    from strategy.agents import load_agent
    from strategy.trainers.algorithms.episodes import python_rng
    from tests.support.peer_rl import multi_turn_execute

    prompts = ["<user>ab=<assistant>", "<user>abc=<assistant>", "<user>abcd=<assistant>",
               "<user>b=<assistant>"]
    turns = ["ba<eos>", "cb<eos>", "a<eos>"]
    torch.manual_seed(1)
    ours = runner(tok, path=OPENRLHF_STYLE, max_new=64, max_len=200).run(
        prompts, [ids(tok, p) for p in prompts], [{"output": "ba"}] * 4, "output",
        Scripted(tok, turns))
    torch.manual_seed(1)
    seed = int(torch.randint(0, 2**62, (1,)))  # what the runner seeds Python's random with
    opening = tok.convert_tokens_to_ids("<assistant>")

    def generate(tokens, max_tokens):  # an episode's n-th turn, as Scripted gives it
        n = tokens.count(opening) - 1  # the prompt's opening, then one per feedback
        action = ids(tok, turns[min(n, len(turns) - 1)])[:max_tokens]
        return action, tok.decode(action, skip_special_tokens=True)

    with python_rng(seed):  # the agents draw their step counts in the same order
        theirs = [multi_turn_execute(load_agent(OPENRLHF_STYLE), p, "ba", generate, 200, tok)
                  for p in prompts]
    for e, peer in zip(ours, theirs):
        assert e.prompt_ids + e.tokens == peer["observation_tokens"]
        mask = [False] * len(peer["observation_tokens"])
        for start, end in peer["action_ranges"]:
            mask[start:end] = [True] * (end - start)
        assert [False] * len(e.prompt_ids) + e.model == mask
        assert e.reward == peer["reward"]
    assert len({len(e.turn_ends) for e in ours}) > 1  # episodes of different lengths


def test_per_token_estimators_skip_feedback_positions():
    """GAE and discounted returns over an episode equal those of its model tokens alone: the
    feedback between turns is the environment's transition, not steps to discount over."""
    from strategy.trainers.losses import discounted_returns, gae

    torch.manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float)  # prompt, 2 turns
    rewards, values = torch.randn(1, 10), torch.randn(1, 10)
    keep = mask[0].bool()
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    want_adv, want_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, 5), 0.9, 0.8)
    torch.testing.assert_close(adv[:, keep], want_adv)
    torch.testing.assert_close(ret[:, keep], want_ret)
    assert adv[0, [3, 4]].eq(0).all() and ret[0, [3, 4]].eq(0).all()  # the feedback
    returns = discounted_returns(rewards, mask, 0.9)
    torch.testing.assert_close(returns[:, keep],
                               discounted_returns(rewards[:, keep], torch.ones(1, 5), 0.9))
    contiguous = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.float)  # one turn, padded
    r, v = torch.randn(1, 8), torch.randn(1, 8)
    old_adv = torch.zeros(1, 8)  # the former loop, over every position
    running = torch.zeros(1)
    rm, vm = r * contiguous, v * contiguous
    for t in reversed(range(8)):
        following = vm[:, t + 1] if t + 1 < 8 else torch.zeros(1)
        running = rm[:, t] + 0.9 * following - vm[:, t] + 0.9 * 0.8 * running
        old_adv[:, t] = running
    got, _ = gae(r, v, contiguous, 0.9, 0.8)
    assert torch.equal(got, old_adv)  # one turn: bit-identical, padding and prompt included


@pytest.mark.parametrize("body,message", [
    (None, "agent_func_path='{path}' is invalid: give an existing Python file defining class "
           "AgentInstance(AgentInstanceBase)"),
    ("from openrlhf.models import Actor\n",
     "agent_func_path='{path}' is invalid: importing it failed: No module named "
     "'openrlhf.models'; OpenRLHF is not installed here: of it only openrlhf.utils.agent's "
     "AgentInstanceBase and MultiTurnAgentExecutor resolve (to strategy.agents)"),
    ("x = 1\n", "agent_func_path='{path}' is invalid: it defines no class AgentInstance (nor "
                "AgentExecutor); define class AgentInstance(AgentInstanceBase) with reset and "
                "step"),
    ("raise RuntimeError('bad import')\n",
     "agent_func_path='{path}' is invalid: importing it failed: RuntimeError: bad import"),
    ("class AgentInstance:\n    pass\n",
     "agent_func_path='{path}' is invalid: AgentInstance has no step(states) method"),
])
def test_bad_agent_files_are_refused_in_one_line(tmp_path, body, message):
    from strategy.agents import load_agent
    from strategy.errors import ConfigError

    path = str(tmp_path / "agent.py")
    if body is not None:
        open(path, "w").write(body)
    with pytest.raises(ConfigError) as err:
        load_agent(path)
    assert str(err.value) == message.format(path=path)


def test_a_bad_step_result_names_the_file_episode_and_turn(tmp_path, tok):
    from strategy.errors import DataError

    path = str(tmp_path / "agent.py")
    open(path, "w").write("from strategy.agents import AgentInstanceBase\n"
                          "class AgentInstance(AgentInstanceBase):\n"
                          "    def step(self, states):\n"
                          "        return {'rewards': float('nan'), 'done': True}\n")
    with pytest.raises(DataError) as err:
        runner(tok, path=path).run(["<user>ab=<assistant>"], [ids(tok, "<user>ab=<assistant>")],
                                   [{}], "output", Scripted(tok, ["a<eos>"]))
    assert str(err.value) == (f"agent_func_path={path!r}: episode 0 (prompt '<user>ab="
                              "<assistant>'), turn 0: rewards is nan; return a finite number "
                              "(or a one-element tensor)")


def test_openrlhfs_import_line_loads_and_leaves_no_openrlhf_module():
    """OpenRLHF 0.11's ``from openrlhf.utils.agent import AgentInstanceBase,
    MultiTurnAgentExecutor`` (tests/data/agents/openrlhf_style.py) resolves to ours while the
    file loads; no ``openrlhf`` module is left importable after."""
    import importlib.util
    import sys

    from strategy.agents import AgentInstanceBase, load_agent

    assert importlib.util.find_spec("openrlhf") is None  # else this checks nothing
    cls = load_agent(OPENRLHF_STYLE)
    assert issubclass(cls, AgentInstanceBase) and cls.__name__ == "AgentInstance"
    assert not [name for name in sys.modules if name.split(".")[0] == "openrlhf"]


@pytest.mark.parametrize("returned,changed", [
    ("states['sampling_params']", None),
    ("None", None),
    ("{'temperature': 1.0}", None),
    ("{'temperature': 0.5}", "temperature=0.5 (configured 1.0)"),
    ("{'max_tokens': 16}", "max_tokens=16 (configured None)"),
    ("types.SimpleNamespace(temperature=1.0, top_p=0.9, n=1)", "top_p=0.9 (configured 1.0)"),
])
def test_sampling_params_a_step_returns_are_the_configured_or_refused(tmp_path, tok, returned,
                                                                     changed):
    """A step gets the configured sampling as ``states["sampling_params"]``; handing it back (or
    None, or the same values) plays on, other values are one line naming them, never dropped."""
    from strategy.errors import DataError

    path = str(tmp_path / "agent.py")
    open(path, "w").write("import types\n"
                          "from openrlhf.utils.agent import AgentInstanceBase\n"
                          "class AgentInstance(AgentInstanceBase):\n"
                          "    def step(self, states):\n"
                          "        assert states['sampling_params'] == " + repr(SAMPLING) + "\n"
                          "        return {'rewards': 1.0, 'done': True,\n"
                          f"                'sampling_params': {returned}}}\n")
    play = runner(tok, path=path).run
    args = (["<user>ab=<assistant>"], [ids(tok, "<user>ab=<assistant>")], [{}], "output",
            Scripted(tok, ["a<eos>"]))
    if changed is None:
        [e] = play(*args)
        assert e.done and e.rewards == [1.0]
        return
    with pytest.raises(DataError) as err:
        play(*args)
    assert str(err.value) == (
        f"agent_func_path={path!r}: episode 0 (prompt '<user>ab=<assistant>'), turn 0: step "
        f"returned sampling_params with {changed}; per-turn sampling is not applied here (the "
        "loss's log-probs are those of --temperature/--top_p/--top_k): return "
        "states['sampling_params'] as given, or None")


def slow_multiply(a: int, b: int) -> int:
    """Multiply, after a long wait.

    Args:
        a: the first factor
        b: the second factor
    """
    import time

    time.sleep(30)
    return a * b


def tool_runner(tok, timeout=5.0, tools=None):
    from functools import partial

    from strategy.demos.toy_tools import TOOLS
    from strategy.tools import ToolAgent, tool_schemas
    from strategy.trainers.algorithms.episodes import EpisodeRunner

    tools = tools or TOOLS
    return EpisodeRunner(partial(ToolAgent, tools, tool_schemas(tools), tok, timeout),
                         "tools='t:T'", tok, 4, 40, 200, 10.0, solo())


def test_a_tool_call_is_run_and_its_result_is_the_templates_tool_turn():
    from strategy.demos.toy_tools import make_tokenizer, tool_call
    from strategy.tools import tool_schemas

    tok = make_tokenizer()
    from strategy.demos.toy_tools import TOOLS

    prompt = tok.apply_chat_template([{"role": "user", "content": "123*456="}], tokenize=False,
                                     add_generation_prompt=True, tools=tool_schemas(TOOLS))
    assert prompt == "<system>multiply(a, b)<user>123*456=<assistant>"
    policy = Scripted(tok, [tool_call(123, 456) + "<eos>", "56088<eos>"])
    [e] = tool_runner(tok).run([prompt], [ids(tok, prompt)], [{"output": "56088"}], "output",
                               policy)
    # exactly what SFT on the conversation renders after the prompt (toy_tools.with_tool)
    whole = tok.apply_chat_template([{"role": "system", "content": "multiply(a, b)"},
                                     {"role": "user", "content": "123*456="},
                                     {"role": "assistant", "content": tool_call(123, 456)},
                                     {"role": "tool", "content": "56088"},
                                     {"role": "assistant", "content": "56088"}], tokenize=False)
    assert tok.decode(e.context) == whole and e.done
    feedback = ids(tok, "<tool>56088<assistant>")
    call = ids(tok, tool_call(123, 456) + "<eos>")
    assert e.model == [True] * len(call) + [False] * len(feedback) + [True] * 6
    assert e.logs == {"tool_calls": 1.0, "tool_errors": 0.0} and e.rewards == [0.0, 0.0]


@pytest.mark.parametrize("action,result", [
    ('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "error: no tool named 'divide'; the tools are multiply"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 1</tool_call>',
     "error: the tool call is not JSON (Expecting ',' delimiter)"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": "x", "b": 2}}</tool_call>',
     "error: ValueError: invalid literal for int() with base 10: 'x'"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>',
     "error: TypeError: multiply() missing 1 required positional argument: 'b'"),
])
def test_a_bad_tool_call_is_answered_with_its_error(action, result):
    from strategy.demos.toy_tools import make_tokenizer

    tok = make_tokenizer()
    prompt = "<user>1*2=<assistant>"
    [e] = tool_runner(tok).run([prompt], [ids(tok, prompt)], [{"output": "2"}], "output",
                               Scripted(tok, [action + "<eos>", "2<eos>"]))
    assert e.text.endswith(f"<tool>{result}<assistant>2")
    assert e.logs == {"tool_calls": 1.0, "tool_errors": 1.0} and e.done


def test_a_tool_that_does_not_return_is_an_error_the_model_sees():
    from strategy.demos.toy_tools import make_tokenizer, tool_call

    tok = make_tokenizer()
    slow_multiply.__name__ = "multiply"
    [e] = tool_runner(tok, timeout=0.5, tools=[slow_multiply]).run(
        ["<user>1*2=<assistant>"], [ids(tok, "<user>1*2=<assistant>")], [{"output": "2"}],
        "output", Scripted(tok, [tool_call(1, 2) + "<eos>", "2<eos>"]))
    assert "<tool>error: multiply did not return within 0.5 s<assistant>" in e.text


def test_the_tool_turn_starts_with_the_templates_separator_after_end_of_turn():
    from strategy.demos.toy_tools import make_tokenizer
    from strategy.errors import ConfigError
    from strategy.tools import tool_turn

    tok = make_tokenizer()
    tok.add_special_tokens({"eos_token": "<|im_end|>"})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                         "<|im_start|>assistant\n{% endif %}")  # Qwen's shape
    assert tool_turn(tok, [("multiply", "6")]) == ("\n<|im_start|>tool\n6<|im_end|>\n"
                                                   "<|im_start|>assistant\n")
    tok.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}" \
                        "{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ConfigError, match="its chat template drops tool turns"):
        tool_turn(tok, [("multiply", "6")])  # no tool role: the result would vanish
    tok.chat_template = "{{ messages | length }}"
    with pytest.raises(ConfigError, match="does not render a tool turn as a continuation"):
        tool_turn(tok, [("multiply", "6")])


def no_docstring(a: int) -> int:
    return a


NOT_TOOLS = [1, 2]
UNDOCUMENTED = [no_docstring]


@pytest.mark.parametrize("spec,message", [
    ("just_a_name", "tools='just_a_name' is invalid: write it as module:name"),
    ("no_such_module:T", "tools='no_such_module:T' is invalid: cannot import 'no_such_module'"),
    ("tests.test_agents:NOT_TOOLS", "tools='tests.test_agents:NOT_TOOLS' is invalid: "
     "tests.test_agents.NOT_TOOLS is not a function or a list of functions"),
    ("tests.test_agents:UNDOCUMENTED", "tools='tests.test_agents:UNDOCUMENTED' is invalid: "
     "no_docstring has no JSON schema"),
])
def test_bad_tools_are_refused_in_one_line(spec, message):
    from strategy.errors import ConfigError
    from strategy.tools import load_tools

    with pytest.raises(ConfigError) as err:
        load_tools(spec)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ------------------------------------------------------------ at 2 ranks


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("agents")
    toy_root(root, n_train=45, n_test=13, model_dir="init")  # 45, 13: neither divides by 2 or 4
    return root


def _argv(root, name: str, **extra) -> list[str]:
    args = {"zero_stage": 2, "micro_train_batch_size": 4, "train_batch_size": 16,
            "micro_eval_batch_size": 4, "group_size": 4, "agent_func_path": OPENRLHF_STYLE,
            "max_new_tokens": 8, "max_len": 40, "learning_rate": 1e-3, "lr_warmup_ratio": 0.0,
            "kl_coef": 0.1, "ppo_epochs": 2, "max_steps": 4, "logging_steps": 1, "seed": 5,
            "pretrain": f"{root}/init", "dataset": f"{root}/data/train.jsonl",
            "eval_dataset": f"{root}/data/test.jsonl", "save_path": f"{root}/{name}/model",
            "ckpt_path": f"{root}/{name}/ckpt", "log_dir": f"{root}/{name}/logs", **extra}
    flags = {True: "--{}", False: "--no-{}"}
    return [flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()
            if v is not None]


def built(root: str, name: str, trainer_cls=None, **extra):
    """(run, trainer) as the grpo/ppo commands build them."""
    from strategy.trainers import GRPOConfig, GRPOTrainer, PPOTrainer
    from strategy.trainers.algorithms.ppo import build_critic
    from strategy.trainers.algorithms.preference import reference_model
    from strategy.trainers.run import Run

    cls = trainer_cls or GRPOTrainer
    run = Run.from_args(_argv(root, name, **extra), trainer=cls).__enter__()
    model = run.model()
    config = run.config(cls.config_classes[0])
    more = {"critic": build_critic(run, config)} if cls is PPOTrainer else {}
    if not config.agent_func_path:  # --tools: the reward scores the answer
        from strategy.trainers.algorithms.rewards import build_rewards

        more["reward"] = build_rewards(run, config)
    trainer = run.trainer(cls, model, grpo=config, max_len=run.data.max_len,
                          ref_model=reference_model(run, model) if config.kl_coef > 0 else None,
                          **more)
    assert isinstance(config, GRPOConfig)
    return run, trainer


def train(root: str, name: str, ppo: bool = False, **extra) -> dict:
    from strategy.trainers import PPOTrainer

    run, trainer = built(root, name, PPOTrainer if ppo else None, **extra)
    try:
        final = trainer.fit()
    finally:
        run.__exit__(None, None, None)
    return {"history": trainer.history, "final": final}


KEYS = ("loss", "reward", "kl", "ratio", "grad_norm", "completion_length", "turns",
        "feedback_tokens", "agent_rounds", "truncated")


@pytest.mark.slow
def test_an_openrlhf_style_agent_trains_and_resumes_exactly(ranks, toy):
    full = ranks.run(train, str(toy), "full", save_steps=2)
    rows = [[{k: row[k] for k in KEYS} for row in out["history"]] for out in full]
    assert rows[0] == rows[1]  # every rank logs the same reduced figures
    first = full[0]["history"][0]
    assert first["ratio"] == 1.0 and first["kl"] == 0.0
    for row in full[0]["history"]:
        assert 1.0 < row["turns"] <= 4.0 and row["feedback_tokens"] > 0
        assert 1.0 <= row["agent_rounds"] <= 3.0 and 0.0 <= row["reward"] <= 1.0
    final = full[0]["final"]
    assert {"exact_match", "reward", "turns"} <= set(final)

    ckpt = toy / "full" / "ckpt"
    shutil.rmtree(ckpt / "global_step4")
    (ckpt / "latest").write_text("global_step2")
    resumed = ranks.run(train, str(toy), "full", save_steps=2, load_checkpoint=True)[0]
    assert [{k: row[k] for k in KEYS} for row in resumed["history"]] == rows[0][2:]
    assert resumed["final"] == final


def inspect_episodes(root: str, stage: int) -> dict:
    """On a fresh policy: a rollout of three-turn episodes, the first micro-batch's gradient
    against one by hand, its loss with the logits at feedback (then model) positions changed,
    and greedy held-out episodes batched against one at a time."""
    run, trainer = built(root, f"inspect{stage}", zero_stage=stage, agent_func_path=THREE,
                         kl_coef=0.0, shared_prompt_forward=False, max_len=48,
                         advantage_estimator="reinforce")
    out = {}
    try:
        sampled = trainer.sample(trainer.next_prompts())
        batches, _ = trainer.experience(sampled)
        pick = max(range(len(batches)), key=lambda i: batches[i]["advantages"].abs().sum())
        b = trainer.to_device(batches[pick])
        rows = b["input_ids"].shape[0]
        episodes = sampled.episodes[pick * rows:(pick + 1) * rows]
        hand_mask = torch.zeros_like(b["input_ids"][:, 1:], dtype=torch.bool)
        for r, e in enumerate(episodes):  # from the episodes, not from the batch's labels
            start = len(e.prompt_ids) - 1
            for k, by_model in enumerate(e.model):
                hand_mask[r, start + k] = by_model
        out["feedback"] = int(sum(len(e.model) - sum(e.model) for e in episodes))
        tokens = int(hand_mask.sum())
        trainer.step_counts = {"tokens": tokens, "completions": rows}
        module = trainer.model.module
        loss, _ = trainer.compute_loss(b)
        if stage < 3:  # gradients of a plain copy of the policy (the engine's hooks reduce them)
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_pretrained(f"{root}/init").float()
            params = list(plain.parameters())
            engine, trainer.model = trainer.model, plain
            trainer._old_logps = {}
            try:
                ours = torch.autograd.grad(trainer.compute_loss(b)[0], params)
            finally:
                trainer.model = engine
            logits = plain(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            logp = torch.log_softmax(logits[:, :-1].float() / trainer.grpo.temperature, -1)
            picked = logp.gather(-1, b["input_ids"][:, 1:, None])[..., 0]
            ratio = torch.exp(picked - picked.detach())  # 1 on the first update, d = d logp
            hand = -(b["advantages"][:, None] * ratio * hand_mask).sum() / tokens
            wants = torch.autograd.grad(hand, params)
            out["grad_gap"] = max((a - w).abs().max().item() for a, w in zip(ours, wants))
            out["grad_size"] = max(w.abs().max().item() for w in wants)
            out["loss_gap"] = abs(loss.item() - hand.item())
        at = {"feedback": ~hand_mask & b["attention_mask"][:, 1:].bool(), "model": hand_mask}
        for name, where in at.items():
            def noisy(_, __, output, where=where):
                output.logits[:, :-1][where] += 5.0 * torch.randn_like(
                    output.logits[:, :-1][where])
                return output
            handle = module.register_forward_hook(noisy)
            with torch.no_grad():
                changed, _ = trainer.compute_loss(b)
            handle.remove()
            out[f"same_loss_{name}"] = torch.equal(changed.detach(), loss.detach())
        batch = next(iter(trainer.eval_dataloader))
        together = trainer.play(batch, sample=False, group=1).episodes
        alone = [trainer.play({k: v[i:i + 1] for k, v in batch.items()}, sample=False,
                              group=1).episodes[0] for i in range(4)]
        out["batched_equal"] = [a.tokens == t.tokens and a.model == t.model
                                for a, t in zip(alone, together[:4])]
        out["turns"] = [len(e.turn_ends) for e in together]
    finally:
        run.__exit__(None, None, None)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_by_hand_no_loss_on_feedback_and_batched_episodes(ranks, toy, stage):
    for out in ranks.run(inspect_episodes, str(toy), stage):
        assert out["feedback"] > 0  # the micro-batch has feedback tokens to leave out
        if stage < 3:
            assert out["grad_size"] > 0  # a micro-batch whose advantages push
            assert out["grad_gap"] <= 1e-5 * out["grad_size"] and out["loss_gap"] < 1e-6
        assert out["same_loss_feedback"] and not out["same_loss_model"]
        assert out["batched_equal"] == [True] * 4
        assert max(out["turns"]) == 3


@pytest.mark.slow
def test_ppo_trains_on_per_turn_rewards_at_zero3(ranks, toy):
    out = ranks.run(train, str(toy), "ppo", ppo=True, zero_stage=3, agent_func_path=THREE,
                    group_size=1, max_steps=2, ppo_epochs=1, max_len=48)
    for row in out[0]["history"]:
        assert row["turns"] > 1 and torch.isfinite(torch.tensor(row["loss"]))


def faulty_run(root: str, fault: str) -> str:
    from strategy.errors import StrategyError

    os.environ["AGENT_FAULT"] = fault
    try:
        train(root, f"fault_{fault}", agent_func_path=FAULTY, kl_coef=0.0, max_steps=2,
              agent_timeout=3)
    except StrategyError as exc:
        return str(exc)
    finally:
        os.environ.pop("AGENT_FAULT")
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("fault,tail", [
    ("raise", "step raised ValueError: the environment broke"),
    ("hang", "step did not return within --agent_timeout=3 s; fix the environment or raise "
             "--agent_timeout"),
])
def test_an_environment_that_raises_or_hangs_stops_every_rank(ranks, toy, fault, tail):
    for message in ranks.run(faulty_run, str(toy), fault, timeout=120):
        assert message.startswith(f"rank 1: DataError: agent_func_path={FAULTY!r}: episode 2 "
                                  "(prompt "), message
        assert message.endswith(f"), turn 1: {tail}") and "\n" not in message


@pytest.fixture(scope="module")
def tools_root(tmp_path_factory):
    """The tool-use example's data, and its tiny model after a short SFT on conversations that
    call the calculator (a model from its config alone never calls a tool)."""
    from tests.support.models import tool_caller

    root = tmp_path_factory.mktemp("tools")
    tool_caller(root, out="init")
    return root


TOOL_FLAGS = {"agent_func_path": None, "tools": "strategy.demos.toy_tools:TOOLS",
              "reward_fn": "strategy.demos.toy_tools:exact_reward", "apply_chat_template": True,
              "max_len": 96, "max_new_tokens": 24, "kl_coef": 0.0}


def tools_run(root: str) -> dict:
    out = {}
    run, trainer = built(root, "tools", **TOOL_FLAGS)
    try:
        out["prompt"] = trainer.train_dataloader.dataset[0]["prompt"]
        out["final"] = trainer.fit()
        out["history"] = trainer.history
    finally:
        run.__exit__(None, None, None)
    return out


@pytest.mark.slow
def test_grpo_with_tools_renders_their_schemas_and_logs_the_calls(ranks, tools_root):
    for out in ranks.run(tools_run, str(tools_root)):
        assert out["prompt"].startswith("<system>multiply(a, b)<user>")
        for row in out["history"]:
            assert {"agent_tool_calls", "agent_tool_errors", "turns"} <= set(row)
            assert row["agent_tool_calls"] > 0 and row["turns"] > 1.0, row  # the tool was called
        assert "exact_match" in out["final"]


@pytest.mark.parametrize("change,message", [
    ({"apply_chat_template": False}, "tools='strategy.demos.toy_tools:TOOLS' is invalid: the "
     "tools' schemas reach the model through the chat template; add --apply_chat_template"),
    ({"agent_func_path": THREE}, "tools='strategy.demos.toy_tools:TOOLS' is invalid: an agent "
     "file is the environment itself; drop --tools or --agent_func_path"),
    ({"overlong_buffer_len": 4}, "overlong_buffer_len=4.0 is invalid: it shapes one "
     "completion's length"),
    ({"rollout_engine": "vllm", "async_rollouts": 1, "partial_rollouts": True},
     "partial_rollouts=True is invalid: episodes played ahead take the weights of the step "
     "before, whole"),
    ({"tools": None, "agent_func_path": THREE, "reward_fn": "strategy.demos.toy_tools:"
      "exact_reward"}, "reward_fn='strategy.demos.toy_tools:exact_reward' is invalid: the "
     "environment's step returns the rewards with --agent_func_path"),
    ({"tools": None, "agent_func_path": "nope.py", "reward_fn": None},
     "agent_func_path='nope.py' is invalid: give an existing Python file"),
], ids=[str(i) for i in range(6)])
def test_bad_episode_settings_fail_before_any_process_group(tools_root, monkeypatch, change,
                                                              message):
    from strategy.errors import ConfigError
    from strategy.trainers import GRPOTrainer
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch)
    argv = [a for a in _argv(tools_root, "refused", **{**TOOL_FLAGS, **change})
            if not a.endswith("=None")]
    with pytest.raises(ConfigError) as info:
        Run.from_args(argv, trainer=GRPOTrainer)
    assert message in str(info.value) and "\n" not in str(info.value)
