"""Every strategy in the registry has a formula for the bytes its collectives move (the parity
tests in tests/parallel/ check each formula against the counted bytes, to the byte)."""

from distft.measure.expected import FORMULAS
from distft.parallel import STRATEGIES


def test_every_strategy_has_a_formula():
    assert set(FORMULAS) == set(STRATEGIES)
