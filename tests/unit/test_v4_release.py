"""DeepSeek-V4 in its release naming and precisions (issue 37 item 2, V4): ``canonical_name``
maps every name transformers writes back on save (the release's) to transformers' module names,
and a checkpoint with the release's FP8 projections (e4m3, 128x128 tiles, UE8M0 scales) and
MXFP4 routed experts (e2m1 packed two a byte, a UE8M0 scale per 1x32) loads to the same logits
and greedy tokens as transformers on the same values dequantized -- transformers reads this
layout only through ``accelerate``, then dequantizes to bf16. The projections the release keeps
in bf16 (the compressors' and the indexer's kv/gate/weights projections) stay bf16 here too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepserve.bench.release import shard_name, split_shards
from libs.engine.block_scales import E2M1, dequantize
from libs.engine.model.layers import Fp8Linear
from libs.engine.v4.load import canonical_name, generate_v4, load_v4
from libs.engine.v4.model import V4State
from libs.engine.v4.moe import Experts
from tests.hf_reference import build_hf_v4, require_reference

require_reference("transformers")

FP8 = re.compile(r"\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.shared_experts\.w[123]\.weight$")
FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
# Names transformers writes on save that the release spells otherwise (and no ``model.``).
_RELEASE_TOP = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
PROMPT = [3, 17, 41, 5, 99, 120, 7, 64, 2, 250, 31, 8, 77, 19, 140, 60, 11]


def release_name(saved: str) -> str:
    """The release's name of a tensor transformers saved: ``layers.1.attn.wq_a.weight``,
    ``embed.weight``, ``head.weight``, ``hc_head_fn``."""
    bare = saved.removeprefix("model.")
    return _RELEASE_TOP.get(bare, bare)


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """UE8M0: the power of two at or above amax / top (1 for an all-zero block)."""
    return torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / top, min=2.0**-126))))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, UE8M0 scales per 128x128 tile, the dequantized value)."""
    rows, cols = w.shape
    tr, tc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(tr * 128, tc * 128)
    padded[:rows, :cols] = w
    amax = padded.reshape(tr, 128, tc, 128).abs().amax(dim=(1, 3))
    s = _pow2_scale(amax, 448.0)
    full = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, s.to(torch.float8_e8m0fnu), q.float() * full


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed e2m1 as int8 [out, in/2], UE8M0 scales [out, in/32], the dequantized value):
    each value rounded to the nearest e2m1 magnitude, the even element in the low nibble."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32)
    s = _pow2_scale(blocks.abs().amax(dim=-1), 6.0)
    x = blocks / s[..., None]
    grid = torch.tensor(E2M1[:8])
    idx = (x.abs()[..., None] - grid).abs().argmin(dim=-1)
    nibble = (idx | ((x < 0).long() << 3)).reshape(rows, cols).to(torch.uint8)
    packed = (nibble[:, 0::2] | (nibble[:, 1::2] << 4)).view(torch.int8)
    value = (grid[idx] * torch.where(x < 0, -1.0, 1.0) * s[..., None]).reshape(rows, cols)
    return packed, s.to(torch.float8_e8m0fnu), value


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, Path]:
    """(transformers on the dequantized values, the release directory, the reference one)."""
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("v4")
    # Expert widths of 64 (K of both expert matrices): the fused MoE's FP4 layout takes the
    # release's MXFP4 as is, so the loader keeps it (a K of 32 would be dequantized).
    hf = build_hf_v4("v4-mixed", seed=7, moe_intermediate_size=64)
    hf.save_pretrained(root / "saved")  # transformers writes the release's names back
    saved = load_file(str(root / "saved" / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for saved_name, t in saved.items():
        name = release_name(saved_name)
        quantize = quantize_fp4 if FP4.search(name) else quantize_fp8 if FP8.search(name) else None
        if quantize is None or ".compressor." in name or t.dim() != 2:
            stored[name] = plain[saved_name] = t
            continue
        q, s, value = quantize(t.float())
        stored[name], stored[name + "_scale_inv"], plain[saved_name] = q, s, value
    out = root / "release"
    out.mkdir()
    sizes = {k: v.numel() * v.element_size() for k, v in stored.items()}
    runs = split_shards(list(stored), sizes, 3)
    weight_map = {}
    for i, run in enumerate(runs, 1):
        save_file(
            {k: stored[k] for k in run}, str(out / shard_name(i, len(runs))), {"format": "pt"}
        )
        weight_map.update((k, shard_name(i, len(runs))) for k in run)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((root / "saved" / "config.json").read_text())
    (root / "saved" / "config.json").unlink()
    (root / "saved" / "model.safetensors").unlink()
    ref = root / "saved"
    save_file(plain, str(ref / "model.safetensors"), {"format": "pt"})
    (ref / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
    }
    (out / "config.json").write_text(json.dumps(config))
    reference = DeepseekV4ForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    return reference, out, ref


def test_release_names_map_to_transformers_modules(
    release: tuple[torch.nn.Module, Path, Path],
) -> None:
    hf, out, _ = release
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "embed.weight" in names and "layers.1.attn.wq_a.weight" in names  # the release's
    mapped = set()
    for name in names:
        if name.endswith("_scale_inv"):
            continue
        ours = canonical_name(name)
        expert = re.match(r"^(.*\.experts)\.\d+\.(w[123])\.weight$", ours)
        if expert:
            ours = expert.group(1) + (".down_proj" if expert.group(2) == "w2" else ".gate_up_proj")
        mapped.add(ours)
    assert mapped == set(hf.state_dict())
    assert canonical_name("layers.1.attn.indexer.compressor.wkv.weight") == (
        "model.layers.1.self_attn.compressor.indexer.kv_proj.weight"
    )
    assert (
        canonical_name("layers.0.ffn.gate.bias")
        == "model.layers.0.mlp.gate.e_score_correction_bias"
    )
    assert canonical_name("layers.2.hc_ffn_scale") == "model.layers.2.ffn_hc.scale"
    assert (
        canonical_name("model.layers.2.self_attn.q_a_proj.weight")
        == "model.layers.2.self_attn.q_a_proj.weight"
    )


def test_fp8_and_fp4_tensors_are_stored_as_released(
    release: tuple[torch.nn.Module, Path, Path],
) -> None:
    _, out, ref = release
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    fp4 = [k for k in tensors if FP4.search(k)]
    assert fp4 and all(tensors[k].dtype == torch.int8 for k in fp4)
    w1 = tensors["layers.1.ffn.experts.0.w1.weight"]
    assert w1.shape == (64, 32) and tensors["layers.1.ffn.experts.0.w1.weight_scale_inv"].shape == (
        64,
        2,
    )
    assert tensors["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.1.attn.wq_a.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.1.attn.compressor.wkv.weight"].dtype != torch.float8_e4m3fn
    # The loader's decoding (nibble order, UE8M0, tiles) gives this test's own values.
    plain = load_file(str(ref / "model.safetensors"))
    for name in ("layers.1.ffn.experts.0.w1.weight", "layers.1.attn.wq_a.weight"):
        want = plain["model." + name]
        assert want.abs().max() > 0
        assert torch.equal(dequantize(tensors[name], tensors[name + "_scale_inv"]), want), name


def test_the_release_generates_as_transformers_does(
    release: tuple[torch.nn.Module, Path, Path],
) -> None:
    hf, out, _ = release
    net = load_v4(str(out), weights="bf16")  # FP8 projections dequantized: transformers' math
    held = [m.fp4 for m in net.modules() if isinstance(m, Experts)]
    assert held and all(w is not None for w in held)  # the routed experts stay in FP4
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = hf(ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(net(ids, V4State.empty(net.cfg)), want, rtol=0, atol=5e-5)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        tokens = hf.generate(ids[None], max_new_tokens=6, do_sample=False)[0, len(PROMPT) :]
    assert list(generate_v4(net, PROMPT, 6, ignore_eos=True).token_ids) == tokens.tolist()


def test_the_release_keeps_its_fp8_projections_in_fp8(
    release: tuple[torch.nn.Module, Path, Path],
) -> None:
    """By default the release's e4m3 projections load as FP8 linears holding the stored bytes
    and scales (the GEMMs quantize activations per token and 128 channels, as DeepSeek's FP8
    inference does); ``weights="bf16"`` gives the same matrices dequantized."""
    _, out, _ = release
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    fp8, plain = load_v4(str(out)), load_v4(str(out), weights="bf16")
    modules, plain_modules = dict(fp8.named_modules()), dict(plain.named_modules())
    held = [n for n in fp8.fp8_projections() if isinstance(modules[n], Fp8Linear)]
    stored = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn and ".wo_a." not in k]
    assert len(held) == len(stored) > 0  # every FP8 projection we run as FP8 stayed FP8
    layer = modules["model.layers.1.self_attn.q_a_proj"]
    release_w = tensors["layers.1.attn.wq_a.weight"]
    assert torch.equal(layer.weight.view(torch.uint8), release_w.view(torch.uint8))
    for name in held:
        want = plain_modules[name].weight
        assert torch.equal(modules[name].dequantized(torch.float32), want), name
    assert isinstance(modules["model.layers.1.self_attn.o_a_proj"].weight, torch.Tensor)
    ids = torch.tensor(PROMPT)
    got = fp8(ids, V4State.empty(fp8.cfg))
    want = plain(ids, V4State.empty(plain.cfg))
    # This random 4-layer model amplifies the activations' e4m3 rounding (~3% per GEMM input)
    # to ~22% of the logits' norm; scales misread (a tile off, UE8M0 taken as a float) are
    # orders of magnitude off.
    assert (got - want).norm() / want.norm() < 0.35


def test_an_ep_rank_reads_only_its_experts(release: tuple[torch.nn.Module, Path, Path]) -> None:
    """``expert_slots``: each layer holds those experts in slot order (an empty slot zeros),
    still in FP4, and never the others; an EP group of two ranks loading the release so gives
    one engine's greedy tokens."""
    from libs.common.sampling import SamplingParams
    from libs.engine.engine import Engine, EngineConfig
    from libs.engine.llm import LLM
    from libs.serving.ep.generate import collect_outputs, generate_ranks

    _, out, _ = release
    full, part = load_v4(str(out)), load_v4(str(out), expert_slots=(5, -1, 2))
    pairs = zip(
        [m for m in full.modules() if isinstance(m, Experts)],
        [m for m in part.modules() if isinstance(m, Experts)],
        strict=True,
    )
    for whole, mine in pairs:
        assert mine.slots == (5, -1, 2) and whole.fp4 is not None and mine.fp4 is not None
        for a, b in zip(whole.fp4, mine.fp4, strict=True):
            assert b.packed.shape[0] == 3 and not b.packed[1].any()  # the empty slot: zeros
            for t, u in ((a.packed, b.packed), (a.scales, b.scales)):
                assert torch.equal(u[0], t[5]) and torch.equal(u[2], t[2])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:5]]
    engine = dict(block_size=16, num_kv_blocks=32, time_budget_s=None)
    one = LLM(engine=Engine(EngineConfig(model=str(out), **engine)))
    want = [o.token_ids for o in one.generate(prompts, params, decode_text=False)]
    results = generate_ranks(str(out), prompts, params, ep=2, decode_text=False, **engine)
    assert [o.token_ids for o in collect_outputs(results, 2)] == want
