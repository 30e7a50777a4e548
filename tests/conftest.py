import os
import sys

import torch

# One intra-op thread per process: on a small shared machine the default oversubscribes the cores
# and the suite runs ten times slower.
torch.set_num_threads(1)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:  # only allowed before any inter-op work has started
    pass

# The tests' shared helpers (`tests/helpers`) are imported as `helpers`.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def qwen():
    """A tiny Qwen4Exp of ours (random weights, fp32, eval): `helpers.qwen4.tiny_config`."""
    from helpers.qwen4 import make_pair

    return make_pair(seed=3)[1]


@pytest.fixture(scope="module")
def ink():
    """A tiny Inkling of ours (random weights, fp32, eval): `helpers.inkling.make_config`."""
    from helpers import inkling

    return inkling.make_pair(inkling.make_config(), seed=4)[1]
