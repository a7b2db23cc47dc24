"""Small helpers: network addresses, logging, formatting."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

__all__ = [
    "get_address",
    "get_ucxpy_logger",
    "format_bytes",
    "format_time",
    "parse_bytes",
    "print_separator",
    "print_key_value",
    "print_multi",
    "hmean",
]

_SIOCGIFADDR = 0x8915
_LOOPBACK = "127.0.0.1"


def _ipv4_of(ifname: str) -> str:
    """IPv4 address of interface ``ifname``; OSError if it has none."""
    name = ifname.encode()[:15]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name))
    return socket.inet_ntoa(packed[20:24])


def _ipv6_of(ifname: str) -> str:
    """First global IPv6 address of ``ifname`` (from /proc/net/if_inet6)."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError as e:
        raise OSError(f"cannot read IPv6 addresses: {e}") from None
    link_local = None
    for row in rows:
        if len(row) < 6 or row[5] != ifname:
            continue
        hexaddr, scope = row[0], int(row[3], 16)
        addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(hexaddr))
        if scope == 0 or scope == 0x10:  # global or host (::1)
            return addr
        link_local = link_local or addr
    if link_local is not None:
        return link_local
    raise OSError(f"interface {ifname!r} has no IPv6 address")


def _interfaces() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return [name for _, name in socket.if_nameindex()]


def get_address(ifname: str | None = None, use_ipv6: bool = False) -> str:
    """Address of a network interface.

    ``ifname``: interface name. If None, ``$UCXPY_IFNAME`` is used when set;
    otherwise the first interface with an address among those whose name
    starts with ``ib``, ``eth``, ``en`` (in that order of preference), and
    finally the loopback address (``127.0.0.1``, or ``::1`` with
    ``use_ipv6``) on a machine that only has ``lo``.

    An explicitly named interface that does not exist or has no address
    raises OSError naming it.

    >>> get_address(ifname="lo")
    '127.0.0.1'
    """
    lookup = _ipv6_of if use_ipv6 else _ipv4_of
    if ifname is None:
        ifname = os.environ.get("UCXPY_IFNAME") or None
    if ifname is not None:
        try:
            return lookup(ifname)
        except OSError as e:
            raise OSError(
                f"cannot get the address of network interface {ifname!r}: {e}"
            ) from None

    names = _interfaces()
    for prefix in ("ib", "eth", "en"):
        for name in names:
            if name.startswith(prefix):
                try:
                    return lookup(name)
                except OSError:
                    continue
    return "::1" if use_ipv6 else _LOOPBACK


def get_ucxpy_logger() -> logging.Logger:
    """The ``"ucx"`` logger, with a handler and the level of
    ``$UCXPY_LOG_LEVEL`` (default WARNING). Idempotent."""
    logger = logging.getLogger("ucx")
    level = os.environ.get("UCXPY_LOG_LEVEL")
    if level:
        logger.setLevel(level.upper())
    if not getattr(logger, "_ucxx_configured", False):
        handler = logging.StreamHandler()
        host = socket.gethostname()
        handler.setFormatter(
            logging.Formatter(
                f"[%(created).6f] [{host}:%(process)d] UCXPY  %(levelname)s %(message)s"
            )
        )
        logger.addHandler(handler)
        logger.propagate = False
        logger._ucxx_configured = True  # type: ignore[attr-defined]
    return logger


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_time(t: float) -> str:
    """Seconds to a human string: ``1.5e-6 -> '1.500 us'``."""
    if t < 1e-6:
        return f"{t * 1e9:.3f} ns"
    if t < 1e-3:
        return f"{t * 1e6:.3f} us"
    if t < 1:
        return f"{t * 1e3:.3f} ms"
    return f"{t:.3f} s"


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
}


def parse_bytes(s: str | int) -> int:
    """``'64MiB' -> 67108864``, ``'1kB' -> 1000``, ``'100' -> 100``."""
    if isinstance(s, int):
        return s
    text = s.strip().replace(" ", "").lower()
    i = 0
    while i < len(text) and (text[i].isdigit() or text[i] in ".e+-"):
        # stop at an 'e' that starts a unit rather than an exponent
        if text[i] == "e" and not (i + 1 < len(text) and (text[i + 1].isdigit() or text[i + 1] in "+-")):
            break
        i += 1
    number, unit = text[:i], text[i:]
    if unit not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {s!r}")
    return int(float(number or "1") * _UNITS[unit])


def print_separator(separator: str = "-", length: int = 80) -> None:
    print(separator * length)


def print_key_value(key: str, value: object, key_length: int = 25) -> None:
    print(f"{key: <{key_length}} | {value}")


def print_multi(values, key_length: int = 25) -> None:
    values = list(values)
    print("".join(f"{s: <{key_length}} | " for s in values[:-1]) + str(values[-1]))


def hmean(a) -> float:
    """Harmonic mean (0 for an empty sequence)."""
    a = [float(x) for x in a]
    if not a:
        return 0.0
    return len(a) / sum(1.0 / x for x in a)

