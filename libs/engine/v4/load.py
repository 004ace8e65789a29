"""DeepSeek-V4 models by name: presets with seeded random weights, or a checkpoint directory in
transformers' layout (``config.json`` with ``model_type: deepseek_v4``, safetensors); and
one-prompt generation through :class:`V4State` (``deepserve generate --model v4-tiny``).

Presets (the bundled DeepSeek tokenizer's 129,280 ids):

* ``v4-tiny``: every V4 block at toy widths (CPU tests): sliding, CSA and HCA layers, hash and
  top-k routing, two hyper-connection streams, windows of 16, compression every 4 / 16 tokens;
* ``v4-flash-slice``: V4-Flash's widths (hidden 4096, 64 heads of 512, 256 experts of 2048,
  indexer 64 x 128 picking 512, window 128, 4 streams) and transformers' default layer
  schedule, 4 layers: for a single H200.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint_stream import DEFAULT_READ_WORKERS, stream_tensors
from ..load_progress import ProgressSink
from ..presets import _name_key, init_random_weights
from .blocks import V4BlockCache, prefill_blocks, restore
from .config import V4Config
from .model import V4ForCausalLM, V4State
from .moe import Experts

if TYPE_CHECKING:
    from ..kernels.fused_moe import Fp4Weight

_VOCAB = 129280
_COMMON: dict[str, Any] = dict(vocab_size=_VOCAB, bos_token_id=0, eos_token_id=1)
V4_PRESETS: dict[str, dict[str, Any]] = {
    "v4-tiny": dict(
        _COMMON,
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=64,
        qk_rope_head_dim=16,
        num_experts_per_tok=2,
        n_routed_experts=8,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=16,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        max_position_embeddings=65536,
    ),
    "v4-flash-slice": dict(
        _COMMON,
        hidden_size=4096,
        moe_intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        qk_rope_head_dim=64,
        num_experts_per_tok=6,
        n_routed_experts=256,
        sliding_window=128,
        o_groups=8,
        o_lora_rank=1024,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        hc_mult=4,
        hc_sinkhorn_iters=20,
    ),
}


def is_v4(model: str) -> bool:
    """Whether ``model`` (a preset name or a checkpoint directory) is a DeepSeek-V4 model."""
    if model in V4_PRESETS:
        return True
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return bool(json.loads(cfg.read_text()).get("model_type") == "deepseek_v4")
    except (OSError, ValueError):
        return False


def v4_config(model: str) -> V4Config:
    """The config of a V4 preset or checkpoint directory, from its name alone (no weights)."""
    if model in V4_PRESETS:
        return V4Config.from_hf(V4_PRESETS[model])
    if not is_v4(model):
        raise ValueError(
            f"{model!r} is neither a V4 preset ({', '.join(V4_PRESETS)}) nor a V4 checkpoint"
        )
    return V4Config.from_hf(json.loads((Path(model) / "config.json").read_text()))


def load_v4(
    model: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    read_workers: int = DEFAULT_READ_WORKERS,
    progress: ProgressSink | None = None,
    weights: str = "auto",
    expert_slots: tuple[int, ...] | None = None,
) -> V4ForCausalLM:
    """A preset with seeded random weights, or a checkpoint directory in DeepSeek's release
    naming or transformers' (routed experts in MXFP4 -- e2m1, a UE8M0 scale per 1x32 -- kept in
    FP4 for the fused MoE, other block-scaled experts dequantized; FP8 e4m3 projections per
    128x128 tile kept in FP8 where :meth:`V4ForCausalLM.fp8_projections` runs them so, others
    dequantized), ``read_workers`` shards read at once, ``progress`` told how far (a preset
    reads nothing, tells nothing). ``weights``: ``auto`` as stored, ``bf16`` every FP8
    projection dequantized, ``fp8`` every one of :meth:`V4ForCausalLM.fp8_projections` in
    FP8 (quantized at load where the checkpoint has it in full precision). ``expert_slots``:
    the routed experts each layer keeps, in slot order (``-1``: an empty slot), one rank of an
    EP group -- a checkpoint's other experts are never held (a preset's are made, then
    dropped: their values come from the whole model's seeded draws)."""
    device = torch.device(device)
    if model in V4_PRESETS:
        net = _build(V4Config.from_hf(V4_PRESETS[model]), device, dtype)
        net.hf_config = dict(V4_PRESETS[model])
        _init_preset(net, seed)
        if expert_slots is not None:
            for module in net.modules():
                if isinstance(module, Experts):
                    module.keep_slots(expert_slots)
        if weights == "fp8":
            net.quantize_weights_fp8()
        return net.eval()
    path = Path(model)
    if not is_v4(model):
        raise ValueError(
            f"{model!r} is neither a V4 preset ({', '.join(V4_PRESETS)}) nor a V4 checkpoint"
        )
    raw = json.loads((path / "config.json").read_text())
    net = _build(V4Config.from_hf(raw), device, dtype, expert_slots)
    net.hf_config = raw
    keep = net.fp8_projections() if weights != "bf16" else ()
    state, fp4, fp8 = _read_state(path, device, read_workers, progress, keep, expert_slots)
    net.quantize_weights_fp8(only=fp8, empty=True)  # filled with the checkpoint's bytes
    net.load_hf_state(state, fp4)
    if weights == "fp8":
        net.quantize_weights_fp8()  # any the checkpoint stored in bf16
    return net.eval()


