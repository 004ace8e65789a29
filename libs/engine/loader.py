"""Build a model from a preset name or a Hugging Face checkpoint directory.

Checkpoint directories hold ``config.json`` and safetensors files, one file or sharded
with ``model.safetensors.index.json``. Routed experts may be stored per expert (the
original ``mlp.experts.{e}.gate_proj.weight`` names, which transformers also writes) or fused
(transformers' in-memory ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]).
FP8 block-quantized weights (DeepSeek's release: ``weight`` in e4m3 with ``weight_scale_inv``
per 128x128 tile) are dequantized while loading when ``weight_dtype`` is bf16; with fp8 (the
default for checkpoints whose config says so) linear layers keep the e4m3 tensors and their scales
as they are and the routed experts are re-quantized to the same format after loading (exact
for DeepSeek's tiles, whose largest element is +-448). MTP layers (``model.layers.{N+j}``) load
into ``mtp.{j}`` when asked for, and are skipped otherwise.

``expert_slots`` (one rank of an expert-parallel group): the decoder layers keep only those
routed experts. From a checkpoint that stores experts one by one, the others are never read;
fused expert tensors are read whole and cut. A preset is built whole, then cut.

Shards are read ``read_workers`` at a time on threads (``checkpoint_stream.py``, shared with
the V4 loader) while this thread places the shard before: on a CUDA model each tensor is copied
from page-locked memory without blocking and dequantized or cut on the device, so the copies
overlap the next shards' reads. A ``weight_scale_inv`` may sit in another shard than its weight.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .block_scales import dequantize
from .checkpoint_stream import DEFAULT_READ_WORKERS, CheckpointError, stream_tensors
from .checkpoint_stream import weight_files as weight_files  # re-exported (bench load)
from .config import ModelConfig
from .hub import resolve_model
from .kernels.fp8_gemm import FP8_DTYPE, quantize_fp8_blocks
from .load_progress import ProgressSink
from .model.layers import Fp8Linear
from .model.model import DeepseekForCausalLM
from .model.moe import Experts
from .presets import PRESETS, init_random_weights

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_FP8_TILE = 128


@dataclass(frozen=True)
class LoadedModel:
    model: DeepseekForCausalLM
    model_id: str  # names the weights: part of every KV frame's identity
    source: str


def model_config(source: str) -> ModelConfig:
    """A preset's, checkpoint directory's or Hub repo's (:func:`~.hub.resolve_model`) model
    config (reads ``config.json`` only)."""
    if source in PRESETS:
        return PRESETS[source]
    path = Path(resolve_model(source))
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{source!r} is neither a preset ({', '.join(PRESETS)}), "
            "a directory with config.json, nor a Hugging Face repo id (ORG/NAME[@REVISION])"
        )
    raw = json.loads((path / "config.json").read_text())
    try:
        return ModelConfig.from_hf(raw)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None


WEIGHT_DTYPES = ("auto", "bf16", "fp8")


def checkpoint_is_fp8(source: str) -> bool:
    """Whether ``source``'s config carries DeepSeek's FP8 quantization_config (e4m3 weights
    with 128x128 ``weight_block_size``). Presets: never."""
    if source in PRESETS:
        return False
    path = Path(resolve_model(source)) / "config.json"
    if not path.is_file():
        return False
    q = json.loads(path.read_text()).get("quantization_config") or {}
    return (
        q.get("quant_method") == "fp8"
        and q.get("fmt", "e4m3") == "e4m3"
        and list(q.get("weight_block_size") or ()) == [_FP8_TILE, _FP8_TILE]
    )


def resolve_weight_dtype(source: str, weight_dtype: str) -> str:
    """``"fp8"`` or ``"bf16"`` (the model dtype). ``"auto"``: fp8 for a checkpoint whose config
    carries DeepSeek's FP8 quantization (its e4m3 weights and tile scales kept as they are:
    dequantized, V3/R1 would need twice the memory, about 1.34 TB), bf16 otherwise. A caller
    that cannot serve FP8 weights (FP4 experts, batch-invariant mode) asks for bf16."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    if weight_dtype == "auto":
        return "fp8" if checkpoint_is_fp8(source) else "bf16"
    return weight_dtype


