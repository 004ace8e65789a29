"""DeepSeek-V4's per-request state cut into blocks, cached by prefix, restored exactly.

A V4 request's state (:class:`~.model.V4State`) is not a KV row per token: per layer it is the
sliding window's last ``W - 1`` key/value rows, and per compressor the entries emitted so far
(one per ``rate`` tokens) plus the tokens of the window still open (and, for CSA, the previous
window's first series). What grows with the sequence is the entries; the rest is a bounded
carry. So the state after ``n * B`` tokens is stored as ``n`` blocks of ``B`` tokens (B = 128,
the engine's block), block ``k`` holding

* the entries each compressor emitted while the block's tokens went in (possibly none: HCA at
  rate 128 emits one per block, a rate above the block size not every block), and
* the carry at the block's end: the window rows, the open window's buffers, the CSA overlap
  series.

Restoring from blocks ``0 .. k`` concatenates their entries and takes block ``k``'s carry: the
state is exactly the one a full recompute reaches at that boundary, so the request continues
with no token replayed (the carry costs storage instead: ``W - 1`` rows of ``head_dim`` per
layer and block, 254 KiB a block for V4-Flash's 43 layers at bf16 with a 128-token window --
against DeepSeek's 140-token replay, which recomputes what this stores).

Blocks are named by the engine's hash chain over the tokens (:func:`chain_hashes`, with the
request's cache salt), so a prefix cache keyed like the KV cache's finds them
(:class:`V4BlockCache`), and travel as the engine's single-block KV frames (:func:`to_frames`,
:func:`from_frames`: model id, a layout naming the V4 config, the chain digest, the MAC with the
deployment's KV key), the kvstore's unit. A block is bytes (``encode_block``: a JSON header
naming each tensor, its dtype, shape and byte range, then the raw bytes; no pickle): whatever
reads one checks every field (:class:`V4BlockError`).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from libs.common.hashchain import chain_hashes

from ..kv.transfer import KVFormatError, KVHeader, decode_frame, encode_frame, verify
from .model import CompressorState, V4ForCausalLM, V4State

BLOCK_TOKENS = 128
MAGIC = b"DSV4BLK1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in _DTYPES.items()}
_CARRY = ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate")
_NAME = re.compile(r"L(\d+)\.(window|(\w+)\.(entries|buf_kv|buf_gate|overlap_kv|overlap_gate))")
MAX_HEADER = 1 << 20


class V4BlockError(ValueError):
    """Bytes that are not a V4 block of this model (or not a block at all)."""


def _counts(state: V4State) -> list[dict[str, int]]:
    return [{n: c.count for n, c in layer.compressors.items()} for layer in state.layers]


def encode_block(state: V4State, before: Sequence[dict[str, int]]) -> bytes:
    """The block that ends at ``state.seen``: the entries emitted since the counts ``before``
    (per layer and compressor, taken at the block's start), and the carry now."""
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(state.layers):
        if layer.window is not None:
            tensors[f"L{i}.window"] = layer.window
        for name, comp in layer.compressors.items():
            if comp.entries is not None:
                tensors[f"L{i}.{name}.entries"] = comp.entries[before[i].get(name, 0) :]
            for part in _CARRY:
                value = getattr(comp, part)
                if value is not None:
                    tensors[f"L{i}.{name}.{part}"] = value
    index = []
    raw = bytearray()
    for name, t in tensors.items():
        data = t.detach().contiguous().cpu()
        blob = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        index.append([name, _NAMES[t.dtype], list(t.shape), len(raw), len(blob)])
        raw += blob
    header = json.dumps({"position": state.seen, "tensors": index}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + bytes(raw)


def decode_block(
    data: bytes, num_layers: int, device: torch.device | str = "cpu"
) -> tuple[int, dict[str, torch.Tensor]]:
    """(the position the block ends at, its tensors by name); :class:`V4BlockError` for
    anything that is not a well-formed block of a ``num_layers``-layer model."""
    if len(data) < len(MAGIC) + 4 or data[: len(MAGIC)] != MAGIC:
        raise V4BlockError("not a V4 state block (bad magic)")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > len(data):
        raise V4BlockError(f"V4 block header of {hlen} bytes does not fit the block")
    try:
        header = json.loads(data[start : start + hlen])
        position = int(header["position"])
        index = list(header["tensors"])
    except (ValueError, KeyError, TypeError) as exc:
        raise V4BlockError(f"unreadable V4 block header: {exc}") from None
    body = memoryview(data)[start + hlen :]
    out: dict[str, torch.Tensor] = {}
    for entry in index:
        try:
            name, dtype_name, shape, offset, size = entry
            dtype = _DTYPES[dtype_name]
            shape = [int(d) for d in shape]
        except (ValueError, KeyError, TypeError) as exc:
            raise V4BlockError(f"bad tensor entry in a V4 block: {entry!r} ({exc})") from None
        m = _NAME.fullmatch(str(name)) if isinstance(name, str) else None
        if m is None or int(m.group(1)) >= num_layers:
            raise V4BlockError(f"V4 block names {name!r}, not a state tensor of this model")
        numel = 1
        for d in shape:
            if d < 0:
                raise V4BlockError(f"V4 block tensor {name} has a negative dimension")
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if size != numel * itemsize or offset < 0 or offset + size > len(body):
            raise V4BlockError(f"V4 block tensor {name}: its bytes do not match its shape")
        if numel:
            flat = torch.frombuffer(bytearray(body[offset : offset + size]), dtype=torch.uint8)
            out[name] = flat.view(dtype).reshape(shape).to(device)
        else:
            out[name] = torch.empty(shape, dtype=dtype, device=device)
    return position, out


def restore(blocks: Sequence[bytes], net: V4ForCausalLM) -> V4State:
    """The state after blocks ``0 .. len - 1`` (each ``block_tokens`` long, consecutive):
    their entries in order and the last block's carry. The request continues from there."""
    return restore_open(blocks, net)[0]


def restore_open(
    blocks: Sequence[bytes], net: V4ForCausalLM
) -> tuple[V4State, list[dict[str, int]]]:
    """:func:`restore`, and the entry counts at the last block's start: what
    :func:`encode_block` takes to write that block again once more tokens went in (the last
    block may be partial: it ends where its header says)."""
    cfg = net.cfg
    device = next(net.parameters()).device
    state = V4State.empty(cfg)
    before = _counts(state)
    for k, data in enumerate(blocks):
        before = _counts(state)
        position, tensors = decode_block(data, cfg.num_hidden_layers, device)
        if k and position <= state.seen:
            raise V4BlockError(f"V4 block {k} ends at {position}, not after block {k - 1}")
        last = k == len(blocks) - 1
        for name, t in tensors.items():
            m = _NAME.fullmatch(name)
            assert m is not None  # checked by decode_block
            layer = state.layers[int(m.group(1))]
            if m.group(2) == "window":
                if last:
                    layer.window = t
                continue
            comp = layer.compressors.setdefault(m.group(3), CompressorState())
            part = m.group(4)
            if part == "entries":
                comp.entries = t if comp.entries is None else torch.cat([comp.entries, t])
            elif last:
                setattr(comp, part, t)
        state.seen = position
    return state, before


def prefill_blocks(
    net: V4ForCausalLM,
    ids: Sequence[int],
    state: V4State | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> tuple[V4State, list[bytes], torch.Tensor]:
    """Run ``ids`` after ``state`` (fresh if None, which must sit on a block boundary) in
    block-aligned chunks; (the state after them, the blocks completed on the way, the logits of
    the last chunk's last token)."""
    state = state or V4State.empty(net.cfg)
    if state.seen % block_tokens:
        raise ValueError(f"state at {state.seen} is not on a {block_tokens}-token boundary")
    device = next(net.parameters()).device
    blocks: list[bytes] = []
    logits = torch.empty(0)
    i = 0
    while i < len(ids):
        step = block_tokens - state.seen % block_tokens
        chunk = list(ids[i : i + step])
        before = _counts(state)
        logits = net(torch.tensor(chunk, device=device), state)[-1]
        i += len(chunk)
        if state.seen % block_tokens == 0:
            blocks.append(encode_block(state, before))
    return state, blocks, logits


@dataclass
class V4BlockCache:
    """Blocks by chain digest (the tokens they cover and the ones before, the cache salt)."""

    block_tokens: int = BLOCK_TOKENS
    blocks: dict[bytes, bytes] = field(default_factory=dict)

    def names(self, tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
        return chain_hashes(list(tokens), self.block_tokens, salt)

    def put(
        self, tokens: Sequence[int], blocks: Sequence[bytes], first: int = 0, salt: bytes = b""
    ) -> None:
        """Store ``blocks`` as blocks ``first ..`` of ``tokens``."""
        names = self.names(tokens[: (first + len(blocks)) * self.block_tokens], salt)
        for name, data in zip(names[first:], blocks, strict=True):
            self.blocks[name] = data

    def longest(self, tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """The cached blocks of the longest prefix of ``tokens[:-1]`` (the last token is
        always computed: its logits are the ones sampled from)."""
        out = []
        for name in self.names(tokens[:-1], salt):
            data = self.blocks.get(name)
            if data is None:
                break
            out.append(data)
        return out


def layout_hash(net: V4ForCausalLM) -> str:
    """Names the state layout (the config's every field): frames of another config are refused."""
    blob = json.dumps(asdict(net.cfg), sort_keys=True, default=str).encode()
    return "v4-state-" + hashlib.sha256(blob).hexdigest()[:16]


def to_frames(
    blocks: Sequence[bytes],
    tokens: Sequence[int],
    model_id: str,
    net: V4ForCausalLM,
    first: int = 0,
    salt: bytes = b"",
    key: bytes | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> list[tuple[bytes, bytes, bytes]]:
    """Blocks ``first ..`` of ``tokens`` as (chain digest, parent digest or b"", single-block KV
    frame) each: what the kvstore's Put takes, as the engine's ``export_blocks`` gives."""
    names = chain_hashes(list(tokens[: (first + len(blocks)) * block_tokens]), block_tokens, salt)
    layout = layout_hash(net)
    out = []
    for k, data in enumerate(blocks, start=first):
        header = KVHeader(
            model_id,
            layout,
            block_tokens,
            "v4-state",
            len(data),
            (k + 1) * block_tokens,
            k,
            (names[k].hex(),),
        )
        out.append((names[k], names[k - 1] if k else b"", encode_frame(header, data, key)))
    return out


def from_frames(
    frames: Sequence[bytes],
    tokens: Sequence[int],
    model_id: str,
    net: V4ForCausalLM,
    salt: bytes = b"",
    key: bytes | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> list[bytes]:
    """The blocks in ``frames`` (blocks ``0 ..`` of ``tokens``, in order), each checked: a
    frame of this model and config, for these tokens (its chain digest), signed with ``key``
    when one is set. :class:`KVFormatError` (or its ``KVIntegrityError``) says which is not."""
    names = chain_hashes(list(tokens[: len(frames) * block_tokens]), block_tokens, salt)
    layout = layout_hash(net)
    out = []
    for k, frame in enumerate(frames):
        header, payload = decode_frame(frame)
        verify(key, header, payload)
        if header.model_id != model_id or header.layout_hash != layout:
            raise KVFormatError(
                f"V4 block {k} is of model {header.model_id!r} / layout {header.layout_hash}, "
                f"not {model_id!r} / {layout}"
            )
        if k >= len(names) or header.first_block != k or header.chain_hash != names[k].hex():
            raise KVFormatError(f"V4 block {k} does not belong to these tokens (chain digest)")
        out.append(bytes(payload))
    return out
