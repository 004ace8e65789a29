from __future__ import annotations

import os
from typing import Any

import pytest
import torch

# Triton kernels run on the CPU through Triton's interpreter; the switch is read when a kernel
# is decorated, so it is set before any test imports one. A CUDA machine runs them compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import dataclasses

    import triton.runtime.interpreter as _interpreter

    # The interpreter checks every int32 add, sub and mul of a kernel for overflow (recomputed
    # in int64, then asserted): a third of an interpreted test's time, at shapes nowhere near
    # int32's range. Compiled kernels do not check either; their offsets past it are int64.
    _builder = _interpreter.interpreter_builder
    _builder.options = dataclasses.replace(_builder.options, sanitize_overflow=False)

    # Each call of a @triton.jit helper inside a kernel patches triton.language for the
    # interpreter again (inspect.getmembers over the whole package, ~0.2 ms), though the
    # kernel's launch patched it already and restores it when the grid is done: a third of an
    # interpreted engine test's time went there. A helper whose modules the running launch has
    # patched skips it; everything else patches as before.
    _patch_lang = _interpreter._patch_lang
    _grid_call = _interpreter.GridExecutor.__call__
    _launch: dict[str, object] = {"starting": False, "langs": None}

    def _langs(fn: Any) -> frozenset[int]:
        mods = {id(_interpreter.tl), id(_interpreter.tl.core)}
        return frozenset(id(v) for v in fn.__globals__.values() if id(v) in mods)

    def _patch_lang_once(fn: Any) -> Any:
        langs = _langs(fn)
        if _launch["starting"]:  # the launch's own patch, restored when its grid is done
            _launch["starting"] = False
            scope = _patch_lang(fn)
            _launch["langs"] = langs
            return scope
        active = _launch["langs"]
        if isinstance(active, frozenset) and langs <= active:
            return None  # a helper's call: patched already (and its result is never used)
        return _patch_lang(fn)

    def _grid_call_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        _launch["starting"] = True
        try:
            return _grid_call(self, *args, **kwargs)
        finally:
            _launch["starting"], _launch["langs"] = False, None

    _interpreter._patch_lang = _patch_lang_once
    _interpreter.GridExecutor.__call__ = _grid_call_once

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny preset's weights, built once per test session (engines share them read-only)."""
    from libs.engine.loader import load

    return load("tiny", "cpu", torch.float32, seed=0)


@pytest.fixture(scope="session")
def tiny_mtp():
    """The tiny preset with its MTP layer, built once per test session (read-only; tests that
    change it work on a copy)."""
    from libs.engine.loader import load

    return load("tiny", "cpu", torch.float32, 0, with_mtp=True)
