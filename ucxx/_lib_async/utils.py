"""Helpers shared by the asyncio layer."""

from __future__ import annotations

import asyncio
import hashlib
import warnings


def get_event_loop() -> asyncio.AbstractEventLoop:
    """The running loop, else the policy's current loop (created if needed)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        policy = asyncio.get_event_loop_policy()
        try:
            return policy.get_event_loop()
        except RuntimeError:
            loop = policy.new_event_loop()
            policy.set_event_loop(loop)
            return loop


def hash64bits(*args) -> int:
    """A 64-bit unsigned hash of ``args`` (of their ``repr``): the same
    value in every process, unlike ``hash()`` of a str."""
    digest = hashlib.blake2b(repr(args).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class UCXAddress(bytes):
    """A UCX worker address (what ``ucxx.get_worker_address()`` returns):
    the packed address bytes, plus RAPIDS ucxx's ``length`` and
    ``create_from_buffer``."""

    __slots__ = ()

    @classmethod
    def create_from_buffer(cls, buffer) -> "UCXAddress":
        """The address serialized in ``buffer`` (any bytes-like object)."""
        return cls(memoryview(buffer).tobytes())

    @property
    def length(self) -> int:
        """Size of the address in bytes."""
        return len(self)

    def __repr__(self) -> str:
        return f"<UCXAddress {len(self)} bytes>"


class CallableBool(int):
    """A bool that can also be called: ``ep.closed`` and ``ep.closed()``
    both work (ucx-py had a method, RAPIDS ucxx a property)."""

    __slots__ = ()

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return "True" if self else "False"

    __str__ = __repr__


TRUE = CallableBool(1)
FALSE = CallableBool(0)


def callable_bool(value: bool) -> CallableBool:
    return TRUE if value else FALSE
