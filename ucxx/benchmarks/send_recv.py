"""Round-trip (ping-pong) benchmark: ``python -m ucxx.benchmarks.send_recv``.

Same options and report as RAPIDS ucxx's ``ucxx.benchmarks.send_recv``. A
server process echoes every message back; a client process times
``--n-iter`` round trips (after ``--n-warmup-iter`` untimed ones) and prints
the report. Latency is half the round-trip time; bandwidth counts the bytes
of both directions.

Backends (``-l/--backend``):

``ucxx-async`` (default)
    the asyncio API of ucxx (``create_listener``/``create_endpoint``,
    ``await ep.send/recv``, ``send_multi``/``recv_multi`` with ``-x > 1``,
    ``am_send``/``am_recv`` with ``--enable-am``).
``ucxx-core``
    the C extension without asyncio: a worker progressed by the benchmark
    loop itself (``--asyncio-wait`` awaits the requests in an event loop
    instead). Worker addresses are exchanged over a TCP rendezvous on
    ``--server-address:--port``.
``asyncio``
    asyncio streams over TCP.
``socket``
    blocking TCP sockets.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import multiprocessing
import multiprocessing.connection
import os
import queue as queue_mod
import statistics
import sys

from ucxx.benchmarks.utils import (
    default_server_address,
    format_bytes,
    parse_bytes,
    print_key_value,
    print_separator,
    run_until_complete,
    set_cuda_device,
)

mp = multiprocessing.get_context("spawn")

BACKENDS = {
    "ucxx-async": ("ucxx_async", "UCXPyAsyncServer", "UCXPyAsyncClient"),
    "ucxx-core": ("ucxx_core", "UCXPyCoreServer", "UCXPyCoreClient"),
    "asyncio": ("asyncio", "AsyncioServer", "AsyncioClient"),
    "socket": ("socket", "SocketServer", "SocketClient"),
}
UCXX_BACKENDS = ("ucxx-async", "ucxx-core")
PROGRESS_MODES = ("blocking", "polling", "thread", "thread-polling")
OBJECT_TYPES = ("numpy", "cupy", "rmm")
EVENT_LOOPS = ("asyncio", "uvloop")

# After the client finished, how long the server may take to exit.
SERVER_EXIT_TIMEOUT = 30.0
# After the server exited, how long the client may still run.
CLIENT_EXIT_TIMEOUT = 60.0


def _get_backend_implementation(backend: str) -> dict:
    try:
        modname, server_cls, client_cls = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"Unknown backend {backend}") from None
    module = importlib.import_module(f"ucxx.benchmarks.backends.{modname}")
    return {
        "server": getattr(module, server_cls),
        "client": getattr(module, client_cls),
    }


def _set_affinity(cpu: int) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, [cpu])


def _run(obj, args):
    if inspect.iscoroutinefunction(obj.run):
        return run_until_complete(obj.run(), args.event_loop)
    return obj.run()


def server(queue, args):
    """Target of the server process: put the port in ``queue``, echo."""
    _set_affinity(args.server_cpu_affinity)
    set_cuda_device(args.object_type, args.server_dev)
    impl = _get_backend_implementation(args.backend)["server"](args, queue)
    _run(impl, args)


def client(queue, port, server_address, args):
    """Target of the client process: time the round trips, print the report."""
    _set_affinity(args.client_cpu_affinity)
    set_cuda_device(args.object_type, args.client_dev)
    impl = _get_backend_implementation(args.backend)["client"](
        args, queue, server_address, port
    )
    _run(impl, args)

    times = queue.get()
    contention = queue.get() if args.report_gil_contention else None
    assert len(times) == args.n_iter, (len(times), args.n_iter)
    print_report(args, times, impl.print_backend_specific_config, contention)
    sys.stdout.flush()


def print_report(args, times, backend_specific=None, contention=None) -> None:
    """Print the RAPIDS-layout report for round-trip durations ``times``
    (seconds, one per timed iteration)."""
    total = sum(times)
    median = statistics.median(times)
    nbytes = args.n_bytes * args.n_buffers
    bw_avg = format_bytes(2 * args.n_iter * nbytes / total) if total > 0 else "inf B"
    bw_med = format_bytes(2 * nbytes / median) if median > 0 else "inf B"
    lat_avg = int(total * 1e9 / (2 * args.n_iter))
    lat_med = int(median * 1e9 / 2)

    print("Roundtrip benchmark")
    print_separator(separator="=")
    print_key_value(key="Iterations", value=f"{args.n_iter}")
    print_key_value(key="Bytes", value=f"{format_bytes(args.n_bytes)}")
    print_key_value(key="Number of buffers", value=f"{args.n_buffers}")
    print_key_value(key="Object type", value=f"{args.object_type}")
    print_key_value(key="Reuse allocation", value=f"{args.reuse_alloc}")
    print_key_value(key="Backend", value=f"{args.backend}")
    if backend_specific is not None:
        backend_specific()
    print_separator(separator="=")
    if args.object_type == "numpy":
        print_key_value(key="Device(s)", value="CPU-only")
        s_aff = (
            args.server_cpu_affinity
            if args.server_cpu_affinity >= 0
            else "affinity not set"
        )
        c_aff = (
            args.client_cpu_affinity
            if args.client_cpu_affinity >= 0
            else "affinity not set"
        )
        print_key_value(key="Server CPU", value=f"{s_aff}")
        print_key_value(key="Client CPU", value=f"{c_aff}")
    else:
        print_key_value(key="Device(s)", value=f"{args.server_dev}, {args.client_dev}")
    print_separator(separator="=")
    print_key_value("Bandwidth (average)", value=f"{bw_avg}/s")
    print_key_value("Bandwidth (median)", value=f"{bw_med}/s")
    print_key_value("Latency (average)", value=f"{lat_avg} ns")
    print_key_value("Latency (median)", value=f"{lat_med} ns")
    if args.report_gil_contention:
        print_key_value("GIL contention", value=f"{contention}")
    if not args.no_detailed_report:
        print_separator(separator="=")
        print_key_value(key="Iterations", value="Bandwidth, Latency")
        print_separator(separator="-")
        for i, t in enumerate(times):
            ts = format_bytes(2 * nbytes / t) if t > 0 else "inf B"
            lat = int(t * 1e9 / 2)
            print_key_value(key=i, value=f"{ts}/s, {lat}ns")


# --------------------------------------------------------------------------
# Options


def _bytes_arg(s: str) -> int:
    try:
        return parse_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _non_negative_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {v}")
    return v


def _non_negative_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {s!r}") from None
    if not v >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must not be negative, got {s}")
    return v


def _spin_us(s: str):
    """--spin-us: 'auto' or a non-negative number of microseconds."""
    return "auto" if s == "auto" else _non_negative_float(s)


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: {s!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {v}")
    return v


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ucxx.benchmarks.send_recv",
        description="Roundtrip benchmark",
    )
    parser.add_argument(
        "-n",
        "--n-bytes",
        metavar="BYTES",
        default="10 Mb",
        type=_bytes_arg,
        help="Message size. Default '10 Mb'.",
    )
    parser.add_argument(
        "-x",
        "--n-buffers",
        default="1",
        type=_positive_int,
        help="Number of buffers to transfer using the multi-buffer transfer API. "
        "All buffers will be of same size specified by --n-bytes and same type "
        "specified by --object_type. (default: 1, i.e., single-buffer transfer)",
    )
    parser.add_argument(
        "--n-iter",
        metavar="N",
        default=10,
        type=_positive_int,
        help="Number of send / recv iterations (default 10).",
    )
    parser.add_argument(
        "--n-warmup-iter",
        default=10,
        type=_non_negative_int,
        help="Number of send / recv warmup iterations (default 10).",
    )
    parser.add_argument(
        "-b",
        "--server-cpu-affinity",
        metavar="N",
        default=-1,
        type=int,
        help="CPU affinity for server process (default -1: not set).",
    )
    parser.add_argument(
        "-c",
        "--client-cpu-affinity",
        metavar="N",
        default=-1,
        type=int,
        help="CPU affinity for client process (default -1: not set).",
    )
    parser.add_argument(
        "-o",
        "--object_type",
        default="numpy",
        choices=OBJECT_TYPES,
        help="In-memory array type.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        default=False,
        action="store_true",
        help="Whether to print timings per iteration (they are printed unless "
        "--no-detailed-report is given).",
    )
    parser.add_argument(
        "-s",
        "--server-address",
        metavar="ip",
        default=default_server_address(),
        type=str,
        help="Server address (default: `ucxx.utils.get_address()` of the "
        "interface named by UCXPY_IFNAME when that is set, else 127.0.0.1).",
    )
    parser.add_argument(
        "-d",
        "--server-dev",
        metavar="N",
        default=0,
        type=int,
        help="GPU device on server (default 0).",
    )
    parser.add_argument(
        "-e",
        "--client-dev",
        metavar="N",
        default=0,
        type=int,
        help="GPU device on client (default 0).",
    )
    parser.add_argument(
        "--reuse-alloc",
        default=False,
        action="store_true",
        help="Reuse memory allocations between communication.",
    )
    parser.add_argument(
        "--cuda-profile",
        default=False,
        action="store_true",
        help="Setting CUDA profiler.start()/stop() around send/recv "
        "typically used with `nvprof --profile-from-start off "
        "--profile-child-processes`",
    )
    parser.add_argument(
        "--rmm-init-pool-size",
        metavar="BYTES",
        default=None,
        type=_bytes_arg,
        help="Initial RMM pool size (default  1/2 total GPU memory)",
    )
    parser.add_argument(
        "--server-only",
        default=False,
        action="store_true",
        help="Start up only a server process (to be used with --client-only).",
    )
    parser.add_argument(
        "--client-only",
        default=False,
        action="store_true",
        help="Connect to solitary server process (to be used with --server-only)",
    )
    parser.add_argument(
        "-p",
        "--port",
        default=None,
        help="The port the server will bind to, if not specified, UCX will bind "
        "to a random port. Must be specified when --client-only is used.",
        type=_port,
    )
    parser.add_argument(
        "--enable-am",
        default=False,
        action="store_true",
        help="Use Active Message API instead of TAG for transfers",
    )
    parser.add_argument(
        "--rmm-managed-memory",
        default=False,
        action="store_true",
        help="Use RMM managed memory (requires `--object-type rmm`)",
    )
    parser.add_argument(
        "--no-detailed-report",
        default=False,
        action="store_true",
        help="Disable detailed report per iteration.",
    )
    parser.add_argument(
        "-l",
        "--backend",
        default="ucxx-async",
        choices=tuple(BACKENDS),
        help="Backend Library (-l) to use, options are: 'ucxx-async' (default), "
        "'ucxx-core', 'asyncio' and 'socket'.",
    )
    parser.add_argument(
        "--report-gil-contention",
        default=False,
        action="store_true",
        help="Report GIL contention (requires the `gilknocker` package).",
    )
    parser.add_argument(
        "--progress-mode",
        default="blocking",
        choices=PROGRESS_MODES,
        help="Progress mode for the UCP worker. Valid options are: 'blocking', "
        "'polling', 'thread' and 'thread-polling'. (Default: 'blocking')",
    )
    parser.add_argument(
        "--spin-us",
        metavar="auto|FLOAT",
        default=None,
        type=_spin_us,
        help="Spin budget in microseconds: how long an await progresses the "
        "worker before it suspends, passed as `ucxx.init(spin_us=...)` "
        "(`Worker(spin_us=...)` with 'ucxx-core'). 'auto' adapts it to the "
        "traffic (capped at 200), 0 never spins. (Default: 'auto', but a "
        "fixed 100 in polling mode)",
    )
    parser.add_argument(
        "--event-loop",
        default="asyncio",
        choices=EVENT_LOOPS,
        help="Event loop of the asyncio-based backends: 'asyncio' (default) "
        "or 'uvloop' (requires the `uvloop` package).",
    )
    parser.add_argument(
        "--asyncio-wait",
        default=False,
        action="store_true",
        help="Only applies to 'ucxx-core' backend: wait for transfer requests "
        "by awaiting them in an asyncio event loop instead of progressing the "
        "worker in the benchmark loop. (Default: disabled)",
    )
    parser.add_argument(
        "--delay-progress",
        default=False,
        action="store_true",
        help="Only applies to 'ucxx-core' backend in RAPIDS ucxx; not "
        "supported here (accepted for compatibility, rejected when given).",
    )
    parser.add_argument(
        "--max-outstanding",
        metavar="N",
        default=32,
        type=_positive_int,
        help="Only applies to 'ucxx-core' backend: number of maximum outstanding "
        "operations, see --delay-progress. (Default: 32)",
    )
    parser.add_argument(
        "--error-handling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Enable endpoint error handling.",
    )
    return parser


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _check_cpu(parser, option: str, cpu: int) -> None:
    if cpu < 0:
        return
    try:
        available = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        available = set(range(os.cpu_count() or 1))
    if cpu not in available:
        parser.error(
            f"{option} {cpu}: CPU not available to this process "
            f"(available: {', '.join(map(str, sorted(available)))})"
        )


def _check_ucxx(parser, args) -> None:
    """Backend-dependent checks of the ucxx backends (imports the package)."""
    try:
        import ucxx
        from ucxx import _ucxx
    except Exception as e:  # ImportError, or a failure inside the package
        parser.error(
            f"backend '{args.backend}' needs the ucxx C extension, which could "
            f"not be imported: {type(e).__name__}: {e}"
        )

    if args.backend == "ucxx-async":
        missing = [
            name
            for name in ("init", "create_listener", "create_endpoint")
            if not hasattr(ucxx, name)
        ]
        if missing:
            parser.error(
                f"backend 'ucxx-async': this ucxx lacks {', '.join(missing)}"
            )
        if args.spin_us is not None and not _accepts(ucxx.init, "spin_us"):
            parser.error(
                "--spin-us: this ucxx's init() does not take spin_us"
            )

    if (
        args.enable_am
        and args.object_type != "numpy"
        and args.backend == "ucxx-async"
        and not hasattr(ucxx, "register_am_allocator")
    ):
        parser.error(
            "--enable-am with --object_type="
            f"{args.object_type} needs ucxx.register_am_allocator (to receive "
            "active messages into device memory), which this ucxx lacks; "
            "use --backend=ucxx-core"
        )

    # blocking and polling are always there; probe the others, so that an
    # unsupported mode fails here and not half-way in a child process.
    if args.progress_mode not in ("blocking", "polling") or args.spin_us is not None:
        kwargs = {"progress_mode": args.progress_mode}
        if args.spin_us is not None:
            kwargs["spin_us"] = args.spin_us
        ctx = worker = None
        try:
            ctx = _ucxx.Context({})
            worker = _ucxx.Worker(ctx, **kwargs)
        except Exception as e:
            what = (
                f"--progress-mode '{args.progress_mode}'"
                if args.spin_us is None
                else f"--progress-mode '{args.progress_mode}' with --spin-us {args.spin_us}"
            )
            parser.error(
                f"{what} is not supported by this build of ucxx: "
                f"{type(e).__name__}: {e}"
            )
        finally:
            if worker is not None:
                worker.close()
            if ctx is not None:
                ctx.close()


def _accepts(func, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


def validate_args(parser, args) -> None:
    """Reject bad option combinations with an argparse error (exit code 2)."""
    if args.server_only and args.client_only:
        parser.error("--server-only and --client-only are mutually exclusive")
    if args.client_only and args.port is None:
        parser.error("--client-only requires --port (the port of the server)")
    if args.n_buffers > 1 and args.backend != "ucxx-async":
        parser.error("Multi-buffer transfer only support for `--backend=ucxx-async`.")
    if args.enable_am and args.n_buffers > 1:
        parser.error("--enable-am cannot be combined with --n-buffers > 1")
    if args.enable_am and args.backend not in UCXX_BACKENDS:
        parser.error(
            f"--enable-am requires a ucxx backend (got --backend={args.backend})"
        )
    if args.delay_progress:
        parser.error("--delay-progress is not supported by this benchmark")
    if args.asyncio_wait and args.backend != "ucxx-core":
        parser.error("`--asyncio-wait` requires `--backend=ucxx-core`")
    if args.cuda_profile and args.object_type == "numpy":
        parser.error(
            "`--cuda-profile` requires `--object_type=cupy` or `--object_type=rmm`"
        )
    if args.rmm_managed_memory and args.object_type != "rmm":
        parser.error("`--rmm-managed-memory` requires `--object_type=rmm`")
    if args.object_type in ("cupy", "rmm"):
        if args.backend not in UCXX_BACKENDS:
            parser.error(f"Backend '{args.backend}' does not support CUDA transfers")
        for mod in ("cupy", "rmm") if args.object_type == "rmm" else ("cupy",):
            if not _has_module(mod):
                parser.error(
                    f"--object_type={args.object_type} requires the `{mod}` "
                    "package, which is not installed"
                )
    if args.event_loop == "uvloop" and not _has_module("uvloop"):
        parser.error("--event-loop=uvloop requires the `uvloop` package")
    if args.report_gil_contention and not _has_module("gilknocker"):
        parser.error(
            "Could not import `gilknocker`. Make sure it is installed or "
            "remove the `--report-gil-contention` argument."
        )
    if args.spin_us is not None and args.backend not in UCXX_BACKENDS:
        parser.error(f"--spin-us requires a ucxx backend (got --backend={args.backend})")
    _check_cpu(parser, "--server-cpu-affinity", args.server_cpu_affinity)
    _check_cpu(parser, "--client-cpu-affinity", args.client_cpu_affinity)
    if (
        args.backend == "ucxx-core"
        and not args.asyncio_wait
        and args.progress_mode.startswith("thread")
    ):
        parser.error(
            f"--backend=ucxx-core progresses the worker itself and supports "
            f"--progress-mode blocking or polling; '{args.progress_mode}' "
            "requires --asyncio-wait"
        )
    if args.backend in UCXX_BACKENDS:
        _check_ucxx(parser, args)


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args)
    return args


# --------------------------------------------------------------------------
# Processes


def _get_port(q, proc):
    """The port the server put in ``q``; None if the server died first."""
    while True:
        try:
            return q.get(timeout=0.2)
        except queue_mod.Empty:
            if not proc.is_alive():
                try:
                    return q.get(timeout=0.5)
                except queue_mod.Empty:
                    return None


def _stop(proc) -> None:
    if proc is not None and proc.is_alive():
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _err(msg: str) -> None:
    print(f"send_recv: error: {msg}", file=sys.stderr, flush=True)


def _supervise(client_proc, server_proc) -> int:
    """Wait for the client (and the server, if local); fail fast when one
    of them dies. Returns the exit code of the benchmark."""
    server_exited_ok = False
    while client_proc.exitcode is None:
        waitfor = [client_proc.sentinel]
        if server_proc is not None and server_proc.exitcode is None:
            waitfor.append(server_proc.sentinel)
        timeout = CLIENT_EXIT_TIMEOUT if server_exited_ok else None
        ready = multiprocessing.connection.wait(waitfor, timeout=timeout)
        if not ready:
            _err(
                f"the client did not finish within {CLIENT_EXIT_TIMEOUT:.0f} s "
                "after the server exited"
            )
            _stop(client_proc)
            return 1
        if server_proc is not None and server_proc.exitcode is not None:
            if server_proc.exitcode != 0:
                client_proc.join(1)
                if client_proc.exitcode is None:
                    _stop(client_proc)
                _err(f"the server process failed (exit code {server_proc.exitcode})")
                return 1
            server_exited_ok = True
    client_proc.join()
    if client_proc.exitcode != 0:
        _stop(server_proc)
        _err(f"the client process failed (exit code {client_proc.exitcode})")
        return 1
    if server_proc is not None:
        server_proc.join(SERVER_EXIT_TIMEOUT)
        if server_proc.exitcode is None:
            _stop(server_proc)
            _err(f"the server did not exit within {SERVER_EXIT_TIMEOUT:.0f} s")
            return 1
        if server_proc.exitcode != 0:
            _err(f"the server process failed (exit code {server_proc.exitcode})")
            return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    server_address = args.server_address
    server_proc = client_proc = None

    try:
        if not args.client_only:
            q1 = mp.Queue()
            server_proc = mp.Process(
                target=server, args=(q1, args), name="send_recv-server"
            )
            server_proc.start()
            port = _get_port(q1, server_proc)
            if port is None:
                server_proc.join(5)
                _err(
                    "the server process exited before it reported its port "
                    f"(exit code {server_proc.exitcode})"
                )
                _stop(server_proc)
                return 1
            print(f"Server Running at {server_address}:{port}", flush=True)
        else:
            port = args.port

        if not args.server_only:
            print(f"Client connecting to server at {server_address}:{port}", flush=True)
            q2 = mp.Queue()
            client_proc = mp.Process(
                target=client,
                args=(q2, port, server_address, args),
                name="send_recv-client",
            )
            client_proc.start()
            return _supervise(client_proc, server_proc)

        server_proc.join()
        if server_proc.exitcode != 0:
            _err(f"the server process failed (exit code {server_proc.exitcode})")
            return 1
        return 0
    except KeyboardInterrupt:
        _stop(client_proc)
        _stop(server_proc)
        return 130


if __name__ == "__main__":
    sys.exit(main())
