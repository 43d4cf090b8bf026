"""Pre-flight checks of a multi-process run: the environment before launch (`network`), a roll call
and timed all-reduce naming a missing or slow rank (`check`), all-reduce bandwidth (`bandwidth`).
docs/multi-node.md shows them in use; `distft doctor` runs them alone."""

from distft.health.bandwidth import Bandwidth, measure_all_reduce
from distft.health.check import HealthHooks, HealthReport, RankPlace, check_health
from distft.health.network import failure_advice, network_interfaces, network_warnings, print_network_warnings

__all__ = [
    "Bandwidth",
    "HealthHooks",
    "HealthReport",
    "RankPlace",
    "check_health",
    "failure_advice",
    "measure_all_reduce",
    "network_interfaces",
    "network_warnings",
    "print_network_warnings",
]
