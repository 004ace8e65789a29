"""``deepserve bench handoff``: moving a prompt's KV from one process to another on a host.

Two processes each own a paged KV cache of a preset's layout (no weights: the hand-off touches
only the cache). The source fills its pool with random bytes; for each prompt length the
destination takes the same blocks two ways, timed end to end:

* ``peer``: the destination maps the source's pool once (CUDA IPC on a GPU, a memfd on CPU --
  :mod:`libs.engine.kv.peer`) and copies the blocks device to device
  (:meth:`PagedKVCache.copy_from_peer`), what a same-host prefill -> decode hand-off does;
* ``bytes``: the source gathers the blocks to host bytes, they cross a local pipe, the
  destination uploads and scatters them -- the path for hosts without a shared device
  (gRPC adds its own framing and copies on top: a lower bound for it).

Each copy is checked (a checksum of the destination blocks equals the source's), and the
figures are GB/s of KV moved. Run as ``deepserve bench handoff --preset v2-lite --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

DEFAULT_TOKENS = "1024,4096,16384"


def _cache(preset: str, device: str, block_size: int, num_blocks: int) -> Any:
    import torch

    from libs.engine.kv.cache import PagedKVCache
    from libs.engine.kv.layout import mla_cache_spec
    from libs.engine.presets import PRESETS

    cfg = PRESETS[preset]
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    spec = mla_cache_spec(cfg, f"bench-{preset}", block_size, dtype)
    return PagedKVCache(spec, num_blocks, torch.device(device), cfg.qk_rope_head_dim)


def _checksum(cache: Any, blocks: list[int]) -> int:
    raw = cache._gather(blocks)
    return int(raw.to(dtype=__import__("torch").int64).sum().item())


def _destination(conn: Connection, preset: str, device: str, bs: int, num_blocks: int) -> None:
    cache = _cache(preset, device, bs, num_blocks)
    pool = cache.open_peer(conn.recv_bytes())
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        kind, src, dst = msg
        if kind == "peer":
            t0 = time.perf_counter()
            event = cache.copy_from_peer(pool, src, dst)
            if event is not None:
                event.synchronize()
            conn.send((time.perf_counter() - t0, _checksum(cache, dst)))
        else:
            data = conn.recv_bytes()
            t0 = time.perf_counter()
            staged = cache.stage([data])
            cache.write_staged(dst, staged)
            _sync(device)
            conn.send((time.perf_counter() - t0, _checksum(cache, dst)))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def run(
    preset: str, device: str, tokens: list[int], block_size: int, repeats: int
) -> dict[str, Any]:
    import torch

    most = max(-(-t // block_size) for t in tokens)
    num_blocks = 2 * most + 8
    src = _cache(preset, device, block_size, num_blocks)
    src.backing.copy_(torch.randint(0, 256, src.backing.shape, dtype=torch.uint8, device="cpu"))
    handle = src.share()
    if handle is None:
        raise SystemExit(f"the {device} KV pool cannot be shared from this process")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_destination, args=(child, preset, device, block_size, num_blocks), daemon=True
    )
    proc.start()
    rows = []
    try:
        parent.send_bytes(handle)
        if parent.recv() != "ready":
            raise SystemExit("the destination process did not map the pool")
        g = torch.Generator().manual_seed(0)
        for n_tok in tokens:
            n = -(-n_tok // block_size)
            nbytes = n * src.spec.bytes_per_block
            best = {"peer": float("inf"), "bytes": float("inf")}
            for _ in range(repeats):
                perm = torch.randperm(num_blocks, generator=g).tolist()
                s_ids, d_ids = perm[:n], perm[n : 2 * n]
                want = _checksum(src, s_ids)
                parent.send(("peer", s_ids, d_ids))
                seconds, got = parent.recv()
                if got != want:
                    raise SystemExit(f"peer copy of {n} blocks arrived corrupted")
                best["peer"] = min(best["peer"], seconds)
                t0 = time.perf_counter()
                data = src.gather_async(s_ids).result()
                parent.send(("bytes", s_ids, d_ids))
                parent.send_bytes(data)
                seconds, got = parent.recv()
                total = time.perf_counter() - t0
                if got != want:
                    raise SystemExit(f"byte copy of {n} blocks arrived corrupted")
                best["bytes"] = min(best["bytes"], total)
            row = {
                "tokens": n_tok,
                "blocks": n,
                "kv_bytes": nbytes,
                "peer_ms": best["peer"] * 1e3,
                "bytes_ms": best["bytes"] * 1e3,
                "peer_gb_s": nbytes / best["peer"] / 1e9,
                "bytes_gb_s": nbytes / best["bytes"] / 1e9,
            }
            row["speedup"] = row["bytes_ms"] / row["peer_ms"]
            rows.append(row)
            print(
                f"{n_tok:>7} tokens  {nbytes / 2**20:8.1f} MiB   peer {row['peer_ms']:8.2f} ms "
                f"({row['peer_gb_s']:7.1f} GB/s)   bytes {row['bytes_ms']:8.2f} ms "
                f"({row['bytes_gb_s']:6.2f} GB/s)   {row['speedup']:6.1f}x",
                flush=True,
            )
    finally:
        parent.send(None)
        proc.join(timeout=30)
    return {
        "what": "handoff",
        "preset": preset,
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "block_size": block_size,
        "bytes_per_block": src.spec.bytes_per_block,
        "repeats": repeats,
        "rows": rows,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="v2-lite", help="cache layout of this preset")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="prompt lengths, comma-separated")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="best of this many per way")
    p.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")


def main(args: argparse.Namespace) -> int:
    tokens = [int(t) for t in str(args.tokens).split(",") if t.strip()]
    if not tokens or min(tokens) <= 0:
        raise SystemExit("--tokens must list positive prompt lengths")
    result = run(args.preset, args.device, tokens, args.block_size, args.repeats)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
