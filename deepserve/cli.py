"""The ``deepserve`` command line.

deepserve generate --model PRESET_OR_DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-tokens N
                   [--temperature T --top-p P --top-k K --seed S] [--device D] [--json]
                   [--ep N [--ep-redundant R]]
deepserve bench engine --preset tiny --device cpu --json OUT [--plot PNG] [--kv-cache-dtype fp8]
                       [--weights fp8]
                       [--experts fp4] [--transformers-batches 1,16,64 | --no-transformers]
deepserve bench recipe [--prompt-tokens 220000] --json OUT
deepserve bench kvstore --json OUT
deepserve bench serve [--long-tokens 32768] --json OUT
deepserve bench serve --url http://HOST:PORT/v1 --trace agent|chat --concurrency N --json OUT
deepserve bench route --trace agent|chat|mixed [--sweep KNOB=V1,V2,...] --json OUT
deepserve bench eplb [--ranks 64 --experts 256 --topk 8 --redundant 1] [--mode decode|prefill]
                     [--layers 8 --steps N --skew 0.6 --seed 0] --json OUT
deepserve bench ep --model PRESET --device cpu|cuda --batch 64,256 [--steps N] [--redundant R]
                   --json OUT
deepserve bench load [--model DIR_OR_REPO | --layout v2-lite|v3 --layers N] [--device D]
                     [--workers 4] --json OUT
deepserve kvstore fsck [--repair] [--grace S] --redis-url URL (--data-dir DIR | --target T ...)
deepserve usage --nats-url URL [--tenant T] [--since ISO] [--json]
                [--price off-peak|peak|schedule|IN,CACHED,OUT]
deepserve up [--port 8000] [--prefill N] [--decode N] [--model M] [--model-name NAME]
             [--device cpu|cuda [--gpus 0,1] [--gpu-memory-fraction F]] [--run-dir .run]
             [--mode auto|aggregated|disaggregated] [--no-restart] [--ep N [--ep-timeout S]]
             [--max-model-len N] [--max-num-batched-tokens N] [--max-num-seqs N] [--host H]
             [--api-key KEY]   (vLLM's names; --served-model-name, --gpu-memory-utilization)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from deepserve.bench import http_load


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


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _speculative_flag(p, "the MTP layer drafts up to this many tokens a step, verified losslessly")
    _batch_invariant_flag(p)
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallelism: N rank processes (CPU: gloo; --device cuda: one GPU each, "
        "NCCL), routed experts sharded over them; greedy tokens equal --ep 1's",
    )
    p.add_argument("--ep-redundant", type=int, default=0, help="spare expert slots per EP rank")


def _speculative_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=int(os.environ.get("DEEPSERVE_SPECULATIVE_TOKENS", "0")),
        help=f"{what} (0: off; env DEEPSERVE_SPECULATIVE_TOKENS)",
    )


def _batch_invariant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant engine: logits independent of batch, chunking and prefill vs "
        "decode (slower; bf16 weights)",
    )


def _generate(args: argparse.Namespace) -> int:
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
        from libs.engine.v4.load import is_v4

        if is_v4(args.model) and (args.ep > 1 or args.ep_redundant):
            raise ValueError("DeepSeek-V4 models do not run with --ep yet")
        if args.batch_invariant and (args.ep > 1 or args.ep_redundant):
            raise ValueError("--batch-invariant does not run with --ep yet")
        if args.ep > 1 or args.ep_redundant:
            out = _generate_ep(args, prompt, params)
        else:
            if args.speculative_tokens and (args.ep > 1 or args.ep_redundant):
                raise ValueError("--speculative-tokens does not run with --ep yet")
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
    """One prompt on an EP group: rank 0 serves it, the others run empty steps beside it."""
    from libs.engine.ep.placement import Placement
    from libs.engine.loader import model_config
    from libs.serving.ep.generate import generate
    from libs.serving.ep.launch import RankFailed

    if args.ep < 1 or args.ep_redundant < 0:
        raise ValueError("--ep must be >= 1 and --ep-redundant >= 0")
    experts = model_config(args.model).n_routed_experts
    placement = Placement.contiguous(experts, args.ep, args.ep_redundant)
    try:
        return generate(
            args.model,
            [prompt],
            params,
            ep=args.ep,
            device=args.device,
            placement=placement,
            dtype=args.dtype,
            seed=args.weights_seed,
            # CPU ranks split the 1 GiB a single CPU engine takes for its KV cache.
            kv_cache_bytes=(1 << 30) // args.ep if args.device == "cpu" else None,
        )[0]
    except RankFailed as exc:
        raise ValueError(f"expert-parallel group failed: {exc}") from None


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = p.add_subparsers(dest="what", required=True)
    e = bsub.add_parser("engine", help="prefill and decode throughput of the engine")
    e.add_argument("--preset", default="tiny")
    e.add_argument("--device", default="cpu")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--prefill-tokens", default=None, help="comma-separated tokens per prefill step")
    e.add_argument("--decode-batches", default=None, help="comma-separated decode batch sizes")
    e.add_argument("--context", type=int, default=None, help="decode context length per request")
    e.add_argument("--decode-steps", type=int, default=8)
    e.add_argument(
        "--transformers-batches",
        default=None,
        help="comma-separated batch sizes of the transformers peer "
        "(default: cuda 1,16,64; cpu 1,4)",
    )
    e.add_argument(
        "--transformers-steps", type=int, default=8, help="decode steps timed for the peer"
    )
    e.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    e.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="fp8: e4m3 KV cache"
    )
    e.add_argument(
        "--experts", choices=("bf16", "fp4"), default="bf16", help="fp4: FP4 routed-expert weights"
    )
    e.add_argument(
        "--weights",
        choices=("auto", "bf16", "fp8"),
        default="auto",
        help="fp8: block-scaled e4m3 linear and routed-expert weights (auto: fp8 for FP8 "
        "checkpoints, bf16 otherwise)",
    )
    e.add_argument("--no-cuda-graphs", action="store_true", help="EngineConfig(cuda_graphs=False)")
    e.add_argument("--no-overlap", action="store_true", help="EngineConfig(overlap=False)")
    e.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto")
    _speculative_flag(e, "speculative decoding: the MTP layer drafts up to this many tokens a step")
    _batch_invariant_flag(e)
    e.add_argument(
        "--speculative-schedule",
        choices=("confidence", "all"),
        default="confidence",
        help="which drafts a step verifies (with --speculative-tokens)",
    )
    e.add_argument(
        "--quality",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with fp8 KV / fp4 experts: logit error against the unquantized engine",
    )
    e.add_argument("--quality-prompts", type=int, default=4)
    e.add_argument("--quality-tokens", type=int, default=256, help="tokens per quality prompt")
    e.add_argument(
        "--quality-steps", type=int, default=32, help="teacher-forced decode steps per prompt"
    )
    e.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")
    e.add_argument(
        "--plot",
        default=None,
        help="also draw the result as this PNG (deepserve.bench.engine_plot)",
    )
    sv = bsub.add_parser(
        "serve",
        help="the stack as processes: TTFT overhead of the hops, "
        "requests/s, lost requests (fake engine); cache hit vs miss TTFT (tiny)",
    )
    sv.add_argument("--prompt-tokens", type=int, default=512, help="prompt size of the fake phase")
    sv.add_argument("--ttft-requests", type=int, default=100, help="sequential requests timed")
    sv.add_argument("--load-requests", type=int, default=400, help="requests of the load phase")
    sv.add_argument(
        "--concurrency", type=int, default=16, help="clients of the load phase (--url: sessions)"
    )
    sv.add_argument("--max-tokens", type=int, default=16, help="completion tokens per load request")
    sv.add_argument(
        "--long-tokens",
        type=int,
        default=32768,
        help="tiny-model prompt for cache hit vs miss (0: skip that phase)",
    )
    sv.add_argument("--run-dir", default="", help="logs of the stacks (default: a temp dir)")
    sv.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")
    http_load.add_arguments(sv)
    r = bsub.add_parser("recipe", help="parallel prompt encoding against single-threaded encoding")
    r.add_argument(
        "--prompt-tokens", type=int, default=220_000, help="prompt size (>= 200K for the figure)"
    )
    r.add_argument("--repeats", type=int, default=5, help="best of this many runs per method")
    r.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")
    k = bsub.add_parser(
        "kvstore",
        help="kvstore put/get/degraded get/lookup and S3 throughput "
        "against plain sequential files on the same disk",
    )
    k.add_argument("--blocks", type=int, default=48, help="blocks per phase")
    k.add_argument(
        "--block-bytes",
        type=int,
        default=9_437_184,
        help="block size (default: one DeepSeek-V3 128-token block, 9 MiB)",
    )
    k.add_argument("--lookups", type=int, default=300, help="Lookup calls of --chain hashes")
    k.add_argument("--chain", type=int, default=2048, help="hashes per Lookup")
    k.add_argument("--s3-blocks", type=int, default=12, help="blocks per S3 phase (0: skip S3)")
    k.add_argument("--dir", default="", help="scratch directory (default: a temp dir)")
    k.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")
    h = bsub.add_parser(
        "handoff",
        help="KV hand-off between two processes: pool references against host bytes",
    )
    from deepserve.bench import handoff

    handoff.add_arguments(h)
    rt = bsub.add_parser(
        "route",
        help="replay a synthetic multi-tenant trace through the balancer "
        "policy, an oracle and round robin over simulated prefill instances",
    )
    from deepserve.bench import route as bench_route_mod

    bench_route_mod.add_arguments(rt)
    ep = bsub.add_parser(
        "eplb",
        help="EPLB placements on a skewed, drifting routing trace against the contiguous one",
    )
    from deepserve.bench import eplb

    eplb.add_arguments(ep)
    epb = bsub.add_parser(
        "ep",
        help="decode step time of the expert-parallel path (a group of one) against the "
        "single-device path, with and without redundant replicas; greedy tokens compared",
    )
    from deepserve.bench import ep as bench_ep_mod

    bench_ep_mod.add_arguments(epb)
    gr = bsub.add_parser(
        "grammar",
        help="decode step time with structured outputs (regex, JSON schema) against none",
    )
    from deepserve.bench import grammar as bench_grammar_mod

    bench_grammar_mod.add_arguments(gr)
    spb = bsub.add_parser(
        "spec",
        help="speculative decoding (MTP drafts; verify-all and by confidence) against one token "
        "a step, per batch size and acceptance level",
    )
    from deepserve.bench import spec as bench_spec_mod

    bench_spec_mod.add_arguments(spb)
    ld = bsub.add_parser(
        "load",
        help="checkpoint load rate (the engine's loader, 1 and N shards at once) against the "
        "disk's raw read of the same files, cold",
    )
    from deepserve.bench import load as bench_load_mod

    bench_load_mod.add_arguments(ld)


def _bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        from deepserve.bench.engine import main as bench_engine

        return bench_engine(args)
    if args.what == "kvstore":
        from deepserve.bench.kvstore import main as bench_kvstore

        return bench_kvstore(args)
    if args.what == "handoff":
        from deepserve.bench.handoff import main as bench_handoff

        return bench_handoff(args)
    if args.what == "route":
        from deepserve.bench.route import main as bench_route

        return bench_route(args)
    if args.what == "eplb":
        from deepserve.bench.eplb import main as bench_eplb

        return bench_eplb(args)
    if args.what == "ep":
        from deepserve.bench.ep import main as bench_ep

        return bench_ep(args)
    if args.what == "grammar":
        from deepserve.bench.grammar import main as bench_grammar

        return bench_grammar(args)
    if args.what == "spec":
        from deepserve.bench.spec import main as bench_spec

        return bench_spec(args)
    if args.what == "load":
        from deepserve.bench.load import main as bench_load

        return bench_load(args)
    if args.what == "serve" and args.url:
        return http_load.run(args)
    if args.what == "serve":
        from deepserve.bench.serve import main as bench_serve

        return bench_serve(args)
    if args.what == "recipe":
        from deepserve.bench.recipe import main as bench_recipe

        return bench_recipe(args)
    raise AssertionError(args.what)


def _add_kvstore(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kvstore", help="kvstore maintenance")
    try:
        from services.kvstore.config import build_parser
        from services.kvstore.main import open_store  # noqa: F401 - the service's packages
    except (
        ImportError
    ) as exc:  # e.g. a GPU box with only the engine's packages: other commands work
        p.set_defaults(
            what=None,
            missing=f"kvstore tools need the service's packages ({exc}); run `make setup`",
        )
        return
    ksub = p.add_subparsers(dest="what", required=True)
    f = ksub.add_parser(
        "fsck", help="find damaged and orphan shards and lost blocks; --repair fixes"
    )
    build_parser(f)  # the service's own flags: same targets, same Redis
    f.add_argument(
        "--repair",
        action="store_true",
        help="rebuild damaged shards, remove orphans and the metadata of lost blocks",
    )
    f.add_argument(
        "--grace",
        type=float,
        default=600.0,
        help="only files older than this many seconds can be orphans (puts in flight)",
    )
    f.add_argument("--json", action="store_true", help="print the report as JSON")


def _kvstore(args: argparse.Namespace) -> int:
    if getattr(args, "missing", None):
        print(args.missing, file=sys.stderr)
        return 2
    import asyncio

    from services.kvstore.config import config_from_args
    from services.kvstore.fsck import fsck
    from services.kvstore.main import open_store
    from services.kvstore.store import StoreUnavailable

    async def run() -> int:
        redis, store = await open_store(config_from_args(args))
        try:
            report = await fsck(store, repair=args.repair, grace_s=args.grace)
        except StoreUnavailable as exc:
            print(f"deepserve kvstore fsck: {exc}", file=sys.stderr)
            return 2
        finally:
            await redis.aclose()
            store.close()
        if args.json:
            print(report.to_json())
        else:
            print(
                f"{report.blocks} blocks, {report.healthy} healthy; "
                f"{len(report.damaged_shards)} damaged shards ({report.repaired_shards} rebuilt); "
                f"{len(report.lost_blocks)} lost blocks; {len(report.orphans)} orphan files "
                f"({report.removed_orphans} removed); targets down: "
                f"{', '.join(report.targets_down) or 'none'}; "
                f"{'clean' if report.clean else 'NOT clean'}"
            )
        return 0 if report.clean else 1

    return asyncio.run(run())


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _speculative_flag(
        p,
        "speculative decoding on prefill and decode: the MTP layer drafts up to this many "
        "tokens a step (the model needs MTP layers, e.g. tiny, v3-slice)",
    )
    _batch_invariant_flag(p)
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


def _up(args: argparse.Namespace) -> int:
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


def _add_usage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("usage", help="total and price the recipe's usage records per tenant")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS with JetStream")
    p.add_argument("--stream", default="DEEPSERVE_USAGE", help="the recipe's --usage-stream")
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--since", default=None, help="only requests recorded from this ISO time")
    p.add_argument(
        "--price",
        default="off-peak",
        help="off-peak, peak (DeepSeek's V4.1-Flash list), schedule (each request by its "
        "start hour), or IN,CACHED,OUT in $ per million tokens",
    )
    p.add_argument("--json", action="store_true", help="print the totals as JSON")


def version() -> str:
    """The installed distribution's version (pyproject.toml), or "unknown" from a bare tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("deepserve")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepserve")
    parser.add_argument("--version", action="version", version=f"deepserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_up(sub)
    _add_kvstore(sub)
    _add_usage(sub)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "up":
        return _up(args)
    if args.command == "kvstore":
        return _kvstore(args)
    if args.command == "usage":
        from deepserve.usage import run

        return run(args.nats_url, args.tenant, args.since, args.price, args.json, args.stream)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
