"""Every CP algorithm (ring, all-gather, Ulysses, hybrid) x layout x causal x documents x GQA (spawned gloo).

fp32 out, lse, dq, dk, dv against the float64 reference of the whole sequence; Ulysses at cp 4 with two
kv heads repeats them, hybrid runs Ulysses over pairs of adjacent CP ranks and the ring across them.
"""

from __future__ import annotations

import itertools

import pytest

from cp_train.parallel.cp.layout import LAYOUTS
from cp_train.parallel.mesh.state import run_with_parallel
from tests import document_cases

TOL = 1e-5
SEQLEN = {2: 32, 4: 64, 8: 128}
CASES = [(layout, causal, heads, kv_heads, spec) for layout, causal, (heads, kv_heads), spec
         in itertools.product(LAYOUTS, (True, False), ((4, 4), (4, 2)), (None, "random"))]


@pytest.mark.parametrize("algorithm,world,ulysses", [("ring", 2, 1), ("ring", 4, 1), ("allgather", 2, 1),
                                                     ("allgather", 4, 1), ("ulysses", 2, 1), ("ulysses", 4, 1),
                                                     ("hybrid", 4, 2)])
def test_algorithm_matches_float64(spawn_world, algorithm: str, world: int, ulysses: int) -> None:
    errors = spawn_world(world).run(run_with_parallel, (1, world, 1, ulysses), document_cases.check_algorithm_cases,
                                    algorithm, CASES, SEQLEN[world])
    failures = {case: error for case, error in zip(CASES, errors[0], strict=True) if error > TOL}
    assert not failures, failures
    assert errors[0] == errors[-1], "ranks disagree"


def test_algorithms_at_cp8(spawn_world) -> None:
    cases = [(layout, True, 8, 2, spec) for layout in ("zigzag", "balanced") for spec in (None, "random")]
    for algorithm, ulysses in (("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2), ("hybrid", 4)):
        errors = spawn_world(8).run(run_with_parallel, (1, 8, 1, ulysses), document_cases.check_algorithm_cases,
                                    algorithm, cases, SEQLEN[8])[0]
        assert max(errors) <= TOL, (algorithm, ulysses, dict(zip(cases, errors, strict=True)))
