"""``deepserve bench spec``: speculative decoding with the MTP head against decoding one token a
step, at chosen acceptance levels, per batch size.

The weights are the preset's random ones turned into the MTP test model
(:func:`libs.engine.speculative.make_mtp_test_model`): the main model's layer outputs scaled to
0, so its next token is a function of the current one, and an MTP head that computes that same
function, then perturbed (a fraction of the vocabulary remapped) to each ``--acceptance`` level.
Every kernel of the main model still runs at full size, so step times are the real ones. A
preset without MTP layers (v2-lite) gets one, as V3 has. ``--head confident`` (the default)
plants the main model's successor function in its vocabulary projection so that the MTP head's
confidence separates right drafts (~0.9) from wrong ones (well under a half), as a trained
head's does; ``--head flat`` keeps the random projection, whose confidences are all alike
(the confidence schedule then has nothing to go on).

Per batch size and mode -- ``off`` (one token a step: CUDA graphs and overlap where the engine
uses them), ``all`` (every draft verified) and ``confidence`` (drafts chosen by calibrated
confidence against the step-time model) -- ``--batch`` requests of ``--prompt-tokens`` decode
``--max-tokens`` greedy tokens together; after their prefill step the decode phase is timed
(wall clock, synchronized at the end): output tokens per second over the batch and per request,
and the drafting counters (verified, accepted, tokens per verification). Ratios against ``off``
in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import time
from typing import Any

import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.loader import LoadedModel, model_config
from libs.engine.model.model import DeepseekForCausalLM
from libs.engine.presets import init_random_weights
from libs.engine.speculative import SpecStats, make_mtp_test_model

MODES = ("off", "all", "confidence")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    p.add_argument(
        "--acceptance",
        default="0.8,0.5",
        help="comma-separated target acceptance per draft (1 - the remapped vocabulary share)",
    )
    p.add_argument("--speculative-tokens", type=int, default=3, help="drafts per step (K)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per request")
    p.add_argument(
        "--head",
        choices=("confident", "flat"),
        default="confident",
        help="the MTP test model's head: confident (its confidence separates right drafts from "
        "wrong ones, as a trained head's does) or flat (random weights: one confidence for all)",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")


def _loaded(preset: str, device: str) -> LoadedModel:
    cfg = model_config(preset)
    if not cfg.num_nextn_predict_layers:
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = DeepseekForCausalLM(cfg, dtype, device, with_mtp=True)
    init_random_weights(model, 0)
    return LoadedModel(model, f"{preset}-mtp-test", preset)


def _run(loaded: LoadedModel, args: argparse.Namespace, batch: int, mode: str) -> dict[str, Any]:
    k = 0 if mode == "off" else args.speculative_tokens
    per_req = -(-(args.prompt_tokens + args.max_tokens + k + 2) // 128) + 1
    engine = Engine(
        EngineConfig(
            model=args.preset,
            device=args.device,
            num_kv_blocks=batch * per_req + 16,
            max_running=max(batch, 1),
            time_budget_s=None,
            with_mtp=True,
            speculative_tokens=k,
            speculative_schedule="all" if mode == "all" else "confidence",
        ),
        loaded=loaded,
    )
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i in range(batch):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, sp)
    t_start = None
    steps = 0
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            if ev.token_id is None:
                continue
            counts[ev.request_id] = counts.get(ev.request_id, 0) + 1
            first.setdefault(ev.request_id, now)
            last[ev.request_id] = now
        if t_start is None and len(first) == batch:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t_start = time.perf_counter()  # every prompt is in: the decode phase from here
            stats0 = dataclasses.replace(engine.speculative.stats) if engine.speculative else None
            continue
        if t_start is not None:
            steps += 1
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - (t_start or time.perf_counter())
    decoded = sum(counts.values()) - batch  # the first tokens came with the prefill
    per_user = [
        (counts[r] - 1) / (last[r] - first[r])
        for r in counts
        if counts[r] > 1 and last[r] > first[r]
    ]
    out: dict[str, Any] = {
        "batch": batch,
        "mode": mode,
        "decode_steps": steps,
        "decode_seconds": elapsed,
        "output_tokens_per_s": decoded / elapsed if elapsed > 0 else 0.0,
        "per_user_tokens_per_s": sum(per_user) / len(per_user) if per_user else 0.0,
    }
    cost = engine.scheduler.cost
    if cost.rows_sizes is not None and cost.rows_seconds is not None:
        # The decode graphs' measured times that priced verification rows (CUDA only).
        out["decode_ms_by_rows"] = {
            int(r): round(float(t) * 1e3, 4)
            for r, t in zip(cost.rows_sizes, cost.rows_seconds, strict=True)
        }
        out["decode_rows_scale"] = cost.rows_scale
    # Replays per graph set (decode, the MTP passes): zero where a step ran eagerly.
    sets = getattr(engine.runner, "graph_sets", {})
    out["graph_replays"] = {n: sum(g.steps for g in gs.graphs.values()) for n, gs in sets.items()}
    if engine.speculative is not None:
        s, s0 = engine.speculative.stats, stats0 or SpecStats()
        verified, accepted = s.verified - s0.verified, s.accepted - s0.accepted
        verifications = s.verifications - s0.verifications
        out |= {
            "drafted": s.drafted - s0.drafted,
            "verified": verified,
            "accepted": accepted,
            "acceptance": accepted / verified if verified else 0.0,
            "verified_per_verification": verified / verifications if verifications else 0.0,
            "tokens_per_verification": (s.emitted - s0.emitted) / verifications
            if verifications
            else 0.0,
        }
    del engine
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",") if b]
    levels = [float(a) for a in args.acceptance.split(",") if a]
    loaded = _loaded(args.preset, args.device)
    rows: list[dict[str, Any]] = []
    for level in levels:
        make_mtp_test_model(
            loaded.model, 0.0, 1.0 - level, seed=1, confident=args.head == "confident"
        )
        for b in batches:
            base = None
            for mode in MODES:
                if mode == "off" and level != levels[0]:
                    # the main model does not change with the level: one baseline suffices
                    base = next(r for r in rows if r["batch"] == b and r["mode"] == "off")
                    continue
                r = _run(loaded, args, b, mode) | {"target_acceptance": level}
                if mode == "off":
                    base = r
                else:
                    assert base is not None
                    r["speedup"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
                    r["per_user_speedup"] = (
                        r["per_user_tokens_per_s"] / base["per_user_tokens_per_s"]
                        if base["per_user_tokens_per_s"]
                        else 0.0
                    )
                rows.append(r)
                print(
                    f"acceptance {level:.2f} batch {b:4d} {mode:10s} "
                    f"{r['output_tokens_per_s']:9.1f} tok/s  per user "
                    f"{r['per_user_tokens_per_s']:7.1f}"
                    + (
                        f"  x{r['speedup']:.2f} (user x{r['per_user_speedup']:.2f})  accepted "
                        f"{r['acceptance']:.2f}, verified/req-step "
                        f"{r['verified_per_verification']:.2f}, emitted/req-step "
                        f"{r['tokens_per_verification']:.2f}"
                        if mode != "off"
                        else ""
                    ),
                    flush=True,
                )
    result = {
        "bench": "spec",
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "host": platform.node(),
        "speculative_tokens": args.speculative_tokens,
        "head": args.head,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