def _build(
    cfg: V4Config,
    device: torch.device,
    dtype: torch.dtype,
    expert_slots: tuple[int, ...] | None = None,
) -> V4ForCausalLM:
    """Parameters allocated in ``dtype`` on ``device`` (V4-Flash's widths would not fit twice)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            net = V4ForCausalLM(cfg, expert_slots)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, t in [*net.named_parameters(), *net.named_buffers()]:
            if t.is_floating_point() and _FP32.search(name):
                t.data = t.data.float()
    return net


def _init_preset(net: V4ForCausalLM, seed: int) -> None:
    """Seeded values for every parameter (norms near 1), hyper-connection scales near 1, and a
    hash-routing table of distinct experts per token id."""
    init_random_weights(net, seed)
    cfg = net.cfg
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
                p.fill_(1.0)
        for name, b in net.named_buffers():
            if name.endswith("tid2eid"):
                g = torch.Generator().manual_seed(_name_key(seed, name))
                scores = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g)
                b.copy_(scores.topk(cfg.num_experts_per_tok, dim=-1).indices)


# DeepSeek's release names (what transformers also writes back on save) -> ours (transformers'
# module names). Top-level tensors by exact name; inside a layer, substring renames in order.
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_IN_LAYER = (
    (".attn.", ".self_attn."),
    (".ffn.", ".mlp."),
    (".indexer.compressor.", ".compressor.indexer."),
    (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".hc_attn_fn", ".attn_hc.fn"),
    (".hc_attn_base", ".attn_hc.base"),
    (".hc_attn_scale", ".attn_hc.scale"),
    (".hc_ffn_fn", ".ffn_hc.fn"),
    (".hc_ffn_base", ".ffn_hc.base"),
    (".hc_ffn_scale", ".ffn_hc.scale"),
    (".attn_sink", ".sinks"),
    (".indexer.weights_proj.", ".compressor.indexer.scorer.weights_proj."),
    (".indexer.wq_b.", ".compressor.indexer.q_b_proj."),
    (".norm.", ".kv_norm."),
    (".ape", ".position_bias"),
    (".wq_a.", ".q_a_proj."),
    (".self_attn.wq_b.", ".self_attn.q_b_proj."),
    (".wkv.", ".kv_proj."),
    (".wgate.", ".gate_proj."),
    (".wo_a.", ".o_a_proj."),
    (".wo_b.", ".o_b_proj."),
    (".q_norm.", ".q_a_norm."),
    (".gate.bias", ".gate.e_score_correction_bias"),
    (".shared_experts.w1.", ".shared_experts.gate_proj."),
    (".shared_experts.w2.", ".shared_experts.down_proj."),
    (".shared_experts.w3.", ".shared_experts.up_proj."),
)
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
_LAYER = re.compile(r"^(?:model\.)?layers\.\d+\.")
# Kept in fp32 whatever the model dtype, as DeepSeek runs them: the hyper-connection mixers,
# sinks, pooling biases, routing bias and the norms.
_FP32 = re.compile(
    r"(attn_hc|ffn_hc|hc_head|sinks|position_bias|e_score_correction_bias"
    r"|(q_a_norm|kv_norm|input_layernorm|post_attention_layernorm|model\.norm)\.weight)"
)


def canonical_name(name: str) -> str:
    """Our (transformers') name for a checkpoint tensor in DeepSeek's release naming, with or
    without the ``model.`` prefix; names already ours pass through."""
    bare = name[6:] if name.startswith("model.") else name
    if bare in _TOP:
        return _TOP[bare]
    if not _LAYER.match(name):
        return name
    out = "model." + bare
    for old, new in _IN_LAYER:
        if old in out and new not in out:
            out = out.replace(old, new)
    return out


def _read_state(
    path: Path,
    device: torch.device,
    read_workers: int = DEFAULT_READ_WORKERS,
    progress: ProgressSink | None = None,
    keep_fp8: Collection[str] = (),
    expert_slots: tuple[int, ...] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[Fp4Weight, Fp4Weight]], set[str]]:
    """Every tensor under our names, block-scaled ones (FP8 e4m3 or packed FP4, with their
    ``weight_scale_inv`` in any shard) dequantized (:mod:`..block_scales`) -- except an e4m3
    weight in 128x128 tiles of a module named in ``keep_fp8``, kept as it is with its scales
    as fp32 ``weight_scale_inv`` (:class:`~..model.layers.Fp8Linear`'s parameters; those
    modules are the third value); per-expert ``w1``/``w3``/``w2`` stacked into
    ``gate_up_proj`` (gate rows, then up rows) and ``down_proj`` -- or, where a layer's every
    expert matrix is MXFP4 (the release), kept in FP4 as the fused MoE's weights (the second
    dict, by the experts' module name); with ``expert_slots``, only those experts, in slot
    order (``-1``: zeros), the others never read. Shards are read ``read_workers`` at a
    time as the V3 loader reads them (:func:`~..checkpoint_stream.stream_tensors`: on CUDA
    copied in while the next shards are read), telling ``progress``."""
    from ..block_scales import dequantize, is_packed_fp4, scale_values

    out: dict[str, torch.Tensor] = {}
    fp8: set[str] = set()
    experts: dict[str, dict[str, dict[int, tuple[torch.Tensor, torch.Tensor | None]]]] = {}
    on = device if device.type == "cuda" else None

    def wanted(k: str) -> bool:  # an EP rank reads only its own experts
        m = _EXPERT.match(canonical_name(k))
        return m is None or expert_slots is None or int(m.group(2)) in expert_slots

    for k, t, scale in stream_tensors(path, wanted, read_workers, on, progress):
        if scale is not None and t.dim() != 2:
            raise ValueError(f"{path.name}: {k} is a {t.dim()}-D scaled tensor; only 2-D load")
        name = canonical_name(k)
        m = _EXPERT.match(name)
        if m:  # raw until its layer's experts are all in: FP4 kept, or every one dequantized
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = (
                t,
                scale,
            )
        elif scale is not None and name[: -len(".weight")] in keep_fp8 and _fp8_tiles(t, scale):
            module = name[: -len(".weight")]
            out[name], out[module + ".weight_scale_inv"] = t, scale_values(scale)
            fp8.add(module)
        else:
            out[name] = dequantize(t, scale) if scale is not None else t
    fp4: dict[str, tuple[Fp4Weight, Fp4Weight]] = {}
    for prefix, parts in experts.items():
        order = expert_slots if expert_slots is not None else range(len(parts.get("w1", ())))
        try:
            w1, w2, w3 = ([_slot(parts[w], e) for e in order] for w in ("w1", "w2", "w3"))
        except KeyError as exc:
            raise ValueError(f"{prefix}: expert tensor {exc} missing from the checkpoint") from None
        n = len(order)
        raw = [*w1, *w2, *w3]
        if all(s is not None and is_packed_fp4(t) and _mx_grid(t, s) for t, s in raw):
            fp4[prefix] = (_stack_fp4(w1, w3), _stack_fp4(w2))
            continue
        full = [dequantize(t, s) if s is not None else t for t, s in raw]
        g, d, u = full[:n], full[n : 2 * n], full[2 * n :]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([a, b]) for a, b in zip(g, u)])
        out[f"{prefix}.down_proj"] = torch.stack(d)
    return out, fp4, fp8


def _fp8_tiles(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``weight`` is e4m3 with one scale per 128x128 tile (the last ones partial)."""
    rows, cols = weight.shape
    return weight.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (
        -(-rows // 128),
        -(-cols // 128),
    )


def _slot(
    held: dict[int, tuple[torch.Tensor, torch.Tensor | None]], expert: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert ``expert``'s (tensor, scale) of one matrix; ``-1`` (an empty slot): zeros shaped
    as another expert's (KeyError for an expert the checkpoint lacks)."""
    if expert >= 0:
        return held[expert]
    t, s = next(iter(held.values()))
    return torch.zeros_like(t), None if s is None else torch.zeros_like(s)


def _mx_grid(packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``scale`` is one scale per 32 along K of this packed FP4 matrix, K a multiple
    of 64 (the fused MoE's FP4 layout takes it as is)."""
    n, half = packed.shape
    return (2 * half) % 64 == 0 and tuple(scale.shape) == (n, 2 * half // 32)


def _stack_fp4(
    first: list[tuple[torch.Tensor, torch.Tensor | None]],
    second: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> Fp4Weight:
    """One expert matrix per entry (``second``: rows appended to each, the up rows under the
    gate rows) as the fused MoE's stacked FP4 weight."""
    from ..block_scales import mxfp4_as_kernel_fp4
    from ..kernels.fused_moe import Fp4Weight

    packed, scales = [], []
    for i, (t, s) in enumerate(first):
        rows = [(t, s)] if second is None else [(t, s), second[i]]
        pieces = [mxfp4_as_kernel_fp4(a, b) for a, b in rows if b is not None]
        packed.append(torch.cat([p for p, _ in pieces]))
        scales.append(torch.cat([q for _, q in pieces]))
    return Fp4Weight(torch.stack(packed), torch.stack(scales))


@dataclass(frozen=True)
class V4Output:
    token_ids: tuple[int, ...]
    finish_reason: str
    cached_tokens: int = 0  # prompt tokens restored from ``cache`` blocks, not computed


def generate_v4(
    net: V4ForCausalLM,
    prompt: Sequence[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = False,
    cache: V4BlockCache | None = None,
    cache_salt: bytes = b"",
) -> V4Output:
    """One prompt to the end: the prompt in one pass, then a token at a time through its
    :class:`V4State`. Greedy at temperature 0, else sampled (``seed`` makes it repeatable).
    With ``cache`` (:mod:`.blocks`): the state of the longest cached prefix is restored, the
    rest of the prompt computed in block-aligned chunks and its full blocks cached."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if max(prompt) >= net.cfg.vocab_size or min(prompt) < 0:
        raise ValueError(f"prompt token ids must be in [0, {net.cfg.vocab_size})")
    device = next(net.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    cached = 0
    if cache is None:
        st = V4State.empty(net.cfg)
        logits = net(torch.tensor(list(prompt), device=device), st)[-1]
    else:
        hits = cache.longest(prompt, cache_salt)
        start = restore(hits, net) if hits else None
        cached = start.seen if start is not None else 0
        st, new, logits = prefill_blocks(net, prompt[cached:], start, cache.block_tokens)
        cache.put(prompt, new, len(hits), cache_salt)
    out: list[int] = []
    while len(out) < max_tokens:
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=gen))
        else:
            tok = int(logits.argmax())
        out.append(tok)
        if not ignore_eos and tok in net.cfg.eos_token_ids:
            return V4Output(tuple(out), "stop", cached)
        if len(out) < max_tokens:
            logits = net(torch.tensor([tok], device=device), st)[-1]
    return V4Output(tuple(out), "length", cached)
