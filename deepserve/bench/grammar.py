"""``deepserve bench grammar``: what structured outputs cost a decode step.

One engine, three runs of ``--batch`` requests decoding together (same prompts, seeded
sampling): unconstrained, every request under a regex (300 lowercase letters or spaces), and
every request under a JSON schema (an object whose string field holds at least 300
characters). Both constraints keep a request inside a string for every timed step, the state a
constrained output spends most tokens in, so every run decodes the full batch. Per run:
wall-clock seconds per decode step over the timed steps, run as the engine runs (no
synchronize between steps, so host work overlaps the device where the engine lets it: a
constrained batch fills its masks while the next forward runs; the committed
``grammar-cuda-h200.json``, measured at 25be9ab, used a synchronize after every step), the
engine's own step seconds, and the host's mask-filling seconds per step. The tokenizer's
preparation for the grammar library (once per engine) and each grammar's compile time (once per
distinct constraint, then cached) are reported apart. Ratios against the unconstrained run, in
one process.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import torch

from libs.common.sampling import Constraint, SamplingParams
from libs.engine.engine import Engine, EngineConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "minLength": 300},
        "confidence": {"enum": ["low", "medium", "high"]},
    },
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
CONSTRAINTS: dict[str, Constraint | None] = {
    "none": None,
    "regex": Constraint("regex", "[a-z ]{300}"),
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")


def _run(engine: Engine, c: Constraint | None, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    vocab = engine.model_config.vocab_size
    for i in range(args.batch):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
        params = SamplingParams(
            max_tokens=4 * args.steps + 16, temperature=1.0, seed=i, constraint=c, ignore_eos=True
        )
        engine.add_request(f"r{i}", prompt, params)
    while engine.scheduler.waiting or any(  # prefill everything first: time decode steps only
        r.num_computed < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    fill: list[float] = []
    grammar = engine.grammar
    real_masks = grammar.masks

    def timed_masks(ids: Any) -> Any:
        t0 = time.perf_counter()
        out = real_masks(ids)
        fill.append(time.perf_counter() - t0)
        return out

    grammar.masks = timed_masks  # type: ignore[method-assign,assignment]
    device, batch = [], []
    cuda = engine.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):  # as the engine runs: no synchronize between steps (overlap)
        if not engine.has_unfinished():
            break
        engine.step()
        device.append(engine.last_step_seconds)
        batch.append(len(engine.scheduler.running))
    sync()
    wall = time.perf_counter() - t0
    del grammar.masks  # back to the method
    for i in range(args.batch):
        engine.abort(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    n = len(device)
    return {
        "steps": n,
        "wall_s_per_step": wall / n,
        "engine_s_per_step": sum(device) / n,
        "mask_fill_s_per_step": sum(fill[-n:]) / n if fill else 0.0,
        "mean_batch": sum(batch) / n,
    }


def main(args: argparse.Namespace) -> int:
    engine = Engine(
        EngineConfig(
            model=args.preset,
            device=args.device,
            max_running=args.batch,
            max_model_len=args.prompt_tokens + args.steps + 8,
        )
    )
    t0 = time.perf_counter()
    engine.grammar  # noqa: B018 - the tokenizer's preparation, once per engine
    backend_s = time.perf_counter() - t0
    compile_s = {}
    for name, c in CONSTRAINTS.items():
        if c is not None:
            t0 = time.perf_counter()
            engine.grammar.compile(c)
            compile_s[name] = time.perf_counter() - t0
    _run(engine, None, argparse.Namespace(**{**vars(args), "steps": 4}))  # warm up
    runs = {name: _run(engine, c, args) for name, c in CONSTRAINTS.items()}
    base = runs["none"]["wall_s_per_step"]
    for name, r in runs.items():
        r["wall_vs_none"] = r["wall_s_per_step"] / base
        print(
            f"{name:12s} {1e3 * r['wall_s_per_step']:8.2f} ms/step wall "
            f"({r['wall_vs_none']:.2f}x)  engine {1e3 * r['engine_s_per_step']:7.2f} ms  "
            f"masks {1e3 * r['mask_fill_s_per_step']:6.2f} ms  batch {r['mean_batch']:.0f}"
            + (f"  compile {1e3 * compile_s[name]:.1f} ms" if name in compile_s else "")
        )
    print(f"grammar backend (tokenizer prepared once per engine): {backend_s:.2f} s")
    out = {
        "bench": "grammar",
        "preset": args.preset,
        "device": args.device,
        "device_name": torch.cuda.get_device_name()
        if engine.device.type == "cuda"
        else platform.processor() or platform.machine(),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "constraints": {
            k: None if c is None else {"kind": c.kind, "spec": c.spec}
            for k, c in CONSTRAINTS.items()
        },
        "backend_s": backend_s,
        "compile_s": compile_s,
        "runs": runs,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0
