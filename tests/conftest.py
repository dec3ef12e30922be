"""Shared test configuration.

* Hypothesis profiles: ``ci`` (set when ``CI`` is in the environment) is derandomized so
  CI runs are reproducible; ``dev`` explores new examples each run.
* One intra-op torch thread for every test: the models are tiny, results are the same,
  and on a loaded 2-core machine OpenMP's spinning second thread makes small convs
  hundreds of times slower.  A test that needs more threads sets them itself; the
  fixture restores the count afterwards.
"""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
