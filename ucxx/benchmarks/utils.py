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
