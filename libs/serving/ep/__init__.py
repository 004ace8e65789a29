"""Expert parallelism's processes: one engine instance as an EP group of N rank processes.

* :mod:`.service` -- the engine services' EP flags, rank identity and one rank's engine;
* :mod:`.lockstep` -- the round every rank of a serving group steps in;
* :mod:`.launch` -- N rank processes on this host, each joined to the group (tests, offline);
* :mod:`.generate` -- offline generation over such a group (``deepserve generate --ep N``).

The layer they drive -- dispatch, combine, placement, EPLB -- is :mod:`libs.engine.ep`.
"""

from .service import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    EPLB_MODES,
    EXIT_GROUP_FAILED,
    EPFlags,
    add_ep_flags,
    build_rank_engine,
    check_ep_model,
    ep_flags_from,
    rank_engine_config,
    rank_flags,
    rank_instance_id,
    tag_rank_logs,
)

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "EPLB_MODES",
    "EXIT_GROUP_FAILED",
    "EPFlags",
    "add_ep_flags",
    "build_rank_engine",
    "check_ep_model",
    "ep_flags_from",
    "rank_engine_config",
    "rank_flags",
    "rank_instance_id",
    "tag_rank_logs",
]
