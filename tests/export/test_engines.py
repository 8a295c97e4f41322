"""How each engine reads an export back (export/engines.py): the aux layer ids each config holds decode
to the layer outputs the draft was trained on."""

import pytest

from spec_cli.export.engines import captured_layer_outputs, read_sglang, read_speculators, read_vllm
from tests.export.drafts import N, read

pytestmark = pytest.mark.usefixtures("one_thread")


def test_aux_ids_written_and_decoded_per_engine(exports):
    vllm, _ = read(exports["vllm"].output)
    sglang, _ = read(exports["sglang"].output)
    spec, _ = read(exports["speculators"].output)
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    for view in (read_vllm(vllm), read_sglang(sglang), read_speculators(spec)):
        assert captured_layer_outputs(view, N, "LlamaForCausalLM") == ([1, 3, 4], None)
