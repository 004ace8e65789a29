"""Expert parallelism for the engine services: flags, rank identity, and one rank's engine.

``python -m services.decode --ep N`` runs one engine instance as an EP group of N ranks, one
process per rank. The process started with ``--ep N`` is the group's supervisor
(:mod:`libs.serving.ep_supervisor`): it runs no engine; it starts the N rank processes -- the
same service with the same flags plus ``--ep-rank k``, ``--ep-rendezvous host:port``, its own
``--instance-id <instance>-r<k>``, ops port and (decode) gRPC port -- and restarts the group
smaller when a rank dies. Attention is data-parallel, so each rank is a routing target of its
own: it heartbeats, takes tasks and receives KV under its own instance id, exactly like an
instance without EP; only its engine steps in lockstep with its peers
(:class:`~.lockstep.Lockstep`, driven by :class:`~libs.serving.engine_loop.EngineLoop`).

Timeouts: the rendezvous and the first collective (every rank has loaded its model) wait up to
``--ep-start-timeout`` (ranks load at different speeds); from then on every collective waits
at most ``--ep-timeout``, so a rank whose peer hangs fails within it. A peer that dies is
noticed sooner: gloo reports the closed connection on the next collective (~1 ms).

EPLB (``--eplb decode|prefill|off``; default: the service's own role when ``--ep`` > 1) moves
the routed experts between the ranks from the load they saw; each rank exports the live
balance on its ops port (:mod:`libs.serving.ep_metrics`).

GPUs: with ``--device cuda`` rank k runs on ``cuda:<k>``, or on ``cuda:<gpus[k]>`` with
``--ep-gpus`` (``deepserve up`` passes each instance its own); NCCL needs one GPU per rank, so
two ranks on one GPU are refused at start. The supervisor probes its devices before each
start (:mod:`libs.serving.ep.health`) and places the group on the healthy ones only.

Hosts: one group may span H hosts (``--ep N --ep-ranks-per-host N/H --ep-node-rank i
--ep-master host:port``): each host runs a supervisor of its own that starts global ranks
``i*N/H .. (i+1)*N/H - 1``; rank 0 (on node 0) serves the rendezvous at ``--ep-master``.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from libs.common.config import flag, parse_gpu_indices
from libs.common.logs import tag_rank

if TYPE_CHECKING:
    from libs.engine.engine import Engine, EngineConfig
    from libs.engine.ep.eplb import EplbConfig
    from libs.engine.load_progress import ProgressSink

    from ..model_flags import ModelFlags

log = logging.getLogger(__name__)

# A rank's exit code when its group failed under it (a peer died or timed out): the rank
# itself is healthy and may join the smaller group the supervisor starts next. 75 = EX_TEMPFAIL.
EXIT_GROUP_FAILED = 75
DEFAULT_TIMEOUT_S = 10.0  # a collective's wait once serving (a tiny model's step: ~10 ms)
DEFAULT_START_TIMEOUT_S = 300.0  # rendezvous + model load of the slowest rank
# A device left out after its rank failed is probed again this long after (and then every
# this long): long enough that a flapping GPU does not restart the group every few seconds.
DEFAULT_REGROW_S = 60.0
EPLB_MODES = ("off", "decode", "prefill")


@dataclass(frozen=True)
class EPFlags:
    """``size`` ranks (1: no EP). ``rank`` None: this process supervises the group (or runs
    alone at size 1); else it is that rank, joining the group at ``rendezvous``."""

    size: int = 1
    rank: int | None = None
    rendezvous: str = ""  # host:port of rank 0's TCP store (the supervisor picks it)
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    # EPLB's defaults ("decode": DeepSeek's 1,000 / 10,000 steps; "prefill": 100 / 1,000) or
    # "off" (placement fixed); the two overrides replace its window / interval (0: keep).
    eplb: str = "off"
    eplb_window: int = 0
    eplb_every: int = 0
    gpus: tuple[int, ...] = ()  # --ep-gpus: rank k on cuda:<gpus[k]>; (): cuda:<k>
    # Hosts: rank 0's rendezvous (""; this host, a free port), ranks per host (0: all of
    # them), this host's index; a device left out after a failure is probed again after
    # regrow_s; health_file lists devices an operator (or a test) marks unhealthy.
    master: str = ""
    ranks_per_host: int = 0
    node_rank: int = 0
    regrow_s: float = DEFAULT_REGROW_S
    health_file: str = ""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--ep must be >= 1, got {self.size}")
        if self.eplb not in EPLB_MODES:
            raise ValueError(f"--eplb must be off, decode or prefill, got {self.eplb!r}")
        if self.eplb_window < 0 or self.eplb_every < 0:
            raise ValueError(
                f"--eplb-window and --eplb-every must be >= 0 (0: the --eplb default), got "
                f"{self.eplb_window} / {self.eplb_every}"
            )
        if len(set(self.gpus)) != len(self.gpus) or any(g < 0 for g in self.gpus):
            raise ValueError(
                f"--ep-gpus must list distinct GPU indices (NCCL needs one GPU per rank), "
                f"got {','.join(map(str, self.gpus))}"
            )
        self._check_hosts()
        if self.gpus and len(self.gpus) < self.local_ranks:
            raise ValueError(
                f"--ep-gpus {','.join(map(str, self.gpus))}: {len(self.gpus)} GPUs for "
                f"{self.local_ranks} ranks on this host; each rank needs a GPU of its own"
            )
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

    def _check_hosts(self) -> None:
        if self.ranks_per_host < 0 or self.size % (self.ranks_per_host or self.size):
            raise ValueError(
                f"--ep-ranks-per-host {self.ranks_per_host} must divide --ep {self.size} "
                f"(0: every rank on this host)"
            )
        if not 0 <= self.node_rank < self.hosts:
            raise ValueError(
                f"--ep-node-rank {self.node_rank} outside {self.hosts} hosts "
                f"(--ep {self.size} / --ep-ranks-per-host {self.local_ranks})"
            )
        if self.master:
            host, _, port = self.master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--ep-master must be host:port, got {self.master!r}")
        elif self.hosts > 1:
            raise ValueError(
                f"--ep {self.size} over {self.hosts} hosts needs --ep-master host:port "
                f"(where node 0's rank 0 serves the rendezvous)"
            )
        if self.regrow_s <= 0:
            raise ValueError(f"--ep-regrow-s must be positive, got {self.regrow_s}")

    @property
    def local_ranks(self) -> int:
        """The ranks this host runs (``--ep-ranks-per-host``; 0: all of them)."""
        return self.ranks_per_host or self.size

    @property
    def hosts(self) -> int:
        return self.size // self.local_ranks

    @property
    def first_rank(self) -> int:
        """This host's first global rank."""
        return self.node_rank * self.local_ranks

    @property
    def supervises(self) -> bool:
        """This process starts and watches the ranks (it runs no engine itself)."""
        return self.size > 1 and self.rank is None

    @property
    def is_rank(self) -> bool:
        return self.rank is not None

    def eplb_config(self) -> EplbConfig | None:
        """What the rank's engine runs: None without EP (one rank) or with ``--eplb off``."""
        if self.size == 1 or self.eplb == "off":
            return None
        import dataclasses

        from libs.engine.ep.eplb import EplbConfig  # numpy only

        base = EplbConfig.named(self.eplb)
        return dataclasses.replace(
            base,
            window_steps=self.eplb_window or base.window_steps,
            rebalance_every=self.eplb_every or base.rebalance_every,
        )

    def rank_device(self, device: str, rank: int) -> str:
        """Rank ``rank``'s torch device for the service's ``--device``: ``cuda`` ->
        ``cuda:<gpus[k]>`` (or ``cuda:<k>`` without ``--ep-gpus``), ``k`` its index on this
        host; else as given."""
        if device == "cuda":
            local = rank - self.first_rank
            return f"cuda:{self.gpus[local] if self.gpus else local}"
        return device


