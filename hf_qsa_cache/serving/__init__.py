"""Continuous batching on `QSAPagedCache`: transformers' `generate_batch` / `init_continuous_batching` API.

* `requests`: one request's host state (tokens, status, sampling) and its transformers result;
* `scheduler`: who holds a cache row, in which order, what each step feeds, whom to preempt;
* `runner`: the model and its cache: row moves, the forward of each step, sampling;
* `sampling`: a request's sampling parameters and its next-token scores; `delivery`: each request's results
  to its handler or its own queue;
* `manager`: the background loop and transformers' manager API; `api`: the model-class mixin.
"""

from .api import ContinuousBatchingMixin
from .manager import ContinuousBatchingManager
from .sampling import Sampling

__all__ = ["ContinuousBatchingManager", "ContinuousBatchingMixin", "Sampling"]
