"""``deepserve bench ...``: the benchmarks, each in :mod:`deepserve.bench` (its flags and its
``main``); this module only names them on the command line."""

from __future__ import annotations

import argparse

from deepserve.bench import http_load
from deepserve.cli_generate import batch_invariant_flag, speculative_flag


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    speculative_flag(e, "speculative decoding: the MTP layer drafts up to this many tokens a step")
    batch_invariant_flag(e)
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


def run(args: argparse.Namespace) -> int:
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
