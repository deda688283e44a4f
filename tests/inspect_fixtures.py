"""Session fixtures of the inspect tests (tests/test_inspect*.py and tests/test_notebook*.py;
registered in tests/conftest.py). The preprocess run is also cached here by session, so a module
that imports the fixture still builds it once."""

from __future__ import annotations

import pytest

from mmdata.dev.synth import SynthRecord, generate_records, write_infinity_mm
from tests.fixtures_preprocess import run_preprocess

BROKEN_NUM_SAMPLES = 50
BROKEN_SEED = 3
_built: dict[str, tuple] = {}


@pytest.fixture(scope="session")
def broken_dataset(tmp_path_factory) -> tuple:
    """(shards dir, synthetic records): every broken kind, through the real preprocess job."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _built:
        raw = tmp_path_factory.mktemp("inspect_broken") / "raw"
        recs: list[SynthRecord] = generate_records(
            BROKEN_NUM_SAMPLES, seed=BROKEN_SEED, broken_fraction=0.2, synthetic=True
        )
        write_infinity_mm(recs, raw, samples_per_tar=25)
        out = raw.parent / "shards"
        run_preprocess(raw, out, seed=BROKEN_SEED, samples_per_shard=16, num_cpus=2)
        _built[key] = (out, recs)
    return _built[key]
