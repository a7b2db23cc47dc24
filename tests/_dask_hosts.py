"""A Dask cluster across namespace hosts (``_netns.Network``), for the tests
and the cross-host benchmark.

:class:`Cluster` starts, from this (root namespace) process:

- ``dask scheduler`` on one host (``--interface eth0``),
- ``dask worker`` processes (``--no-nanny``, one thread) on others, each
  told its address one of three ways (``WORKER_STYLES``): ``--interface
  eth0``; ``--host`` with the address ``ucxx.get_address(ifname="eth0")``
  gives inside that host; ``--listen-address`` on every interface
  (``0.0.0.0``) with ``--contact-address`` naming eth0's address,
- a client process on the scheduler's host running :func:`driver_main`
  (this file run as a script): a ``distributed.Client`` that executes JSON
  commands read from stdin (``{"cmd": ..., "args": [...]}``) and answers
  one ``@@ {json}`` line each (``{"error": ...}`` if the command raised).

Every process is a fresh one, started after the network exists (UCX reads
the routing table once per process), with the UCX device (``eth0``) given
either as ``UCX_NET_DEVICES`` or as the dask config key
``distributed.comm.ucxx.environment.net-devices``; its output goes to a log
file under the cluster's directory (:meth:`Cluster.logs` shows the tails).
Times exchanged with the driver are wall-clock (``time.time()``), the clock
of Dask's own event log; every process runs on the same kernel.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER_STYLES = ("interface", "host", "listen")


def _bin(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else shutil.which(name) or name


def base_env(extra: dict | None = None) -> dict:
    """Environment of every cluster process: this one's without UCX_ and
    DASK_ settings, this checkout first on the path, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UCX_", "DASK_", "UCXPY_"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    # Deterministic placement for the tests (no work stealing), no dashboards.
    env["DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING"] = "False"
    env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"
    env["DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__GIL__ENABLED"] = "False"
    # The hosts share one kernel: UCX would reach across them through shared
    # memory, around the links the tests take down. Real hosts share none.
    env["DASK_DISTRIBUTED__COMM__UCXX__SHARED_MEMORY"] = "False"
    if os.environ.get("UCXX_TEST_EVENT_LOOP") == "uvloop":
        env["DASK_DISTRIBUTED__ADMIN__EVENT_LOOP"] = "uvloop"
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


class Proc:
    """A cluster process and its log file."""

    def __init__(self, name: str, host, popen: subprocess.Popen, log: str):
        self.name = name
        self.host = host
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return "<no log>"


