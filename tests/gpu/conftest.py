"""The GPU tests manage their own context; CUDA opens device fds and
threads of its own, so the suite-wide leak check does not apply here."""

import pytest


@pytest.fixture(autouse=True)
def check_leaks():
    yield
