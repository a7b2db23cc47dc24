"""Hosts made of network namespaces, for the tests and the benchmarks.

    host a  eth0 --veth-- r-a  +
    host b  eth0 --veth-- r-b  +  router namespace (forwards between links)
    host c  eth0 --veth-- r-c  +

Every host is a network namespace with loopback and one link, ``eth0``, a
veth pair whose other end ``r-<host>`` is in a router namespace that
forwards between the links. Host number ``i`` has ``10.<B>.<i+1>.2/24``,
the router ``10.<B>.<i+1>.1`` on that link (the host's default route);
``B`` is drawn per network. Nothing is created in the root namespace (a
link there would be seen, and then lost, by every UCX process of the
machine); each veth end is created directly inside its namespace, so the
fixed device names cannot clash with anything, and neither can the
addresses, which exist only inside these namespaces.

Names: the namespaces of one network are ``uxn<pid>-<tag>-<host>`` (and
``...-router``), ``pid`` being the creating process. :meth:`Network.down`
kills every process inside them and deletes them, also after a failure
(use the network as a context manager or call ``down()`` in a
``finally``); :func:`cleanup_stale`, run by :meth:`Network.up`, does the
same for namespaces whose creator no longer runs (a run killed with
SIGKILL). Processes are started in a host with :meth:`Host.popen` (``ip
netns exec``).

Faults and shaping of one host's link (both directions):

- :meth:`Network.link` takes the router's end (or the host's) down and up;
- :meth:`Network.shape` adds delay, random loss and a rate limit. With
  ``tc netem`` (kernel ``sch_netem``) delay and loss are netem qdiscs on
  both ends of the link. Without it, loss is an iptables ``statistic``
  rule in the router and delay an iptables ``NFQUEUE`` rule whose packets
  a small process in the router namespace (:func:`delayer_main`, this file
  run as a script) releases after the delay: the kernel keeps the packets,
  the process only sees their ids. Its own latency adds to the delay
  (20-60 µs per pass on a 2-core VM; :meth:`Network.rtt` measures the
  result). A rate limit is a ``tbf`` qdisc (or netem's ``rate``) on both
  ends;
- :meth:`Network.drop_all` drops every packet the router forwards.

:func:`unavailable` says why namespaces cannot be used here (not root, no
``ip netns``, no veth), :meth:`Network.shaping_unavailable` why a given
kind of shaping cannot.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid

PREFIX = "uxn"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sh(*args, check=True, timeout=20) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))}: {r.stderr.strip()}")
    return r


_UNAVAILABLE: list = []


def unavailable() -> str | None:
    """None if network namespaces with veth links can be made here, else
    the reason why not (tests skip with it)."""
    if _UNAVAILABLE:
        return _UNAVAILABLE[0]
    why = _probe()
    _UNAVAILABLE.append(why)
    return why


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-0-probe"
    try:
        r = sh("ip", "netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"ip netns unavailable: {e}"
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    try:
        r = sh("ip", "link", "add", "va", "netns", probe, "type", "veth",
               "peer", "name", "vb", "netns", probe, check=False)
        if r.returncode != 0:
            return f"veth pairs unavailable: {r.stderr.strip()}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_processes(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process inside namespace ``ns`` and wait until they
    are gone (at most ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        r = sh("ip", "netns", "pids", ns, check=False)
        pids = [int(p) for p in r.stdout.split() if p.isdigit()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def list_namespaces() -> list[str]:
    r = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def cleanup_stale() -> list[str]:
    """Delete the namespaces of this harness whose creating process is no
    longer running, after killing what runs inside them. Returns their
    names."""
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if not m or _pid_alive(int(m.group(1))):
            continue
        _kill_netns_processes(ns)
        sh("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    return removed


class Host:
    """One namespace host: ``name``, namespace ``ns``, link ``ifname``
    (eth0) with address ``ip``; ``gw`` is the router's address on the link
    and ``rdev`` the router's end of it."""

    def __init__(self, net: "Network", name: str, index: int, ns: str, subnet: str):
        self.net = net
        self.name = name
        self.index = index
        self.ns = ns
        self.ifname = "eth0"
        self.ip = f"{subnet}.2"
        self.gw = f"{subnet}.1"
        self.rdev = f"r-{name}"[:15]

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.ip} ({self.ns})>"

    def sh(self, *args, check=True, timeout=20):
        return sh("ip", "netns", "exec", self.ns, *args, check=check, timeout=timeout)

    def popen(self, argv, env=None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside this host (``ip netns exec`` execs it: the
        child's pid is the program's). The network kills it in ``down()``
        if it still runs."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *map(str, argv)],
                                env=env, **kwargs)
        self.net.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        r = sh("ip", "netns", "pids", self.ns, check=False)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def kill_all(self, sig=signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process inside this host; returns their
        pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids


class Network:
    """Hosts ``names`` around a router namespace (module docstring)."""

    def __init__(self, names=("a", "b", "c")):
        if len(set(names)) != len(names) or len(names) > 250:
            raise ValueError(f"bad host names {names!r}")
        tag = uuid.uuid4().hex[:6]
        base = f"{PREFIX}{os.getpid()}-{tag}"
        b = random.randrange(100, 200)
        self.router = f"{base}-router"
        self.hosts = {n: Host(self, n, i, f"{base}-{n}", f"10.{b}.{i + 1}")
                      for i, n in enumerate(names)}
        self.procs: list[subprocess.Popen] = []
        self._shaped: dict[str, dict] = {}
        self._delayers: dict[str, subprocess.Popen] = {}
        self._dropping: list[str] = []
        self._netem: bool | None = None
        self._iptables: str | None | bool = False  # False: not probed
        self.drop_kind: str | None = None
        self.is_up = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Network":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def namespaces(self) -> list[str]:
        return [self.router] + [h.ns for h in self.hosts.values()]

    def rsh(self, *args, check=True, timeout=20):
        """A command in the router namespace."""
        return sh("ip", "netns", "exec", self.router, *args, check=check, timeout=timeout)

    # -- creation and removal ------------------------------------------------

    def up(self) -> None:
        cleanup_stale()
        self.is_up = True
        sh("ip", "netns", "add", self.router)
        self.rsh("ip", "link", "set", "lo", "up")
        for h in self.hosts.values():
            sh("ip", "netns", "add", h.ns)
            sh("ip", "link", "add", h.ifname, "netns", h.ns, "type", "veth",
               "peer", "name", h.rdev, "netns", self.router)
            h.sh("ip", "link", "set", "lo", "up")
            h.sh("ip", "addr", "add", f"{h.ip}/24", "dev", h.ifname)
            h.sh("ip", "link", "set", h.ifname, "up")
            h.sh("ip", "route", "add", "default", "via", h.gw)
            self.rsh("ip", "addr", "add", f"{h.gw}/24", "dev", h.rdev)
            self.rsh("ip", "link", "set", h.rdev, "up")
        self.rsh("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")

    def down(self) -> None:
        """Kill every process started in the network (and anything else
        running inside its namespaces), delete the namespaces (and with
        them every link and qdisc). Safe to call more than once."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        for ns in self.namespaces():
            if os.path.exists(f"/run/netns/{ns}"):
                _kill_netns_processes(ns)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        self.procs.clear()
        self._delayers.clear()
        for ns in self.namespaces():
            sh("ip", "netns", "del", ns, check=False)
        self.is_up = False

    def leftovers(self) -> list[str]:
        """Namespaces of this network that still exist."""
        existing = set(list_namespaces())
        return [ns for ns in self.namespaces() if ns in existing]

    def counters(self, host: str) -> dict:
        """Bytes through the router's end of ``host``'s link: ``from_host``
        (received from it) and ``to_host`` (sent to it)."""
        r = self.rsh("ip", "-s", "-j", "link", "show", "dev", self.hosts[host].rdev)
        stats = json.loads(r.stdout)[0]["stats64"]
        return {"from_host": stats["rx"]["bytes"], "to_host": stats["tx"]["bytes"]}

    # -- faults --------------------------------------------------------------

    def link(self, host: str, state: str, side: str = "router") -> None:
        """Set the link of ``host`` ``"down"`` or ``"up"``, at the router's
        end (``side="router"``: the host sees its carrier go) or at the
        host's own end (``"host"``: its route goes with it and comes back)."""
        h = self.hosts[host]
        if state not in ("up", "down"):
            raise ValueError(state)
        if side == "router":
            self.rsh("ip", "link", "set", h.rdev, state)
        elif side == "host":
            h.sh("ip", "link", "set", h.ifname, state)
            if state == "up":
                h.sh("ip", "route", "replace", "default", "via", h.gw)
        else:
            raise ValueError(side)

    def drop_all(self) -> None:
        """Drop every packet the router forwards, both directions, every
        link (netem loss 100%, else a pfifo limit 0 qdisc, on the router's
        ends: a drop in a sender's own qdisc would be local congestion to
        its TCP, which does not count towards keepalive or user timeouts)."""
        for h in self.hosts.values():
            r = self.rsh("tc", "qdisc", "replace", "dev", h.rdev, "root", "netem",
                         "loss", "100%", check=False)
            if r.returncode == 0:
                self.drop_kind = "netem loss 100%"
            else:
                self.rsh("tc", "qdisc", "replace", "dev", h.rdev, "root", "pfifo", "limit", "0")
                self.drop_kind = "pfifo limit 0"
            self._dropping.append(h.rdev)

    def undrop(self) -> None:
        for dev in self._dropping:
            self.rsh("tc", "qdisc", "del", "dev", dev, "root", check=False)
        self._dropping.clear()

    # -- shaping -------------------------------------------------------------

    @property
    def netem(self) -> bool:
        """Whether the kernel has tc netem (probed in the router)."""
        if self._netem is None:
            r = self.rsh("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us",
                         check=False)
            self._netem = r.returncode == 0
            if self._netem:
                self.rsh("tc", "qdisc", "del", "dev", "lo", "root", check=False)
        return self._netem

    @property
    def iptables(self) -> str | None:
        """An iptables command that works in the router (with the
        ``statistic`` match and the ``NFQUEUE`` target), or None."""
        if self._iptables is False:
            self._iptables = None
            for cmd in ("iptables", "iptables-legacy"):
                if shutil.which(cmd) is None:
                    continue
                rules = (["-m", "statistic", "--mode", "random", "--probability", "0.5",
                          "-j", "DROP"],
                         ["-j", "NFQUEUE", "--queue-num", "999", "--queue-bypass"])
                ok = True
                for rule in rules:
                    r = self.rsh(cmd, "-A", "FORWARD", "-i", "lo", *rule, check=False)
                    ok = ok and r.returncode == 0
                    self.rsh(cmd, "-D", "FORWARD", "-i", "lo", *rule, check=False)
                if ok:
                    self._iptables = cmd
                    break
        return self._iptables

    def shaping_unavailable(self, delay_us=0, loss_pct=0.0, rate=None) -> str | None:
        """None if :meth:`shape` can do this here, else why not."""
        if self.netem:
            return None
        if rate is not None and self.rsh("tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                                         "rate", "1gbit", "burst", "64kb", "latency", "10ms",
                                         check=False).returncode != 0:
            return "neither tc netem nor tc tbf in this kernel"
        self.rsh("tc", "qdisc", "del", "dev", "lo", "root", check=False)
        if (delay_us or loss_pct) and self.iptables is None:
            return ("no tc netem in this kernel, and no iptables with the statistic match "
                    "and the NFQUEUE target to emulate delay and loss")
        return None

    def shape(self, host: str, delay_us: float = 0, loss_pct: float = 0.0,
              rate: str | None = None) -> str:
        """Delay (µs per direction), random loss (% per direction) and a
        rate limit (tc units, e.g. ``"200mbit"``) on the link of ``host``,
        replacing what was set before. Returns how it was done."""
        why = self.shaping_unavailable(delay_us, loss_pct, rate)
        if why:
            raise RuntimeError(why)
        self.unshape(host)
        h = self.hosts[host]
        ends = ((self.rsh, h.rdev), (h.sh, h.ifname))
        how = []
        if self.netem:
            spec = []
            if delay_us:
                spec += ["delay", f"{int(delay_us)}us"]
            if loss_pct:
                spec += ["loss", f"{loss_pct}%"]
            if rate:
                spec += ["rate", rate]
            if spec:
                # netem's own queue: room for a large window at this delay
                spec += ["limit", "100000"]
                for run, dev in ends:
                    run("tc", "qdisc", "replace", "dev", dev, "root", "netem", *spec)
                how.append("netem " + " ".join(spec))
        else:
            if rate:
                burst = "256kb"
                for run, dev in ends:
                    run("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", burst, "latency", "100ms")
                how.append(f"tbf rate {rate}")
            rules = []
            if loss_pct:
                p = f"{loss_pct / 100:.6f}"
                for d in ("-i", "-o"):
                    rules.append(("filter", "FORWARD", [d, h.rdev, "-m", "statistic", "--mode",
                                                        "random", "--probability", p, "-j",
                                                        "DROP"]))
                how.append(f"iptables statistic drop {loss_pct}%")
            if delay_us:
                q_in, q_out = 2 * h.index, 2 * h.index + 1
                self._start_delayer(host, {q_in: delay_us, q_out: delay_us})
                rules.append(("filter", "FORWARD", ["-i", h.rdev, "-j", "NFQUEUE", "--queue-num",
                                                    str(q_in), "--queue-bypass"]))
                rules.append(("mangle", "POSTROUTING", ["-o", h.rdev, "-j", "NFQUEUE",
                                                        "--queue-num", str(q_out),
                                                        "--queue-bypass"]))
                how.append(f"NFQUEUE delay {delay_us:g} us")
            for table, chain, rule in rules:
                self.rsh(self.iptables, "-t", table, "-A", chain, *rule)
            self._shaped[host] = {"rules": rules}
        self._shaped.setdefault(host, {})["how"] = ", ".join(how)
        return self._shaped[host]["how"]

    def unshape(self, host: str) -> None:
        state = self._shaped.pop(host, None)
        if state is None:
            return
        h = self.hosts[host]
        for table, chain, rule in state.get("rules", ()):
            self.rsh(self.iptables, "-t", table, "-D", chain, *rule, check=False)
        proc = self._delayers.pop(host, None)
        if proc is not None:
            proc.kill()
            proc.wait(10)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
        self.rsh("tc", "qdisc", "del", "dev", h.rdev, "root", check=False)
        h.sh("tc", "qdisc", "del", "dev", h.ifname, "root", check=False)

    def rtt(self, src: str, dst: str, count: int = 200) -> dict:
        """Round-trip times (µs: p10, p50, p90) of ``count`` small UDP
        messages from host ``src`` to an echo on host ``dst``."""
        d = self.hosts[dst]
        port = 9999
        echo = subprocess.Popen(
            ["ip", "netns", "exec", d.ns, sys.executable, os.path.abspath(__file__), "echo",
             d.ip, str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.procs.append(echo)
        try:
            echo.stdout.readline()
            r = self.hosts[src].sh(sys.executable, os.path.abspath(__file__), "ping", d.ip,
                                   port, count, timeout=120)
            return json.loads(r.stdout)
        finally:
            echo.kill()
            echo.wait(10)
            echo.stdout.close()

    def _start_delayer(self, host: str, queues: dict[int, float]) -> None:
        args = [f"{q}:{d}" for q, d in queues.items()]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.router, sys.executable, os.path.abspath(__file__),
             "delay", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(proc)
        self._delayers[host] = proc
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline().decode() if ready else ""
        if not line.startswith("READY"):
            proc.kill()
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.poll() else ""
            raise RuntimeError(f"packet delayer did not start: {line!r} {err}")


# --------------------------------------------------------------------------
# The packet delayer: nfnetlink_queue spoken directly over a netlink socket.
# Packets queued by an iptables NFQUEUE rule stay in the kernel; this process
# gets their ids (copy mode "meta", GSO packets unsegmented) and accepts them
# in batches ("every id up to N") once each has waited its queue's delay.
# --------------------------------------------------------------------------

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_TIMESTAMP = 4
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
_NLMSGHDR = struct.Struct("=IHHII")


def _nla(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _nfq_msg(kind: int, queue: int, attrs, flags=NLM_F_REQUEST, seq=0) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + b"".join(attrs)
    return _NLMSGHDR.pack(16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def _nl_request(sock, msg: bytes, seq: int) -> None:
    sock.send(msg)
    while True:
        data = sock.recv(65536)
        off = 0
        while off + 16 <= len(data):
            length, kind, _flags, mseq, _pid = _NLMSGHDR.unpack_from(data, off)
            if kind == NLMSG_ERROR and mseq == seq:
                err = struct.unpack_from("=i", data, off + 16)[0]
                if err:
                    raise OSError(-err, f"nfnetlink_queue config: {os.strerror(-err)}")
                return
            off += (length + 3) & ~3


def delayer_main(argv) -> int:
    """``delay Q:US [Q:US ...]``: hold the packets of NFQUEUE queue ``Q``
    for ``US`` microseconds each."""
    delays = {}
    for a in argv:
        q, us = a.split(":")
        delays[int(q)] = float(us) * 1e-6
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 ns
    except Exception:
        pass
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    seq = 0
    for q in delays:
        for attrs in (
            [_nla(NFQA_CFG_CMD, struct.pack(">BBH", NFQNL_CFG_CMD_BIND, 0, socket.AF_INET))],
            [_nla(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META)),
             _nla(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", 200_000)),
             _nla(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)),
             _nla(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO))],
        ):
            seq += 1
            _nl_request(sock, _nfq_msg(NFQNL_MSG_CONFIG, q, attrs, NLM_F_REQUEST | NLM_F_ACK,
                                       seq), seq)
    sock.setblocking(False)
    # Packets get their arrival time from the kernel (NFQA_TIMESTAMP) once
    # some socket asks for receive timestamps: the delay then counts from
    # the arrival, not from this process's wake-up.
    stamp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stamp.setsockopt(socket.SOL_SOCKET, 29, 1)  # SO_TIMESTAMP (Linux)
    print("READY", flush=True)
    pending = {q: collections.deque() for q in delays}
    buf = bytearray(1 << 20)
    packet_kind = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
    clock = time.time  # the clock of NFQA_TIMESTAMP
    while True:
        heads = [dq[0][0] for dq in pending.values() if dq]
        timeout = max(0.0, min(heads) - clock()) if heads else None
        readable, _, _ = select.select([sock], [], [], timeout)
        if readable:
            while True:
                try:
                    n = sock.recv_into(buf)
                except BlockingIOError:
                    break
                except OSError:  # ENOBUFS: the next batch verdict covers them
                    continue
                now = clock()
                off = 0
                while off + 16 <= n:
                    length = struct.unpack_from("=I", buf, off)[0]
                    kind = struct.unpack_from("=H", buf, off + 4)[0]
                    if length < 16:
                        break
                    if kind == packet_kind:
                        q = struct.unpack_from(">H", buf, off + 18)[0]
                        a = off + 20
                        end = off + length
                        pid = None
                        arrived = now
                        while a + 4 <= end:
                            alen, akind = struct.unpack_from("=HH", buf, a)
                            if alen < 4:
                                break
                            akind &= 0x3FFF
                            if akind == NFQA_PACKET_HDR:
                                pid = struct.unpack_from(">I", buf, a + 4)[0]
                            elif akind == NFQA_TIMESTAMP:
                                sec, usec = struct.unpack_from(">QQ", buf, a + 4)
                                arrived = min(now, sec + usec * 1e-6)
                            a += (alen + 3) & ~3
                        dq = pending.get(q)
                        if dq is not None and pid is not None:
                            dq.append((arrived + delays[q], pid))
                    off += (length + 3) & ~3
        now = clock()
        for q, dq in pending.items():
            last = None
            while dq and dq[0][0] <= now:
                last = dq.popleft()[1]
            if last is not None:
                msg = _nfq_msg(NFQNL_MSG_VERDICT_BATCH, q,
                               [_nla(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))])
                while True:
                    try:
                        sock.send(msg)
                        break
                    except BlockingIOError:
                        select.select([], [sock], [], 0.01)


def echo_main(ip: str, port: int) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, port))
    print("READY", flush=True)
    while True:
        data, peer = s.recvfrom(64)
        s.sendto(data, peer)


def ping_main(ip: str, port: int, count: int) -> int:
    """Print {p10, p50, p90} of ``count`` UDP round trips (µs) as JSON; a
    message lost (netem or iptables loss) is sent again."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.5)
    rtts = []
    for i in range(count):
        msg = i.to_bytes(4, "little")
        while True:
            t0 = time.perf_counter()
            s.sendto(msg, (ip, port))
            try:
                while s.recv(64) != msg:
                    pass
            except socket.timeout:
                continue
            rtts.append((time.perf_counter() - t0) * 1e6)
            break
    rtts.sort()
    print(json.dumps({k: round(rtts[int(q * (len(rtts) - 1))], 1)
                      for k, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))}))
    return 0


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "delay":
        sys.exit(delayer_main(sys.argv[2:]))
    if cmd == "echo" and len(sys.argv) == 4:
        sys.exit(echo_main(sys.argv[2], int(sys.argv[3])))
    if cmd == "ping" and len(sys.argv) == 5:
        sys.exit(ping_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    print(f"usage: {sys.argv[0]} delay QUEUE:MICROSECONDS ... | echo IP PORT | "
          "ping IP PORT COUNT", file=sys.stderr)
    sys.exit(2)
