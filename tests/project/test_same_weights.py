"""A refactor changes no number: each method and each clipping route ends a short run with the
weights recorded before the trainer was split into methods, clippers and step callbacks
(tests/same_weights.py). On the machine that recorded them the bytes are equal (its sha256;
`python -m tests.same_weights` says so case by case); on another CPU the sums agree to float
rounding, far below what any change of the computation moves them (training moves them by
~1e-1, a rounding difference by ~1e-6)."""
import json

import pytest

from tests.conftest import require
from tests.same_weights import CASES, RECORD, case_name, fingerprint, train


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_the_weights_are_the_recorded_ones(case):
    require("fmnist")
    recorded = json.loads(RECORD.read_text())[case_name(*case)]["sums"]
    now = fingerprint(train(*case))["sums"]
    assert now.keys() == recorded.keys()
    for name, sums in now.items():
        assert sums == pytest.approx(recorded[name], rel=1e-4, abs=1e-4), name
