"""``deepserve generate``: one prompt through the engine in this process (``--ep N``: an
expert-parallel group of N rank processes). Also the engine flags other commands share."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids must name at least one token id")
    return ids


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="generate from one prompt in this process")
    p.add_argument(
        "--model",
        default="tiny",
        help="preset name (tiny, v2-lite, v3-slice, v4-tiny, v4-flash-slice), checkpoint dir, "
        "or Hugging Face repo id ORG/NAME[@REVISION] (fetched into the HF cache; "
        "HF_HUB_OFFLINE, HF_TOKEN)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the model's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights")
    speculative_flag(p, "the MTP layer drafts up to this many tokens a step, verified losslessly")
    batch_invariant_flag(p)
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallelism: N rank processes (CPU: gloo; --device cuda: one GPU each, "
        "NCCL), routed experts sharded over them; greedy tokens equal --ep 1's",
    )
    p.add_argument("--ep-redundant", type=int, default=0, help="spare expert slots per EP rank")
    p.add_argument(
        "--ep-master",
        default="",
        help="host:port of the EP group's rendezvous (rank 0's host), the same on every host; "
        "empty: every rank on this host",
    )
    p.add_argument(
        "--ep-ranks-per-host",
        type=int,
        default=0,
        help="ranks of the group on each host (divides --ep; 0: all here); run the same "
        "command on each host with its --ep-node-rank: the host of rank 0 prints the output",
    )
    p.add_argument("--ep-node-rank", type=int, default=0, help="this host's index in the group")


def speculative_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=int(os.environ.get("DEEPSERVE_SPECULATIVE_TOKENS", "0")),
        help=f"{what} (0: off; env DEEPSERVE_SPECULATIVE_TOKENS)",
    )


def batch_invariant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant engine: logits independent of batch, chunking and prefill vs "
        "decode (slower; bf16 weights)",
    )


def run(args: argparse.Namespace) -> int:
    from libs.common.sampling import SamplingParams
    from libs.engine.engine import InvalidRequest
    from libs.engine.hub import resolve_model
    from libs.engine.llm import LLM

    try:
        args.model = resolve_model(args.model)  # a Hub repo id: its snapshot directory
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
        )
        prompt = args.prompt if args.prompt is not None else args.prompt_ids
        from libs.engine.features import Setup, check
        from libs.engine.v4.load import is_v4

        ep = args.ep > 1 or bool(args.ep_redundant)
        check(  # the engine's table of refused combinations, before any rank starts
            Setup(
                family="deepseek-v4" if is_v4(args.model) else "deepseek-v3",
                batch_invariant=args.batch_invariant,
                speculative=args.speculative_tokens > 0,
                expert_parallel=ep,
            )
        )
        if ep:
            out = _generate_ep(args, prompt, params)
        else:
            llm = LLM(
                args.model,
                device=args.device,
                dtype=args.dtype,
                seed=args.weights_seed,
                speculative_tokens=args.speculative_tokens,
                batch_invariant=args.batch_invariant,
            )
            out = llm.generate([prompt], params)[0]
    except (ValueError, InvalidRequest) as exc:
        print(f"deepserve generate: {exc}", file=sys.stderr)
        return 2
    if out is None:  # an EP host without rank 0: the host of rank 0 prints the output
        return 0
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": list(out.token_ids),
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                },
                ensure_ascii=False,
            )
        )
    else:
        print(out.text)
    return 0


def _generate_ep(args: argparse.Namespace, prompt: str | list[int], params: Any) -> Any:
    """One prompt on an EP group: rank 0 serves it, the others run empty steps beside it.
    None on a host without rank 0."""
    from libs.engine.ep.placement import Placement
    from libs.engine.registry import routed_experts
    from libs.serving.ep.generate import generate_ranks
    from libs.serving.ep.launch import RankFailed

    if args.ep < 1 or args.ep_redundant < 0:
        raise ValueError("--ep must be >= 1 and --ep-redundant >= 0")
    ranks = _host_ranks(args)
    placement = Placement.contiguous(routed_experts(args.model), args.ep, args.ep_redundant)
    try:
        results = generate_ranks(
            args.model,
            [prompt],
            params,
            ep=args.ep,
            device=args.device,
            placement=placement,
            master=args.ep_master,
            ranks=ranks,
            dtype=args.dtype,
            seed=args.weights_seed,
            # CPU ranks split the 1 GiB a single CPU engine takes for its KV cache.
            kv_cache_bytes=(1 << 30) // len(ranks) if args.device == "cpu" else None,
        )
    except RankFailed as exc:
        raise ValueError(f"expert-parallel group failed: {exc}") from None
    # Rank 0 serves the one prompt; another host's ranks only ran their experts beside it.
    return next((out for r in results for _, out in r.outputs), None)


def _host_ranks(args: argparse.Namespace) -> list[int]:
    """The global ranks this host runs (``--ep-ranks-per-host``, ``--ep-node-rank``), the host
    flags checked as the services check them."""
    from libs.serving.ep.service import EPFlags

    ep = EPFlags(
        size=args.ep,
        master=args.ep_master,
        ranks_per_host=args.ep_ranks_per_host,
        node_rank=args.ep_node_rank,
    )
    return list(range(ep.first_rank, ep.first_rank + ep.local_ranks))
