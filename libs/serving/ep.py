"""Expert parallelism for the engine services: flags, rank identity, and one rank's engine.

``python -m services.decode --ep N`` runs one engine instance as an EP group of N ranks, one
process per rank. The process started with ``--ep N`` is the group's supervisor
(:mod:`libs.serving.ep_supervisor`): it runs no engine; it starts the N rank processes -- the
same service with the same flags plus ``--ep-rank k``, ``--ep-rendezvous host:port``, its own
``--instance-id <instance>-r<k>``, ops port and (decode) gRPC port -- and restarts the group
smaller when a rank dies. Attention is data-parallel, so each rank is a routing target of its
own: it heartbeats, takes tasks and receives KV under its own instance id, exactly like an
instance without EP; only its engine steps in lockstep with its peers
(:class:`libs.engine.ep.lockstep.Lockstep`, driven by :class:`~.engine_loop.EngineLoop`).

Timeouts: the rendezvous and the first collective (every rank has loaded its model) wait up to
``--ep-start-timeout`` (ranks load at different speeds); from then on every collective waits
at most ``--ep-timeout``, so a rank whose peer hangs fails within it. A peer that dies is
noticed sooner: gloo reports the closed connection on the next collective (~1 ms).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from libs.common.config import flag

if TYPE_CHECKING:
    from libs.engine.engine import Engine

    from .model_flags import ModelFlags

log = logging.getLogger(__name__)

# A rank's exit code when its group failed under it (a peer died or timed out): the rank
# itself is healthy and may join the smaller group the supervisor starts next. 75 = EX_TEMPFAIL.
EXIT_GROUP_FAILED = 75
DEFAULT_TIMEOUT_S = 10.0  # a collective's wait once serving (a tiny model's step: ~10 ms)
DEFAULT_START_TIMEOUT_S = 300.0  # rendezvous + model load of the slowest rank


@dataclass(frozen=True)
class EPFlags:
    """``size`` ranks (1: no EP). ``rank`` None: this process supervises the group (or runs
    alone at size 1); else it is that rank, joining the group at ``rendezvous``."""

    size: int = 1
    rank: int | None = None
    rendezvous: str = ""  # host:port of rank 0's TCP store (the supervisor picks it)
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--ep must be >= 1, got {self.size}")
        if self.timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError(
                f"--ep-timeout and --ep-start-timeout must be positive, got "
                f"{self.timeout_s} / {self.start_timeout_s}"
            )
        if self.rank is not None:
            if not 0 <= self.rank < self.size:
                raise ValueError(f"--ep-rank {self.rank} outside a group of --ep {self.size}")
            host, _, port = self.rendezvous.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"--ep-rank needs --ep-rendezvous host:port, got {self.rendezvous!r}"
                )

    @property
    def supervises(self) -> bool:
        """This process starts and watches the ranks (it runs no engine itself)."""
        return self.size > 1 and self.rank is None

    @property
    def is_rank(self) -> bool:
        return self.rank is not None


def rank_instance_id(instance_id: str, rank: int, generation: int = 0) -> str:
    """The routing identity of one rank: ``<instance>-r<k>``; after the group restarted
    ``generation`` times ``<instance>-r<k>-g<generation>``, so the entrypoint never mistakes
    a new rank for the one that failed its requests (it excludes failed ids on retry)."""
    base = f"{instance_id}-r{rank}"
    return base if generation == 0 else f"{base}-g{generation}"


def add_ep_flags(parser: argparse.ArgumentParser) -> None:
    flag(
        parser,
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks of this instance, one process each (started by this "
        "process, which then supervises them); each rank is its own routing target, "
        "<instance-id>-r<k>. 1: no expert parallelism",
    )
    flag(
        parser,
        "--ep-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds any collective of a serving EP group may wait: a rank whose peer hangs "
        "fails within it, and the group restarts with the ranks that are left",
    )
    flag(
        parser,
        "--ep-start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        help="seconds the ranks may take to meet and load the model",
    )
    # Set by the supervisor on the ranks it starts, not by people.
    flag(parser, "--ep-rank", type=int, default=-1, help=argparse.SUPPRESS)
    flag(parser, "--ep-rendezvous", default="", help=argparse.SUPPRESS)


def ep_flags_from(args: argparse.Namespace) -> EPFlags:
    return EPFlags(
        size=args.ep,
        rank=None if args.ep_rank < 0 else args.ep_rank,
        rendezvous=args.ep_rendezvous,
        timeout_s=args.ep_timeout,
        start_timeout_s=args.ep_start_timeout,
    )


def check_ep_model(ep: EPFlags, model: ModelFlags) -> None:
    """ValueError for a model an EP group cannot run (the fake engine has no experts)."""
    if ep.size > 1 and model.model == "fake":  # fake_engine.FAKE_MODEL (imports torch)
        raise ValueError("--ep needs a model with experts; --model fake has none")


def build_rank_engine(model: ModelFlags, ep: EPFlags) -> Engine:
    """This rank's engine: join the group, load the model with this rank's experts, meet the
    peers once loaded (``start_timeout_s``), then tighten every collective to ``timeout_s``.
    Slow (loads weights): call off the event loop."""
    import dataclasses

    import torch

    from libs.engine.engine import Engine
    from libs.engine.ep.group import EPGroup
    from libs.engine.ep.launch import rank_device

    assert ep.rank is not None
    host, _, port = ep.rendezvous.rpartition(":")
    device = rank_device(model.device, ep.rank)
    if not device.startswith("cuda"):
        # N ranks share this host's cores: none oversubscribes them on its own.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ep.size))
    group = EPGroup.init(
        ep.rank, ep.size, host, int(port), device=device, timeout_s=ep.start_timeout_s
    )
    engine = Engine(dataclasses.replace(model.engine_config(), device=device), ep=group)
    group.all_max([0])  # every rank has loaded: from here on a wait means a failed peer
    set_collective_timeout(group, ep.timeout_s)
    return engine


def set_collective_timeout(group: object, seconds: float) -> None:
    """Every later collective of the default process group waits at most ``seconds``.

    torch's ``_set_pg_timeout`` is private; EPGroup is the place for a public
    ``set_timeout`` (the EP engine's owner's file)."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds))
    if hasattr(group, "timeout_s"):
        group.timeout_s = seconds
