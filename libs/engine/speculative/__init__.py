"""Speculative decoding with the model's MTP head, lossless, drafts verified by confidence.

:mod:`.decoder` (the engine's speculative half, :class:`SpecDecoder`) over :mod:`.policy`
(which drafts to verify), :mod:`.verify` (acceptance, row by row) and :mod:`.drafter` (the MTP
passes); :mod:`.synthetic` makes an MTP head for measuring without trained weights.
"""

from .decoder import SpecDecoder
from .policy import SCHEDULES, AcceptanceModel, choose_drafts
from .synthetic import make_mtp_test_model
from .verify import (
    SpecStats,
    SpecStep,
    greedy_accept,
    seeded_generator,
    token_logprob,
    verification_rules,
    verify_row,
)

__all__ = [
    "SCHEDULES",
    "AcceptanceModel",
    "SpecDecoder",
    "SpecStats",
    "SpecStep",
    "choose_drafts",
    "greedy_accept",
    "make_mtp_test_model",
    "seeded_generator",
    "token_logprob",
    "verification_rules",
    "verify_row",
]
