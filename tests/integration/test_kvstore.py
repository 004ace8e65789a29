"""kvstore over real Redis and gRPC, with blocks made by the real tiny engine.

The kvstore runs as its own process (``python -m services.kvstore``) against a redis-server on
a free port; the test talks to it through the generated gRPC stubs, as prefill and the
entrypoint do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepserve.procs import free_port, start_redis, stop, wait_port
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.proto.deepserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
BS = 16
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@dataclass
class KVStoreProc:
    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    redis_port: int
    data_dir: Path
    stub: kvstore_pb2_grpc.KVStoreStub
    channel: grpc.Channel

    def healthz(self) -> tuple[int, dict[str, str]]:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}/healthz", timeout=5
            ) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def redis(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port)

    def block_files(self) -> list[Path]:
        """Every shard file on the 12 default targets (``<data_dir>/targets/tNN``)."""
        return sorted(
            p
            for p in (self.data_dir / "targets").rglob("*")
            if p.is_file() and not p.name.startswith(".deepserve")
        )

    def shard_files(self, h: bytes) -> list[Path]:
        return sorted(self.data_dir.glob(f"targets/t*/{h.hex()[:2]}/{h.hex()}.*"))


def start_kvstore(tmp: Path, redis_port: int) -> KVStoreProc:
    grpc_port, http_port = free_port(), free_port()
    data_dir = tmp / "data"
    with open(tmp / "kvstore.log", "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.kvstore",
                "--grpc-port",
                str(grpc_port),
                "--http-port",
                str(http_port),
                "--redis-url",
                f"redis://127.0.0.1:{redis_port}/0",
                "--data-dir",
                str(data_dir),
                "--drain-seconds",
                "2",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_port("127.0.0.1", grpc_port, 30, proc)
    wait_port("127.0.0.1", http_port, 30, proc)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    return KVStoreProc(
        proc,
        grpc_port,
        http_port,
        redis_port,
        data_dir,
        kvstore_pb2_grpc.KVStoreStub(channel),
        channel,
    )


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVStoreProc]:
    tmp = tmp_path_factory.mktemp("kvstore")
    redis_port = free_port()
    redis_proc = start_redis(redis_port, tmp / "redis")
    k = start_kvstore(tmp, redis_port)
    try:
        yield k
    finally:
        k.channel.close()
        stop(k.proc)
        stop(redis_proc)
    assert k.proc.returncode == 0, "kvstore did not exit cleanly on SIGTERM"


@pytest.fixture(scope="module")
def engine_blocks(tiny_loaded) -> dict[str, object]:
    """One prompt run on the tiny engine: its greedy output and its exported blocks."""
    p = prompt(4 * BS + 5, 1)  # 4 full blocks inside prompt[:-1], plus a partial tail
    e = make_engine(tiny_loaded)
    e.add_request("a", p, GREEDY, hold_kv=True)
    out = drain(e)["a"]
    blocks = e.export_blocks("a")[:4]  # the prompt's blocks (later ones hold generated tokens)
    return {"prompt": p, "output": out, "blocks": blocks}


def make_engine(tiny_loaded) -> Engine:
    return Engine(
        EngineConfig(model="tiny", block_size=BS, num_kv_blocks=64, time_budget_s=None),
        loaded=tiny_loaded,
    )


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


def drain(e: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while e.has_unfinished():
        for ev in e.step():
            if ev.token_id is not None:
                out.setdefault(ev.request_id, []).append(ev.token_id)
    return out


def put(stub: kvstore_pb2_grpc.KVStoreStub, blocks, **kw) -> kvstore_pb2.PutReply:
    msgs = [
        kvstore_pb2.PutBlock(hash=h, parent_hash=parent, data=data, **kw)
        for h, parent, data in blocks
    ]
    return stub.Put(iter(msgs), timeout=30)


def get(stub: kvstore_pb2_grpc.KVStoreStub, hashes: list[bytes]) -> list[kvstore_pb2.Block]:
    return list(stub.Get(kvstore_pb2.GetRequest(hashes=hashes), timeout=30))


def lookup(stub: kvstore_pb2_grpc.KVStoreStub, hashes: list[bytes]) -> int:
    return stub.Lookup(kvstore_pb2.LookupRequest(hashes=hashes), timeout=10).num_present


def stats(stub: kvstore_pb2_grpc.KVStoreStub) -> tuple[int, int]:
    s = stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)
    return s.blocks, s.bytes


def test_kvstore_does_not_import_torch() -> None:
    code = (
        "import sys, services.kvstore.main, services.kvstore.store, services.kvstore.handlers; "
        "assert 'torch' not in sys.modules, 'kvstore imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_ready_while_redis_answers(kv: KVStoreProc) -> None:
    status, body = kv.healthz()
    assert status == 200 and body["status"] == "ok", body
    health = health_pb2_grpc.HealthStub(kv.channel)
    for name in ("", "deepserve.v1.KVStore"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_put_lookup_get_stats(kv: KVStoreProc, engine_blocks) -> None:
    blocks = engine_blocks["blocks"]
    hashes = [h for h, _, _ in blocks]
    before = stats(kv.stub)
    assert lookup(kv.stub, hashes) == 0

    reply = put(kv.stub, blocks, tenant="t1", traffic_class=common_pb2.TRAFFIC_CLASS_AGENT)
    assert (reply.stored, reply.skipped) == (4, 0)
    again = put(kv.stub, blocks[:2])
    assert (again.stored, again.skipped) == (0, 2)

    assert lookup(kv.stub, hashes) == 4
    assert lookup(kv.stub, hashes[:2]) == 2
    unknown = bytes(32)
    assert lookup(kv.stub, hashes + [unknown]) == 4
    assert lookup(kv.stub, [unknown] + hashes) == 0, "Lookup counts only the leading blocks"

    got = get(kv.stub, hashes)
    assert [b.hash for b in got] == hashes
    assert [b.data for b in got] == [data for _, _, data in blocks], "Get must return the bytes put"
    assert [b.hash for b in get(kv.stub, hashes[:2] + [unknown] + hashes[2:])] == hashes[:2]

    size = sum(len(data) for _, _, data in blocks)
    assert stats(kv.stub) == (before[0] + 4, before[1] + size)
    meta = kv.redis().hgetall(f"ds:kv:{hashes[1].hex()}")
    assert meta[b"size"] == str(len(blocks[1][2])).encode()
    assert meta[b"tenant"] == b"t1" and meta[b"class"] == b"agent"
    assert meta[b"parent"] == hashes[0].hex().encode() and float(meta[b"last_access"]) > 0
    assert not [p for p in kv.block_files() if p.name.endswith(".tmp")]


def test_lookup_stops_at_a_gap(kv: KVStoreProc, tiny_loaded) -> None:
    e = make_engine(tiny_loaded)
    e.add_request("g", prompt(3 * BS + 1, 7), SamplingParams(max_tokens=1), hold_kv=True)
    drain(e)
    blocks = e.export_blocks("g")
    put(kv.stub, [blocks[0], blocks[2]])
    assert lookup(kv.stub, [h for h, _, _ in blocks]) == 1
    put(kv.stub, [blocks[1]])
    assert lookup(kv.stub, [h for h, _, _ in blocks]) == 3


def test_bad_blocks_are_refused_and_nothing_is_stored(kv: KVStoreProc, tiny_loaded) -> None:
    e = make_engine(tiny_loaded)
    e.add_request("b", prompt(2 * BS + 3, 11), SamplingParams(max_tokens=1), hold_kv=True)
    drain(e)
    (h0, p0, f0), (h1, p1, f1) = e.export_blocks("b")
    files, before = kv.block_files(), stats(kv.stub)
    cases = {
        "malformed": [(h0, p0, b"not a frame at all")],
        "truncated": [(h0, p0, f0[:-10])],
        "hash mismatch": [(h0, p0, f1)],
        "short hash": [(h0[:8], p0, f0)],
        "parent on a first block": [(h0, h1, f0)],
        "good block then a bad one": [(h0, p0, f0), (h1, p1, f1[:-1])],
    }
    for what, msgs in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            put(kv.stub, msgs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        assert err.value.details(), what
        assert lookup(kv.stub, [h0, h1]) == 0, f"{what}: a refused put left a visible block"
    assert stats(kv.stub) == before
    assert kv.block_files() == files, "a refused put left files behind"
    with pytest.raises(grpc.RpcError) as err:
        lookup(kv.stub, [b"short"])
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hashes[0]" in err.value.details()
    )


def test_delete(kv: KVStoreProc, tiny_loaded) -> None:
    e = make_engine(tiny_loaded)
    e.add_request("d", prompt(2 * BS + 1, 13), SamplingParams(max_tokens=1), hold_kv=True)
    drain(e)
    blocks = e.export_blocks("d")
    hashes = [h for h, _, _ in blocks]
    before = stats(kv.stub)
    put(kv.stub, blocks)
    reply = kv.stub.Delete(kvstore_pb2.DeleteRequest(hashes=hashes + [bytes(32)]), timeout=10)
    assert reply.deleted == 2
    assert lookup(kv.stub, hashes) == 0 and get(kv.stub, hashes) == []
    assert stats(kv.stub) == before
    assert not any(p.name.split(".")[0] in {h.hex() for h in hashes} for p in kv.block_files())


def test_invisible_without_metadata_and_damaged_files_drop_out(
    kv: KVStoreProc, tiny_loaded
) -> None:
    e = make_engine(tiny_loaded)
    e.add_request("o", prompt(2 * BS + 1, 17), SamplingParams(max_tokens=1), hold_kv=True)
    drain(e)
    (h0, p0, f0), (h1, p1, f1) = e.export_blocks("o")
    put(kv.stub, [(h0, p0, f0)])
    shards = {p: p.read_bytes() for p in kv.shard_files(h0)}
    assert len(shards) == 12
    kv.stub.Delete(kvstore_pb2.DeleteRequest(hashes=[h0]), timeout=10)
    for p, data in shards.items():  # a crash after the shards were written, before metadata
        p.write_bytes(data)
    assert lookup(kv.stub, [h0]) == 0 and get(kv.stub, [h0]) == []

    put(kv.stub, [(h0, p0, f0), (h1, p1, f1)])
    before = stats(kv.stub)
    for p in kv.shard_files(h1)[:3]:  # 3 of 12 shards damaged behind the store's back: lost
        p.write_bytes(p.read_bytes()[:100])
    assert [b.hash for b in get(kv.stub, [h0, h1])] == [h0]
    assert lookup(kv.stub, [h0, h1]) == 1, "a damaged block must stop being promised"
    assert stats(kv.stub) == (before[0] - 1, before[1] - len(f1))


def test_fetched_frames_continue_identically(kv: KVStoreProc, engine_blocks, tiny_loaded) -> None:
    blocks, p = engine_blocks["blocks"], engine_blocks["prompt"]
    put(kv.stub, blocks)
    hashes = [h for h, _, _ in blocks]
    n = lookup(kv.stub, hashes)
    frames = [b.data for b in get(kv.stub, hashes[:n])]
    fresh = make_engine(tiny_loaded)
    fresh.add_request("b", p, GREEDY, kv=frames)
    assert fresh.info("b").num_cached_tokens == 4 * BS
    assert drain(fresh)["b"] == engine_blocks["output"]


def test_redis_down_means_unavailable_then_recovers(tmp_path: Path) -> None:
    redis_port = free_port()
    redis_proc = start_redis(redis_port, tmp_path / "redis")
    k = start_kvstore(tmp_path, redis_port)
    try:
        assert k.healthz()[0] == 200
        stop(redis_proc)
        deadline = time.monotonic() + 10
        while k.healthz()[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = k.healthz()
        assert status == 503 and "Redis DOWN" in body["detail"], body
        with pytest.raises(grpc.RpcError) as err:
            lookup(k.stub, [bytes(32)])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in err.value.details()
        health = health_pb2_grpc.HealthStub(k.channel)
        assert (
            health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.NOT_SERVING
        )

        redis_proc = start_redis(redis_port, tmp_path / "redis")
        deadline = time.monotonic() + 10
        while k.healthz()[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert k.healthz()[0] == 200 and lookup(k.stub, [bytes(32)]) == 0
    finally:
        k.channel.close()
        stop(k.proc)
        stop(redis_proc)
    assert k.proc.returncode == 0


def test_v4_state_blocks_round_trip_through_the_kvstore(kv: KVStoreProc) -> None:
    """DeepSeek-V4's state blocks (libs/engine/v4/blocks.py) as the kvstore's unit: a prompt's
    blocks put as signed single-block frames, found by Lookup of the chain, got back, restored,
    and the request continues as a full recompute."""
    import torch

    from libs.engine.v4.blocks import BLOCK_TOKENS, from_frames, prefill_blocks, restore, to_frames
    from libs.engine.v4.load import load_v4
    from libs.engine.v4.model import V4State

    net = load_v4("v4-tiny")
    key = b"k" * 32
    ids = prompt(2 * BLOCK_TOKENS + 20, 77)
    _, blocks, _ = prefill_blocks(net, ids[: 2 * BLOCK_TOKENS])
    frames = to_frames(blocks, ids, "v4-tiny-seed0", net, key=key)
    assert put(kv.stub, frames).stored == 2
    names = [h for h, _, _ in frames]
    assert lookup(kv.stub, names) == 2
    got = {b.hash: b.data for b in get(kv.stub, names)}
    restored = restore(
        from_frames([got[h] for h in names], ids, "v4-tiny-seed0", net, key=key), net
    )
    full = net(torch.tensor(ids), V4State.empty(net.cfg))
    rest = net(torch.tensor(ids[2 * BLOCK_TOKENS :]), restored)
    torch.testing.assert_close(rest, full[2 * BLOCK_TOKENS :], rtol=1e-5, atol=1e-5)
