"""One `flows.prepare` run hashes the source and the tokenizer once, built or cached alike."""

import pytest

from flows.prepare import prepare
from tests.unit.conftest_data import chat_config
from trainflow.data import prepare as prepare_module


@pytest.fixture
def fingerprints(monkeypatch):
    """Count source and tokenizer fingerprints computed in this process."""
    counts = {"source": 0, "tokenizer": 0}

    def counting(kind, original):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        prepare_module, "source_fingerprint", counting("source", prepare_module.source_fingerprint)
    )
    monkeypatch.setattr(
        prepare_module,
        "tokenizer_fingerprint",
        counting("tokenizer", prepare_module.tokenizer_fingerprint),
    )
    return counts


def test_a_prepare_run_fingerprints_the_dataset_once(prefect_api, tmp_path, fingerprints):
    config = chat_config(tmp_path)

    built = prepare(config)
    assert not built.cache_hit
    assert fingerprints == {"source": 1, "tokenizer": 1}

    cached = prepare(config)
    assert cached.cache_hit and cached.uri == built.uri
    assert fingerprints == {"source": 2, "tokenizer": 2}
