"""``deepserve up``'s flags (vLLM's names where vLLM has one) and the call into
:func:`deepserve.up.run_up` (read from :mod:`deepserve.up` when the command runs)."""

from __future__ import annotations

import argparse
import sys

from deepserve.cli_generate import batch_invariant_flag, speculative_flag


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run the whole stack (NATS, Redis, every service) until Ctrl-C")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI-compatible API")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument(
        "--model",
        default="tiny",
        help="preset (tiny, v2-lite, v3-slice), checkpoint dir, Hugging Face repo id "
        "ORG/NAME[@REVISION] (fetched into the HF cache before anything starts), or fake; "
        "prefill and decode",
    )
    p.add_argument(
        "--model-name",
        "--served-model-name",
        default=None,
        help="served model name (default: deepseek-<preset>, or the checkpoint dir's name)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where prefill and decode run; cuda: spread over --gpus",
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="--device cuda: GPU indices, e.g. 0,1 (default: every visible GPU); engines are "
        "dealt round robin in the order prefill-0, decode-0, prefill-1, ... (with --ep N: "
        "N GPUs of their own each)",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="--device cuda: share of its GPU each engine may use (default: 0.90 / engines "
        "on that GPU)",
    )
    p.add_argument(
        "--mode",
        choices=("auto", "aggregated", "disaggregated"),
        default="auto",
        help="aggregated: one engine per GPU (CPU: max(--prefill, --decode) engines) does "
        "prefill and decode (one copy of the weights, one KV pool, no KV hand-over); "
        "disaggregated: separate prefill and decode engines (sharing a GPU: under CUDA MPS "
        "when available); auto: aggregated where the roles would share a GPU, else "
        "disaggregated",
    )
    p.add_argument("--run-dir", default=".run", help="logs, NATS/Redis/kvstore data")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="a request's context limit in tokens, for every engine and the API's checks "
        "(0: the model's)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="tokens one engine step may carry (0: each engine's default: prefill 32768, "
        "aggregated 8192)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=0, help="requests one engine step may carry (0: 256)"
    )
    p.add_argument(
        "--host",
        default="",
        help="address the API binds (default 127.0.0.1; the recipe's ops port follows it)",
    )
    p.add_argument(
        "--api-key",
        default="",
        help="require this key on the API (Authorization: Bearer / x-api-key); tenant "
        "'default' (several keys and tenants: DEEPSERVE_API_KEYS=KEY=TENANT,...)",
    )
    speculative_flag(
        p,
        "speculative decoding on prefill and decode: the MTP layer drafts up to this many "
        "tokens a step (the model needs MTP layers, e.g. tiny, v3-slice)",
    )
    batch_invariant_flag(p)
    p.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness"
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="stop the whole stack when a service exits, instead of restarting it "
        "(backoff 1 s doubling to 30 s; 5 failed starts in a row stop the stack)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks per prefill/decode instance (CPU: gloo; --device cuda: "
        "NCCL, a GPU of its own per rank, N GPUs per instance from --gpus): each rank its "
        "own process and routing target <instance>-r<k>; a dead rank: the group restarts "
        "with the ranks left",
    )
    p.add_argument(
        "--ep-timeout",
        type=float,
        default=None,
        help="--ep: seconds a collective may wait before the group counts as failed "
        "(default: the services' 10)",
    )


def run(args: argparse.Namespace) -> int:
    from deepserve.up import default_model_name, run_up, vllm_args
    from libs.engine.hub import ModelUnavailable, resolve_model

    try:
        # Resolved once, before anything starts: every service gets the same snapshot.
        model = resolve_model(args.model)
    except ModelUnavailable as exc:
        print(f"deepserve up: {exc}", file=sys.stderr)
        return 2
    return run_up(
        args.port,
        args.prefill,
        args.decode,
        model,
        args.model_name or default_model_name(args.model),
        args.run_dir,
        ready_timeout=args.ready_timeout,
        device=args.device,
        gpus=args.gpus,
        gpu_memory_fraction=args.gpu_memory_fraction,
        restart=not args.no_restart,
        ep=args.ep,
        ep_timeout=args.ep_timeout,
        speculative_tokens=args.speculative_tokens,
        batch_invariant=args.batch_invariant,
        mode=args.mode,
        more_args=vllm_args(
            args.max_model_len, args.max_num_batched_tokens, args.max_num_seqs, args.host
        ),
        api_key=args.api_key,
    )
