"""Plot of a ``deepserve bench engine`` result (matplotlib, a test extra):

    python -m deepserve.bench.engine_plot RESULT.json [OUT.png]
    deepserve bench engine ... --json RESULT.json --plot OUT.png

Left: decode tokens/s against batch size for the engine and transformers' ``generate`` on the
same weights (log scales), each engine point labelled with its fraction of the measured copy
bandwidth roofline. Right: prefill MFU against tokens per step, labelled with tokens/s.
Without OUT the file is ``docs/img/engine-<preset>-<device>.png``, e.g.
``docs/img/engine-v3-slice-cuda-h200.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def default_path(result: dict[str, Any]) -> Path:
    device = "cuda" if str(result.get("device", "cpu")).startswith("cuda") else "cpu"
    name = ""
    if device == "cuda":
        words = str(result.get("device_name", "")).split()
        name = next((w.lower() for w in reversed(words) if any(c.isdigit() for c in w)), "")
    stem = f"engine-{result['preset']}-{device}" + (f"-{name}" if name else "")
    return Path("docs/img") / f"{stem}.png"


def plot(result: dict[str, Any], out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out) if out is not None else default_path(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    decode = result.get("decode", [])
    xs = [d["batch"] for d in decode]
    ys = [d["tokens_per_s"] for d in decode]
    left.plot(xs, ys, "o-", label="deepserve")
    for d in decode:
        left.annotate(
            f"{d['roofline_fraction']:.2f} of BW",
            (d["batch"], d["tokens_per_s"]),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
        )
    peer = [r for r in result.get("transformers_decode", []) if "tokens_per_s" in r]
    if peer:
        left.plot(
            [r["batch"] for r in peer],
            [r["tokens_per_s"] for r in peer],
            "s--",
            label=f"transformers {result.get('transformers', {}).get('version', '')} generate",
        )
        speedup = result.get("speedup_vs_transformers", {})
        for r in peer:
            x = speedup.get(str(r["batch"]))
            if x:
                left.annotate(
                    f"{x:.1f}x",
                    (r["batch"], r["tokens_per_s"]),
                    textcoords="offset points",
                    xytext=(4, -10),
                    fontsize=7,
                )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    ticks = sorted(set(xs) | {r["batch"] for r in peer})
    left.set_xticks(ticks, [str(t) for t in ticks])
    ctx = decode[0]["context"] if decode else ""
    left.set_xlabel("decode batch (requests)")
    left.set_ylabel("decode tokens/s")
    left.set_title(f"decode at {ctx}-token context", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8, loc="upper left")

    prefill = result.get("prefill", [])
    px = [p["tokens"] for p in prefill]
    right.plot(px, [p["mfu"] for p in prefill], "o-", color="C2")
    for p in prefill:
        right.annotate(
            f"{p['tokens_per_s']:,.0f} tok/s",
            (p["tokens"], p["mfu"]),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
        )
    right.set_xscale("log", base=2)
    right.set_xticks(px, [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in px])
    right.set_ylim(0, max([p["mfu"] for p in prefill] + [0.05]) * 1.3)
    right.set_xlabel("prefill tokens per step")
    right.set_ylabel("MFU (of measured matmul FLOP/s)")
    right.set_title("prefill", fontsize=10)
    right.grid(True, alpha=0.3)

    opts = result.get("options", {})
    extras = [
        f"KV {opts['kv_cache_dtype']}" if opts.get("kv_cache_dtype", "auto") != "auto" else "",
        f"experts {opts['experts']}" if opts.get("experts", "bf16") != "bf16" else "",
    ]
    tag = ", ".join(e for e in extras if e)
    q = result.get("quality", {})
    if "relative_error" in q:
        tag += f" (logit rel. err {q['relative_error']:.3g}, top-1 {q['top1_agreement']:.3f})"
    fig.suptitle(
        f"bench engine: {result['preset']} on {result.get('device_name', result.get('device'))}, "
        f"{result.get('dtype', '')}" + (f", {tag}" if tag else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    result = json.loads(Path(argv[0]).read_text())
    print(plot(result, Path(argv[1]) if len(argv) > 1 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
