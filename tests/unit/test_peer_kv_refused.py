"""A decode instance opens a KV pool only by a reference a prefill peer signed for that very
request (issue 33 item 7): a made-up handle, one signed under another key, another request's,
one altered to point elsewhere, a stale one and a replayed one are refused with a clear error
before the pool is opened -- no file mapped or grown, no block taken, no token sent."""

from __future__ import annotations

import asyncio
import os
import pickle
import tempfile
from dataclasses import replace

import pytest

from libs.common import subjects
from libs.common.sampling import SamplingParams
from libs.engine.kv import peer
from libs.engine.kv.transfer import PeerKV
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engine_loop import EngineLoop
from libs.serving.peer_seal import MAX_AGE_S, PeerKVRefused, PeerSeals, seal
from libs.transport.inproc import InProcKVPusher
from services.decode import metrics as decode_metrics
from services.decode.handlers import DecodeHandler
from services.prefill.handlers import PrefillHandler
from tests.unit.test_prefill_decode_handlers import BS, Bus, make, prompt, reference, task

KEY = b"serving-tier"


# -- the seal itself ---------------------------------------------------------------------------
def test_a_sealed_reference_opens_once_for_its_request_only() -> None:
    kv = PeerKV(b"handle", (1, 2), 0, 20, ("aa", "bb"))
    now = [1000.0]
    seals = PeerSeals(KEY, clock=lambda: now[0])
    sealed = seal(kv, "r1", KEY, now=1000.0)
    assert sealed.pool != kv.pool and seals.open(sealed, "r1") == kv
    moved = seal(kv, "r6", KEY, now=1000.0)
    refusals = [
        ("used already", sealed, "r1"),  # replayed
        ("not signed", kv, "r2"),  # made up
        ("does not match its MAC", seal(kv, "r3", b"another key", now=1000.0), "r3"),
        ("made for another request", seal(kv, "r4", KEY, now=1000.0), "r5"),  # another's
        ("altered", replace(moved, block_ids=(1 << 30,)), "r6"),  # pointed outside the pool
    ]
    for why, ref, rid in refusals:
        with pytest.raises(PeerKVRefused, match=why):
            seals.open(ref, rid)
    late = seal(kv, "r7", KEY, now=1000.0)
    now[0] = 1000.0 + MAX_AGE_S + 1
    with pytest.raises(PeerKVRefused, match="issued 61 s ago"):
        seals.open(late, "r7")
    assert PeerSeals(None).open(kv, "r8") is kv  # no key: nothing signed or checked (local use)


# -- a decode instance ---------------------------------------------------------------------------
class RecordingPusher(InProcKVPusher):
    """The in-process pusher, keeping each DecodeTask with what it carried."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[control_pb2.DecodeTask] = []

    async def push(self, address: str, task: control_pb2.DecodeTask, kv: bytes | PeerKV) -> None:
        self.tasks.append(task)
        await super().push(address, task, kv)


def forged_handle(fd: int) -> bytes:
    """A well-formed handle of a file this process holds open: what an attacker on the host
    would send to make decode map (and grow) it."""
    return pickle.dumps(
        peer._Handle(
            pool_id="made-up",
            host=peer.host_id(),
            device_type="cpu",
            num_blocks=256,
            nbytes=1 << 20,
            pid=os.getpid(),
            fd=fd,
        )
    )


async def test_decode_refuses_forged_foreign_and_replayed_pool_handles(tiny_loaded) -> None:
    bus = Bus()
    await bus.start()
    ploop = EngineLoop(make(tiny_loaded, KEY), name="p")
    dloop = EngineLoop(make(tiny_loaded, KEY), name="d")
    ploop.start()
    dloop.start()
    try:
        decode = DecodeHandler(
            dloop, bus.publish, instance_id="d", model_name="m", address="inproc:0", block_size=BS
        )
        pusher = RecordingPusher()
        pusher.register("inproc:0", decode)
        prefill = PrefillHandler(
            ploop,
            bus.publish,
            pusher,
            instance_id="p",
            model_name="m",
            block_size=BS,
            max_model_len=163840,
        )
        # A real hand-over on this host: a signed reference, opened and copied.
        p, sp = prompt(40, 3), SamplingParams(max_tokens=4, ignore_eos=True)
        prefill.submit(task("legit", p, sp))
        events = await bus.wait_done("legit")
        assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, p, sp)
        legit, legit_task = pusher.sent[-1], pusher.tasks[-1]
        assert isinstance(legit, PeerKV)

        for _ in range(100):  # decode's relay ends (the KV is freed) after the last event
            if decode.num_active == 0:
                break
            await asyncio.sleep(0.02)
        pools = len(dloop.engine.kv.peer_pools)
        free = await dloop.call(lambda e: e.blocks.num_free)
        refused = decode_metrics.PEER_REFUSED._value.get()
        with tempfile.TemporaryFile() as victim:
            made_up = replace(legit, pool=forged_handle(victim.fileno()))
            other_key = seal(made_up, "other-key", b"not the serving tier's key")
            cases = [
                ("made-up", made_up, "is not signed"),
                ("other-key", other_key, "does not match its MAC"),
                ("another-request", legit, "does not match its MAC"),  # legit's, elsewhere
                ("legit", legit, "used already"),  # replayed after its request ended
                (
                    "outside",
                    replace(legit, block_ids=tuple(b + (1 << 20) for b in legit.block_ids)),
                    "does not match its MAC",
                ),
            ]
            for rid, kv, why in cases:
                t = control_pb2.DecodeTask()
                t.CopyFrom(legit_task)
                t.request_id, t.events_subject = rid, subjects.token_events(rid)
                reply = await decode.accept(t, kv)
                assert not reply.accepted and why in reply.error, (rid, reply.error)
                assert "nothing imported" in reply.error
                assert not reply.send_bytes  # not "try bytes": a forgery is no transport issue
            victim.seek(0, os.SEEK_END)
            assert victim.tell() == 0  # never mapped, never grown
        assert decode_metrics.PEER_REFUSED._value.get() == refused + len(cases)
        assert len(dloop.engine.kv.peer_pools) == pools  # no pool opened
        assert await dloop.call(lambda e: e.blocks.num_free) == free  # no block taken
        assert decode.num_active == 0
        bus.settle()
        for rid, _, _ in cases[:3] + cases[4:]:
            assert not bus.events[subjects.token_events(rid)]  # no token sent anywhere
    finally:
        await ploop.close()
        await dloop.close()
