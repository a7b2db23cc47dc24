"""Echo server: sends every message it receives back to its sender.

Run it, then the client (examples/echo_client.py) in another terminal::

    python examples/echo_server.py --port 13337
    python examples/echo_client.py --port 13337

Each message is framed with ``Endpoint.send_obj`` / ``recv_obj`` (a size
header, then the payload), so messages of any size work. The server serves
any number of clients at once and runs until interrupted (Ctrl-C), or until
``--max-clients`` clients have come and gone.
"""

import argparse
import asyncio
import logging

import ucxx


async def handle_client(ep: ucxx.Endpoint, stats: dict) -> None:
    """Echo messages until the client closes the connection."""
    n = 0
    while True:
        try:
            msg = await ep.recv_obj()
        except ucxx.UCXError:  # client closed (UCXCanceledError) or died
            break
        await ep.send_obj(msg)
        n += 1
    await ep.close()
    stats["clients"] += 1
    print(f"client {ep.uid:#x} done after {n} messages", flush=True)
    stats["event"].set()


async def main(args) -> None:
    stats = {"clients": 0, "event": asyncio.Event()}
    listener = ucxx.create_listener(
        lambda ep: handle_client(ep, stats), port=args.port, host=args.host
    )
    print(f"echo server listening on {listener.ip}:{listener.port}", flush=True)
    try:
        while args.max_clients is None or stats["clients"] < args.max_clients:
            await stats["event"].wait()
            stats["event"].clear()
    finally:
        listener.close()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=13337, help="port to listen on (0: any)")
    p.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    p.add_argument("--max-clients", type=int, default=None,
                   help="exit after serving this many clients")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    try:
        asyncio.run(main(parse_args()))
    except KeyboardInterrupt:
        pass
