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
import sys
from collections.abc import Sequence

from deepserve import cli_bench, cli_generate, cli_ops, cli_up

# Each command's flags and its run live in cli_<command>.py; scripts/flag_docs.py builds the
# `deepserve up` table from this name.
_add_up = cli_up.add_parser


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
    cli_generate.add_parser(sub)
    cli_bench.add_parser(sub)
    _add_up(sub)
    cli_ops.add_kvstore(sub)
    cli_ops.add_usage(sub)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return cli_generate.run(args)
    if args.command == "up":
        return cli_up.run(args)
    if args.command == "kvstore":
        return cli_ops.kvstore(args)
    if args.command == "usage":
        return cli_ops.usage(args)
    return cli_bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
