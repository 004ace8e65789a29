"""What a DeepSeek-V4 request carries between forward calls, per layer, as data (:class:`V4State`;
see :mod:`.model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import V4Config


class CompressorState:
    """One compressor's state (module doc). Rows fed one at a time (decode) wait in a list
    until their window closes or someone reads ``buf_kv``/``buf_gate``: appending a row
    launches nothing on the device (the rows are views of their step's projections, so a
    window of ``rate`` tokens keeps up to ``rate - 1`` steps' projection rows alive)."""

    def __init__(self) -> None:
        self._kv: torch.Tensor | None = None
        self._gate: torch.Tensor | None = None
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # after _kv/_gate
        self.entries: torch.Tensor | None = None
        self.overlap_kv: torch.Tensor | None = None
        self.overlap_gate: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[0])

    @property
    def buffered(self) -> int:
        """Tokens of the open window fed so far."""
        return (0 if self._kv is None else int(self._kv.shape[0])) + len(self._rows)

    def append(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """One more token's ``[1, width]`` rows, joined to the buffer only when read."""
        self._rows.append((kv, gate))

    def take(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The open window's rows (kv pieces, gate pieces) in order; the buffer left empty."""
        kv = ([] if self._kv is None else [self._kv]) + [r[0] for r in self._rows]
        gate = ([] if self._gate is None else [self._gate]) + [r[1] for r in self._rows]
        self._kv = self._gate = None
        self._rows = []
        return kv, gate

    def _join(self) -> None:
        if self._rows:
            kv = [] if self._kv is None else [self._kv]
            gate = [] if self._gate is None else [self._gate]
            self._kv = torch.cat(kv + [r[0] for r in self._rows])
            self._gate = torch.cat(gate + [r[1] for r in self._rows])
            self._rows = []

    @property
    def buf_kv(self) -> torch.Tensor | None:
        self._join()
        return self._kv

    @buf_kv.setter
    def buf_kv(self, value: torch.Tensor | None) -> None:
        self._join()
        self._kv = value

    @property
    def buf_gate(self) -> torch.Tensor | None:
        self._join()
        return self._gate

    @buf_gate.setter
    def buf_gate(self, value: torch.Tensor | None) -> None:
        self._join()
        self._gate = value


@dataclass
class LayerState:
    window: torch.Tensor | None = None
    compressors: dict[str, CompressorState] = field(default_factory=dict)


@dataclass
class V4State:
    """A request's state between forward calls (module doc); ``seen`` tokens so far."""

    layers: list[LayerState]
    seen: int = 0

    @classmethod
    def empty(cls, cfg: V4Config) -> V4State:
        return cls([LayerState() for _ in range(cfg.num_hidden_layers)])
