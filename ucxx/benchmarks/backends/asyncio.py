"""``--backend asyncio``: asyncio streams over TCP (what a pure-asyncio
application gets without UCX)."""

from __future__ import annotations

import asyncio
import warnings
from time import perf_counter

from ucxx.benchmarks.backends.base import BaseClient, BaseServer
from ucxx.benchmarks.utils import GilContention, put_results

# Stream buffer limit: large enough that a message is never split by it.
_LIMIT = 1024**3


class AsyncioServer(BaseServer):
    has_cuda_support = False

    async def run(self):
        args = self.args
        done = asyncio.get_running_loop().create_future()

        async def handle_stream(reader, writer):
            try:
                for _ in range(args.n_iter + args.n_warmup_iter):
                    msg = await reader.readexactly(args.n_bytes)
                    writer.write(msg)
                    await writer.drain()
                # Let the client close first (EOF), then close our side.
                await reader.read(1)
                writer.close()
                await writer.wait_closed()
            except BaseException as e:
                if not done.done():
                    done.set_exception(e)
                raise
            else:
                if not done.done():
                    done.set_result(None)

        server = await asyncio.start_server(
            handle_stream, args.server_address, args.port or 0, limit=_LIMIT
        )
        self.queue.put(server.sockets[0].getsockname()[1])
        async with server:
            await done


class AsyncioClient(BaseClient):
    has_cuda_support = False

    async def run(self):
        args = self.args
        if args.reuse_alloc:
            warnings.warn(
                "Reuse allocation not supported by 'asyncio' backend, it will be "
                "ignored."
            )
        reader, writer = await asyncio.open_connection(
            self.server_address, self.port, limit=_LIMIT
        )
        send_msg = bytes(i % 256 for i in range(min(args.n_bytes, 256)))
        send_msg = (send_msg * (args.n_bytes // 256 + 1))[: args.n_bytes]

        gil = GilContention(args.report_gil_contention)
        gil.start()
        times = []
        recv_msg = b""
        for i in range(args.n_iter + args.n_warmup_iter):
            start = perf_counter()
            writer.write(send_msg)
            await writer.drain()
            recv_msg = await reader.readexactly(args.n_bytes)
            stop = perf_counter()
            if i >= args.n_warmup_iter:
                times.append(stop - start)
        contention = gil.stop()

        writer.close()
        await writer.wait_closed()
        if recv_msg != send_msg:
            raise RuntimeError("asyncio backend: the echoed message differs")
        put_results(self.queue, args, times, contention)
