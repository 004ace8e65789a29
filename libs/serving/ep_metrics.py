"""Prometheus metrics of one EP rank: how evenly its group's ranks share the routed experts.

Read off the engine thread's published :class:`~.engine_loop.EngineStats` at scrape time (no
engine call, no lock): ``deepserve_ep_balance_max_mean`` (the busiest rank's expert load over
the mean over EPLB's window, 1.0 = even; 1.3: the MoE layers wait 30 % longer than an even
split would), ``deepserve_ep_rebalances_total`` and ``deepserve_ep_moved_slots_total``. Every
rank of a group reports the same figures (they share the group's counts). Registered only by
a rank whose engine runs EPLB, so the series are absent without EP or with ``--eplb off``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .engine_stats import EngineStats


class EPBalanceCollector(Collector):
    """Yields the balance of ``stats()`` (the loop's latest snapshot) on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        balance = self._stats().ep_balance
        max_mean = float("nan") if balance is None else balance.max_mean
        yield GaugeMetricFamily(
            "deepserve_ep_balance_max_mean",
            "busiest EP rank's routed-expert load over the mean, over EPLB's window (1 = even)",
            value=max_mean,
        )
        yield GaugeMetricFamily(
            "deepserve_ep_balance_window_steps",
            "engine steps the balance covers",
            value=0 if balance is None else balance.window_steps,
        )
        yield CounterMetricFamily(
            "deepserve_ep_rebalances",
            "EPLB re-placements that moved expert weights",
            value=0 if balance is None else balance.rebalances,
        )
        yield CounterMetricFamily(
            "deepserve_ep_moved_slots",
            "expert slots EPLB re-placements moved (weights copied between ranks)",
            value=0 if balance is None else balance.moved_slots,
        )