class Cluster:
    """Scheduler and client on ``net[scheduler_host]``, workers where
    :meth:`start_worker` puts them. ``protocol`` is ``ucxx``, ``ucx``
    (distributed-ucxx's scheme) or ``tcp``; ``env`` is added to every
    process's environment."""

    def __init__(self, net, protocol: str = "ucxx", scheduler_host: str = "a",
                 port: int = 8786, env: dict | None = None, directory: str | None = None):
        self.net = net
        self.protocol = protocol
        self.sched_host = net[scheduler_host]
        self.port = port
        self.env = dict(env or {})
        self.dir = directory or tempfile.mkdtemp(prefix="ucxx-hosts-")
        self._own_dir = directory is None
        self.scheduler: Proc | None = None
        self.workers: dict[str, Proc] = {}
        self.driver: Proc | None = None
        self._buf = b""

    @property
    def address(self) -> str:
        return f"{self.protocol}://{self.sched_host.ip}:{self.port}"

    def _ucx_env(self, host, how: str = "env") -> dict:
        """The UCX device setting of processes on ``host``: as UCX_NET_DEVICES
        (``how="env"``) or as the dask config key (``how="config"``)."""
        if self.protocol == "tcp":
            return {}
        if how == "config":
            # distributed-ucxx's section is "distributed-ucxx", ours
            # "distributed.comm.ucxx"
            key = ("DASK_DISTRIBUTED_UCXX__" if self.protocol == "ucx"
                   else "DASK_DISTRIBUTED__COMM__UCXX__")
            return {f"{key}ENVIRONMENT__NET_DEVICES": host.ifname}
        return {"UCX_NET_DEVICES": host.ifname}

    def _start(self, name: str, host, argv, env) -> Proc:
        log = os.path.join(self.dir, f"{name}.log")
        f = open(log, "ab")
        try:
            popen = host.popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f,
                               stderr=subprocess.STDOUT)
        finally:
            f.close()
        return Proc(name, host, popen, log)

    # -- processes -------------------------------------------------------

    def start_scheduler(self) -> None:
        h = self.sched_host
        env = base_env({**self._ucx_env(h), **self.env})
        self.scheduler = self._start(
            "scheduler", h,
            [_bin("dask"), "scheduler", "--protocol", self.protocol, "--interface", h.ifname,
             "--port", self.port, "--no-dashboard", "--dashboard-address", ":0"], env)

    def start_worker(self, host: str, name: str, style: str = "interface",
                     ucx_config: str = "env", nthreads: int = 1, port: int = 0,
                     extra_env: dict | None = None) -> Proc:
        """A ``dask worker`` named ``name`` on ``host``, its address given
        by ``style`` (WORKER_STYLES)."""
        h = self.net[host]
        env = base_env({**self._ucx_env(h, ucx_config), **self.env, **(extra_env or {})})
        argv = [_bin("dask"), "worker", self.address, "--name", name, "--nthreads", nthreads,
                "--no-nanny", "--no-dashboard", "--death-timeout", "60",
                "--local-directory", os.path.join(self.dir, f"{name}-space"),
                "--memory-limit", "0"]
        if style == "interface":
            argv += ["--interface", h.ifname]
        elif style == "host":
            ip = h.sh(sys.executable, "-c",
                      f"import ucxx; print(ucxx.get_address(ifname={h.ifname!r}))",
                      timeout=60).stdout.strip()
            argv += ["--host", ip]
        elif style == "listen":
            if not port:
                raise ValueError("style 'listen' needs a fixed port")
            argv += ["--listen-address", f"{self.protocol}://0.0.0.0:{port}",
                     "--contact-address", f"{self.protocol}://{h.ip}:{port}"]
        else:
            raise ValueError(f"unknown worker style {style!r}")
        if port and style != "listen":
            argv += ["--worker-port", port]
        proc = self._start(name, h, argv, env)
        self.workers[name] = proc
        return proc

    def start_driver(self, timeout: float = 120) -> dict:
        h = self.sched_host
        env = base_env({**self._ucx_env(h), **self.env})
        log = os.path.join(self.dir, "driver.log")
        f = open(log, "ab")
        try:
            popen = h.popen([sys.executable, os.path.abspath(__file__), "driver", self.address],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f)
        finally:
            f.close()
        self.driver = Proc("driver", h, popen, log)
        self._buf = b""
        return self.read_reply(timeout)

    def stop(self) -> None:
        """Stop every process of the cluster (SIGKILL: the network's
        teardown would anyway)."""
        procs = [self.driver, self.scheduler, *self.workers.values()]
        for p in procs:
            if p is not None and p.alive():
                p.popen.kill()
        for p in procs:
            if p is not None:
                try:
                    p.popen.wait(10)
                except subprocess.TimeoutExpired:  # pragma: no cover
                    pass
                if p.popen.stdin:
                    p.popen.stdin.close()
                if p.popen.stdout:
                    p.popen.stdout.close()
        self.driver = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self, n: int = 3000) -> str:
        out = []
        for p in [self.scheduler, *self.workers.values(), self.driver]:
            if p is not None:
                out.append(f"----- {p.name} on {p.host.name} (rc {p.popen.poll()}) -----\n"
                           f"{p.tail(n)}")
        return "\n".join(out)

    # -- the driver ------------------------------------------------------

    def send(self, cmd: str, *args) -> None:
        if self.driver is None or not self.driver.alive():
            raise RuntimeError(f"the client process is not running\n{self.logs()}")
        line = json.dumps({"cmd": cmd, "args": list(args)}) + "\n"
        self.driver.popen.stdin.write(line.encode())
        self.driver.popen.stdin.flush()

    def read_reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.driver.popen.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, _, self._buf = self._buf.partition(b"\n")
                if line.startswith(b"@@ "):
                    reply = json.loads(line[3:])
                    if "error" in reply:
                        raise DriverError(f"{reply['error']}\n{self.logs()}")
                    return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the client within {timeout} s\n{self.logs()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise DriverError(f"the client process exited\n{self.logs()}")
                self._buf += chunk

    def call(self, cmd: str, *args, timeout: float = 120) -> dict:
        self.send(cmd, *args)
        return self.read_reply(timeout)


class DriverError(AssertionError):
    pass


# --------------------------------------------------------------------------
# Driver side (inside the client's host) and the functions it runs on the
# workers and the scheduler. Workers import this module by name (PYTHONPATH
# has this directory), so that functions pickle by reference.
# --------------------------------------------------------------------------

_client = None
# Log records of interest, kept by the probe of each process.
_records: list = []
PROBED = ("Worker stream died", "Connection to", "Remove worker", "Register worker",
          "Lost all workers")


class _ProbeHandler(logging.Handler):
    """Keeps (time, logger, message, exception chain type names) of the
    records that mention one of the PROBED phrases."""

    def emit(self, record) -> None:
        msg = record.getMessage()
        if any(p in msg for p in PROBED):
            exc = record.exc_info[1] if record.exc_info else None
            chain = []
            while exc is not None and len(chain) < 5:
                chain.append(type(exc).__name__)
                exc = exc.__cause__ or exc.__context__
            _records.append((record.created, record.name, msg[:300], chain))


def install_probe() -> bool:
    root = logging.getLogger("distributed")
    if not any(isinstance(h, _ProbeHandler) for h in root.handlers):
        root.addHandler(_ProbeHandler())
    return True


def get_records() -> list:
    return list(_records)


def local_facts(dask_worker=None, dask_scheduler=None) -> dict:
    """What this process listens on, its event loop's kind and the UCX
    devices it uses."""
    import asyncio

    server = dask_worker or dask_scheduler
    out = {"listen": [lst.listen_address for lst in server.listeners],
           "contact": [lst.contact_address for lst in server.listeners],
           "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
           "backend": type(server.listeners[0]).__module__ if server.listeners else None,
           "net_devices": None, "transports": None}
    try:
        import ucxx

        if ucxx.core._ctx is not None:
            out["net_devices"] = ucxx.get_config().get("NET_DEVICES")
            out["transports"] = sorted(ucxx.get_active_transports())
    except Exception as e:  # noqa: BLE001
        out["transports"] = repr(e)
    return out


async def reach(addresses, dask_worker=None, dask_scheduler=None) -> dict:
    """Connect to every address with this process's comm backend and ask
    the server there who it is."""
    import asyncio

    from distributed.core import rpc

    out = {}
    for addr in addresses:
        try:
            async with rpc(addr) as r:
                ident = await asyncio.wait_for(r.identity(), 30)
            out[addr] = ident.get("id") or ident.get("type") or "ok"
        except Exception as e:  # noqa: BLE001
            out[addr] = f"ERROR {e!r}"
    return out


def make_block(nbytes: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=min(nbytes, 1 << 20), dtype=np.uint8)
    reps = -(-nbytes // block.size)
    return np.tile(block, reps)[:nbytes]


def checksum(a) -> str:
    import hashlib

    return hashlib.blake2b(memoryview(a).cast("B")).hexdigest()


def _part(side: int, i: int, rows: int, nparts: int, seed: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed + 1000 * side + i)
    return pd.DataFrame({"key": rng.integers(0, nparts * rows, rows),
                         f"v{side}": rng.integers(0, 1 << 40, rows)})


def _ddf(side: int, nparts: int, rows: int, seed: int):
    import dask.dataframe as dd

    meta = _part(side, 0, 0, nparts, seed)
    return dd.from_map(_part, [side] * nparts, range(nparts), rows=rows, nparts=nparts,
                       seed=seed, meta=meta, divisions=[None] * (nparts + 1),
                       enforce_metadata=False)


def _expected_merge(nparts: int, rows: int, seed: int):
    import pandas as pd

    left = pd.concat([_part(0, i, rows, nparts, seed) for i in range(nparts)])
    right = pd.concat([_part(1, i, rows, nparts, seed) for i in range(nparts)])
    return left.merge(right, on="key", how="inner")


def _canonical(df):
    return df.sort_values(list(df.columns)).reset_index(drop=True)


class Driver:
    """The commands of the client process."""

    def __init__(self, address: str):
        from distributed import Client

        self.client = Client(address, timeout="60s", set_as_default=True)
        self.futures: dict = {}
        self.client.run(install_probe)
        self.client.run_on_scheduler(install_probe)

    def info(self) -> dict:
        info = self.client.scheduler_info(n_workers=-1)
        workers = {a: {"name": w.get("name"), "host": w.get("host")}
                   for a, w in info["workers"].items()}
        facts = self.client.run(local_facts)
        sched = self.client.run_on_scheduler(local_facts)
        return {"scheduler": info["address"], "workers": workers, "facts": facts,
                "scheduler_facts": sched}

    def wait_workers(self, names, timeout: float) -> dict:
        """Wait until the workers named ``names`` (and no others) are
        registered; their addresses and registration times."""
        deadline = time.time() + timeout
        want = sorted(names)
        while True:
            info = self.client.scheduler_info(n_workers=-1)["workers"]
            have = sorted(str(w.get("name")) for w in info.values())
            if have == want:
                break
            if time.time() > deadline:
                raise TimeoutError(f"workers {have}, expected {want}")
            time.sleep(0.1)
        return {"workers": {str(w["name"]): a for a, w in info.items()}, "t": time.time()}

    def install_probes(self) -> dict:
        self.client.run(install_probe)
        self.client.run_on_scheduler(install_probe)
        return {}

    def reach(self) -> dict:
        """Every address the scheduler hands out, reached from every worker,
        the scheduler and this client."""
        info = self.client.scheduler_info(n_workers=-1)
        targets = [info["address"], *info["workers"]]
        out = {"client": self.client.sync(reach, targets)}
        out.update(self.client.run(reach, targets))
        out["scheduler"] = self.client.run_on_scheduler(reach, targets)
        return {"from": out}

    def merge(self, nparts: int, rows: int, seed: int) -> dict:
        t0 = time.time()
        left, right = _ddf(0, nparts, rows, seed), _ddf(1, nparts, rows, seed)
        got = left.merge(right, on="key", how="inner", shuffle_method="tasks").compute()
        dt = time.time() - t0
        want = _expected_merge(nparts, rows, seed)
        ok = _canonical(got).equals(_canonical(want))
        return {"ok": bool(ok), "rows": len(got), "expected_rows": len(want), "seconds": dt}

    def shuffle(self, nparts: int, rows: int, seed: int, method: str = "tasks") -> dict:
        import pandas as pd

        t0 = time.time()
        ddf = _ddf(0, nparts, rows, seed)
        shuffled = ddf.shuffle("key", npartitions=nparts, shuffle_method=method)
        parts = self.client.compute(shuffled.to_delayed())
        parts = self.client.gather(parts)
        dt = time.time() - t0
        keys = [set(p["key"]) for p in parts]
        disjoint = sum(len(k) for k in keys) == len(set().union(*keys))
        got = pd.concat(parts)
        want = pd.concat([_part(0, i, rows, nparts, seed) for i in range(nparts)])
        ok = disjoint and _canonical(got).equals(_canonical(want))
        return {"ok": bool(ok), "rows": len(got), "partitions": len(parts),
                "disjoint": disjoint, "seconds": dt}

    def transfer_start(self, src: str, dst: str, nbytes: int, seed: int) -> dict:
        """Make a block of ``nbytes`` on worker ``src`` (may be recomputed
        elsewhere), then ask worker ``dst`` for its checksum: the block
        travels src -> dst. Returns once the block exists on src and the
        checksum task is submitted."""
        from distributed import wait

        addr = self._addresses()
        x = self.client.submit(make_block, nbytes, seed, workers=[addr[src]],
                               allow_other_workers=True, pure=False)
        wait(x, timeout=120)
        t = time.time()
        y = self.client.submit(checksum, x, workers=[addr[dst]], allow_other_workers=True,
                               pure=False)
        self.futures["transfer"] = (x, y, nbytes, seed, addr[src], addr[dst], t)
        return {"t_submit": t, "src": addr[src], "dst": addr[dst]}

    def transfer_wait(self, timeout: float) -> dict:
        x, y, nbytes, seed, src, dst, t0 = self.futures.pop("transfer")
        got = y.result(timeout=timeout)
        t = time.time()
        want = checksum(make_block(nbytes, seed))
        try:
            logs = self.client.run(_incoming_log, workers=[dst])
        except Exception as e:  # noqa: BLE001  (dst itself was lost)
            logs = {dst: repr(e)}
        holders = sorted(self.client.who_has([x])[x.key])
        del x, y
        return {"ok": got == want, "t_done": t, "seconds": t - t0, "holders": holders,
                "incoming": logs, "src": src, "dst": dst}

    def records(self) -> dict:
        """The probes' records of every worker (that still runs) and of the
        scheduler, and the scheduler's add/remove-worker events."""
        workers = {}
        for addr in self._addresses().values():
            try:
                workers.update(self.client.run(get_records, workers=[addr], on_error="return"))
            except Exception as e:  # noqa: BLE001  (removed meanwhile)
                workers[addr] = repr(e)
        return {"workers": workers,
                "scheduler": self.client.run_on_scheduler(get_records),
                "events": self.client.run_on_scheduler(_worker_events)}

    def _addresses(self) -> dict:
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return {str(w["name"]): a for a, w in info.items()}

    def close(self) -> dict:
        self.client.close()
        return {}


def _incoming_log(dask_worker) -> list:
    return [{k: e[k] for k in ("start", "stop", "total", "bandwidth", "who")}
            for e in dask_worker.transfer_incoming_log]


def _worker_events(dask_scheduler) -> list:
    out = []
    for t, msg in dask_scheduler.get_events("all"):
        if isinstance(msg, dict) and msg.get("action") in ("add-worker", "remove-worker"):
            out.append({"t": t, "action": msg["action"], "worker": msg.get("worker"),
                        "stimulus_id": msg.get("stimulus_id")})
    return out


def driver_main(address: str) -> int:
    import traceback

    def reply(obj) -> None:
        sys.stdout.write("@@ " + json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()

    try:
        driver = Driver(address)
    except BaseException as e:  # noqa: BLE001
        reply({"error": f"cannot start the client: {e!r}\n{traceback.format_exc()}"})
        return 1
    reply({"started": time.time()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            out = getattr(driver, req["cmd"])(*req.get("args", []))
        except BaseException as e:  # noqa: BLE001
            reply({"error": f"{req['cmd']}: {e!r}\n{traceback.format_exc()}"})
            continue
        reply(out)
        if req["cmd"] == "close":
            break
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "driver":
        sys.path.insert(0, HERE)
        import _dask_hosts

        sys.exit(_dask_hosts.driver_main(sys.argv[2]))
    print(f"usage: {sys.argv[0]} driver SCHEDULER_ADDRESS", file=sys.stderr)
    sys.exit(2)
