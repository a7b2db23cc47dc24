"""Fuzzing the decoders of peer-controlled bytes.

- ``fuzz/fuzz_frames.py`` (the one multi-frame format's header and frame
  table, as recv_multi and the Dask comm receive them) and
  ``fuzz/fuzz_handshake.py`` (connection handshake message) run under
  atheris for a bounded number of runs (skipped when atheris is not
  installed);
- the same harness functions run in-process on seeded random mutations of
  their seed corpora (no atheris needed);
- mutated headers and handshake messages go over real endpoints, and the
  live receive must agree with the pure decoder (error or the same frames),
  with the C extension doing the receiving (this is the part the sanitizer
  job, ``.ci/sanitize``, exercises under ASan + UBSan).

What is fuzzed and how: docs/RELIABILITY.md ("Fuzzing").
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import re
import subprocess
import sys

import pytest

import ucxx
import ucxx.core
from ucxx import _ucxx as U

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "fuzz")
HARNESSES = ["fuzz_frames", "fuzz_handshake"]
ATHERIS_RUNS = int(os.environ.get("UCXX_FUZZ_RUNS", "200000"))
ATHERIS_MAX_S = int(os.environ.get("UCXX_FUZZ_MAX_S", "20"))
MUTATIONS = int(os.environ.get("UCXX_FUZZ_MUTATIONS", "20000"))
HOST = "127.0.0.1"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(FUZZ, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def have_atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four byte-level mutations (flip, set, insert, delete, splice
    an interesting integer, truncate, extend)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[pos % len(b)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[pos % len(b)] = rng.randrange(256)
        elif op == 2:
            b[pos:pos] = bytes([rng.randrange(256)])
        elif op == 3 and b:
            del b[pos % len(b)]
        elif op == 4:
            v = rng.choice([0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 2 ** 31, 2 ** 32 - 1, 2 ** 63,
                            2 ** 64 - 1, 4096, 65536, 65537])
            width = rng.choice([1, 2, 4, 8])
            b[pos:pos + width] = (v % (1 << (8 * width))).to_bytes(width, "little")
        elif op == 5:
            del b[pos:]
        elif op == 6:
            b += bytes(rng.randrange(64))
        else:
            b[pos:pos] = b[:rng.randrange(len(b) + 1)]
    return bytes(b)


# --------------------------------------------------------------- atheris
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", HARNESSES)
def test_atheris(name, tmp_path):
    if not have_atheris():
        pytest.skip("atheris is not installed (pip install atheris)")
    cmd = [sys.executable, os.path.join(FUZZ, name + ".py"), f"-runs={ATHERIS_RUNS}",
           f"-max_total_time={ATHERIS_MAX_S}", f"-artifact_prefix={tmp_path}/",
           "-print_final_stats=1"]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=ATHERIS_MAX_S + 120,
                       cwd=tmp_path, env=env)
    out = p.stdout + p.stderr
    crashes = [f for f in os.listdir(tmp_path) if f.startswith(("crash-", "leak-", "timeout-"))]
    assert p.returncode == 0 and not crashes, (
        f"{name}: rc={p.returncode}, artifacts {crashes}:\n{out[-4000:]}")
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    runs = int(m.group(1)) if m else 0
    assert runs > 0, out[-2000:]
    print(f"\n{name}: {runs} atheris runs, {out.count('NEW ')} new units")


# -------------------------------------------------- in-process mutations
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", HARNESSES)
def test_seeded_mutations(name):
    """Seeded random mutations of the seed corpus through the harness
    function (any exception but the decoder's UCXError is a finding)."""
    h = load(name)
    rng = random.Random(f"ucxx-{name}")
    corpus = list(h.seeds())
    for i in range(MUTATIONS):
        data = mutate(rng, rng.choice(corpus))
        try:
            h.test_one_input(data)
        except Exception as e:
            raise AssertionError(f"{name} input #{i} {data.hex()}: {e!r}") from e
        if i % 97 == 0:
            corpus.append(data)  # mutate mutants too


# --------------------------------------------------------- over the wire
@pytest.fixture
async def pair():
    accepted: asyncio.Queue = asyncio.Queue()
    lst = ucxx.create_listener(accepted.put_nowait, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port)
    sep = await asyncio.wait_for(accepted.get(), 30)
    try:
        yield ep, sep
    finally:
        await ep.close()
        await sep.close()
        lst.close()


LIVE_CASES = int(os.environ.get("UCXX_FUZZ_LIVE", "300"))


@pytest.mark.leak_check
@pytest.mark.timeout(300)
async def test_live_recv_multi_agrees_with_decoder(pair):
    """Mutated header messages (and, when the decoder accepts them, frames of
    the announced sizes) sent to recv_multi on a real endpoint: recv_multi
    raises UCXError exactly when the pure decoder does, and otherwise
    returns frames of the decoded sizes. Each case uses its own tag, so
    leftovers of a rejected case cannot reach the next."""
    h = load("fuzz_frames")
    ep, sep = pair
    max_frames, max_bytes = 16, 1 << 20
    sep.recv_multi_max_frames, sep.recv_multi_max_bytes = max_frames, max_bytes
    rng = random.Random("ucxx-live-multi")
    corpus = [s for s in h.seeds()]
    agree = {"rejected": 0, "accepted": 0}
    def generated() -> bytes:
        # a well-formed header for random frames, sometimes with one byte of
        # its table (or prefix) changed
        sizes = [rng.choice([0, 1, 7, 100, 4096, 70000]) for _ in range(rng.randint(0, 20))]
        msgs = h.frames.encode_header(sizes, [0] * len(sizes))
        data = h.join(msgs[0], msgs[1] if len(msgs) > 1 else b"")
        if rng.random() < 0.5:
            b = bytearray(data)
            b[rng.randrange(3, len(b))] = rng.randrange(256)
            data = bytes(b)
        return data

    for case in range(LIVE_CASES):
        raw = generated() if rng.random() < 0.4 else mutate(rng, rng.choice(corpus))
        parts = h.split(raw)
        if parts is None:
            continue
        _mf, _mb, msg1, msg2 = parts
        try:
            _app, sizes, memtypes, _read = h.decode(max_frames, max_bytes, msg1, msg2)
            expect = "frames"
        except ucxx.UCXError as e:
            expect = type(e)
        if expect == "frames" and any(memtypes):
            continue  # CUDA frames: no device here
        tag = 0x5000 + case
        r = asyncio.ensure_future(sep.recv_multi(tag=tag, force_tag=True))
        await ep.send(msg1, tag=tag, force_tag=True)
        if h.table_follows(msg1):
            try:
                h.frames.decode_prefix(msg1, max_frames, max_bytes)
            except ucxx.UCXError:
                pass
            else:
                # recv_multi receives message 2 once the prefix checks passed
                await ep.send(msg2, tag=tag, force_tag=True)
        if expect == "frames":
            await ep.gather_send([bytes(s) for s in sizes], tag=tag, force_tag=True)
        try:
            frames = await asyncio.wait_for(r, 10)
        except ucxx.UCXError as e:
            assert expect != "frames", f"case {case}: decoder accepted, live raised {e!r}"
            assert isinstance(e, expect), f"case {case}: {e!r} vs {expect.__name__}"
            agree["rejected"] += 1
        except asyncio.TimeoutError:
            raise AssertionError(f"case {case}: recv_multi hung on {msg1.hex()}") from None
        else:
            assert expect == "frames", f"case {case}: live accepted what the decoder refused"
            assert [f.nbytes for f in frames] == list(sizes)
            agree["accepted"] += 1
    print(f"\nlive recv_multi: {agree}")
    assert agree["rejected"] > 0 and agree["accepted"] > 0


@pytest.mark.leak_check
@pytest.mark.timeout(300)
async def test_live_handshake_agrees_with_decoder():
    """A raw UCX listener answers create_endpoint() with mutated handshake
    messages (32 bytes or more, some with an identity block): the connection
    is refused with UCXError exactly when ``decode_peer`` refuses the
    answer, and times out where an announced identity block is cut short."""
    h = load("fuzz_handshake")
    rng = random.Random("ucxx-live-handshake")
    answers = []

    def on_ep(c_ep):
        answers.append(c_ep)
        c_ep.stream_send(answers_to_send.pop(0))

    answers_to_send: list[bytes] = []
    lst = ucxx.core._get_ctx().worker.listen(on_ep, port=0, host=HOST)
    counts = {"refused": 0, "accepted": 0}
    try:
        for case in range(60):
            msg = mutate(rng, rng.choice(h.seeds()))
            if len(msg) < h.hs.MSG_SIZE:
                msg = msg + bytes(h.hs.MSG_SIZE - len(msg))  # short: a timeout test
            answers_to_send.append(msg)
            # What the decoder makes of the answer: accepted, refused, or
            # an identity block announced but cut short (the client waits
            # for the rest: a timeout).
            try:
                h.hs.decode_peer(msg)
                expect = "accepted"
            except ucxx.UCXError as e:
                expect = "timeout" if "identity block missing" in str(e) else "refused"
            try:
                ep = await ucxx.create_endpoint(HOST, lst.port, connect_timeout=2)
            except ucxx.UCXError as e:
                # The stream receives take exactly what the handshake needs:
                # the rest stays in the stream, unread.
                assert expect != "accepted", f"case {case}: decoder accepted, live raised {e!r}"
                assert isinstance(e, U.UCXTimedOutError) == (expect == "timeout"), (
                    f"case {case}: {e!r}, decoder: {expect}")
                counts["refused"] += 1
            else:
                assert expect == "accepted", f"case {case}: live accepted, decoder: {expect}"
                ep.abort()
                counts["accepted"] += 1
    finally:
        lst.close()
        for c in answers:
            c.abort()
    print(f"\nlive handshake: {counts}")
    assert counts["refused"] > 0
