"""The interpreter's share of a ping-pong round trip, without any transport.

``pingpong_py.py``'s client loop (``await send(out)``, ``await recv(inb)``,
one clock reading and one stored sample per iteration) and its server loop
(``await recv(buf)``, ``await send(buf)``) run here against stand-ins that
return an already-completed asyncio future, so every await finishes at
once, as a transfer that completes inside its call does. (The loops are
copies of ``pingpong_py.py``'s, not shared functions: there they run
inline in the client and server coroutines, and an extra coroutine level
would change what the benchmark measures.) What is left is
the Python bytecode of the loops and the awaits: work that any Python
package doing the same ping-pong pays on top of the transport, whatever it
does inside ``send``/``recv``.

The stand-ins are Python functions (``lambda b: done``), which cost more
per call than the extension's C methods; the call overhead of such a
function over a C builtin taking the same argument (``len``) is measured
too and subtracted, four calls per round trip.

Usage::

    python benchmarks/floor.py [-n ITERATIONS] [-r REPEATS]

Prints the minimum over the repeats (least disturbed by other work) of each
figure in ns.
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def _client(n: int, send, recv) -> float:
    out, inb = bytearray(1), bytearray(1)
    samples = [0] * n
    clock = time.perf_counter_ns
    t_start = t_prev = clock()
    for i in range(n):
        await send(out)
        await recv(inb)
        t_now = clock()
        samples[i] = t_now - t_prev
        t_prev = t_now
    return (t_prev - t_start) / n


async def _server(n: int, send, recv) -> float:
    buf = bytearray(1)
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(n):
        await recv(buf)
        await send(buf)
    return (clock() - t0) / n


def _call_overhead(n: int, f) -> float:
    """ns per ``f(out)`` in a loop, minus the same loop calling ``len``."""
    out = bytearray(1)
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(n):
        f(out)
    t1 = clock()
    for _ in range(n):
        len(out)
    t2 = clock()
    return ((t1 - t0) - (t2 - t1)) / n


async def measure(n: int, repeats: int) -> dict:
    done = asyncio.get_running_loop().create_future()
    done.set_result(1)

    def stub(b):
        return done

    client = min([await _client(n, stub, stub) for _ in range(repeats)])
    server = min([await _server(n, stub, stub) for _ in range(repeats)])
    call = min(_call_overhead(n, stub) for _ in range(repeats))
    return {
        "client_ns": client,
        "server_ns": server,
        "stub_call_overhead_ns": call,
        "round_trip_ns": client + server - 4 * call,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--iterations", type=int, default=1_000_000)
    p.add_argument("-r", "--repeats", type=int, default=5)
    args = p.parse_args()
    r = asyncio.run(measure(args.iterations, args.repeats))
    print(f"client loop, per iteration       {r['client_ns']:8.1f} ns")
    print(f"server loop, per iteration       {r['server_ns']:8.1f} ns")
    print(f"stand-in call overhead (each)    {r['stub_call_overhead_ns']:8.1f} ns")
    print(f"interpreter work per round trip  {r['round_trip_ns']:8.1f} ns"
          "  (client + server - 4 x call overhead)")


if __name__ == "__main__":
    main()
