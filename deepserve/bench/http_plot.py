"""``bench serve --url --plot``: time to first token against prompt length, and the
inter-token gaps' distribution, of one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: list[Any], summary: dict[str, Any], path: Path) -> None:
    """``results``: ``http_load.Result`` s; ``summary``: its ``summarize``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.scatter(
        [r.prompt_tokens for r in ok],
        [r.ttft_s * 1e3 for r in ok],
        s=8,
        c=[r.cached_tokens / max(1, r.prompt_tokens) for r in ok],
        cmap="viridis",
    )
    a.set_xlabel("prompt tokens")
    a.set_ylabel("TTFT (ms)")
    a.set_title("time to first token (colour: cached share)")
    gaps = sorted(g * 1e3 for r in ok for g in r.itl_s)
    if gaps:
        b.plot(gaps, [i / len(gaps) for i in range(len(gaps))])
    b.set_xlabel("inter-token latency (ms)")
    b.set_ylabel("fraction of gaps")
    b.set_title(
        f"{summary['output_tokens_per_s']:.0f} output tok/s, "
        f"${summary['revenue_per_gpu_hour']:.2f}/GPU-h"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