def rank_instance_id(instance_id: str, rank: int, generation: int = 0) -> str:
    """The routing identity of one rank: ``<instance>-r<k>``; after the group restarted
    ``generation`` times ``<instance>-r<k>-g<generation>``, so the entrypoint never mistakes
    a new rank for the one that failed its requests (it excludes failed ids on retry)."""
    base = f"{instance_id}-r{rank}"
    return base if generation == 0 else f"{base}-g{generation}"


def add_ep_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """``role`` ("decode" or "prefill"): the service's own --eplb default."""
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
        "fails within it, and the group restarts without the failed rank's device",
    )
    flag(
        parser,
        "--ep-start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        help="seconds the ranks may take to meet and load the model",
    )
    flag(
        parser,
        "--eplb",
        default=role,
        help="with --ep > 1: expert load balancing, re-placing the routed experts over the "
        "ranks from the load they saw: decode (1,000-step window, every 10,000 steps), "
        "prefill (100 / 1,000), or off (placement fixed)",
    )
    flag(parser, "--eplb-window", type=int, default=0, help="EPLB window in steps (0: --eplb's)")
    flag(
        parser,
        "--eplb-every",
        type=int,
        default=0,
        help="steps between EPLB re-placements (0: --eplb's)",
    )
    flag(
        parser,
        "--ep-gpus",
        default="",
        help="with --ep N and --device cuda: the N GPUs of the ranks, e.g. 0,1 (rank k on the "
        "k-th); empty: cuda:0..N-1",
    )
    add_host_flags(parser)
    # Set by the supervisor on the ranks it starts, not by people.
    flag(parser, "--ep-rank", type=int, default=-1, help=argparse.SUPPRESS)
    flag(parser, "--ep-rendezvous", default="", help=argparse.SUPPRESS)


