"""Helpers for tests that run ucxx in child processes (RAPIDS ucxx's
``ucxx.testing``): run a target so that its traceback reaches the parent,
join a group of processes within one deadline, and make sure a child is
gone and exited cleanly."""

from __future__ import annotations

import queue as _queue
import time
import traceback
from typing import Any, Callable, Iterable

__all__ = ["run_in_subprocess", "join_processes", "terminate_process"]


def run_in_subprocess(target: Callable[..., Any], error_queue, *args: Any, **kwargs: Any) -> None:
    """Call ``target(*args, **kwargs)``; if it raises, put its formatted
    traceback on ``error_queue`` and re-raise (the process then exits with a
    non-zero code). Use it as a ``multiprocessing.Process`` target and pass
    the same queue to :func:`terminate_process`."""
    try:
        target(*args, **kwargs)
    except Exception:
        error_queue.put(traceback.format_exc())
        raise


def join_processes(processes: Iterable, timeout: float) -> None:
    """Join every process, all of them within ``timeout`` seconds in total
    (each ``join`` gets what is left of the deadline)."""
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


def terminate_process(process, kill_wait: float = 3.0, error_queue=None) -> None:
    """Make sure ``process`` has ended: kill it if it is still running and
    wait up to ``kill_wait`` seconds for it to go.

    Raises ValueError if it is still alive after that, RuntimeError if it
    exited with a non-zero code (with the child's traceback when it ran
    under :func:`run_in_subprocess` with ``error_queue``)."""
    if process.is_alive():
        process.kill()
    process.join(timeout=kill_wait)
    if process.is_alive():
        raise ValueError(
            f"process {process.pid} is still alive {kill_wait} s after SIGKILL"
        )
    if process.exitcode != 0:
        msg = f"Process did not exit cleanly (exit code: {process.exitcode})"
        if error_queue is not None:
            try:
                tb = error_queue.get(timeout=0.5)
            except _queue.Empty:
                pass
            else:
                raise RuntimeError(f"{msg}\n\nSubprocess traceback:\n{tb}")
        raise RuntimeError(msg)
