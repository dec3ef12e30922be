"""PTQ tests run many tiny forward passes: one torch thread is faster than two on a
shared machine (and gives the same numbers)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
