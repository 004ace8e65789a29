"""``deepserve bench load``: how fast a checkpoint loads against how fast its disk reads.

In one process, over the same files: the disk's raw read (every shard read whole with plain
``readinto``, ``--workers`` files at a time, nothing else done), then the engine's loader
(``libs/engine/loader.py:load_weights``: headers, wanted tensors, views, dtype conversion and
the copy into the model -- on CUDA from page-locked memory, overlapped with the next shards'
reads) with one shard read at a time and with ``--workers`` at once. Cold runs start with the
files' pages dropped from the page cache (``posix_fadvise(DONTNEED)`` after an ``fsync``: no
root needed), so they read the disk; warm runs find the files in the page cache, which stands
in for storage faster than the loader (NVMe arrays): there the loader's own work is the limit.
GB/s are file bytes / seconds; ``vs_raw`` is the loader's rate over the raw read's, cold against
cold and warm against warm.

The checkpoint is ``--model`` (a directory or Hub repo id) or, by default, a synthetic one
written first (``release.py``): ``--layout v2-lite`` has DeepSeek-V2-Lite's shapes (bf16, 64
experts of 2048x1408) cut to ``--layers`` layers; ``--layout v3`` DeepSeek-V3's e4m3 release
format at V2-Lite's widths (writing it quantizes on the host: slower to make).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from deepserve.bench.release import V2_LITE, V3, synthetic_state, write_release
from libs.engine.hub import resolve_model
from libs.engine.loader import load_weights, model_config, resolve_weight_dtype, weight_files
from libs.engine.model.model import DeepseekForCausalLM

# DeepSeek-V2-Lite's config.json, as released (the layer count is --layers).
V2_LITE_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "rope_theta": 10000,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
}
CHUNK = 64 << 20  # raw read: bytes per readinto


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="a checkpoint directory or Hub repo id")
    p.add_argument("--layout", choices=("v2-lite", "v3"), default="v2-lite")
    p.add_argument("--layers", type=int, default=2, help="synthetic checkpoint: layers")
    p.add_argument("--shards", type=int, default=8, help="synthetic checkpoint: shards")
    p.add_argument("--dir", default="", help="where to write it (default: a temp dir)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype")
    p.add_argument("--workers", type=int, default=4, help="shards read at once")
    p.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")


def drop_cache(files: list[Path]) -> bool:
    """Evict ``files`` from the page cache; False where the OS cannot be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def raw_read(files: list[Path], workers: int) -> dict[str, float]:
    """Every file read whole, ``workers`` at a time: the disk's own rate."""

    def one(f: Path) -> int:
        buf = bytearray(CHUNK)
        view, n = memoryview(buf), 0
        with open(f, "rb", buffering=0) as fh:
            while got := fh.readinto(view):
                n += got
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        nbytes = sum(pool.map(one, files))
    spent = time.perf_counter() - t0
    return {"workers": workers, "seconds": spent, "gb_s": nbytes / 1e9 / spent}


def loader_read(source: str, device: str, dtype: torch.dtype, workers: int) -> dict[str, float]:
    """``load_weights`` into a model built (empty) beforehand: the loading alone."""
    cfg = model_config(source)
    model = DeepseekForCausalLM(cfg, dtype, torch.device(device))
    if resolve_weight_dtype(source, "auto") == "fp8":
        model.quantize_weights_fp8(empty=True, experts=False)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    load_weights(model, Path(source), workers)
    if cuda:
        torch.cuda.synchronize()
    return {"read_workers": workers, "seconds": time.perf_counter() - t0}


def synthesize(args: argparse.Namespace, root: Path) -> Path:
    config = {**V2_LITE_CONFIG, "num_hidden_layers": args.layers}
    layout = V2_LITE if args.layout == "v2-lite" else V3
    if layout == V3:
        config.update(model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc")
    state = synthetic_state(config, dtype=torch.bfloat16 if layout == V2_LITE else torch.float32)
    return write_release(root / args.layout, layout, config, state, shards=args.shards)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        t0 = time.perf_counter()
        path = Path(resolve_model(args.model)) if args.model else synthesize(args, Path(tmp))
        made = time.perf_counter() - t0
        files = weight_files(path)
        nbytes = sum(f.stat().st_size for f in files)
        dtype = getattr(torch, args.dtype)
        dropped = drop_cache(files)
        cold = raw_read(files, args.workers)
        warm = raw_read(files, args.workers)
        runs = []
        for cache, raw in (("cold", cold), ("warm", warm)):
            for workers in sorted({1, args.workers}):
                if cache == "cold":
                    drop_cache(files)
                r: dict[str, Any] = {"page_cache": cache}
                r.update(loader_read(str(path), args.device, dtype, workers))
                r["gb_s"] = nbytes / 1e9 / r["seconds"]
                r["vs_raw"] = r["gb_s"] / raw["gb_s"]
                runs.append(r)
    device = args.device
    if device.startswith("cuda"):
        device = torch.cuda.get_device_name(torch.device(device))
    return {
        "bench": "load",
        "checkpoint": {
            "source": args.model or f"synthetic {args.layout}, {args.layers} layers",
            "files": len(files),
            "gb": nbytes / 1e9,
            "written_s": None if args.model else made,
        },
        "device": device,
        "dtype": args.dtype,
        "page_cache_dropped": dropped,
        "raw_read_cold": cold,
        "raw_read_warm": warm,
        "loader": runs,
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
    }


def main(args: argparse.Namespace) -> int:
    result = run(args)
    cold = result["raw_read_cold"]
    print(
        f"{result['checkpoint']['source']}: {result['checkpoint']['files']} files, "
        f"{result['checkpoint']['gb']:.2f} GB; device {result['device']}"
    )
    print(f"  raw read (disk, cold)   {cold['gb_s']:6.2f} GB/s  ({cold['workers']} files at once)")
    print(f"  raw read (page cache)   {result['raw_read_warm']['gb_s']:6.2f} GB/s")
    for r in result["loader"]:
        print(
            f"  loader, {r['read_workers']} reading, {r['page_cache']}  {r['gb_s']:6.2f} GB/s  "
            f"({r['seconds']:.2f} s, {r['vs_raw']:.2f}x the raw read, {r['page_cache']})"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
