"""CUDA context helpers (RAPIDS ucxx's ``ucxx._cuda_context``).

Nothing here runs at ``import ucxx``: the CUDA bindings are imported on the
first call. ``cuda.core`` (``cuda-core`` package) is used when installed,
else numba's CUDA driver API.
"""

from __future__ import annotations

__all__ = ["ensure_cuda_context", "synchronize_default_stream"]


def _device(device_id: int):
    """``cuda.core`` Device ``device_id`` made current, or None when
    cuda.core is not installed."""
    try:
        from cuda.core import Device
    except ImportError:
        try:
            from cuda.core.experimental import Device
        except ImportError:
            return None
    dev = Device(device_id)
    dev.set_current()
    return dev


def _numba_cuda():
    try:
        from numba import cuda
    except ImportError as e:
        raise ImportError(
            "CUDA context management needs cuda-core (pip install cuda-core) "
            "or numba with CUDA support"
        ) from e
    return cuda


def ensure_cuda_context(device_id: int = 0) -> None:
    """Create (if needed) the primary CUDA context of ``device_id`` and
    make it current on this thread."""
    if _device(device_id) is None:
        cuda = _numba_cuda()
        cuda.select_device(device_id)


def synchronize_default_stream(device_id: int = 0) -> None:
    """Wait for the work queued on ``device_id``'s default stream (before
    handing its buffers to UCX)."""
    dev = _device(device_id)
    if dev is not None:
        dev.sync()
        return
    cuda = _numba_cuda()
    cuda.select_device(device_id)
    cuda.default_stream().synchronize()
