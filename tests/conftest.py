"""Fixtures shared by the tests (the helpers they use are in `helpers.py` and `stats.py`)."""

import atexit
import os
import shutil
import tempfile

# Triton kernels run under Triton's interpreter where there is no GPU. It must be set before anything imports triton
# (transformers may), since triton's own library functions (tl.sort, ...) are defined at its import.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Cost models profiled by the tests (two workers loading the machine at once) stay out of the user's cache, where a
# later benchmark or server would read a profile timed under that load.
# The process that makes the folder (the controller; test workers inherit it) removes it when it exits.
if not os.environ.get("ANGELSPEC_COST_MODELS"):
    os.environ["ANGELSPEC_COST_MODELS"] = tempfile.mkdtemp(prefix="angelspec-test-cost-models-")
    atexit.register(shutil.rmtree, os.environ["ANGELSPEC_COST_MODELS"], ignore_errors=True)
# That folder is the tests' own, so its profiles are cached whatever the load (the rule that a profile measured on a
# busy machine is not cached has its own tests in test_draft_policy.py).
os.environ.setdefault("ANGELSPEC_PROFILE_MAX_OTHER_LOAD", "inf")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import FAMILIES, cores_per_worker, tiny_target  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need CUDA: skipped, with the reason, where this torch sees no GPU."""
    if torch.cuda.is_available():
        return
    why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
    skip = pytest.mark.skip(reason=f"needs a CUDA device (torch.cuda.is_available() is False: {why})")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine threads cost them up to 10x;
    tests on the real target (marked `real_model`) get this process's share of the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cores_per_worker() if request.node.get_closest_marker("real_model") else 1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param
