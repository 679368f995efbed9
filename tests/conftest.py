import os

import pytest

from strategy.dist import LAUNCH_ENV
from tests.support.leftovers import Leftovers
from tests.support.ranks import Ranks

LEFTOVERS = Leftovers()  # at import: the marker and temp root reach every process tests start


def _answer_cpu_info_once() -> None:
    """py-cpuinfo's answer (~1 s of CPU, asked 5 times by each rank's DeepSpeed op loads) in
    ``STRATEGY_CPU_INFO`` before any job starts, so none of the suite's ranks asks again."""
    import cpuinfo

    from strategy.internals import cache_cpu_info

    cache_cpu_info()
    cpuinfo.get_cpu_info()


_answer_cpu_info_once()

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_switch] = "1"  # nothing in the tests may reach a hub


@pytest.fixture(scope="session")
def ranks():
    """Long-lived ranks: ``ranks.run(fn, *args, world_size=2)`` runs ``fn`` on each."""
    pool = Ranks()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def launch_env_kept():
    """A test that gets as far as ``dist.ensure_launch_env`` in the pytest process fills the
    launcher's variables for a 1-rank run; left set, they would make every later job's ranks
    think so (a Slurm job's two tasks both rank 0 of 1). Each test ends with them as before."""
    saved = {key: os.environ.get(key) for key in LAUNCH_ENV}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def nothing_left():
    """The session fails when it leaves anything on the machine (the last fixture to end). An
    xdist worker checks what is its own; the controller, the machine's (``pytest_sessionfinish``
    below)."""
    yield
    left = LEFTOVERS.report()
    LEFTOVERS.clear()
    assert not left, f"the test session left these behind (now removed):\n{left}"


@pytest.hookimpl(trylast=True)  # after xdist's own, which ends the workers
def pytest_sessionfinish(session):
    """Under pytest-xdist, the controller (which runs no test, so no fixture) fails the run when
    the workers, all ended, left anything on the machine."""
    if not session.config.pluginmanager.hasplugin("dsession"):
        return  # a session of its own (or a worker): its ``nothing_left`` checked
    left = LEFTOVERS.report(settle=True)
    LEFTOVERS.clear()
    if left:
        session.config.get_terminal_writer().line(
            f"error: the test session left these behind (now removed):\n{left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Which test is running, for what the session leaves behind (``Leftovers.seen``)."""
    LEFTOVERS.test = item.nodeid
    yield
    LEFTOVERS.test = f"(after {item.nodeid})"


def pytest_configure(config):
    # an xdist worker by its own config, not the environment (a pytest a test starts inherits it)
    LEFTOVERS.worker = getattr(config, "workerinput", {}).get("workerid")
    config.addinivalue_line("markers", "gpu: needs an accelerator; skipped on CPU-only machines")
    config.addinivalue_line("markers", "slow: spawns processes or trains; still part of CI")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``CI=true`` a test skipped for a missing capability (root, a mount, libaio, a tool)
    fails: CI must not report "passed" for work it never did. GPU-marked tests stay skipped."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or "gpu" in item.keywords:
        return
    if hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true ({reason}); CI must have what this test needs"


# the files that take longest (--durations, one worker), first: pytest-xdist (``-n 2 --dist
# loadfile``) hands out whole files in this order, so the long ones start at once and the rest
# (each under 8 s) even out the end
LONGEST_FIRST = ("test_ray.py", "test_vllm.py", "test_cli.py", "test_grpo.py",
                 "test_multinode.py", "test_trainers.py", "test_default_run.py", "test_agents.py",
                 "test_launch.py", "test_parallel.py", "test_shipped_configs.py",
                 "test_remote_reward.py", "test_checkpoint.py", "test_ppo.py", "test_harness.py",
                 "test_faults.py", "test_distill.py", "test_docs.py")


def _longest_first(item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    from deepspeed.accelerator import get_accelerator

    items.sort(key=_longest_first)  # stable: each file's own order kept

    if get_accelerator().device_name() != "cpu":
        return
    skip = pytest.mark.skip(reason="needs an accelerator (GPU); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
