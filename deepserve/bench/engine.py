"""``deepserve bench engine``: prefill and decode throughput against the device's own limits.

Measured in one run: the device's copy bandwidth and dense matmul rate (the limits), then
prefill steps of several sizes and decode steps at several batch sizes. Each figure is also
given as a fraction of the limit for the FLOPs / bytes the step must move (from the cost
model), so results read the same on any machine.

In the same run, unless ``--no-transformers``: transformers' ``generate`` on the same weights
(the peer baseline, :mod:`deepserve.bench.hf_peer`; its parameters are the engine's tensors) at
``--transformers-batches`` with the same context and prompts, giving
``transformers_decode_tokens_per_s`` and ``speedup_vs_transformers``.

Engine options: ``--kv-cache-dtype fp8`` (e4m3 KV cache), ``--experts fp4`` (FP4 routed-expert
weights), ``--weights fp8`` (block-scaled e4m3 linear and routed-expert weights; ``bf16`` forces
unquantized weights), ``--no-cuda-graphs``, ``--no-overlap``, ``--kernels auto|triton|torch``. With
fp8 KV, fp4 experts or fp8 weights and ``--quality`` (the default), the error of the configured
engine's logits against an unquantized engine's logits on the same weights is measured first
(``quality`` in the JSON): ``--quality-prompts`` random prompts of ``--quality-tokens`` tokens,
then ``--quality-steps`` teacher-forced decode steps through the KV cache (both engines fed the
same tokens). The two engines are built one after the other (the reference's logits are kept
on the CPU), so a preset that fills most of the device still fits; both run without CUDA graphs
and overlap.

``--plot PATH`` draws the result with :mod:`deepserve.bench.engine_plot` (also
``python -m deepserve.bench.engine_plot RESULT.json [OUT.png]``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import torch

from libs.common.sampling import SamplingParams
from libs.engine.cost_model import StepShape
from libs.engine.engine import Engine, EngineConfig

from .hf_peer import decode_prompts, free_memory, sync


class _Defaults(TypedDict):
    prefill: list[int]
    batches: list[int]
    context: int


DEFAULTS: dict[str, _Defaults] = {
    "cpu": {"prefill": [512, 2048], "batches": [1, 4, 16], "context": 512},
    "cuda": {"prefill": [4096, 16384, 32768], "batches": [1, 16, 64, 256], "context": 2048},
}
TRANSFORMERS_BATCHES = {"cpu": [1, 4], "cuda": [1, 16, 64]}
_QUALITY_SEED = 1_000_003  # SamplingParams.seed of quality request i is this + i (greedy: unused)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_limits(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    n_bytes = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, 5)
    copy_bps = 2 * n_bytes / t  # read + write
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _timed(lambda: a @ b, device, 5)
    return {"copy_bytes_per_s": copy_bps, "matmul_flops_per_s": 2 * n**3 / t}


def _drain_prefill(engine: Engine, rids: list[str]) -> None:
    pending = set(rids)
    while pending:
        for ev in engine.step():
            pending.discard(ev.request_id)


def bench_prefill(
    engine: Engine, tokens: int, limits: dict[str, float], vocab: int
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(tokens)
    times = []
    for rep in range(2):
        rid = f"prefill-{tokens}-{rep}"
        ids = torch.randint(3, vocab, (tokens,), generator=g).tolist()
        engine.add_request(rid, ids, SamplingParams(max_tokens=1))
        plan_tokens = 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            plan_tokens += engine.last_step_tokens
        sync(engine.device)
        times.append(time.perf_counter() - t0)
    seconds = min(times)
    shape = StepShape(((tokens, tokens),))
    flops = engine.cost.flops(shape)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "flops": flops,
        "mfu": flops / seconds / limits["matmul_flops_per_s"],
    }


def decode_room(speculative_tokens: int, steps: int) -> int:
    """Tokens a timed decode request may emit: the warm-up and timed steps, each up to
    ``1 + K`` tokens with K drafts, and a margin."""
    return (speculative_tokens + 1) * (steps + 2) + 64


def bench_decode(
    engine: Engine, batch: int, context: int, steps: int, limits: dict[str, float], vocab: int
) -> dict[str, Any]:
    rids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid, ids in zip(
        rids, decode_prompts(batch, context, vocab).tolist()
    ):  # the peer's prompts too
        # Room for every step below, so the batch stays whole while it is timed; aborted after.
        room = decode_room(engine.config.speculative_tokens, steps)
        engine.add_request(rid, ids, SamplingParams(max_tokens=room, ignore_eos=True))
    _drain_prefill(engine, rids)  # every request has its first token: decode from here
    engine.step()  # warm-up decode step
    tokens = 0  # emitted: one per request and step, more with speculative decoding
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens += sum(ev.token_id is not None for ev in engine.step())
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    seconds = elapsed / steps
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    shape = StepShape(tuple((1, context + 2) for _ in range(batch)))
    step_bytes = engine.cost.bytes(shape)
    tps = tokens / elapsed
    return {
        "batch": batch,
        "context": context,
        "step_seconds": seconds,
        "tokens_per_s": tps,
        "per_user_tokens_per_s": tps / batch,
        "bytes_per_step": step_bytes,
        "roofline_fraction": step_bytes / seconds / limits["copy_bytes_per_s"],
    }


# -- engine options ------------------------------------------------------------------------------
def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields the flags change from their defaults (only those are passed)."""
    opts: dict[str, Any] = {}
    if getattr(args, "kv_cache_dtype", "auto") == "fp8":
        opts["kv_cache_dtype"] = "float8_e4m3fn"
    if getattr(args, "experts", "bf16") == "fp4":
        opts["expert_dtype"] = "fp4"
    if getattr(args, "weights", "auto") in ("bf16", "fp8"):
        opts["weight_dtype"] = args.weights
    if getattr(args, "no_cuda_graphs", False):
        opts["cuda_graphs"] = False
    if getattr(args, "no_overlap", False):
        opts["overlap"] = False
    if getattr(args, "kernels", "auto") != "auto":
        opts["kernels"] = args.kernels
    if getattr(args, "batch_invariant", False):
        opts["batch_invariant"] = True
    if getattr(args, "speculative_tokens", 0):
        opts["speculative_tokens"] = args.speculative_tokens
        opts["speculative_schedule"] = getattr(args, "speculative_schedule", "confidence")
    return opts


