"""The supervisor of one EP instance: starts its rank processes on healthy devices, restarts
the group without a device whose rank failed, grows it back once that device is healthy, and
stops them all together.

Why a supervisor rather than rank 0 starting its siblings: after a rank dies, the survivors'
``torch.distributed`` group is broken for good (it cannot be re-initialised reliably in the
same process) and their models hold the experts of an N-rank placement, so every rank of the
new group is a fresh process anyway; the one process that outlives every group must then be
none of its ranks. It runs no engine and no NATS client: one ops port whose ``/healthz`` is
200 while every rank of the current group answers its own ``/healthz`` with 200.

A generation of the group: one process per healthy device, ``python -m services.<service>
<argv> --ep size --ep-rank k --ep-rendezvous <master> ... --instance-id
<instance>-r<k>[-g<gen>] --http-port <port k> [--device cuda:<gpu>] [--grpc-port 0]``
(:func:`~.ep.rank_flags`; argparse keeps the last value of a repeated flag, so the service's
own flags pass through unchanged). Devices are ``--ep-gpus`` (or ``0..N-1``; CPU ranks: slots
that only name a place) and are probed before every start (:mod:`.ep.health`).

When a rank exits, the others fail their next collective within ``--ep-timeout`` (a dead
peer: at once) and exit with :data:`~libs.serving.ep.EXIT_GROUP_FAILED`. The device of the
rank that failed (and of any rank that had to be killed) is left out for ``--ep-regrow-s``;
the other devices are probed and the group restarts on the healthy ones, at that count
(``Placement.contiguous`` covers every expert at any size). While the group is smaller than
its devices, the left-out ones are probed every ``--ep-regrow-s``; once one is healthy the
group is drained (SIGTERM) and restarted larger. Requests of a failed group fail with
retryable errors and its ranks stop heartbeating: the entrypoint retries them elsewhere.

Across hosts (``--ep-ranks-per-host`` < ``--ep``) each host's supervisor runs its own ranks and
the group's size is fixed: the hosts agree on nothing but ``--ep-master``, so a host restarts
its ranks at full size once every device of its own probes healthy (shrinking a multi-host
group is not done).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from libs.common.service import ServiceContext

from .ep import EXIT_GROUP_FAILED, EPFlags, rank_flags, rank_instance_id
from .ep.health import DeviceProbe

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
    device: int  # a GPU index (--device cuda) or a CPU rank's slot
    healthy: bool = False


@dataclass
class Group:
    generation: int
    size: int
    device: str  # the service's --device
    ranks: list[Rank] = field(default_factory=list)
    was_up: bool = False  # every rank answered /healthz 200 at some point

    @property
    def healthy(self) -> bool:
        return bool(self.ranks) and all(r.healthy for r in self.ranks)

    def describe(self) -> str:
        ids = ", ".join(f"{r.instance_id}@{r.ops_port}" for r in self.ranks)
        kind = "cuda:" if self.device == "cuda" else "slot "
        devices = ", ".join(f"{kind}{r.device}" for r in self.ranks)
        return f"ep group generation {self.generation}, {self.size} ranks: {ids} (on {devices})"


class EPSupervisor:
    """Runs ``python -m services.<service>`` ranks for ``ep``; see the module doc.
    ``probe`` and ``command`` (the rank's argv before its flags) are for tests."""

    def __init__(
        self,
        ctx: ServiceContext,
        service: str,
        argv: Sequence[str],
        ep: EPFlags,
        *,
        own_grpc_port: bool,
        device: str = "cpu",
        probe: DeviceProbe | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.ctx, self.service, self.argv, self.ep = ctx, service, list(argv), ep
        self.device = device  # the service's --device: "cuda" gives each rank a GPU of its own
        self.own_grpc_port = own_grpc_port  # decode: each rank serves KVTransfer on its own port
        self.instance_id = ctx.config.instance_id
        self.group: Group | None = None
        self.restarts = 0
        gpus = ep.gpus[: ep.local_ranks] if device == "cuda" and ep.gpus else ()
        self.devices: list[int] = list(gpus) or list(range(ep.local_ranks))
        self.probe = probe or DeviceProbe(device, ep.health_file)
        self.command = list(command or [sys.executable, "-m", f"services.{service}"])
        self.left_out: dict[int, float] = {}  # device -> when its rank failed (monotonic)

    @property
    def multi_host(self) -> bool:
        return self.ep.hosts > 1

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
        generation = 0
        while True:
            devices = await self._place()
            if devices is None:  # stopped while waiting for devices
                return 0
            if not devices:
                log.error("EP group cannot start: none of devices %s is healthy", self.devices)
                return 1
            group = self.group = await self._start(devices, generation)
            log.info("started %s", group.describe())
            outcome = await self._wait_exit_or_stop(group)
            if outcome is None:
                await self._stop(group)
                return 0
            generation += 1
            if outcome == "grow":
                log.info("a left-out device is healthy again: growing the EP group")
                await self._stop(group)
                continue
            suspects = await self._collapse(group, outcome)
            if not group.was_up:
                # Never served (a rank failed at start): the service's own supervisor
                # (deepserve up) restarts this process with backoff.
                log.error("EP group cannot restart (it never served); exiting")
                return 1
            now = time.monotonic()
            self.left_out.update((r.device, now) for r in suspects)
            self.restarts += 1
            log.warning(
                "rank %s exited with %s; restarting the group %s",
                outcome.instance_id,
                outcome.proc.returncode,
                self._restart_how(suspects),
            )

    def _eligible(self, exclude: Sequence[int] = ()) -> list[int]:
        """Devices not left out in the last ``--ep-regrow-s`` (nor in ``exclude``)."""
        now = time.monotonic()
        return [
            d
            for d in self.devices
            if d not in exclude and now - self.left_out.get(d, -1e18) >= self.ep.regrow_s
        ]

    async def _place(self) -> list[int] | None:
        """The devices of the next group; None if stopped while waiting. One host: the
        healthy eligible ones. Several: all of this host's, waiting until they are healthy."""
        if not self.multi_host:
            return await self.probe.healthy(self._eligible())
        while True:
            healthy = await self.probe.healthy(self.devices)
            if len(healthy) == len(self.devices):
                return healthy
            self.ctx.log.warning(
                "EP group spans %d hosts: waiting for devices %s to be healthy",
                self.ep.hosts,
                sorted(set(self.devices) - set(healthy)),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), self.ep.regrow_s)
                return None

    def _restart_how(self, suspects: Sequence[Rank]) -> str:
        if self.multi_host:
            return "at full size once this host's devices probe healthy (it spans hosts)"
        if not suspects:
            return "on every healthy device (no rank of it failed on its own)"
        return "without " + ", ".join(self._device_name(r.device) for r in suspects)

    def _device_name(self, device: int) -> str:
        return f"cuda:{device}" if self.device == "cuda" else f"slot {device}"

    async def _start(self, devices: Sequence[int], generation: int) -> Group:
        multi = self.multi_host
        size = self.ep.size if multi else len(devices)
        first = self.ep.first_rank if multi else 0
        group = Group(generation, size, self.device)
        rendezvous = self.ep.master or f"{HOST}:{_free_port()}"
        for k, dev in enumerate(devices):
            rank = first + k
            rid = rank_instance_id(self.instance_id, rank, generation)
            ops = _free_port()
            flags = rank_flags(
                self.ep,
                rank,
                size,
                rendezvous=rendezvous,
                instance_id=rid,
                ops_port=ops,
                device=self.device,
                own_grpc_port=self.own_grpc_port,
                gpu=dev if self.device == "cuda" else None,
                local_ranks=self.ep.local_ranks if multi else 0,
                node_rank=self.ep.node_rank if multi else 0,
            )
            proc = await asyncio.create_subprocess_exec(
                *self.command, *self.argv, *flags, stdin=asyncio.subprocess.DEVNULL
            )
            group.ranks.append(Rank(rank, rid, ops, proc, dev))
        return group

    async def _wait_exit_or_stop(self, group: Group) -> Rank | Literal["grow"] | None:
        """The first rank to exit, "grow" once a left-out device is healthy again, or None
        once a stop signal came."""
        waits: dict[asyncio.Future[Any], Rank] = {
            asyncio.ensure_future(r.proc.wait()): r for r in group.ranks
        }
        stop = asyncio.ensure_future(self.ctx.stop.wait())
        grow = asyncio.ensure_future(self._healthy_again(group))
        try:
            done, _ = await asyncio.wait([*waits, stop, grow], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in [*waits, stop, grow]:
                f.cancel()
        exited = [waits[f] for f in done if f in waits]
        if self.ctx.stop.is_set():  # stopping: ranks exit by the same SIGTERM
            return None
        if exited:
            return exited[0]
        return "grow" if grow in done else None

    async def _healthy_again(self, group: Group) -> None:
        """Returns once a device outside ``group`` probes healthy (one host only: a group
        across hosts always runs at full size); probes every ``--ep-regrow-s``."""
        if self.multi_host:
            await asyncio.Event().wait()  # never
        in_use = [r.device for r in group.ranks]
        while True:
            await asyncio.sleep(self.ep.regrow_s)
            out = self._eligible(exclude=in_use)
            try:
                if out and await self.probe.healthy(out):
                    return
            except Exception:  # a probe that breaks must not take the serving group down
                self.ctx.log.exception("ep: probing devices %s failed", out)

    async def _collapse(self, group: Group, failed: Rank) -> list[Rank]:
        """Let the other ranks notice (their next collective fails) and exit; kill what has
        not after ``--ep-timeout`` + the drain time. Returns the suspects: every rank that
        did not exit as a healthy survivor of a failed group (:data:`EXIT_GROUP_FAILED`) --
        ``failed`` unless it only noticed first that a peer hung."""
        grace = self.ep.timeout_s + self.ctx.config.drain_seconds + 5.0
        others = [r for r in group.ranks if r is not failed]
        await self._wait_all(others, grace)
        for r in others:
            if r.proc.returncode is None:
                self.ctx.log.warning("rank %s did not exit; killing it", r.instance_id)
                await self._kill(r)
        return [r for r in group.ranks if r.proc.returncode != EXIT_GROUP_FAILED]

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
