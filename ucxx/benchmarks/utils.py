"""Helpers shared by the benchmark CLI and its backends.

Nothing here imports the C extension: the CLI must be able to parse its
options (and run the pure-Python backends) without it.
"""

from __future__ import annotations

import asyncio
import os
import re

__all__ = [
    "parse_bytes",
    "format_bytes",
    "print_separator",
    "print_key_value",
    "default_server_address",
    "get_allocator",
    "new_event_loop",
    "run_until_complete",
    "set_cuda_device",
    "GilContention",
    "put_results",
    "ucx_config_value",
    "print_ucx_config",
    "run_cluster_server",
    "run_cluster_workers",
]

# Byte units, case-insensitive. Decimal units (kB, MB, ...) are powers of
# 1000, binary units (KiB, MiB, ...) powers of 1024; the trailing "B" is
# optional ("10M", "10MB", "10 Mb" and "10mb" are all 10_000_000).
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _p, _m in _DECIMAL.items():
    _UNITS[_p] = _m
    _UNITS[_p + "b"] = _m
for _p, _m in _BINARY.items():
    _UNITS[_p] = _m
    _UNITS[_p + "b"] = _m

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(s: str | int | float) -> int:
    """Parse a size such as ``"10MB"``, ``"1 B"``, ``"1MiB"``, ``"1.5 kB"``
    or ``"100"`` into a number of bytes.

    Same semantics as ``dask.utils.parse_bytes``: units are case-insensitive,
    ``kB``/``MB``/``GB``/``TB``/``PB`` are powers of 1000,
    ``KiB``/``MiB``/``GiB``/``TiB``/``PiB`` powers of 1024, the trailing
    ``B`` may be left out and a unit alone means one of it (``"MiB"`` is
    1048576). Fractions are truncated to whole bytes. Raises ValueError for
    anything else, including negative sizes.
    """
    if isinstance(s, bool):
        raise ValueError(f"Could not interpret {s!r} as a byte size")
    if isinstance(s, (int, float)):
        if s < 0:
            raise ValueError(f"Byte size must not be negative: {s!r}")
        return int(s)
    if not isinstance(s, str):
        raise ValueError(f"Could not interpret {s!r} as a byte size")
    m = _SIZE_RE.match(s)
    if m is None or (m.group(1) == "" and m.group(2) == ""):
        raise ValueError(f"Could not interpret {s!r} as a byte size")
    number, unit = m.group(1), m.group(2).lower()
    if number in ("", "."):
        if number == ".":
            raise ValueError(f"Could not interpret {s!r} as a byte size")
        number = "1"
    try:
        n = float(number)
    except ValueError:
        raise ValueError(f"Could not interpret {number!r} as a number") from None
    try:
        multiplier = _UNITS[unit]
    except KeyError:
        raise ValueError(
            f"Could not interpret {m.group(2)!r} as a byte unit "
            "(use B, kB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)"
        ) from None
    return int(n * multiplier)


def format_bytes(n: int | float) -> str:
    """Format a number of bytes like ``dask.utils.format_bytes``:
    ``"9.54 MiB"``, ``"1.00 kiB"``, ``"100 B"``."""
    for prefix, k in (
        ("Pi", 2**50),
        ("Ti", 2**40),
        ("Gi", 2**30),
        ("Mi", 2**20),
        ("ki", 2**10),
    ):
        if n >= k * 0.9:
            return f"{n / k:.2f} {prefix}B"
    return f"{int(n)} B"


def print_separator(separator: str = "-", length: int = 80) -> None:
    """Print one separator character ``length`` times."""
    print(separator * length)


def print_key_value(key, value, key_length: int = 25) -> None:
    """Print ``key | value`` with a fixed-width key field."""
    print(f"{key: <{key_length}} | {value}")


def default_server_address() -> str:
    """Default for ``--server-address``.

    The address of the interface named by ``UCXPY_IFNAME`` when that
    variable is set (``ucxx.utils.get_address()``), else ``127.0.0.1``, so
    that the benchmark works on a machine that has only loopback.
    """
    ifname = os.environ.get("UCXPY_IFNAME")
    if ifname:
        try:
            from ucxx.utils import get_address

            addr = get_address(ifname=ifname)
            if addr:
                return addr
        except Exception:
            pass
    return "127.0.0.1"


