"""AuxCapture, the one aux hook: a forward's outputs of the chosen layers, in the order asked for."""

import pytest
import torch

from spec_cli.targets import loading
from spec_cli.targets.capture import AuxCapture

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return loading.load_model(tiny_llama_dir, torch.device("cpu"), torch.float32)


def test_takes_the_chosen_layer_outputs_in_the_order_asked(model):
    ids = torch.randint(5, 400, (1, 9), generator=torch.Generator().manual_seed(0))
    capture = AuxCapture(
        model, [6, 1, 3]
    )  # not ascending: the order is the draft's concatenation order
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        aux = capture.take()
    finally:
        capture.close()
    H = model.config.hidden_size
    assert aux.shape == (1, 9, 3 * H)
    for k, layer in enumerate([6, 1, 3]):  # hidden_states[i + 1] is layer i's output
        torch.testing.assert_close(
            aux[..., k * H : (k + 1) * H], out.hidden_states[layer + 1], rtol=0, atol=0
        )


def test_no_layers_give_an_empty_state_per_position(model):
    """EAGLE-1/2 reads no intermediate layer: [B, T, 0], shaped like the forward's hidden state."""
    ids = torch.randint(5, 400, (2, 5), generator=torch.Generator().manual_seed(2))
    capture = AuxCapture(model, [])
    try:
        with torch.no_grad():
            out = model.get_decoder()(input_ids=ids)
        aux = capture.take(out.last_hidden_state)
    finally:
        capture.close()
    assert aux.shape == (2, 5, 0) and aux.dtype == out.last_hidden_state.dtype


def test_disabled_keeps_nothing_and_close_removes_the_hooks(model):
    ids = torch.randint(5, 400, (1, 4), generator=torch.Generator().manual_seed(1))
    layers = loading.decoder_layers(model)
    before = [len(layer._forward_hooks) for layer in layers]  # transformers may hook layers itself
    capture = AuxCapture(model, [1, 2, 3])
    capture.enabled = False
    with torch.no_grad():
        model(input_ids=ids)
    assert capture._captured == {}
    capture.close()
    assert [len(layer._forward_hooks) for layer in layers] == before
