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

# Test helpers live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
