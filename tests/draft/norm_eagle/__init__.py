"""NORM-EAGLE: an algorithm that exists only in the tests, to prove that a new algorithm is its own
package plus one line in ALGORITHMS (tests/draft/test_new_algorithm.py adds that line).

It is EAGLE-3 reading two target layers instead of three (its own count and defaults), with one more
loss term: the norm of the draft's fused aux state (fc) is pulled towards
the norm of the target's last hidden state at the same position, weighted by its own option
--norm-weight. So it has its own option, its own supervision need (the per-token field `hidden_norm`,
computed by the target backends from what the target gives), and its own export format (`plain`:
the checkpoint's tensors and DraftConfig as they are, read back by its own rule in rules.py), which no
serving engine reads."""

from __future__ import annotations

from dataclasses import dataclass

from spec_cli.draft.algorithm import Algorithm, ExportFormat
from spec_cli.help import OBJECTIVE
from spec_cli.options import NON_NEGATIVE, option


@dataclass(frozen=True)
class NormOptions:
    norm_weight: float = option(
        0.5,
        "--norm-weight",
        help="--algorithm norm-eagle: weight of the squared difference between the "
        "draft's fc norm and the target's hidden-state norm.",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )


def two_aux_layers(n: int) -> list[int]:
    return [1, n - 3]


NORM_EAGLE = Algorithm(
    name="norm-eagle",
    title="NORM-EAGLE",
    summary="a test variant",
    aux_layers=2,
    default_aux_layers=two_aux_layers,
    implementation="tests.draft.norm_eagle.implementation",
    formats=(ExportFormat("plain", "plain safetensors", None),),
    export_rules="tests.draft.norm_eagle.rules",
    options=NormOptions,
    needs=frozenset({"hidden_norm"}),
)