def add_host_flags(parser: argparse.ArgumentParser) -> None:
    """Where the group meets and which of its ranks this host runs; its devices' health."""
    flag(
        parser,
        "--ep-master",
        default="",
        help="host:port where rank 0 (on --ep-node-rank 0) serves the EP group's rendezvous; "
        "the same on every host of the group. Empty: this host, a free port (one host only)",
    )
    flag(
        parser,
        "--ep-ranks-per-host",
        type=int,
        default=0,
        help="ranks of the EP group on each host (divides --ep); 0: every rank on this host",
    )
    flag(
        parser,
        "--ep-node-rank",
        type=int,
        default=0,
        help="this host's index in the EP group: it runs global ranks "
        "node*ranks-per-host .. (node+1)*ranks-per-host - 1",
    )
    flag(
        parser,
        "--ep-regrow-s",
        type=float,
        default=DEFAULT_REGROW_S,
        help="seconds before a device left out of the EP group after a failure is probed "
        "again (and between probes); when healthy, the group restarts larger",
    )
    flag(
        parser,
        "--ep-health-file",
        default="",
        help="a file of device indices (one a line) the EP supervisor treats as unhealthy, "
        "re-read at every probe: take a GPU out by hand (tests: CPU ranks' devices)",
    )


def ep_flags_from(args: argparse.Namespace) -> EPFlags:
    return EPFlags(
        size=args.ep,
        rank=None if args.ep_rank < 0 else args.ep_rank,
        rendezvous=args.ep_rendezvous,
        timeout_s=args.ep_timeout,
        start_timeout_s=args.ep_start_timeout,
        eplb=args.eplb,
        eplb_window=args.eplb_window,
        eplb_every=args.eplb_every,
        gpus=parse_gpu_indices(args.ep_gpus, "--ep-gpus"),
        master=args.ep_master,
        ranks_per_host=args.ep_ranks_per_host,
        node_rank=args.ep_node_rank,
        regrow_s=args.ep_regrow_s,
        health_file=args.ep_health_file,
    )


