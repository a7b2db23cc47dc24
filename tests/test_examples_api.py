"""The examples in examples/ run as documented."""

import os
import subprocess
import sys
import time

import pytest

from conftest import child_env

pytestmark = pytest.mark.leak_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _read_line(proc, timeout=30.0) -> str:
    """Next stdout line that is not a UCX log line."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the example printed nothing"
            if not sel.select(remaining):
                continue
            line = proc.stdout.readline().decode()
            assert line, f"the example exited: {proc.stderr.read().decode()[-2000:]}"
            if not (line.startswith("[") and " UCX " in line):
                return line.strip()
    finally:
        sel.close()


@pytest.mark.timeout(60)
def test_echo_server_and_client():
    server = subprocess.Popen(
        [sys.executable, os.path.join(EXAMPLES, "echo_server.py"),
         "--port", "0", "--host", "127.0.0.1", "--max-clients", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(),
    )
    try:
        line = _read_line(server)
        assert line.startswith("echo server listening on 127.0.0.1:"), line
        port = line.rsplit(":", 1)[1]
        client = subprocess.run(
            [sys.executable, os.path.join(EXAMPLES, "echo_client.py"),
             "--port", port, "-n", "20", "--size", "5000"],
            capture_output=True, env=child_env(), timeout=45,
        )
        assert client.returncode == 0, client.stderr.decode()[-2000:]
        assert b"20 messages of 5000 bytes echoed" in client.stdout
        assert _read_line(server).startswith("client ")
        assert server.wait(timeout=20) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()
        server.stderr.close()


def test_examples_document_usage():
    for name, needle in [
        ("echo_server.py", "python examples/echo_server.py --port 13337"),
        ("echo_client.py", "python examples/echo_client.py --port 13337"),
    ]:
        with open(os.path.join(EXAMPLES, name)) as f:
            assert needle in f.read()