def load(
    source: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_mtp: bool = False,
    expert_slots: tuple[int, ...] | None = None,
    weight_dtype: str = "auto",
    read_workers: int = DEFAULT_READ_WORKERS,
    progress: ProgressSink | None = None,
) -> LoadedModel:
    """``weight_dtype`` (see :func:`resolve_weight_dtype`): fp8 keeps linear and routed-expert
    weights in e4m3 with 128x128 block scales (a preset's are quantized after init); the model
    id then says so, since the weights differ. ``source``: a preset, a checkpoint directory or
    a Hub repo id (loaded from its snapshot directory in the Hugging Face cache).
    ``read_workers``: shards read at once (:func:`load_weights`); ``progress`` hears how far
    the read has got (:mod:`.load_progress`; a preset reads nothing and tells it nothing)."""
    source = resolve_model(source)
    cfg = model_config(source)
    fp8 = resolve_weight_dtype(source, weight_dtype) == "fp8"
    suffix = "+fp8" if fp8 else ""
    if source in PRESETS:
        model = DeepseekForCausalLM(cfg, dtype, device, with_mtp=with_mtp)
        init_random_weights(model, seed)
        if expert_slots is not None:
            model.keep_experts(expert_slots)
        if fp8:
            model.quantize_weights_fp8()
        return LoadedModel(model, f"{source}-seed{seed}@{cfg.config_hash()}{suffix}", source)
    path = Path(source)
    model = DeepseekForCausalLM(cfg, dtype, device, with_mtp=with_mtp, expert_slots=expert_slots)
    if fp8:
        model.quantize_weights_fp8(empty=True, experts=False)
    load_weights(model, path, read_workers, progress)
    if fp8:
        model.quantize_weights_fp8()
    return LoadedModel(model, f"{path.name}@{_checkpoint_digest(path)}{suffix}", str(path))


def _checkpoint_digest(path: Path) -> str:
    """Names the weights by config and the safetensors files' names, sizes and headers."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head_len = int.from_bytes(fh.read(8), "little")
            h.update(
                f.name.encode()
                + f.stat().st_size.to_bytes(8, "little")
                + fh.read(min(head_len, 1 << 24))
            )
    return h.hexdigest()[:16]


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return dequantize(w, scale_inv)  # block_scales.py: 128x128 tiles, UE8M0 scales too


def _target_name(name: str, cfg: ModelConfig, with_mtp: bool) -> str | None:
    """Our parameter name for a checkpoint tensor name; None to skip it."""
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        j = int(m.group(1)) - cfg.num_hidden_layers
        if not with_mtp or j >= cfg.num_nextn_predict_layers:
            return None
        return f"mtp.{j}.{m.group(2)}"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def load_weights(
    model: DeepseekForCausalLM,
    path: Path,
    read_workers: int = DEFAULT_READ_WORKERS,
    progress: ProgressSink | None = None,
) -> None:
    """Fill ``model`` from the checkpoint directory ``path``, ``read_workers`` shards read at
    once (:func:`~.checkpoint_stream.stream_tensors`, which tells ``progress``); on a CUDA
    model, tensors are copied in as they are read (dequantized and cut there)."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    with_mtp = len(model.mtp) > 0
    # Which experts each Experts module keeps (None: all), by its name.
    held = {n: m.slots for n, m in model.named_modules() if isinstance(m, Experts)}
    fp8_linears = {n + ".weight" for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    loaded: set[str] = set()
    expert_parts: dict[str, int] = {}
    inter = cfg.moe_intermediate_size

    def wanted(name: str) -> bool:
        target = _target_name(name, cfg, with_mtp)
        m = _EXPERT.match(target or "")
        if target is None or m is None:
            return target is not None
        slots = held.get(m.group(1))
        return slots is None or int(m.group(2)) in slots

    on = device if device.type == "cuda" else None
    for name, tensor, scale in stream_tensors(path, wanted, read_workers, on, progress):
        target = _target_name(name, cfg, with_mtp)
        if target is not None and target in fp8_linears:  # kept (or made) e4m3 + block scales
            _copy_fp8(params, target, tensor, scale, name)
            loaded.update((target, target + "_scale_inv"))
            continue
        if tensor.dtype == FP8_DTYPE:
            if scale is None:
                raise CheckpointError(f"{name} is fp8 but has no {name}_scale_inv")
            tensor = _dequant_fp8(tensor, scale)
        if target is None:
            continue
        m = _EXPERT.match(target)
        if m:  # one expert's projection into the fused tensors (every slot holding it)
            base, e, proj = m.group(1), int(m.group(2)), m.group(3)
            slots = held.get(base)
            rows = [e] if slots is None else [s for s, x in enumerate(slots) if x == e]
            w = "w2" if proj == "down_proj" else "w13"
            dst, key = params.get(f"{base}.{w}"), f"{base}.{w}"
            if dst is None or e >= cfg.n_routed_experts:
                raise CheckpointError(f"unexpected tensor {name}")
            for row in rows:
                if proj == "down_proj":
                    _copy(dst[row], tensor, name)
                else:
                    half = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    _copy(dst[row, half], tensor, name)
            expert_parts[key] = expert_parts.get(key, 0) + 1
            continue
        target = target.replace(".mlp.experts.gate_up_proj", ".mlp.experts.w13")
        target = target.replace(".mlp.experts.down_proj", ".mlp.experts.w2")
        if target not in params:
            raise CheckpointError(f"unexpected tensor {name} (no parameter {target})")
        slots = held.get(target.rsplit(".", 1)[0]) if target.endswith((".w13", ".w2")) else None
        if slots is not None:  # fused experts: keep this rank's rows
            tensor = _cut_experts(tensor, slots, cfg.n_routed_experts, name)
        _copy(params[target], tensor, name)
        loaded.add(target)
    for key, count in expert_parts.items():
        parts_per_expert = 2 if key.endswith(".w13") else 1
        slots = held.get(key.rsplit(".", 1)[0])
        experts = cfg.n_routed_experts if slots is None else len({e for e in slots if e >= 0})
        if count == parts_per_expert * experts:
            loaded.add(key)
    _tie_defaults(model, params, loaded)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s): {shown}")


