"""KV hand-off between two processes on one GPU host, by CUDA IPC.

A second process (spawned: a fresh interpreter, as a decode service is) maps this process's
KV pool from its share handle and copies blocks out of it device to device; an engine in that
process continues a prompt from the copied blocks with the same greedy tokens as an engine
that imported the same KV as bytes, even though the source blocks are overwritten right after
the copy is reported done. Also: the off-thread halves (gather then bytes; stage then
write) round-trip blocks on the device.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.common.sampling import SamplingParams  # noqa: E402
from libs.engine.engine import Engine, EngineConfig  # noqa: E402
from libs.engine.kv.transfer import PeerKV  # noqa: E402

CONFIG = dict(
    model="tiny",
    device="cuda",
    dtype="float32",
    block_size=16,
    num_kv_blocks=256,
    time_budget_s=None,
)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = [(i * 7919) % 120000 + 3 for i in range(70)]


def _continue_in_another_process(conn: Connection) -> None:
    engine = Engine(EngineConfig(**CONFIG))  # type: ignore[arg-type]
    ref: PeerKV = conn.recv()
    try:
        done = engine.add_request("d", PROMPT, GREEDY, kv=ref)
        if done is not None:
            done.synchronize()
        conn.send("copied")
        out: list[int] = []
        while engine.has_unfinished():
            out += [ev.token_id for ev in engine.step() if ev.token_id is not None]
        conn.send(out)
    except Exception as exc:  # noqa: BLE001 - report it to the test
        conn.send(f"error: {exc!r}")


def _from_bytes(frame: bytes) -> list[int]:
    """The same continuation from the same KV, imported as bytes in this process."""
    engine = Engine(EngineConfig(**CONFIG))  # type: ignore[arg-type]
    engine.add_request("x", PROMPT, GREEDY, kv=frame)
    out: list[int] = []
    while engine.has_unfinished():
        out += [ev.token_id for ev in engine.step() if ev.token_id is not None]
    return out


def test_another_process_continues_from_blocks_it_maps_by_cuda_ipc() -> None:
    src = Engine(EngineConfig(**CONFIG))  # type: ignore[arg-type]
    src.add_request("s", PROMPT, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    want = _from_bytes(src.export_kv("s", include_partial=True))
    assert len(want) == GREEDY.max_tokens
    ref = src.peer_kv("s")
    assert ref is not None and len(ref.block_ids) == 5
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_continue_in_another_process, args=(child,), daemon=True)
    proc.start()
    try:
        parent.send(ref)
        first = parent.recv()
        assert first == "copied", first
        src.release("s")  # the blocks may now be reused: the copy is done
        src.add_request("junk", [5] * 200, SamplingParams(max_tokens=1))  # and overwritten
        while src.has_unfinished():
            src.step()
        got = parent.recv()
        assert not isinstance(got, str), got  # the child's error, if it failed
    finally:
        proc.join(timeout=120)
    assert got == want


def test_off_thread_halves_round_trip_blocks_on_the_device() -> None:
    engine = Engine(EngineConfig(**CONFIG))  # type: ignore[arg-type]
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=1), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    frame = engine.export_kv_async("s", include_partial=True)()
    assert frame == engine.export_kv("s", include_partial=True)
    other = Engine(EngineConfig(**CONFIG))  # type: ignore[arg-type]
    prepared = other.prepare_kv([frame])
    other.add_request("d", PROMPT, GREEDY, kv=prepared, hold_kv=True)
    assert other.export_blocks("d") == engine.export_blocks("s")  # the 4 full blocks


def test_exports_reuse_host_buffers_without_mixing_their_blocks() -> None:
    # The kvstore's write-back gathers each finished request's blocks into page-locked host
    # buffers that are handed out again once read: exports in flight together get their own,
    # a later one reuses a buffer, and each reads its own request's blocks.
    engine = Engine(EngineConfig(**CONFIG))  # type: ignore[arg-type]
    other = [(t * 31) % 120000 + 5 for t in PROMPT]
    for rid, prompt in (("a", PROMPT), ("b", other)):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    finish_a = engine.export_blocks_async("a")
    finish_b = engine.export_blocks_async("b")  # both in flight
    assert finish_b() == engine.export_blocks("b")
    assert finish_a() == engine.export_blocks("a")
    pool = engine.cache._pinned
    assert pool is not None and pool.allocated == 2
    assert engine.export_blocks_async("b")() == engine.export_blocks("b")  # a reused buffer
    assert pool.allocated == 2
