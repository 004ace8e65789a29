"""Where a service's threads spend their time, from ``py-spy record -f raw --threads --idle``
(scripts/gpu/serve.sh PROFILE=record): per thread, its samples and the share of them under each
function (a function counted once per sample however deep it recurs), largest first.

Run: python3 scripts/gpu/profile_summary.py RECORD.txt [--top N] [--thread NAME]

With ``--idle`` a thread blocked in a call (waiting for the GPU, a lock, the socket) is sampled
where it waits, so a thread's shares add up to its wall time, not its CPU time.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterable

_LOCATION = re.compile(r" \([^()]*:\d+\)$")


def summarize(lines: Iterable[str]) -> dict[str, tuple[int, Counter[str]]]:
    """Per thread (``thread (id): name``): (samples, samples per function)."""
    out: dict[str, tuple[int, Counter[str]]] = {}
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack.startswith("thread (") or not count.isdigit():
            raise ValueError(f"not a py-spy raw line: {line[:120]!r}")
        n = int(count)
        thread, *frames = stack.split(";")
        total, funcs = out.get(thread, (0, Counter()))
        for f in {_LOCATION.sub("", f) for f in frames}:
            funcs[f] += n
        out[thread] = (total + n, funcs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record")
    ap.add_argument("--top", type=int, default=25, help="functions listed per thread")
    ap.add_argument("--thread", default="", help="only threads whose name contains this")
    args = ap.parse_args(argv)
    with open(args.record) as f:
        threads = summarize(f)
    for name, (total, funcs) in sorted(threads.items(), key=lambda kv: -kv[1][0]):
        if args.thread not in name:
            continue
        print(f"== {name}: {total} samples")
        for fn, n in funcs.most_common(args.top):
            print(f"  {100 * n / total:5.1f}%  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
