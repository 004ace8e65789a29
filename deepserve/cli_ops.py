"""Operators' commands: ``deepserve kvstore fsck`` (the kvstore service's own flags) and
``deepserve usage`` (:mod:`deepserve.usage`)."""

from __future__ import annotations

import argparse
import sys


def add_kvstore(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def kvstore(args: argparse.Namespace) -> int:
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


def add_usage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def usage(args: argparse.Namespace) -> int:
    from deepserve.usage import run

    return run(args.nats_url, args.tenant, args.since, args.price, args.json, args.stream)
