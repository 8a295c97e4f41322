"""The draft-algorithm seam: every algorithm in ALGORITHMS is complete and declares what the rest of
spec_cli reads (a new one going through the whole CLI: tests/draft/test_new_algorithm.py); the
aux-layer count and defaults are the algorithm's."""

import dataclasses

import pytest

from spec_cli.draft import algorithms
from spec_cli.draft.eagle3 import EAGLE3
from spec_cli.errors import ConfigError
from spec_cli.targets import loading

N_LAYERS = 8  # tests.tiny's target


def test_every_algorithm_names_itself_and_reads_its_own_count_of_layers():
    assert "eagle3" in algorithms.ALGORITHMS and algorithms.get(None) is EAGLE3
    for name, algorithm in algorithms.ALGORITHMS.items():
        assert algorithm.name == name
        assert len(algorithm.default_aux_layers(30)) == algorithm.aux_layers
        assert (algorithm.export is None) == (algorithm.formats == ())
        assert (
            callable(algorithm.build)
            and callable(algorithm.objective)
            and algorithm.code is not None
        )
        for fmt in (
            algorithm.formats
        ):  # each format's reading rules are there, and its engine is one spec_cli knows
            assert fmt.engine in (None, "vllm", "sglang") and callable(algorithm.rules.check)
            assert callable(algorithm.rules.recognise) and callable(algorithm.rules.read)
    assert EAGLE3.default_aux_layers(30) == [1, 14, 26]  # SmolLM2: what vLLM and SGLang capture
    with pytest.raises(ConfigError, match="unknown draft algorithm 'medusa'") as err:
        algorithms.get("medusa")
    assert "eagle3" in err.value.hint


TWO = dataclasses.replace(
    EAGLE3, name="eagle3-two", aux_layers=2, default_aux_layers=lambda n: [1, n - 3], formats=()
)


@pytest.fixture
def two_aux(monkeypatch):
    monkeypatch.setitem(algorithms.ALGORITHMS, TWO.name, TWO)


def test_the_aux_layer_count_and_defaults_come_from_the_algorithm(two_aux):
    assert loading.parse_aux_layers(None, N_LAYERS, "eagle3-two") == [1, N_LAYERS - 3]
    assert loading.parse_aux_layers("0,3", N_LAYERS, "eagle3-two") == [0, 3]
    with pytest.raises(ConfigError, match=r"exactly 2 layer ids \(eagle3-two reads 2\), got 3"):
        loading.parse_aux_layers("1,2,3", N_LAYERS, "eagle3-two")
    with pytest.raises(ConfigError, match=r"exactly 3 layer ids \(eagle3 reads 3\), got 2"):
        loading.parse_aux_layers("1,2", N_LAYERS)
