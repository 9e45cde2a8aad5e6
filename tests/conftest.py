"""Shared pytest configuration: marker handling and worker-pool shutdown."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton has no CPU backend: its kernels are tested under the interpreter. The variable must be set
# before anything imports triton (transformers may, while other test modules are collected), or
# triton initialises in compiled mode and the interpreter tests fail with mixed state.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # a plain `pytest` (not `python -m pytest`) from an uninstalled checkout
    import seqpar  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seqpar.testing import shutdown_pools  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow test; set SEQPAR_SLOW=1 to run it")
    has_cuda = torch.cuda.is_available()
    run_slow = os.environ.get("SEQPAR_SLOW") == "1"
    skip_static_full = pytest.mark.skip(reason="slow static GPU check; set SEQPAR_GPU_STATIC_FULL=1 to run it")
    run_static_full = os.environ.get("SEQPAR_GPU_STATIC_FULL") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu_static_full" in item.keywords and not run_static_full:
            item.add_marker(skip_static_full)


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: intra-op threads only slow these checks down on a busy 2-core box
    (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_worker_pools():
    """Stop the persistent multi-process worker pools when the session ends."""
    yield
    shutdown_pools()
