"""``--model ORG/NAME[@REVISION]``: resolved through huggingface_hub into the standard cache
(libs/engine/hub.py), tested offline against a cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from deepserve import cli
from libs.engine import hub
from libs.engine.config import ModelConfig
from libs.engine.hub import ModelUnavailable, model_label, parse_repo_id, resolve_model
from libs.engine.llm import LLM
from libs.engine.model.model import DeepseekForCausalLM
from libs.engine.presets import init_random_weights
from libs.engine.tokenizer import model_vocab_size
from libs.serving.model_flags import add_model_flags, model_flags_from

REPO = "acme/tiny-ds"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HF_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _write_checkpoint(path: Path) -> None:
    """A small synthetic checkpoint: config.json + model.safetensors of seeded weights."""
    path.mkdir(parents=True)
    model = DeepseekForCausalLM(ModelConfig.from_hf(HF_CONFIG), torch.float32, "cpu")
    init_random_weights(model, seed=3)
    state = {k: v.contiguous() for k, v in model.named_parameters()}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(HF_CONFIG))


def _hf_cache(root: Path, repo: str = REPO, commit: str = COMMIT) -> Path:
    """``root`` laid out as huggingface_hub's cache: blobs named by their hash, the snapshot's
    files symlinks to them, refs/main naming the commit. Returns the snapshot directory."""
    src = root.parent / "src"
    if not src.exists():
        _write_checkpoint(src)
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    snapshot = _hf_cache(cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local directory named like the repo
    return snapshot


def test_repo_ids_are_told_from_presets_and_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_repo_id("deepseek-ai/DeepSeek-V3") == ("deepseek-ai/DeepSeek-V3", None)
    assert parse_repo_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for not_a_repo in ("tiny", "fake", "v4-tiny", "./org/name", "/org/name", "~/x/y", "a--b/c"):
        assert parse_repo_id(not_a_repo) is None, not_a_repo
        assert resolve_model(not_a_repo) == not_a_repo
    (tmp_path / "local" / "ckpt").mkdir(parents=True)  # an existing relative path wins
    assert parse_repo_id("local/ckpt") is None


def test_a_cached_repo_resolves_offline_to_its_snapshot(offline_cache: Path, monkeypatch) -> None:
    assert resolve_model(REPO) == str(offline_cache)
    assert resolve_model(f"{REPO}@{COMMIT}") == str(offline_cache)
    assert resolve_model(f"{REPO}@main") == str(offline_cache)
    assert model_label(str(offline_cache)) == REPO
    # HF_HOME/hub is the cache when HF_HUB_CACHE is not set.
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(offline_cache.parents[3]))
    assert resolve_model(REPO) == str(offline_cache)
    # Everything that turns a model string into files sees the snapshot.
    assert model_vocab_size(REPO) == HF_CONFIG["vocab_size"]
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    assert model_flags_from(parser.parse_args(["--model", REPO])).model == str(offline_cache)


def test_the_engine_loads_a_repo_as_its_directory(offline_cache: Path, capsys) -> None:
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    from libs.common.sampling import SamplingParams

    sp = SamplingParams(**params)  # type: ignore[arg-type]
    by_repo = LLM(REPO, num_kv_blocks=16)
    by_dir = LLM(str(offline_cache.parents[3] / "src"), num_kv_blocks=16)
    assert by_repo.engine.loaded.source == str(offline_cache)
    out_repo = by_repo.generate([[5, 6, 7, 8]], sp)[0].token_ids
    out_dir = by_dir.generate([[5, 6, 7, 8]], sp)[0].token_ids
    assert list(out_repo) == list(out_dir) and len(out_repo) == 6
    # deepserve generate takes the repo id too.
    argv = ["generate", "--model", REPO, "--prompt-ids", "5,6,7,8", "--max-tokens", "6"]
    assert cli.main([*argv, "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == list(out_dir)


def test_an_uncached_repo_offline_is_one_line(offline_cache: Path, capsys, monkeypatch) -> None:
    with pytest.raises(ModelUnavailable) as err:
        resolve_model("acme/not-cached")
    msg = str(err.value)
    assert "'acme/not-cached'" in msg and "HF_HUB_OFFLINE" in msg and "\n" not in msg
    with pytest.raises(ModelUnavailable, match="not-cached@v2"):
        resolve_model("acme/not-cached@v2")
    argv = ["generate", "--model", "acme/not-cached", "--prompt-ids", "1"]
    assert cli.main(argv) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and "acme/not-cached" in err_text
    # deepserve up says it before starting anything.
    started: list[object] = []
    monkeypatch.setattr("deepserve.up.run_up", lambda *a, **k: started.append(a) or 0)
    assert cli.main(["up", "--model", "acme/not-cached"]) == 2
    err_text = capsys.readouterr().err
    assert err_text.startswith("deepserve up: Hugging Face repo 'acme/not-cached'")
    assert err_text.count("\n") == 1 and not started
    # ... and hands the services the snapshot directory of a cached one.
    assert cli.main(["up", "--model", REPO]) == 0
    assert started[0][3] == str(offline_cache) and started[0][4] == "tiny-ds"


def _http_error(cls: type, status: int) -> Exception:
    response = SimpleNamespace(status_code=status, headers={}, request=None, url="")
    return cls("refused", response=response)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("error", "words"),
    [
        ("GatedRepoError", ("is gated", "HF_TOKEN")),
        ("RepositoryNotFoundError", ("was not found on the Hugging Face Hub",)),
        ("RevisionNotFoundError", ("has no revision 'v9'",)),
        ("HfHubHTTPError", ("refused access (HTTP 401)", "HF_TOKEN")),
    ],
)
def test_hub_refusals_are_named(error: str, words, tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub
    import huggingface_hub.errors as errors

    exc = _http_error(getattr(errors, error), 401 if error == "HfHubHTTPError" else 404)

    def refuse(*_a, **_k):
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelUnavailable) as err:
        resolve_model("acme/private@v9")
    assert "'acme/private@v9'" in str(err.value) and "\n" not in str(err.value)
    for w in words:
        assert w in str(err.value)


def test_a_repo_without_config_json_is_not_a_checkpoint(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    empty = tmp_path / "snap"
    empty.mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(empty))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    monkeypatch.chdir(tmp_path)
    hub._snapshot.cache_clear()
    with pytest.raises(ModelUnavailable, match="has no config.json"):
        resolve_model("acme/readme-only")
