"""Device health for an EP supervisor: which of its devices may take a rank.

A device is one index: a GPU (``--device cuda``: the ``--ep-gpus`` entry, or ``0..N-1``) or,
for CPU ranks, a slot ``0..N-1`` that only names a rank's place. It is healthy when

* it is not listed in ``--ep-health-file`` (one index a line, re-read at every probe: an
  operator takes a GPU out by hand; a test marks a CPU "device" unhealthy), and
* on CUDA, a fresh process can allocate on it and run a kernel with the right answer within
  :data:`PROBE_TIMEOUT_S` (a process of its own: a GPU that fell off the bus or hit an Xid
  error hangs or kills the caller, and the supervisor must survive it; a fresh CUDA context
  also does not see the failed rank's state).

CPU slots have no hardware to probe, so only the file decides for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0  # a CUDA context and a kernel: ~2-5 s on a healthy GPU

# 2^20 twos summed: 2^21, exact in float32; a wrong answer is a broken GPU, not rounding.
_CUDA_PROBE = """
import sys, torch
d = torch.device("cuda", int(sys.argv[1]))
x = torch.full((1 << 20,), 2.0, device=d)
s = float(x.sum().item())
torch.cuda.synchronize(d)
sys.exit(0 if s == float(1 << 21) else 3)
"""


def listed_unhealthy(path: str) -> set[int]:
    """The device indices ``path`` lists (no file, or ``path`` empty: none). Lines that are
    not integers are ignored with a warning: a typo must not take the whole host out."""
    if not path:
        return set()
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return set()
    out = set()
    for line in text.split():
        try:
            out.add(int(line))
        except ValueError:
            log.warning("ep health file %s: %r is not a device index; ignored", path, line)
    return out


async def probe_cuda(gpu: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """A tiny allocation and kernel on ``cuda:<gpu>`` in a subprocess; False on any failure
    or when it takes longer than ``timeout_s``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CUDA_PROBE,
        str(gpu),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("ep: cuda:%d probe did not finish within %.0f s", gpu, timeout_s)
        return False
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        log.warning("ep: cuda:%d probe failed (exit %s): %s", gpu, proc.returncode, tail[0])
        return False
    return True


class DeviceProbe:
    """Probes a supervisor's devices: ``cuda`` (real probes) or anything else (file only)."""

    def __init__(self, device: str, health_file: str = "", timeout_s: float = PROBE_TIMEOUT_S):
        self.cuda = device.startswith("cuda")
        self.health_file = health_file
        self.timeout_s = timeout_s

    async def healthy(self, devices: Sequence[int]) -> list[int]:
        """The healthy ones of ``devices``, in their order (probed concurrently)."""
        marked = listed_unhealthy(self.health_file)
        candidates = [d for d in devices if d not in marked]
        if self.cuda and candidates:
            ok = await asyncio.gather(*(probe_cuda(d, self.timeout_s) for d in candidates))
            candidates = [d for d, good in zip(candidates, ok) if good]
        return candidates
