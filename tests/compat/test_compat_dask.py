"""Both Dask backends on this package: its own (``ucxx-c://``, and
``ucxx://`` without distributed-ucxx) and distributed-ucxx's (``ucx://``,
and ``ucxx://`` when it is installed), each computing a merge on a
LocalCluster, in worker processes and in-process. Every cluster runs in a
child process (its own ucxx context, nothing left in the test process).

The tests that need distributed-ucxx (``pip install --no-deps
distributed-ucxx-cu12``) skip without it; the ones "without" it hide it in
the child (imports and entry points), so they run either way."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("distributed")
pytest.importorskip("dask.dataframe")

HAVE_DISTRIBUTED_UCXX = importlib.util.find_spec("distributed_ucxx") is not None
needs_distributed_ucxx = pytest.mark.skipif(
    not HAVE_DISTRIBUTED_UCXX,
    reason="distributed-ucxx is not installed (pip install --no-deps distributed-ucxx-cu12)",
)

# Imported first in every process of a run "without distributed-ucxx"
# (PYTHONPATH): the package cannot be imported and its entry points are not
# listed, as if it were not installed.
HIDE_DISTRIBUTED_UCXX = '''
import importlib.abc, importlib.metadata as md, sys

class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "distributed_ucxx":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
_entry_points = md.entry_points

def entry_points(**params):
    eps = _entry_points(**params)
    if not isinstance(eps, md.EntryPoints):
        return eps
    return md.EntryPoints(
        ep for ep in eps if not ep.value.startswith("distributed_ucxx")
    )

md.entry_points = entry_points
'''

MERGE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import pandas as pd
    import dask
    import dask.dataframe as dd
    from distributed import Client, LocalCluster
    from distributed.comm.registry import get_backend

    protocol, processes = sys.argv[1], sys.argv[2] == "1"
    if __name__ == "__main__":
        with dask.config.set({"dataframe.shuffle.method": "tasks"}):
            with LocalCluster(protocol=protocol, n_workers=2, threads_per_worker=1,
                              processes=processes, host="127.0.0.1",
                              dashboard_address=None) as cluster, \\
                    Client(cluster) as client:
                assert cluster.scheduler_address.startswith(protocol + "://")
                left = pd.DataFrame({"k": np.arange(2000) % 97, "a": np.arange(2000)})
                right = pd.DataFrame({"k": np.arange(97), "b": np.arange(97) * 3})
                got = dd.merge(dd.from_pandas(left, npartitions=4),
                               dd.from_pandas(right, npartitions=3), on="k").compute()
                want = left.merge(right, on="k")
                key = ["k", "a"]
                pd.testing.assert_frame_equal(
                    got.sort_values(key).reset_index(drop=True)[want.columns],
                    want.sort_values(key).reset_index(drop=True))
                workers = list(client.scheduler_info()["workers"])
                assert len(workers) == 2
                assert all(w.startswith(protocol + "://") for w in workers)
        backend = type(get_backend(protocol))
        print("ok", backend.__module__ + "." + backend.__qualname__)
    """
)


def _run(script: str, *args: str, hide: bool, tmp_path, timeout: int = 240) -> list[str]:
    env = dict(os.environ)
    env.setdefault("UCX_TLS", "tcp")
    if hide:
        (tmp_path / "sitecustomize.py").write_text(HIDE_DISTRIBUTED_UCXX)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(tmp_path), env.get("PYTHONPATH")) if p
        )
    path = tmp_path / "run.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path), *args], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    return out.stdout.strip().splitlines()


SCHEMES = textwrap.dedent(
    """
    from importlib.metadata import entry_points
    from distributed.comm.registry import get_backend
    import ucxx.distributed as ud
    names = {}
    for ep in entry_points(group="distributed.comm.backends"):
        if ep.name in ("ucx", "ucxx", "ucxx-c"):
            b = ep.load()()
            names.setdefault(ep.name, set()).add(type(b).__module__ + "." + type(b).__name__)
    for scheme in ("ucxx", "ucxx-c"):
        b = get_backend(scheme)
        print(scheme, type(b).__module__ + "." + type(b).__name__, sorted(names[scheme]))
    try:
        b = get_backend("ucx")
        print("ucx", type(b).__module__ + "." + type(b).__name__, sorted(names.get("ucx", ())))
    except Exception as e:
        print("ucx", type(e).__name__)
    """
)


@pytest.mark.timeout(120)
@needs_distributed_ucxx
def test_schemes_with_distributed_ucxx(tmp_path):
    lines = _run(SCHEMES, hide=False, tmp_path=tmp_path)
    # Every ucxx entry point (distributed-ucxx's and ours) gives
    # distributed-ucxx's backend: the choice does not depend on their order.
    assert lines[0] == ("ucxx distributed_ucxx.ucxx.UCXXBackendLegacyPrefix "
                        "['distributed_ucxx.ucxx.UCXXBackendLegacyPrefix']")
    assert lines[1] == "ucxx-c ucxx.distributed.UCXXCBackend ['ucxx.distributed.UCXXCBackend']"
    assert lines[2] == "ucx distributed_ucxx.ucxx.UCXXBackend ['distributed_ucxx.ucxx.UCXXBackend']"


@pytest.mark.timeout(120)
def test_schemes_without_distributed_ucxx(tmp_path):
    lines = _run(SCHEMES, hide=True, tmp_path=tmp_path)
    assert lines[0] == "ucxx ucxx.distributed.UCXXBackend ['ucxx.distributed.UCXXBackend']"
    assert lines[1] == "ucxx-c ucxx.distributed.UCXXCBackend ['ucxx.distributed.UCXXCBackend']"
    assert lines[2].split()[0] == "ucx" and "distributed_ucxx" not in lines[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_distributed_ucxx
@pytest.mark.parametrize("processes", [True, False], ids=["processes", "threads"])
@pytest.mark.parametrize("protocol,backend", [
    ("ucx", "distributed_ucxx.ucxx.UCXXBackend"),
    ("ucxx", "distributed_ucxx.ucxx.UCXXBackendLegacyPrefix"),
    ("ucxx-c", "ucxx.distributed.UCXXCBackend"),
])
def test_merge_with_distributed_ucxx(tmp_path, protocol, backend, processes):
    assert _run(MERGE, protocol, "1" if processes else "0", hide=False,
                tmp_path=tmp_path)[-1] == f"ok {backend}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [True, False], ids=["processes", "threads"])
@pytest.mark.parametrize("protocol,backend", [
    ("ucxx", "ucxx.distributed.UCXXBackend"),
    ("ucxx-c", "ucxx.distributed.UCXXCBackend"),
])
def test_merge_without_distributed_ucxx(tmp_path, protocol, backend, processes):
    assert _run(MERGE, protocol, "1" if processes else "0", hide=True,
                tmp_path=tmp_path)[-1] == f"ok {backend}"
