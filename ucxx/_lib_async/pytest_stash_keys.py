"""The pytest stash key RAPIDS ucxx's async test suite shares between its
``conftest.py`` (which writes each test's asyncio timeout) and
``utils_test.compute_timeouts`` (which reads it)."""

import pytest

# A stash, not ``config.cache``: the stash stays in-process, so it also
# works on pytest-xdist workers.
ASYNCIO_PLUGIN_TIMEOUT_STASH_KEY = pytest.StashKey[float]()
