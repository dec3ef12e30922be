"""One intra-op thread for these tests: the models are tiny, and on a loaded machine
OpenMP's spinning threads make a 2-thread conv hundreds of times slower."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
