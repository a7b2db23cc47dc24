"""``python -m ucxx.benchmarks.send_recv``: options, report layout, backends.

The CLI runs as a subprocess (server and client are separate spawned
processes); the report it prints is parsed and checked against the RAPIDS
ucxx layout.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import time

import pytest

from ucxx.benchmarks import send_recv
from ucxx.benchmarks.utils import format_bytes, parse_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEP_EQ = "=" * 80
SEP_DASH = "-" * 80

BASE_KEYS = [
    "Iterations",
    "Bytes",
    "Number of buffers",
    "Object type",
    "Reuse allocation",
    "Backend",
]
BACKEND_KEYS = {
    "ucxx-async": ["Transfer API", "Progress mode", "UCX_TLS", "UCX_NET_DEVICES"],
    "ucxx-core": [
        "Transfer API",
        "Progress mode",
        "Asyncio wait",
        "Delay progress",
        "UCX_TLS",
        "UCX_NET_DEVICES",
    ],
    "asyncio": [],
    "socket": [],
}
DEVICE_KEYS = ["Device(s)", "Server CPU", "Client CPU"]
RESULT_KEYS = [
    "Bandwidth (average)",
    "Bandwidth (median)",
    "Latency (average)",
    "Latency (median)",
]

UNITS = {"B": 1, "kiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
BW_RE = re.compile(r"^(\d+(?:\.\d+)?) (B|kiB|MiB|GiB|TiB|PiB)/s$")
LAT_RE = re.compile(r"^(\d+) ns$")
DETAIL_RE = re.compile(r"^(\d+(?:\.\d+)?) (B|kiB|MiB|GiB|TiB|PiB)/s, (\d+)ns$")


def _env():
    env = dict(os.environ)
    env.pop("UCXPY_IFNAME", None)
    # Keep UCX's network traffic on loopback (shared memory is unaffected).
    env.setdefault("UCX_NET_DEVICES", "lo")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(*argv, timeout=90):
    return subprocess.run(
        [sys.executable, "-m", "ucxx.benchmarks.send_recv", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_env(),
    )


def _row(line):
    """``(key, value)`` of a ``f"{key: <25} | {value}"`` row."""
    assert len(line) >= 28 and line[25:28] == " | ", f"bad row: {line!r}"
    return line[:25].rstrip(), line[28:]


def _bw(value):
    m = BW_RE.match(value)
    assert m, f"bad bandwidth: {value!r}"
    return float(m.group(1)) * UNITS[m.group(2)]


def _lat(value):
    m = LAT_RE.match(value)
    assert m, f"bad latency: {value!r}"
    return int(m.group(1))


def parse_report(stdout, backend, n_iter, detailed=True):
    """Check the report layout line by line; return the rows as a dict and
    the per-iteration ``[(bandwidth B/s, latency ns)]``."""
    lines = stdout.splitlines()
    assert "Roundtrip benchmark" in lines, stdout
    lines = lines[lines.index("Roundtrip benchmark") + 1 :]
    for line in lines:
        if set(line) <= set("=-") and line:
            assert len(line) == 80, f"separator of {len(line)} chars: {line!r}"

    expected = (
        [SEP_EQ]
        + BASE_KEYS
        + BACKEND_KEYS[backend]
        + [SEP_EQ]
        + DEVICE_KEYS
        + [SEP_EQ]
        + RESULT_KEYS
    )
    if detailed:
        expected += [SEP_EQ, "Iterations", SEP_DASH] + [str(i) for i in range(n_iter)]
    assert len(lines) == len(expected), "\n".join(lines)

    rows = {}
    details = []
    for line, want in zip(lines, expected):
        if want in (SEP_EQ, SEP_DASH):
            assert line == want, f"expected separator {want!r}, got {line!r}"
            continue
        key, value = _row(line)
        assert key == want, f"expected key {want!r}, got {key!r}"
        if want.isdigit():
            m = DETAIL_RE.match(value)
            assert m, f"bad detail row: {line!r}"
            details.append((float(m.group(1)) * UNITS[m.group(2)], int(m.group(3))))
        elif want == "Iterations" and "Iterations" in rows:
            assert value == "Bandwidth, Latency"
        else:
            rows[key] = value
    return rows, details


def check_report(
    proc, backend, n_iter, n_bytes, n_buffers=1, detailed=True, **expect
):
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    m = re.search(r"^Server Running at (\S+):(\d+)$", out, re.M)
    assert m, out
    assert re.search(r"^Client connecting to server at \S+:\d+$", out, re.M), out

    rows, details = parse_report(out, backend, n_iter, detailed)
    assert rows["Iterations"] == str(n_iter)
    assert rows["Bytes"] == format_bytes(n_bytes)
    assert rows["Number of buffers"] == str(n_buffers)
    assert rows["Backend"] == backend
    for key, value in expect.items():
        assert rows[key] == value, (key, rows[key], value)

    bw_avg = _bw(rows["Bandwidth (average)"])
    bw_med = _bw(rows["Bandwidth (median)"])
    lat_avg = _lat(rows["Latency (average)"])
    lat_med = _lat(rows["Latency (median)"])
    assert lat_avg > 0 and lat_med > 0
    # Latency is half the round trip; bandwidth counts both directions:
    # bandwidth == bytes / latency (up to the 3 digits printed).
    total = n_bytes * n_buffers
    if total > 0:
        assert bw_avg == pytest.approx(total / (lat_avg * 1e-9), rel=0.02)
        assert bw_med == pytest.approx(total / (lat_med * 1e-9), rel=0.02)
    else:
        assert bw_avg == 0 and bw_med == 0
    if detailed:
        assert len(details) == n_iter
        lats = [lat for _, lat in details]
        assert abs(statistics.mean(lats) - lat_avg) <= 1
        if n_iter % 2 == 1:
            assert statistics.median(lats) == lat_med
        for bw, lat in details:
            if total > 0:
                assert bw == pytest.approx(total / (lat * 1e-9), rel=0.02)
    return rows


# --------------------------------------------------------------------------
# Size strings


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "text, value",
    [
        ("10MB", 10_000_000),
        ("10 Mb", 10_000_000),
        ("10mb", 10_000_000),
        ("10M", 10_000_000),
        ("1 B", 1),
        ("1B", 1),
        ("100", 100),
        ("0", 0),
        ("1MiB", 2**20),
        ("1 mib", 2**20),
        ("1Mi", 2**20),
        ("MiB", 2**20),
        ("1.5kB", 1500),
        ("1 kB", 1000),
        ("1KiB", 1024),
        ("2 GiB", 2 * 2**30),
        ("1GB", 10**9),
        ("1TB", 10**12),
        ("1e3", 1000),
        ("  8 kiB ", 8192),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["", "abc", "10 XB", "-1", "1..2", "1 B B", "."])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1, "1 B"),
        (900, "900 B"),
        (1023, "1.00 kiB"),
        (10_000_000, "9.54 MiB"),
        (2**20, "1.00 MiB"),
        (3 * 2**30, "3.00 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# --------------------------------------------------------------------------
# Options


@pytest.mark.timeout(30)
def test_defaults(monkeypatch):
    monkeypatch.delenv("UCXPY_IFNAME", raising=False)
    args = send_recv.make_parser().parse_args([])
    assert args.backend == "ucxx-async"
    assert args.n_bytes == 10_000_000
    assert args.n_buffers == 1
    assert args.n_iter == 10
    assert args.n_warmup_iter == 10
    assert args.server_cpu_affinity == -1
    assert args.client_cpu_affinity == -1
    assert args.object_type == "numpy"
    assert args.server_address == "127.0.0.1"
    assert args.port is None
    assert args.server_only is False and args.client_only is False
    assert args.reuse_alloc is False
    assert args.no_detailed_report is False
    assert args.enable_am is False
    assert args.progress_mode == "blocking"
    assert args.error_handling is True
    assert args.spin_us is None
    assert args.event_loop == "asyncio"


@pytest.mark.timeout(30)
def test_default_server_address_from_ifname(monkeypatch):
    monkeypatch.setenv("UCXPY_IFNAME", "lo")
    assert send_recv.make_parser().parse_args([]).server_address == "127.0.0.1"


@pytest.mark.timeout(30)
def test_print_report_exact(capsys):
    """The report for known timings, character for character."""
    args = send_recv.make_parser().parse_args(
        ["-l", "socket", "-n", "1000", "--n-iter", "3", "-c", "1"]
    )
    send_recv.print_report(args, [0.001, 0.002, 0.004])
    eq, dash = "=" * 80, "-" * 80
    assert capsys.readouterr().out.splitlines() == [
        "Roundtrip benchmark",
        eq,
        "Iterations                | 3",
        "Bytes                     | 0.98 kiB",
        "Number of buffers         | 1",
        "Object type               | numpy",
        "Reuse allocation          | False",
        "Backend                   | socket",
        eq,
        "Device(s)                 | CPU-only",
        "Server CPU                | affinity not set",
        "Client CPU                | 1",
        eq,
        "Bandwidth (average)       | 837.05 kiB/s",
        "Bandwidth (median)        | 0.95 MiB/s",
        "Latency (average)         | 1166666 ns",
        "Latency (median)          | 1000000 ns",
        eq,
        "Iterations                | Bandwidth, Latency",
        dash,
        "0                         | 1.91 MiB/s, 500000ns",
        "1                         | 0.95 MiB/s, 1000000ns",
        "2                         | 488.28 kiB/s, 2000000ns",
    ]


@pytest.mark.timeout(30)
def test_options_parse():
    args = send_recv.parse_args(
        [
            "-l", "socket", "-n", "1MiB", "--n-iter", "3", "--n-warmup-iter", "0",
            "-s", "127.0.0.1", "-p", "12345", "--reuse-alloc",
            "--no-detailed-report", "--no-error-handling", "-b", "0", "-c", "0",
        ]
    )
    assert args.n_bytes == 2**20
    assert args.n_iter == 3 and args.n_warmup_iter == 0
    assert args.port == 12345
    assert args.reuse_alloc and args.no_detailed_report
    assert args.error_handling is False
    assert args.server_cpu_affinity == 0 and args.client_cpu_affinity == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--server-only", "--client-only"], "mutually exclusive"),
        (["-l", "socket", "--client-only"], "--client-only requires --port"),
        (["-l", "socket", "-x", "2"], "Multi-buffer transfer only support"),
        (["-l", "asyncio", "-x", "4"], "Multi-buffer transfer only support"),
        (["--enable-am", "-x", "2"], "--enable-am cannot be combined"),
        (["-l", "socket", "--enable-am"], "--enable-am requires a ucxx backend"),
        (["-o", "torch"], "invalid choice: 'torch'"),
        (["-l", "tornado"], "invalid choice: 'tornado'"),
        (["--progress-mode", "bogus"], "invalid choice: 'bogus'"),
        (["--event-loop", "trio"], "invalid choice: 'trio'"),
        (["-n", "10 XB"], "byte unit"),
        (["-n", "-5"], "-n/--n-bytes"),
        (["--n-iter", "0"], "must be at least 1"),
        (["-x", "0"], "must be at least 1"),
        (["--n-warmup-iter", "-1"], "must not be negative"),
        (["-p", "70000"], "port must be in"),
        (["-l", "socket", "--spin-us", "5"], "--spin-us requires a ucxx backend"),
        (["--spin-us", "-1"], "must not be negative"),
        (["-l", "socket", "-o", "cupy"], "does not support CUDA transfers"),
        (["-l", "asyncio", "-o", "rmm"], "does not support CUDA transfers"),
        (["--asyncio-wait"], "`--asyncio-wait` requires `--backend=ucxx-core`"),
        (["-l", "ucxx-core", "--delay-progress"], "--delay-progress is not supported"),
        (["-l", "socket", "--cuda-profile"], "`--cuda-profile` requires"),
        (["-l", "socket", "--rmm-managed-memory"], "requires `--object_type=rmm`"),
        (["-l", "socket", "-b", "4096"], "CPU not available"),
        (["-l", "socket", "-c", "4096"], "CPU not available"),
        (
            ["-l", "ucxx-core", "--progress-mode", "thread"],
            "requires --asyncio-wait",
        ),
    ],
)
def test_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        send_recv.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("object_type", ["cupy", "rmm"])
def test_cuda_object_type_needs_package(object_type, capsys):
    needed = ["cupy"] + (["rmm"] if object_type == "rmm" else [])
    if all(send_recv._has_module(m) for m in needed):
        pytest.skip(f"{object_type} is installed")
    with pytest.raises(SystemExit) as e:
        send_recv.parse_args(["-l", "ucxx-async", "-o", object_type])
    assert e.value.code == 2
    assert "package, which is not installed" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_help():
    proc = run_cli("--help", timeout=30)
    assert proc.returncode == 0
    for opt in (
        "--n-bytes", "--n-buffers", "--n-iter", "--n-warmup-iter",
        "--server-cpu-affinity", "--client-cpu-affinity", "--object_type",
        "--server-address", "--port", "--server-only", "--client-only",
        "--reuse-alloc", "--no-detailed-report", "--backend", "--progress-mode",
        "--error-handling", "--no-error-handling", "--enable-am", "--spin-us",
        "--event-loop",
    ):
        assert opt in proc.stdout, opt


@pytest.mark.timeout(30)
def test_bad_option_cli_exit_code():
    proc = run_cli("--server-only", "--client-only", timeout=30)
    assert proc.returncode == 2
    assert "mutually exclusive" in proc.stderr
    assert "Roundtrip benchmark" not in proc.stdout


# --------------------------------------------------------------------------
# Pure-Python backends


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["socket", "asyncio"])
@pytest.mark.parametrize("size", ["1 B", "64kB", "1MiB"])
def test_tcp_backends(backend, size):
    n = parse_bytes(size)
    proc = run_cli("-l", backend, "-n", size, "--n-iter", "5", "--n-warmup-iter", "2")
    rows = check_report(
        proc, backend, 5, n, **{"Object type": "numpy", "Reuse allocation": "False"}
    )
    assert rows["Device(s)"] == "CPU-only"
    assert rows["Server CPU"] == "affinity not set"
    assert rows["Client CPU"] == "affinity not set"
    assert "Server Running at 127.0.0.1:" in proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["socket", "asyncio"])
def test_tcp_backends_options(backend):
    proc = run_cli(
        "-l", backend, "-n", "10kB", "--n-iter", "3", "--n-warmup-iter", "0",
        "--reuse-alloc", "--no-detailed-report", "-b", "0", "-c", "0",
    )
    rows = check_report(
        proc, backend, 3, 10_000, detailed=False, **{"Reuse allocation": "True"}
    )
    assert rows["Server CPU"] == "0" and rows["Client CPU"] == "0"


@pytest.mark.timeout(120)
def test_asyncio_backend_uvloop():
    pytest.importorskip("uvloop")
    proc = run_cli(
        "-l", "asyncio", "--event-loop", "uvloop", "-n", "100", "--n-iter", "3",
        "--n-warmup-iter", "1",
    )
    check_report(proc, "asyncio", 3, 100)


@pytest.mark.timeout(120)
def test_zero_bytes():
    proc = run_cli("-l", "socket", "-n", "0", "--n-iter", "3", "--n-warmup-iter", "1")
    rows = check_report(proc, "socket", 3, 0)
    assert rows["Bandwidth (average)"] == "0 B/s"


def _start_server(argv):
    """``--server-only`` in the background (a context manager: its pipes are
    closed and it is waited for on exit)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ucxx.benchmarks.send_recv", "--server-only", *argv],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=REPO, env=_env(),
    )


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["socket", "asyncio"])
def test_server_only_client_only(backend):
    port = _free_port()
    common = ["-l", backend, "-p", str(port), "--n-iter", "3",
              "--n-warmup-iter", "1", "-n", "1kB"]
    with _start_server(common) as server:
        try:
            line = server.stdout.readline()
            assert line.strip() == f"Server Running at 127.0.0.1:{port}", line
            proc = run_cli("--client-only", *common)
            assert proc.returncode == 0, proc.stderr
            assert "Server Running" not in proc.stdout
            rows, _ = parse_report(proc.stdout, backend, 3)
            assert rows["Iterations"] == "3"
            assert server.wait(timeout=30) == 0
        finally:
            if server.poll() is None:
                server.kill()


