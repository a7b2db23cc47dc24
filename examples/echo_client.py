"""Echo client: sends messages to examples/echo_server.py and checks the
replies.

::

    python examples/echo_server.py --port 13337
    python examples/echo_client.py --port 13337 [--host 127.0.0.1] [-n 10] [--size 1024]

It connects (the connection handshake takes one round trip), sends ``-n``
messages of ``--size`` bytes with ``Endpoint.send_obj``, receives each echo
with ``recv_obj``, checks it, prints the mean round-trip time, and closes
the connection. Exits with status 1 if an echo does not match.
"""

import argparse
import asyncio
import os
import sys
import time

import ucxx


async def main(args) -> int:
    ep = await ucxx.create_endpoint(args.host, args.port)
    print(f"connected to {args.host}:{args.port}", flush=True)
    t0 = time.perf_counter()
    try:
        for i in range(args.n):
            msg = os.urandom(args.size)
            await ep.send_obj(msg)
            echo = await ep.recv_obj()
            if bytes(echo) != msg:
                print(f"message {i}: echo does not match", file=sys.stderr)
                return 1
    finally:
        await ep.close()
    dt = time.perf_counter() - t0
    print(f"{args.n} messages of {args.size} bytes echoed; "
          f"mean round trip {dt / max(args.n, 1) * 1e6:.1f} us", flush=True)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="server address")
    p.add_argument("--port", type=int, default=13337, help="server port")
    p.add_argument("-n", type=int, default=10, help="number of messages")
    p.add_argument("--size", type=int, default=1024, help="message size in bytes")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