def get_allocator(object_type: str, rmm_init_pool_size=None, rmm_managed_memory=False):
    """Array module for ``object_type``: numpy, cupy, or cupy allocating
    through an RMM pool (``rmm``)."""
    if object_type == "numpy":
        import numpy as xp
    elif object_type == "cupy":
        import cupy as xp
    elif object_type == "rmm":
        import cupy as xp
        import rmm

        try:
            from rmm.allocators.cupy import rmm_cupy_allocator
        except ImportError:  # older rmm
            rmm_cupy_allocator = rmm.rmm_cupy_allocator

        rmm.reinitialize(
            pool_allocator=True,
            managed_memory=rmm_managed_memory,
            initial_pool_size=rmm_init_pool_size,
        )
        xp.cuda.set_allocator(rmm_cupy_allocator)
    else:
        raise ValueError(f"Unknown object type {object_type!r}")
    return xp


def set_cuda_device(object_type: str, device: int) -> None:
    """Select the GPU of this process (before any CUDA call)."""
    if object_type in ("cupy", "rmm"):
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)


def new_event_loop(kind: str = "asyncio") -> asyncio.AbstractEventLoop:
    """A fresh event loop: the default asyncio one, or uvloop's."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    if kind == "asyncio":
        return asyncio.new_event_loop()
    raise ValueError(f"Unknown event loop {kind!r}")


def run_until_complete(coro, kind: str = "asyncio"):
    """Run ``coro`` on a new loop of ``kind``, like ``asyncio.run``: tasks
    still pending at the end (also after an error) are cancelled and
    awaited before the loop closes."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(kind)) as runner:
        return runner.run(coro)


class GilContention:
    """``--report-gil-contention``: wraps ``gilknocker.KnockKnock``."""

    def __init__(self, enabled: bool):
        self._knocker = None
        if enabled:
            from gilknocker import KnockKnock

            # The smallest polling interval: with a larger one the metric
            # is zero for small messages and noisy for large ones.
            self._knocker = KnockKnock(polling_interval_micros=1)

    def start(self) -> None:
        if self._knocker is not None:
            self._knocker.start()

    def stop(self):
        """Stop and return the metric (None when disabled)."""
        if self._knocker is None:
            return None
        self._knocker.stop()
        return self._knocker.contention_metric


def put_results(queue, args, times, contention) -> None:
    """Hand the client's results to ``send_recv.client`` (see BaseClient)."""
    queue.put(times)
    if args.report_gil_contention:
        queue.put(contention)


def ucx_config_value(name: str) -> str:
    """A UCX setting (``"TLS"``, ``"NET_DEVICES"``) as the package sees it:
    ``ucxx.get_config()`` (keys without the ``UCX_`` prefix)."""
    import ucxx

    return ucxx.get_config().get(name, "")


def print_ucx_config() -> None:
    """The ``UCX_TLS`` and ``UCX_NET_DEVICES`` report rows."""
    print_key_value(key="UCX_TLS", value=f"{ucx_config_value('TLS')}")
    print_key_value(key="UCX_NET_DEVICES", value=f"{ucx_config_value('NET_DEVICES')}")


def _host_u1(buf):
    """``buf`` (host buffer, numpy array, or an object with
    ``__cuda_array_interface__``) as a flat host ``uint8`` numpy array."""
    import numpy as np

    if hasattr(buf, "__cuda_array_interface__"):
        import cupy

        return cupy.asnumpy(cupy.asarray(buf)).reshape(-1).view("u1")
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view("u1")
    return np.frombuffer(buf, dtype="u1")


def check_echo(received, sent, n_buffers: int = 1) -> None:
    """Check the last echo of a run (outside the timed loop): each received
    buffer must equal ``sent`` (the client's message). Catches a transport
    that completes requests without moving the data."""
    import numpy as np

    got = received if isinstance(received, (list, tuple)) else [received]
    if len(got) != n_buffers:
        raise RuntimeError(f"echo: expected {n_buffers} buffers, got {len(got)}")
    expected = _host_u1(sent)
    for buf in got:
        if not np.array_equal(_host_u1(buf), expected):
            raise RuntimeError("echo: the received message differs from the sent one")


