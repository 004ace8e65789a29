"""Plots of ``deepserve bench route`` results (matplotlib, a test extra):

python -m deepserve.bench.route_plot docs/img bench/results/route-{agent,chat,mixed}-cpu.json
python -m deepserve.bench.route_plot docs/img bench/results/route-sweep-*-cpu.json

Results with a ``sweep`` (``--sweep``) draw ``route-tradeoff.png``: hit rate (as a fraction
of the oracle's) against max/mean busy time, one curve per trace; the others draw
``route-hit-rate.png`` and ``route-p99-wait.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from libs.routing.buckets import bucket_names

ROUTERS = ("policy", "oracle", "round_robin")


def plot(out_dir: Path, results: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    traces = [r["trace"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.27
    for i, name in enumerate(ROUTERS):
        vals = [r["routers"][name]["hit_rate"] for r in results]
        ax.bar([x + (i - 1) * width for x in range(len(results))], vals, width, label=name)
    ax.set_xticks(range(len(results)), traces)
    ax.set_ylim(0, 1)
    ax.set_ylabel("prompt tokens hit in GPU cache")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("bench route: prefix-cache hit rate by router")
    fig.tight_layout()
    hit = out_dir / "route-hit-rate.png"
    fig.savefig(hit, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        seen = r["routers"]["policy"]["queueing"]
        buckets = [
            b for b in bucket_names(r["bucket_bounds"]) if seen.get(b, {}).get("requests", 0) >= 5
        ]
        for i, name in enumerate(("policy", "round_robin")):
            q = r["routers"][name]["queueing"]
            ax.bar(
                [x + (i - 0.5) * 0.4 for x in range(len(buckets))],
                [q[b]["p99_wait_s"] for b in buckets],
                0.4,
                label=name,
            )
        ax.set_xticks(range(len(buckets)), buckets, fontsize=8)
        ax.set_title(f"{r['trace']}: p99 queueing (s)", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    wait = out_dir / "route-p99-wait.png"
    fig.savefig(wait, dpi=110)
    plt.close(fig)
    return [hit, wait]


def plot_sweep(out_dir: Path, results: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for r in results:
        knob, rows = r["sweep"]["knob"], r["sweep"]["rows"]
        xs = [row["max_mean_load"] for row in rows]
        ys = [row["hit_ratio_to_oracle"] for row in rows]
        (line,) = ax.plot(xs, ys, "o-", ms=4, label=f"{r['trace']}: policy, {knob} swept")
        for row, x, y in zip(rows, xs, ys):
            label = "off" if row[knob] is None else f"{row[knob]:g}"
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        rr = r["routers"]["round_robin"]
        ax.plot(
            [rr["max_mean_load"]],
            [rr["hit_rate"] / r["oracle_hit_rate"]],
            "x",
            color=line.get_color(),
            label=f"{r['trace']}: round robin",
        )
        oracle = r["routers"]["oracle"]
        ax.plot([oracle["max_mean_load"]], [1.0], "s", color=line.get_color(), mfc="none", ms=6)
    ax.axvline(1.15, color="grey", lw=0.8, ls="--")
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("max/mean busy time of the prefill instances (whole run)")
    ax.set_ylabel("prompt-token hit rate / oracle's")
    ax.set_title("bench route: locality against load (squares: locality-only oracle)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out_dir / "route-tradeoff.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    results = [json.loads(Path(p).read_text()) for p in argv[1:]]
    order = {"agent": 0, "chat": 1, "mixed": 2}
    results.sort(key=lambda r: order.get(r["trace"], 9))
    sweeps = [r for r in results if "sweep" in r]
    plain = [r for r in results if "sweep" not in r]
    paths = plot(Path(argv[0]), plain) if plain else []
    if sweeps:
        paths.append(plot_sweep(Path(argv[0]), sweeps))
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
