"""Server/client pairs used by ``python -m ucxx.benchmarks.send_recv``.

Each module holds one backend: ``ucxx_async`` (the asyncio API of ucxx),
``ucxx_core`` (the C extension driven without asyncio), ``asyncio``
(asyncio streams over TCP) and ``socket`` (blocking TCP sockets).
"""