@pytest.mark.timeout(60)
def test_client_fails_fast_without_server():
    port = _free_port()
    t0 = time.monotonic()
    proc = run_cli("-l", "socket", "--client-only", "-p", str(port), timeout=50)
    assert proc.returncode == 1
    assert "client process failed" in proc.stderr
    assert time.monotonic() - t0 < 40


@pytest.mark.timeout(60)
def test_server_failure_is_reported():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run_cli("-l", "socket", "-p", str(port), timeout=50)
    assert proc.returncode == 1
    assert "before it reported its port" in proc.stderr


# --------------------------------------------------------------------------
# ucxx backends (need the built C extension)


def _ucxx_run(backend, *extra, n_iter=5, size="1kB", detailed=True):
    argv = ["-l", backend, "-n", size, "--n-iter", str(n_iter), "--n-warmup-iter", "2"]
    if not detailed:
        argv.append("--no-detailed-report")
    return run_cli(*argv, *extra, timeout=100)


def _unsupported(proc):
    return proc.returncode == 2 and "is not supported by this build of ucxx" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
@pytest.mark.parametrize("size", ["1 B", "1MiB"])
def test_ucxx_async(mode, size):
    proc = _ucxx_run("ucxx-async", "--progress-mode", mode, size=size)
    rows = check_report(
        proc, "ucxx-async", 5, parse_bytes(size),
        **{"Transfer API": "TAG", "Progress mode": mode},
    )
    assert rows["UCX_TLS"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["thread", "thread-polling"])