def make_config(**kwargs: Any) -> EngineConfig:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise SystemExit(
            f"deepserve bench engine: this engine's EngineConfig has no {', '.join(unknown)} "
            "(the flag that sets it is not supported yet)"
        )
    return EngineConfig(**kwargs)


def _no_graphs_no_overlap() -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: False for k in ("cuda_graphs", "overlap") if k in known}


# -- quality: logits of a quantized engine against the unquantized one -----------------------------
def quality_inputs(
    vocab: int, prompts: int, tokens: int, steps: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompts and the tokens every engine is fed after them (teacher forcing)."""
    g = torch.Generator().manual_seed(20240531)
    ps = [torch.randint(3, vocab, (tokens,), generator=g).tolist() for _ in range(prompts)]
    forced = [torch.randint(3, vocab, (steps + 1,), generator=g).tolist() for _ in range(prompts)]
    return ps, forced


def capture_logits(
    engine: Engine, prompts: list[list[int]], forced: list[list[int]]
) -> dict[tuple[int, int], torch.Tensor]:
    """fp32 CPU logits of every sampled position, keyed (prompt index, position).

    The engine runs the prompts through :meth:`Engine.step` as usual; its sampler is replaced
    for the duration by one that records the logits and returns the forced tokens, so every
    engine decodes the same continuation through its own KV cache.
    """
    rows: dict[tuple[int, int], torch.Tensor] = {}

    def sample(
        logits: torch.Tensor, params: Any, positions: Any, *_: Any, **__: Any
    ) -> torch.Tensor:
        out = []
        for r, (p, pos) in enumerate(zip(params, positions)):
            i = int(p.seed) - _QUALITY_SEED
            rows[(i, int(pos))] = logits[r].detach().float().cpu()
            out.append(forced[i][int(pos) - len(prompts[i])])
        return torch.tensor(out, dtype=torch.int64, device=logits.device)

    engine.sampler.sample_device = sample  # type: ignore[method-assign]
    try:
        for i, p in enumerate(prompts):
            engine.add_request(
                f"quality-{i}",
                p,
                SamplingParams(max_tokens=len(forced[i]), ignore_eos=True, seed=_QUALITY_SEED + i),
            )
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.sampler.sample_device  # back to the class's method
    want = sum(len(f) for f in forced)
    if len(rows) != want:
        raise RuntimeError(
            f"quality: captured {len(rows)} logit rows, expected {want} "
            "(the engine no longer samples through engine.sampler.sample_device?)"
        )
    return rows


def compare_logits(
    ours: dict[tuple[int, int], torch.Tensor],
    ref: dict[tuple[int, int], torch.Tensor],
    prompt_len: int,
) -> dict[str, Any]:
    keys = sorted(ref)
    if sorted(ours) != keys:
        raise RuntimeError("quality: the two engines sampled different positions")

    def stats(sel: list[tuple[int, int]]) -> dict[str, float]:
        a = torch.stack([ours[k] for k in sel])
        b = torch.stack([ref[k] for k in sel])
        d = (a - b).abs()
        return {
            "rows": len(sel),
            "max_abs_diff": float(d.max()),
            "mean_abs_diff": float(d.mean()),
            "relative_error": float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)),
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "ref_logit_std": float(b.std()),
        }

    out: dict[str, Any] = stats(keys)
    out["prefill"] = stats([k for k in keys if k[1] == prompt_len])
    out["decode"] = stats([k for k in keys if k[1] > prompt_len])
    return out


def bench_quality(args: argparse.Namespace, opts: dict[str, Any]) -> dict[str, Any]:
    """Reference (default options) engine first, its logits to the CPU, freed; then the
    configured one."""
    device = torch.device(args.device)
    n, tokens, steps = args.quality_prompts, args.quality_tokens, args.quality_steps
    base = dict(
        model=args.preset,
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=n * (-(-(tokens + steps + 2) // 128)) + 4,
        max_tokens_per_step=max(8192, n * tokens),
        time_budget_s=None,
        max_running=n,
        max_model_len=tokens + steps + 8,
        **_no_graphs_no_overlap(),
    )
    quant = {k: v for k, v in opts.items() if k not in ("cuda_graphs", "overlap")}
    rows = {}
    # The reference runs unquantized weights even for an FP8 checkpoint (whose auto is fp8).
    reference: dict[str, Any] = {"weight_dtype": "bf16"} if "weight_dtype" in quant else {}
    for name, extra in (("reference", reference), ("configured", quant)):
        engine = Engine(make_config(**base, **extra))
        prompts, forced = quality_inputs(engine.model_config.vocab_size, n, tokens, steps)
        rows[name] = capture_logits(engine, prompts, forced)
        del engine
        free_memory(device)
    result = compare_logits(rows["configured"], rows["reference"], tokens)
    result.update(
        prompts=n,
        prompt_tokens=tokens,
        decode_steps=steps,
        reference_options=reference,
        configured_options=quant,
        note="same weights (preset seed); both engines fed the same tokens; "
        "no CUDA graphs / overlap in either",
    )
    return result


def _served_model(engine: Engine) -> torch.nn.Module:
    """The model behind the engine: its loaded V2/V3 model, or the V4 runner's."""
    from libs.engine.v4.serving import V4Runner

    if isinstance(engine.runner, V4Runner):
        return engine.runner.net
    return engine.model


# -- the transformers peer -------------------------------------------------------------------------
def bench_transformers(
    model: torch.nn.Module, batches: list[int], context: int, steps: int, device: torch.device
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    try:
        import transformers
    except ImportError:
        return [], {"skipped": "transformers is not installed"}
    from .hf_peer import build_hf_peer, hf_decode_throughput, shared_fraction

    hf = build_hf_peer(model)
    info = {
        "version": transformers.__version__,
        "class": type(hf).__name__,
        "attn_implementation": hf.config._attn_implementation,
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "weights_shared_fraction": shared_fraction(hf, model),
        "method": "t(generate 1+n tokens) - t(generate 1 token) over n greedy steps, EOS ignored",
    }
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    dtype = next(model.parameters()).dtype
    cast: Any = contextlib.nullcontext
    runs: list[dict[str, Any]] = []
    for b in batches:
        for attempt in range(2):
            try:
                with cast():
                    runs.append(hf_decode_throughput(hf, b, context, steps, device))
                break
            except oom:
                free_memory(device)
                runs.append({"batch": b, "context": context, "error": "out of memory"})
                break
            except RuntimeError as exc:  # the peer's own failure: recorded, the engine's stand
                free_memory(device)
                err = str(exc).splitlines()[0]
                if attempt == 0 and "dtype" in err and device.type == "cuda":
                    # Some transformers versions feed fp32 norm outputs to bf16 matmuls;
                    # autocast casts every matmul's inputs, as their later versions do.
                    info["autocast"] = f"{dtype} (without it: {err})"
                    cast = functools.partial(torch.autocast, "cuda", dtype=dtype)
                    continue
                runs.append({"batch": b, "context": context, "error": err})
                break
    del hf
    free_memory(device)
    return runs, info


def _ints(text: str | None, default: list[int]) -> list[int]:
    return [int(x) for x in text.split(",") if x] if text else list(default)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    prefill_sizes = _ints(args.prefill_tokens, DEFAULTS[kind]["prefill"])
    batches = _ints(args.decode_batches, DEFAULTS[kind]["batches"])
    context = args.context or DEFAULTS[kind]["context"]
    opts = engine_options(args)
    peer_on = not getattr(args, "no_transformers", False)
    peer_batches = _ints(getattr(args, "transformers_batches", None), TRANSFORMERS_BATCHES[kind])
    peer_steps = getattr(args, "transformers_steps", 8)
    quantized = (
        "kv_cache_dtype" in opts or "expert_dtype" in opts or opts.get("weight_dtype") == "fp8"
    )
    quality: dict[str, Any]
    if quantized and getattr(args, "quality", True):
        for name, default in (
            ("quality_prompts", 4),
            ("quality_tokens", 256),
            ("quality_steps", 32),
        ):
            if not hasattr(args, name):
                setattr(args, name, default)
        quality = bench_quality(args, opts)
        print(
            f"quality vs unquantized: max |dlogit| {quality['max_abs_diff']:.4f}  mean "
            f"{quality['mean_abs_diff']:.5f}  rel {quality['relative_error']:.5f}  "
            f"top-1 agree {quality['top1_agreement']:.3f} over {quality['rows']} positions"
        )
    else:
        quality = {
            "skipped": "no --kv-cache-dtype fp8 / --experts fp4 / --weights fp8"
            if not quantized
            else "--no-quality"
        }

    k = opts.get("speculative_tokens", 0)
    per_request = context + decode_room(k, args.decode_steps) + k + 8  # the drafts' slots too
    max_len = max(max(prefill_sizes), per_request) + 1
    blocks = max(
        -(-max(prefill_sizes) // 128) * 2 + 8,
        max(batches) * (-(-per_request // 128) + 1),
    )

    def build(**options: Any) -> Engine:
        return Engine(
            make_config(
                model=args.preset,
                device=args.device,
                dtype=args.dtype,
                num_kv_blocks=blocks,
                max_tokens_per_step=max(32768, max(prefill_sizes)),
                time_budget_s=None,
                max_running=max(batches),
                max_model_len=max_len,
                **options,
            )
        )

    engine = build(**opts)
    dtype = next(_served_model(engine).parameters()).dtype
    limits = measure_limits(device, dtype)
    vocab = engine.model_config.vocab_size

    def measure(e: Engine) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        pre = [bench_prefill(e, n, limits, vocab) for n in prefill_sizes]
        dec = [bench_decode(e, b, context, args.decode_steps, limits, vocab) for b in batches]
        for p in pre:
            print(
                f"prefill {p['tokens']:>6} tokens: {p['tokens_per_s']:>10.0f} tok/s  "
                f"MFU {p['mfu']:.3f}"
            )
        for d in dec:
            print(
                f"decode batch {d['batch']:>4} @ {d['context']}: {d['tokens_per_s']:>9.1f} tok/s "
                f"({d['per_user_tokens_per_s']:.1f}/user)  roofline {d['roofline_fraction']:.3f}"
            )
        return pre, dec

    prefill, decode = measure(engine)
    invariant_cost: dict[str, Any] = {"skipped": "no --batch-invariant"}
    if opts.get("batch_invariant"):
        # What the mode costs: the same workload on the default engine, in this run.
        del engine
        free_memory(device)
        print("the default engine (no --batch-invariant), same workload:")
        engine = build(**{k: v for k, v in opts.items() if k != "batch_invariant"})
        ref_prefill, ref_decode = measure(engine)
        invariant_cost = {
            "default_prefill_tokens_per_s": {
                str(p["tokens"]): p["tokens_per_s"] for p in ref_prefill
            },
            "default_decode_tokens_per_s": {str(d["batch"]): d["tokens_per_s"] for d in ref_decode},
            "prefill_ratio": {
                str(p["tokens"]): p["tokens_per_s"] / r["tokens_per_s"]
                for p, r in zip(prefill, ref_prefill, strict=True)
            },
            "decode_ratio": {
                str(d["batch"]): d["tokens_per_s"] / r["tokens_per_s"]
                for d, r in zip(decode, ref_decode, strict=True)
            },
        }
        for key, what in (("prefill_ratio", "prefill {} tokens"), ("decode_ratio", "decode {}")):
            for size, ratio in invariant_cost[key].items():
                print(f"batch-invariant / default, {what.format(size)}: {ratio:.2f}x")

    peer: list[dict[str, Any]] = []
    peer_info: dict[str, Any] = {"skipped": "--no-transformers"}
    if peer_on:
        weights_quantized = "expert_dtype" in opts or opts.get("weight_dtype") == "fp8"
        if weights_quantized:  # our weights are quantized: the peer runs the bf16 weights
            del engine
            free_memory(device)
            engine = Engine(
                make_config(
                    model=args.preset,
                    device=args.device,
                    dtype=args.dtype,
                    num_kv_blocks=1,
                    weight_dtype="bf16",
                    **_no_graphs_no_overlap(),
                )
            )
        engine.cache = None  # type: ignore[assignment]  # the engine is done: free its KV for the peer
        free_memory(device)
        peer, peer_info = bench_transformers(
            _served_model(engine), peer_batches, context, peer_steps, device
        )
        if weights_quantized and peer:
            peer_info["weights"] = "unquantized (bf16) engine weights of the same preset seed"
    del engine
    free_memory(device)
    ok = [r for r in peer if "tokens_per_s" in r]
    for r in peer:
        if "tokens_per_s" in r:
            print(
                f"transformers batch {r['batch']:>4} @ {r['context']}: "
                f"{r['tokens_per_s']:>9.1f} tok/s "
                f"({r['per_user_tokens_per_s']:.1f}/user)"
            )
        else:
            print(f"transformers batch {r['batch']:>4} @ {r['context']}: {r.get('error')}")
    ours = {d["batch"]: d["tokens_per_s"] for d in decode}
    result = {
        "bench": "engine",
        "preset": args.preset,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if kind == "cuda"
        else platform.processor() or platform.machine(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "options": {
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "experts": getattr(args, "experts", "bf16"),
            "weights": getattr(args, "weights", "auto"),
            "cuda_graphs": not getattr(args, "no_cuda_graphs", False),
            "overlap": not getattr(args, "no_overlap", False),
            "kernels": getattr(args, "kernels", "auto"),
            "speculative_tokens": getattr(args, "speculative_tokens", 0),
            "speculative_schedule": getattr(args, "speculative_schedule", "confidence"),
            "batch_invariant": getattr(args, "batch_invariant", False),
        },
        "engine_config_overrides": opts,
        "limits": limits,
        "prefill": prefill,
        "decode": decode,
        "prefill_tokens_per_s": {str(p["tokens"]): p["tokens_per_s"] for p in prefill},
        "prefill_mfu": {str(p["tokens"]): p["mfu"] for p in prefill},
        "decode_tokens_per_s": {str(d["batch"]): d["tokens_per_s"] for d in decode},
        "decode_per_user_tokens_per_s": {
            str(d["batch"]): d["per_user_tokens_per_s"] for d in decode
        },
        "decode_roofline_fraction": {str(d["batch"]): d["roofline_fraction"] for d in decode},
        "transformers": peer_info,
        "transformers_decode": peer,
        "transformers_decode_tokens_per_s": {str(r["batch"]): r["tokens_per_s"] for r in ok},
        "transformers_per_user_tokens_per_s": {
            str(r["batch"]): r["per_user_tokens_per_s"] for r in ok
        },
        "speedup_vs_transformers": {
            str(r["batch"]): ours[r["batch"]] / r["tokens_per_s"] for r in ok if r["batch"] in ours
        },
        "quality": quality,
        "batch_invariant_cost": invariant_cost,
    }
    for b, x in result["speedup_vs_transformers"].items():
        print(f"speedup vs transformers at batch {b}: {x:.1f}x")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if getattr(args, "plot", None):
        from .engine_plot import plot

        print(f"plot: {plot(result, Path(args.plot))}")
    return 0