def tag_rank_logs(service: str, rank: int) -> None:
    """Rank ``rank``'s log lines read ``... decode r1 INFO ...``: the N ranks write into their
    supervisor's log, and a line must say which rank wrote it. (Redaction is a record
    factory, untouched by a new formatter.)"""
    tag_rank(service, rank)


def check_ep_model(ep: EPFlags, model: ModelFlags) -> None:
    """ValueError for a model or device an EP group cannot run: the fake engine has no
    experts; NCCL refuses two ranks on one GPU."""
    if ep.size > 1 and model.model == "fake":  # fake_engine.FAKE_MODEL (imports torch)
        raise ValueError("--ep needs a model with experts; --model fake has none")
    if ep.gpus and not model.device.startswith("cuda"):
        raise ValueError(f"--ep-gpus applies to --device cuda, not --device {model.device}")
    if ep.gpus and ep.size == 1:
        raise ValueError("--ep-gpus applies with --ep > 1")
    if ep.supervises and model.device.startswith("cuda:"):
        raise ValueError(
            f"--ep {ep.size} with --device {model.device} puts every rank on one GPU (NCCL "
            f"needs one per rank): use --device cuda [--ep-gpus "
            f"{','.join(str(g) for g in range(ep.size))}]"
        )


def rank_engine_config(model: ModelFlags, ep: EPFlags) -> EngineConfig:
    """The engine config of rank ``ep.rank``: its device and the EPLB it runs."""
    import dataclasses

    assert ep.rank is not None
    return dataclasses.replace(
        model.engine_config(),
        device=ep.rank_device(model.device, ep.rank),
        eplb=ep.eplb_config(),
    )


def rank_flags(
    ep: EPFlags,
    rank: int,
    size: int,
    *,
    rendezvous: str,
    instance_id: str,
    ops_port: int,
    device: str,
    own_grpc_port: bool,
    gpu: int | None = None,
    local_ranks: int = 0,
    node_rank: int = 0,
) -> list[str]:
    """The flags the supervisor appends to its own argv for global rank ``rank`` of a group
    of ``size`` (argparse keeps the last of a repeated flag): its identity, ports, the hosts'
    shape (``local_ranks`` on each; 0: all on one) and device -- ``--device cuda:<gpu>`` of its
    own when the service runs on ``cuda`` (``gpu`` None: ``--ep-gpus``' pick by rank)."""
    flags = [
        "--ep",
        str(size),
        "--ep-rank",
        str(rank),
        "--ep-rendezvous",
        rendezvous,
        "--ep-ranks-per-host",
        str(local_ranks),
        "--ep-node-rank",
        str(node_rank),
        "--instance-id",
        instance_id,
        "--http-port",
        str(ops_port),
    ]
    if device == "cuda":
        flags += ["--device", f"cuda:{gpu}" if gpu is not None else ep.rank_device(device, rank)]
    if own_grpc_port:
        flags += ["--grpc-port", "0"]
    return flags


def build_rank_engine(
    model: ModelFlags, ep: EPFlags, progress: ProgressSink | None = None
) -> Engine:
    """This rank's engine: join the group, load the model with this rank's experts, meet the
    peers once loaded (``start_timeout_s``), then tighten every collective to ``timeout_s``.
    ``progress`` hears how far its read of the checkpoint has got. Slow (loads weights): call
    off the event loop."""
    import dataclasses

    import torch

    from libs.engine.engine import Engine
    from libs.engine.ep.group import EPGroup

    assert ep.rank is not None
    host, _, port = ep.rendezvous.rpartition(":")
    config = dataclasses.replace(rank_engine_config(model, ep), load_progress=progress)
    if not config.device.startswith("cuda"):
        # N ranks share this host's cores: none oversubscribes them on its own.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ep.local_ranks))
    group = EPGroup.init(
        ep.rank, ep.size, host, int(port), device=config.device, timeout_s=ep.start_timeout_s
    )
    engine = Engine(config, ep=group)
    group.all_max([0])  # every rank has loaded: from here on a wait means a failed peer
    group.set_timeout(ep.timeout_s)
    return engine
