"""A NATS outage is not an instance's death (issue 13): while the entrypoint is cut off from
NATS no instance is silent, and afterwards silence counts from the reconnection."""

from __future__ import annotations

from typing import Any

from services.entrypoint.transport import HeartbeatWatch


class FakeNats:
    def __init__(self) -> None:
        self.is_connected = True
        self.cb: Any = None

    async def subscribe(self, subject: str, cb: Any) -> object:
        self.cb = cb
        return object()


class Msg:
    def __init__(self, subject: str) -> None:
        self.subject, self.data = subject, b""


async def test_silence_during_and_after_a_nats_outage() -> None:
    now = [100.0]
    watch = HeartbeatWatch(clock=lambda: now[0])
    nc = FakeNats()
    await watch.start(nc)  # type: ignore[arg-type]
    await nc.cb(Msg("ds.heartbeat.decode.d1"))
    assert watch.silent_for("d1") == 0.0 and watch.silent_for("other") is None
    now[0] += 2.0
    assert watch.silent_for("d1") == 2.0  # connected: plain silence
    nc.is_connected = False
    now[0] += 30.0
    assert watch.silent_for("d1") == 0.0  # cut off: nobody is declared dead
    nc.is_connected = True
    now[0] += 1.0
    assert watch.silent_for("d1") == 0.0  # back: counted from the reconnection
    now[0] += 4.0
    assert watch.silent_for("d1") == 4.0  # and a real death is still seen
    await nc.cb(Msg("ds.heartbeat.decode.d1"))
    assert watch.silent_for("d1") == 0.0
