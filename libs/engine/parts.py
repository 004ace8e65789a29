"""What an :class:`~libs.engine.engine.Engine` runs on: its parts, and what they promise.

The engine owns the policy (scheduler, block accounting, KV frames); the parts it is handed
own the bytes: a :class:`StepRunner` computes each scheduled step and a :class:`KVBlockStore`
holds the KV of each block id. Each model family builds the real ones for its models
(:mod:`libs.engine.registry`: paged cache, sampler, model runner with its CUDA graphs); the
deterministic fake engine (``libs.serving.fake_engine``) plugs a hash and a dict into the same
engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from .config import ModelConfig
from .cost_model import CostModel
from .kv.layout import CacheSpec
from .loader import LoadedModel
from .runner import Launched
from .scheduler import StepPlan

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .ep.runtime import EPRuntime

log = logging.getLogger(__name__)


class KVBlockStore(Protocol):
    """The KV cache as the engine sees it: bytes per block id.

    Block ids are the engine's (its :class:`BlockManager` decides who owns one and when it
    may be overwritten); the store only keeps ``spec.bytes_per_block`` bytes for each.
    """

    def read_blocks(self, blocks: Sequence[int]) -> bytes:
        """Block-major bytes of ``blocks``, in order."""
        ...

    def write_blocks(self, blocks: Sequence[int], payload: bytes | memoryview) -> None:
        """Overwrite ``blocks`` with ``payload`` (``len(blocks)`` blocks, block-major)."""
        ...

    # The halves that keep bulk copies off the engine thread.
    def gather_async(self, blocks: Sequence[int]) -> Any:
        """Start copying ``blocks`` out (engine thread); the result's ``result()`` (any
        thread) returns their bytes; the blocks may be reused as soon as this returns."""
        ...

    def stage(self, payloads: Sequence[bytes | memoryview]) -> Any:
        """Make whole blocks ready to write (any thread, no page touched)."""
        ...

    def write_staged(self, blocks: Sequence[int], staged: Any, start: int = 0) -> None:
        """Write staged rows ``start ..`` into ``blocks`` (engine thread)."""
        ...

    # Another process's pool on this host (kv/peer.py).
    def share(self) -> bytes | None:
        """A handle another process maps with :meth:`open_peer`; None if not shareable."""
        ...

    def open_peer(self, handle: bytes) -> Any:
        """Map another pool of this layout; raises ``PeerUnavailable`` if not reachable."""
        ...

    def copy_from_peer(self, src: Any, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> Any:
        """Copy blocks from a mapped pool into ours; returns an event to wait on (or None)."""
        ...


class StepRunner(Protocol):
    """Computes scheduled steps: ``launch`` may return before the step is done (overlap);
    ``collect`` waits for it and returns the sampled id per sampling request and the
    step's seconds (what calibrates the cost model)."""

    def launch(
        self,
        plan: StepPlan,
        params: Sequence[SamplingParams],
        prev: Launched | None,
        num_generated: Sequence[int] | None = None,
        histories: Sequence[tuple[int, list[int], int]] | None = None,
        *,
        masks_fn: Callable[[], tuple[list[int], torch.Tensor] | None] | None = None,
    ) -> Launched:
        """``params``: per sampling seq of ``plan``, in plan order; ``prev``: the step in flight;
        ``num_generated`` (when a seq sets min_tokens) and ``histories`` (when one uses a
        penalty): see :meth:`ModelRunner.launch`."""
        ...

    def collect(self, launched: Launched) -> tuple[dict[str, int], float]: ...

    def logprobs(self, launched: Launched) -> dict[str, TokenLogprob]:
        """After ``collect``: the logprobs of the requests that asked, by request id."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop what the runner keeps for it."""
        ...

    def warm_kernels(self) -> None:
        """Compile the kernel variants serving can ask for, before it does (warm-up)."""
        ...


@dataclass(frozen=True)
class EngineParts:
    model_id: str  # names the weights: part of every KV frame's identity
    model_config: ModelConfig
    spec: CacheSpec
    cache: KVBlockStore
    num_blocks: int
    cost: CostModel
    runner: StepRunner
    device: torch.device = torch.device("cpu")
    loaded: LoadedModel | None = None  # the model behind a ModelRunner; None for a fake
    ep: EPRuntime | None = None  # this rank's side of an expert-parallel group; None: alone


def max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    return min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def kernels_on(config: EngineConfig, why: Callable[[], str | None]) -> bool:
    """Whether the engine runs its Triton kernels: ``kernels="auto"`` on CUDA unless ``why()``
    names a width they do not take (then PyTorch, with a warning); ``"triton"`` refuses such
    a model; ``"torch"`` never."""
    if not config.use_kernels:
        return False
    reason = why()
    if reason is None:
        return True
    if config.kernels == "triton":
        raise ValueError(f"kernels='triton' cannot serve this model: {reason}")
    log.warning("engine: PyTorch instead of the kernels: %s", reason)
    return False


def nominal_rates(device: torch.device) -> tuple[float, float]:
    """Starting FLOP/s and bytes/s for the cost model; calibrated by measured steps."""
    if device.type == "cuda":
        return 6e14, 4e12  # H200-class bf16 dense / HBM; the calibration corrects the rest
    return 5e10, 1e10
