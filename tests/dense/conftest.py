"""Dense tests run on one thread: their tensors are tiny, and on a shared 2-core machine OpenMP's spinning
workers cost more than they give."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