# --------------------------------------------------------------------------
# A small cluster of ucxx processes (RAPIDS ucxx's benchmark helpers): one
# server process that introduces the workers to each other, and worker
# processes, fully connected, each running a function and reporting its
# result to the server.
# --------------------------------------------------------------------------


async def _send_pickled(ep, obj) -> None:
    import pickle

    await ep.send_obj(pickle.dumps(obj))


async def _recv_pickled(ep):
    import pickle

    return pickle.loads(await ep.recv_obj())


def _fresh_context() -> None:
    """A forked child cannot use the context it inherited: start without."""
    import ucxx

    try:
        ucxx.reset()
    except ucxx.UCXError:  # the parent's endpoints/listeners: left alone
        pass


def _cluster_server(results_q, server_file, n_workers, ucx_options) -> None:
    import json

    import ucxx

    _fresh_context()
    if ucx_options is not None:
        ucxx.init(ucx_options)

    async def run():
        peers: dict = {}
        results: dict = {}

        async def handle(ep):
            rank, ip, port = await _recv_pickled(ep)
            peers[rank] = (ip, port)
            while len(peers) < n_workers:
                await asyncio.sleep(0.01)
            await _send_pickled(ep, peers)
            results[rank] = await _recv_pickled(ep)
            await ep.close()

        listener = ucxx.create_listener(handle)
        text = json.dumps({"address": ucxx.get_address(), "port": listener.port})
        if server_file is None:
            print(text, flush=True)
        else:
            with open(server_file, "w") as f:  # one write: readers poll for it
                f.write(text)
        while len(results) < n_workers or listener.active_clients:
            await asyncio.sleep(0.01)
        listener.close()
        return results

    loop = asyncio.new_event_loop()
    try:
        results = loop.run_until_complete(run())
    finally:
        loop.close()
    for rank in range(n_workers):
        results_q.put(results[rank])


def _cluster_start(target, args, error_wrapper):
    import multiprocessing

    mp = multiprocessing.get_context("fork")
    if error_wrapper is None:
        p = mp.Process(target=target, args=args)
        p.start()
        return p, None
    error_q = mp.Queue()
    p = mp.Process(target=error_wrapper, args=(target, error_q, *args))
    p.start()
    return p, error_q


def _run_cluster_server(server_file, n_workers, ucx_options_list=None, error_wrapper=None):
    """Start the server process of a cluster of ``n_workers`` workers.

    The cluster's processes are forked: the calling process must have no
    ucxx context at that moment (``ucxx.reset()`` first), since UCX's
    background thread does not survive fork.

    It writes ``{"address": ..., "port": ...}`` (JSON) to ``server_file``
    (stdout if None), waits for every worker to report its listener,
    sends each the whole table, and collects each worker's result.
    ``ucx_options_list``: UCX options (a dict) for the server's
    ``ucxx.init``. ``error_wrapper`` (e.g. ``ucxx.testing.run_in_subprocess``)
    wraps the process target; then an error queue is returned too.

    Returns ``(process, result_queue)``, or ``(process, result_queue,
    error_queue)`` with ``error_wrapper``. The results come in rank order.
    """
    import multiprocessing

    results_q = multiprocessing.get_context("fork").Queue()
    p, error_q = _cluster_start(
        _cluster_server, (results_q, server_file, n_workers, ucx_options_list), error_wrapper
    )
    if error_wrapper is None:
        return p, results_q
    return p, results_q, error_q


def run_cluster_server(server_file, n_workers, ucx_options_list=None) -> list:
    """:func:`_run_cluster_server`, waited for: the workers' results in
    rank order."""
    p, q = _run_cluster_server(server_file, n_workers, ucx_options_list)
    results = [q.get() for _ in range(n_workers)]  # before join: a full pipe blocks
    p.join()
    if p.exitcode:
        raise RuntimeError(f"cluster server exited with code {p.exitcode}")
    return results


