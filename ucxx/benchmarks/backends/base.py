"""Interface of a benchmark backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from argparse import Namespace
from queue import Queue


class BaseServer(ABC):
    """The echo side of the round-trip benchmark.

    ``run()`` (a plain function or a coroutine function) must:

    1. start listening (on ``args.port`` if given, else any free port);
    2. put the port it listens on into ``queue`` exactly once;
    3. echo every message of ``args.n_warmup_iter + args.n_iter`` round trips;
    4. shut down once the client is done.
    """

    has_cuda_support = False

    def __init__(self, args: Namespace, queue: Queue):
        self.args = args
        self.queue = queue

    @abstractmethod
    def run(self):
        ...


class BaseClient(ABC):
    """The timing side of the round-trip benchmark.

    ``run()`` (a plain function or a coroutine function) must connect to
    ``server_address:port``, do ``args.n_warmup_iter + args.n_iter`` round
    trips (send, then receive the echo), and put into ``queue`` the list of
    the ``args.n_iter`` timed round-trip durations in seconds (then, with
    ``--report-gil-contention``, the contention metric).
    """

    has_cuda_support = False

    def __init__(self, args: Namespace, queue: Queue, server_address: str, port):
        self.args = args
        self.queue = queue
        self.server_address = server_address
        self.port = port

    @abstractmethod
    def run(self):
        ...

    def print_backend_specific_config(self) -> None:
        """Print report rows specific to this backend (none by default)."""
