import os

import pytest

from tests.support.ranks import Ranks, shm_buffers

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_switch] = "1"  # nothing in the tests may reach a hub


@pytest.fixture(scope="session")
def ranks():
    """Long-lived ranks: ``ranks.run(fn, *args, world_size=2)`` runs ``fn`` on each."""
    pool = Ranks()
    yield pool
    pool.close()


@pytest.fixture(scope="session", autouse=True)
def no_shm_leak():
    before = set(shm_buffers())
    yield
    leaked = set(shm_buffers()) - before
    assert not leaked, f"test session left DeepSpeed shared-memory buffers: {sorted(leaked)}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an accelerator; skipped on CPU-only machines")
    config.addinivalue_line("markers", "slow: spawns processes or trains; still part of CI")


def pytest_collection_modifyitems(config, items):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    skip = pytest.mark.skip(reason="needs an accelerator (GPU); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
