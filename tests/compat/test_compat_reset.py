"""``ucxx.reset()`` as in RAPIDS ucxx: it names the endpoints and listeners
the application still holds open, detaches the context all the same (the
next call gets a new one: one test's leftovers do not make every later
reset fail), and a later reset closes the old context once they are gone."""

from __future__ import annotations

import asyncio
import gc

import pytest

import ucxx

T = pytest.mark.timeout
HOST = "127.0.0.1"
MSG = "Trying to reset UCX but not all Endpoints and/or Listeners are closed"


async def _pair():
    accepted = asyncio.Queue()
    lst = ucxx.create_listener(accepted.put_nowait, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port)
    sep = await asyncio.wait_for(accepted.get(), 10)
    return lst, ep, sep


@pytest.fixture(autouse=True)
def _fresh():
    ucxx.reset()
    yield
    ucxx.reset()
    assert ucxx.core._ctx is None


@T(60)
async def test_live_listener_raises_then_no_cascade():
    lst = ucxx.create_listener(lambda ep: None, host=HOST)
    old = ucxx.core._ctx
    with pytest.raises(ucxx.UCXError, match=MSG) as ei:
        ucxx.reset()
    assert repr(lst) in str(ei.value)
    assert ucxx.core._ctx is None
    ucxx.reset()  # no cascade: nothing of the current context is open
    new = ucxx.core._get_ctx()
    assert new is not old and new.worker_address != old.worker_address
    assert not old.worker.closed  # the listener still works
    lst.close()
    ucxx.reset()
    assert old.worker.closed and new.worker.closed and ucxx.core._retired == []


@T(60)
async def test_live_endpoint_raises_naming_it():
    lst, ep, sep = await _pair()
    lst.close()
    sep.abort()
    with pytest.raises(ucxx.UCXError, match=MSG) as ei:
        ucxx.reset()
    assert f"{ep.uid:#x}" in str(ei.value)
    assert f"{sep.uid:#x}" not in str(ei.value)  # aborted: not in use
    ep.abort()
    ucxx.reset()
    assert ucxx.core._retired == []


@T(60)
async def test_endpoint_whose_peer_failed_counts_until_closed():
    lst, ep, sep = await _pair()
    lst.close()
    sep.abort()  # no close message: ep's peer is gone
    for _ in range(500):
        if not ep.alive:
            break
        await asyncio.sleep(0.01)
    assert not ep.alive
    with pytest.raises(ucxx.UCXError, match=MSG):
        ucxx.reset()
    await ep.close()
    ucxx.reset()


@T(60)
async def test_endpoint_closed_by_its_peer_does_not_count():
    lst, ep, sep = await _pair()
    lst.close()
    await sep.close()
    for _ in range(500):
        if ep.closed:
            break
        await asyncio.sleep(0.01)
    assert ep.closed
    ucxx.reset()  # ep is still referenced, but closed: nothing raised
    assert ucxx.core._retired == []


@T(60)
async def test_dropped_objects_do_not_count():
    lst, ep, sep = await _pair()
    del lst, ep, sep
    gc.collect()
    ucxx.reset()
    assert ucxx.core._ctx is None and ucxx.core._retired == []


@T(60)
async def test_reset_from_a_listener_callback():
    resets = []

    def server(ep):
        ep.abort()
        try:
            ucxx.reset()
        except ucxx.UCXError as e:  # the listener is alive
            resets.append(e)

    lst = ucxx.create_listener(server, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port)
    while lst.active_clients or not resets:
        await asyncio.sleep(0.01)
    assert MSG in str(resets[0])
    ucxx.reset()  # the listener's context was detached by the first reset
    del lst, ep
    gc.collect()
    ucxx.reset()
    assert ucxx.core._retired == []
