"""``--model ORG/NAME[@REVISION]``: a Hugging Face Hub repository, fetched into the standard cache.

:func:`resolve_model` is the one place a model string becomes something the loader, the
tokenizer and the services can open: presets, ``fake`` and existing local paths come back as
they are; a repo id (``deepseek-ai/DeepSeek-V3``, ``org/name@<branch, tag or commit>``) comes
back as the snapshot directory ``huggingface_hub.snapshot_download`` leaves in the cache
(``<cache>/models--ORG--NAME/snapshots/<commit>``), which then loads as the checkpoint
directory it is. Only the files a checkpoint needs are fetched (``*.json``, ``*.safetensors``,
``*.jinja``: config, weights, index, tokenizer, chat template).

The environment is read at each call, as huggingface_hub reads it at import: ``HF_HUB_CACHE``
(else ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``), ``HF_HUB_OFFLINE`` (only the cache
is looked at) and ``HF_TOKEN`` (gated and private repos). A repo that cannot be had is one
:class:`ModelUnavailable` line naming the repo and why (offline and not cached, no such repo or
revision, gated or unauthorized, the Hub unreachable), never a traceback.

Torch-free and cheap to import: huggingface_hub is imported only when a repo id is resolved.
A process resolves a repo id once (cached by id, revision, cache directory and offline mode),
so a branch such as ``main`` names one commit for the whole process.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.jinja")
# huggingface_hub's repo id rules: [org/]name, letters, digits, '-', '_', '.'; at most 96 chars.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^({_PART}/{_PART})(?:@(.+))?$")
_TRUE = ("1", "ON", "YES", "TRUE")


class ModelUnavailable(ValueError):
    """A Hub repository named by ``--model`` cannot be had; the message is one line."""


def parse_repo_id(model: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``model`` is spelled as a Hub repo id and is not an existing
    local path; None otherwise (presets, ``fake``, directories, ``./x``, ``/x``, ``~/x``)."""
    if not model or model.startswith((".", "/", "~")) or Path(model).exists():
        return None
    m = _REPO_ID.match(model)
    if m is None or "--" in m.group(1) or ".." in m.group(1) or len(m.group(1)) > 96:
        return None
    revision = m.group(2)
    if revision is not None and not revision.strip():
        return None
    return m.group(1), revision


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps repositories, from the environment as it is now."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def resolve_model(model: str) -> str:
    """A path (or preset name) for ``model``; see the module docstring. A repo id is fetched
    (or, offline, found) in the Hub cache; :class:`ModelUnavailable` when it cannot be."""
    parsed = parse_repo_id(model)
    if parsed is None:
        return model
    repo, revision = parsed
    return _snapshot(repo, revision, hub_cache_dir(), hub_offline())


@functools.lru_cache(maxsize=16)
def _snapshot(repo: str, revision: str | None, cache_dir: str, offline: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"{repo}@{revision}" if revision else repo
    where = f"Hugging Face repo {name!r}"
    try:
        path = snapshot_download(
            repo,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            allow_patterns=list(CHECKPOINT_FILES),
        )
    except IncompleteSnapshotError as exc:
        raise ModelUnavailable(
            f"{where}: the cached snapshot in {cache_dir} is incomplete and the Hub cannot be "
            f"reached to finish it ({_first_line(exc)})"
        ) from None
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ModelUnavailable(
                f"{where} is not in the Hugging Face cache {cache_dir} and HF_HUB_OFFLINE is "
                "set: download it once online (or point HF_HUB_CACHE / HF_HOME at a cache "
                "that holds it)"
            ) from None
        raise ModelUnavailable(
            f"{where}: the Hugging Face Hub cannot be reached and the repo is not in the cache "
            f"{cache_dir} ({_cause(exc)})"
        ) from None
    except GatedRepoError:
        raise ModelUnavailable(
            f"{where} is gated: accept its terms on huggingface.co and set HF_TOKEN to a token "
            "of that account"
        ) from None
    except RevisionNotFoundError:
        raise ModelUnavailable(f"{where}: the repo has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
        raise ModelUnavailable(
            f"{where} was not found on the Hugging Face Hub (private repos need a token; "
            f"{token}), nor is it a local directory"
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise ModelUnavailable(
                f"{where}: the Hub refused access (HTTP {status}): set HF_TOKEN to a token "
                "that may read it"
            ) from None
        raise ModelUnavailable(f"{where}: {_first_line(exc)}") from None
    except HFValidationError as exc:
        raise ModelUnavailable(f"{where}: {_first_line(exc)}") from None
    except OSError as exc:  # disk full, permissions on the cache, ...
        raise ModelUnavailable(f"{where}: fetching into {cache_dir} failed: {exc}") from None
    if not (Path(path) / "config.json").is_file():
        raise ModelUnavailable(f"{where} has no config.json: not a model checkpoint ({path})")
    return str(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return f"{type(cause).__name__}: {_first_line(cause)}" if cause else _first_line(exc)


def model_label(model: str) -> str:
    """A short name for logs: a preset as it is, a Hub cache snapshot as ``ORG/NAME``, a
    directory by its name."""
    path = Path(model)
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/", 1)
    return path.name or model