def _cut_experts(
    tensor: torch.Tensor, slots: tuple[int, ...], n_experts: int, name: str
) -> torch.Tensor:
    """Rows ``slots`` of a fused [E, ...] expert tensor (an empty slot, ``-1``: zeros)."""
    if tensor.shape[0] != n_experts:
        raise CheckpointError(f"{name}: {tensor.shape[0]} experts, the config says {n_experts}")
    rows = torch.tensor([max(e, 0) for e in slots], dtype=torch.int64, device=tensor.device)
    out = tensor.index_select(0, rows)
    for s, e in enumerate(slots):
        if e < 0:
            out[s].zero_()
    return out


def _tie_defaults(
    model: DeepseekForCausalLM, params: Mapping[str, torch.Tensor], loaded: set[str]
) -> None:
    """Fill tensors a checkpoint may legitimately omit from the ones they are tied to."""
    if model.cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
        params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        loaded.add("lm_head.weight")
    for j in range(len(model.mtp)):
        for own, main in (
            (f"mtp.{j}.embed_tokens.weight", "model.embed_tokens.weight"),
            (f"mtp.{j}.shared_head.head.weight", "lm_head.weight"),
        ):
            if own not in loaded:
                params[own].copy_(params[main])
                loaded.add(own)


def _copy_fp8(
    params: Mapping[str, torch.Tensor],
    target: str,
    tensor: torch.Tensor,
    scale: torch.Tensor | None,
    name: str,
) -> None:
    """An :class:`Fp8Linear`'s weight and scales: the checkpoint's e4m3 tiles as they are, or
    a higher-precision tensor quantized here."""
    if tensor.dtype == FP8_DTYPE:
        if scale is None:
            raise CheckpointError(f"{name} is fp8 but has no {name}_scale_inv")
        q, s = tensor, scale.to(torch.float32)
    else:
        qw = quantize_fp8_blocks(tensor)
        q, s = qw.q, qw.scale
    _copy(params[target], q, name)
    _copy(params[target + "_scale_inv"], s, name + "_scale_inv")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(
            f"{name}: shape {tuple(src.shape)} does not match the config's {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
