"""Each attention test leaves the kernels' ISA and thread count as it found them."""

from __future__ import annotations

import pytest

from tests.kernels.attention.oracle import fk


@pytest.fixture(autouse=True)
def _restore_kernel_state():
    threads = fk.num_threads()
    yield
    fk.set_isa(fk.best_isa())
    fk.set_num_threads(threads)
