"""The supervisor of one EP instance: starts its N rank processes, restarts the group smaller
when a rank dies, stops them all together.

Why a supervisor rather than rank 0 starting its siblings: after a rank dies, the survivors'
``torch.distributed`` group is broken for good (it cannot be re-initialised reliably in the
same process) and their models hold the experts of an N-rank placement, so every rank of the
new group is a fresh process anyway; the one process that outlives every group must then be
none of its ranks. It runs no engine and no NATS client: one ops port whose ``/healthz`` is
200 while every rank of the current group answers its own ``/healthz`` with 200.

A generation of the group: ``size`` processes ``python -m services.<service> <argv> --ep size
--ep-rank k --ep-rendezvous 127.0.0.1:<port> --instance-id <instance>-r<k>[-g<gen>]
--http-port <port k> [--device cuda:<gpu k>] [--grpc-port 0]`` (:func:`~.ep.rank_flags`;
argparse keeps the last value of a repeated flag, so the service's own flags pass through
unchanged; with ``--device cuda`` rank k gets ``--ep-gpus``' k-th GPU, else ``cuda:<k>``).
When one exits, the others fail their next collective within ``--ep-timeout`` (a dead
peer: at once) and exit with
:data:`~libs.serving.ep.EXIT_GROUP_FAILED`; the survivors' count is the next group's size
(``Placement.contiguous`` covers every expert at any size). Their requests failed with
retryable errors, the dead rank's stop heartbeating: the entrypoint retries them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from libs.common.service import ServiceContext

from .ep import EXIT_GROUP_FAILED, EPFlags, rank_flags, rank_instance_id

HOST = "127.0.0.1"
HEALTH_POLL_S = 0.5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/healthz", timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError, urllib.error.HTTPError):
        return False


@dataclass
class Rank:
    rank: int
    instance_id: str
    ops_port: int
    proc: asyncio.subprocess.Process
    healthy: bool = False


@dataclass
class Group:
    generation: int
    size: int
    ranks: list[Rank] = field(default_factory=list)
    was_up: bool = False  # every rank answered /healthz 200 at some point

    @property
    def healthy(self) -> bool:
        return bool(self.ranks) and all(r.healthy for r in self.ranks)

    def describe(self) -> str:
        ids = ", ".join(f"{r.instance_id}@{r.ops_port}" for r in self.ranks)
        return f"ep group generation {self.generation}, {self.size} ranks: {ids}"


class EPSupervisor:
    """Runs ``python -m services.<service>`` ranks for ``ep.size``; see the module doc."""

    def __init__(
        self,
        ctx: ServiceContext,
        service: str,
        argv: Sequence[str],
        ep: EPFlags,
        *,
        own_grpc_port: bool,
        device: str = "cpu",
    ) -> None:
        self.ctx, self.service, self.argv, self.ep = ctx, service, list(argv), ep
        self.device = device  # the service's --device: "cuda" gives each rank a GPU of its own
        self.own_grpc_port = own_grpc_port  # decode: each rank serves KVTransfer on its own port
        self.instance_id = ctx.config.instance_id
        self.group: Group | None = None
        self.restarts = 0

    def health(self) -> tuple[bool, str]:
        g = self.group
        if g is None:
            return False, "starting the EP group"
        if not g.healthy:
            return False, f"{g.describe()} (not all serving yet)"
        return True, f"{self.instance_id} serving as {g.describe()}"

    async def run(self) -> int:
        """Until SIGTERM (stop every rank, 0) or a group that cannot go on (1)."""
        log = self.ctx.log
        log.info("ops on %s:%d", self.ctx.config.host, await self.ctx.start_ops(self.health))
        self.ctx.background(self._poll_health(), "ep-health")
        size, generation = self.ep.size, 0
        while True:
            group = self.group = await self._start(size, generation)
            log.info("started %s", group.describe())
            failed = await self._wait_exit_or_stop(group)
            if failed is None:
                await self._stop(group)
                return 0
            survivors = await self._collapse(group, failed)
            if survivors == 0 or not group.was_up:
                # Never served (a rank failed at start) or nobody left: the service's own
                # supervisor (deepserve up) restarts this process with backoff.
                log.error(
                    "EP group cannot restart (%d healthy ranks left, %s); exiting",
                    survivors,
                    "had served" if group.was_up else "never served",
                )
                return 1
            self.restarts += 1
            log.warning(
                "rank %s exited with %s; restarting the group with %d ranks (was %d)",
                failed.instance_id,
                failed.proc.returncode,
                survivors,
                size,
            )
            size, generation = survivors, generation + 1

    async def _start(self, size: int, generation: int) -> Group:
        group = Group(generation, size)
        rendezvous = f"{HOST}:{_free_port()}"
        for k in range(size):
            rid = rank_instance_id(self.instance_id, k, generation)
            ops = _free_port()
            flags = rank_flags(
                self.ep,
                k,
                size,
                rendezvous=rendezvous,
                instance_id=rid,
                ops_port=ops,
                device=self.device,
                own_grpc_port=self.own_grpc_port,
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                f"services.{self.service}",
                *self.argv,
                *flags,
                stdin=asyncio.subprocess.DEVNULL,
            )
            group.ranks.append(Rank(k, rid, ops, proc))
        return group

    async def _wait_exit_or_stop(self, group: Group) -> Rank | None:
        """The first rank to exit, or None once a stop signal came."""
        waits = {asyncio.ensure_future(r.proc.wait()): r for r in group.ranks}
        stop = asyncio.ensure_future(self.ctx.stop.wait())
        try:
            done, _ = await asyncio.wait([*waits, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in [*waits, stop]:
                f.cancel()
        exited = [waits[f] for f in done if f in waits]
        if self.ctx.stop.is_set() or not exited:  # stopping: ranks exit by the same SIGTERM
            return None
        return exited[0]

    async def _collapse(self, group: Group, failed: Rank) -> int:
        """Let the other ranks notice (their next collective fails) and exit; kill what has
        not after ``--ep-timeout`` + the drain time. Returns how many exited healthy."""
        grace = self.ep.timeout_s + self.ctx.config.drain_seconds + 5.0
        others = [r for r in group.ranks if r is not failed]
        await self._wait_all(others, grace)
        for r in others:
            if r.proc.returncode is None:
                self.ctx.log.warning("rank %s did not exit; killing it", r.instance_id)
                await self._kill(r)
        return sum(r.proc.returncode == EXIT_GROUP_FAILED for r in others)

    async def _stop(self, group: Group) -> None:
        for r in group.ranks:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGTERM)
        await self._wait_all(group.ranks, self.ctx.config.drain_seconds + 5.0)
        for r in group.ranks:
            if r.proc.returncode is None:
                await self._kill(r)

    @staticmethod
    async def _wait_all(ranks: Sequence[Rank], timeout: float) -> None:
        if ranks:
            await asyncio.wait(
                [asyncio.ensure_future(r.proc.wait()) for r in ranks], timeout=timeout
            )

    @staticmethod
    async def _kill(r: Rank) -> None:
        with contextlib.suppress(ProcessLookupError):
            r.proc.kill()
        await r.proc.wait()

    async def _poll_health(self) -> None:
        while True:
            g = self.group
            if g is not None:
                for r in g.ranks:
                    r.healthy = r.proc.returncode is None and await asyncio.to_thread(
                        _healthz, r.ops_port
                    )
                g.was_up = g.was_up or g.healthy
            await asyncio.sleep(HEALTH_POLL_S)


async def supervise(
    ctx: ServiceContext,
    service: str,
    argv: Sequence[str],
    ep: EPFlags,
    *,
    own_grpc_port: bool,
    device: str = "cpu",
) -> int:
    """The ``serve`` of a service started with ``--ep N`` (N > 1): the EP group's supervisor."""
    return await EPSupervisor(
        ctx, service, argv, ep, own_grpc_port=own_grpc_port, device=device
    ).run()
