"""Serving glue shared by the engine-wrapping services (prefill, decode).

* :mod:`.engine_loop` -- the engine in its own thread, driven from asyncio;
* :mod:`.model_flags` -- the model/engine flags both services take;
* :mod:`.convert` -- proto <-> engine conversions (no I/O);
* :mod:`.runtime` -- NATS connection and heartbeat helpers.
"""

from .engine_loop import EngineLoop
from .engine_stats import EngineStats
from .request_stream import EngineFailed, EngineLoopClosed, RequestStream

__all__ = ["EngineFailed", "EngineLoop", "EngineLoopClosed", "EngineStats", "RequestStream"]
