"""Shared set-up of the rollout worker tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One torch thread, as a rollout worker runs by default (`rollout.threads`): tiny models are faster on one, and
    two thrash on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