@pytest.mark.parametrize(
    "backend, extra",
    [("ucxx-async", []), ("ucxx-core", ["--asyncio-wait"])],
    ids=["async", "core-asyncio-wait"],
)
def test_ucxx_thread_modes(backend, extra, mode):
    """A thread mode either works or is refused at parse time, clearly."""
    proc = _ucxx_run(backend, "--progress-mode", mode, *extra)
    if _unsupported(proc):
        assert f"--progress-mode '{mode}'" in proc.stderr
        assert "Roundtrip benchmark" not in proc.stdout
        return
    check_report(proc, backend, 5, 1000, **{"Progress mode": mode})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reuse", [False, True])
def test_ucxx_async_multi(reuse):
    extra = ["-x", "3"] + (["--reuse-alloc"] if reuse else [])
    proc = _ucxx_run("ucxx-async", *extra, size="10kB")
    check_report(
        proc, "ucxx-async", 5, 10_000, n_buffers=3,
        **{"Number of buffers": "3", "Reuse allocation": str(reuse)},
    )


@pytest.mark.timeout(120)
def test_ucxx_async_am():
    proc = _ucxx_run("ucxx-async", "--enable-am", size="4kB")
    check_report(proc, "ucxx-async", 5, 4000, **{"Transfer API": "AM"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra",
    [
        ["--reuse-alloc"],
        ["--no-error-handling"],
        ["--progress-mode", "polling", "--spin-us", "0"],
        ["--spin-us", "20"],
        ["--event-loop", "uvloop"],
    ],
    ids=["reuse", "no-eh", "spin0", "spin20", "uvloop"],
)
def test_ucxx_async_options(extra):
    if "uvloop" in extra:
        pytest.importorskip("uvloop")
    proc = _ucxx_run("ucxx-async", *extra, detailed=False)
    check_report(proc, "ucxx-async", 5, 1000, detailed=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
@pytest.mark.parametrize("size", ["1 B", "1MiB"])
def test_ucxx_core(mode, size):
    proc = _ucxx_run("ucxx-core", "--progress-mode", mode, size=size)
    check_report(
        proc, "ucxx-core", 5, parse_bytes(size),
        **{
            "Transfer API": "TAG",
            "Progress mode": mode,
            "Asyncio wait": "False",
            "Delay progress": "False",
        },
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra",
    [
        ["--asyncio-wait"],
        ["--asyncio-wait", "--progress-mode", "polling"],
        ["--enable-am"],
        ["--reuse-alloc", "--no-error-handling"],
    ],
    ids=["asyncio-wait", "asyncio-wait-polling", "am", "reuse-no-eh"],
)
def test_ucxx_core_options(extra):
    proc = _ucxx_run("ucxx-core", *extra)
    rows = check_report(proc, "ucxx-core", 5, 1000)
    assert rows["Asyncio wait"] == str("--asyncio-wait" in extra)
    assert rows["Transfer API"] == ("AM" if "--enable-am" in extra else "TAG")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["ucxx-async", "ucxx-core"])
def test_ucxx_server_only_client_only(backend):
    port = _free_port()
    common = ["-l", backend, "-p", str(port), "--n-iter", "3",
              "--n-warmup-iter", "1", "-n", "1kB"]
    with _start_server(common) as server:
        try:
            line = server.stdout.readline()
            assert line.strip() == f"Server Running at 127.0.0.1:{port}", line
            proc = run_cli("--client-only", *common)
            assert proc.returncode == 0, proc.stderr
            parse_report(proc.stdout, backend, 3)
            assert server.wait(timeout=30) == 0
        finally:
            if server.poll() is None:
                server.kill()