def _cluster_worker(
    result_q, server_info, num_node_workers, rank, ucx_options_list, ensure_cuda_device, func, args
) -> None:
    import inspect

    import numpy as np

    if ensure_cuda_device:
        from ucxx._cuda_context import ensure_cuda_context

        devs = getattr(args, "devs", None) or [0]
        os.environ["CUDA_VISIBLE_DEVICES"] = str(devs[(rank % num_node_workers) % len(devs)])
        ensure_cuda_context(0)

    import ucxx

    _fresh_context()
    if ucx_options_list is not None:
        ucxx.init(ucx_options_list[rank])

    async def run():
        eps: dict = {}

        async def on_peer(ep):
            peer_rank = np.empty(1, dtype=np.uint64)
            await ep.recv(peer_rank)
            eps[int(peer_rank[0])] = ep

        listener = ucxx.create_listener(on_peer)
        server = await ucxx.create_endpoint(server_info["address"], server_info["port"])
        await _send_pickled(server, (rank, ucxx.get_address(), listener.port))
        table = await _recv_pickled(server)
        for peer in range(rank + 1, len(table)):
            ip, port = table[peer]
            ep = await ucxx.create_endpoint(ip, port)
            await ep.send(np.array([rank], dtype=np.uint64))
            eps[peer] = ep
        while len(eps) < len(table) - 1:
            await asyncio.sleep(0.01)
        result = func(rank, eps, args)
        if inspect.isawaitable(result):
            result = await result
        await _send_pickled(server, result)
        await asyncio.gather(server.close(), *(ep.close() for ep in eps.values()))
        listener.close()
        return result

    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(run())
    finally:
        loop.close()
    result_q.put(result)


def _run_cluster_workers(
    server_info,
    num_workers,
    num_node_workers,
    node_idx,
    worker_func,
    worker_args=None,
    ucx_options_list=None,
    ensure_cuda_device=False,
    error_wrapper=None,
):
    """Start this node's ``num_node_workers`` worker processes (ranks
    ``node_idx * num_node_workers`` on) of a cluster whose server
    :func:`_run_cluster_server` started.

    ``server_info``: the server's file, or its ``{"address", "port"}``.
    Each worker connects to every other (``eps``: rank -> Endpoint), runs
    ``worker_func(rank, eps, worker_args)`` (a function or a coroutine
    function) and reports its result to the server. ``ucx_options_list``:
    one dict of UCX options per rank. ``ensure_cuda_device``: select the
    GPU ``worker_args.devs[rank]`` and create its context first.
    ``num_workers`` is the cluster's size (the server's table says it too).

    Returns the processes, or ``(process, error_queue)`` pairs with
    ``error_wrapper`` (e.g. ``ucxx.testing.run_in_subprocess``); the caller
    joins them.
    """
    import json
    import multiprocessing

    if isinstance(server_info, str):
        with open(server_info) as f:
            server_info = json.load(f)
    elif not isinstance(server_info, dict):
        raise ValueError(
            "server_info must be the path of a server file or a dict with "
            "'address' and 'port'"
        )
    mp = multiprocessing.get_context("fork")
    out = []
    for i in range(num_node_workers):
        rank = node_idx * num_node_workers + i
        p, error_q = _cluster_start(
            _cluster_worker,
            (mp.Queue(), server_info, num_node_workers, rank, ucx_options_list,
             ensure_cuda_device, worker_func, worker_args),
            error_wrapper,
        )
        out.append(p if error_wrapper is None else (p, error_q))
    return out


def run_cluster_workers(
    server_info,
    num_workers,
    num_node_workers,
    node_idx,
    worker_func,
    worker_args=None,
    ucx_options_list=None,
    ensure_cuda_device=False,
) -> None:
    """:func:`_run_cluster_workers`, waited for; RuntimeError if a worker
    failed."""
    procs = _run_cluster_workers(
        server_info, num_workers, num_node_workers, node_idx, worker_func,
        worker_args, ucx_options_list, ensure_cuda_device,
    )
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"cluster worker exited with code {p.exitcode}")
