"""The per-token fields a draft algorithm asks for (TargetBatch.extras) over the wire: the server
computes those of its --algorithm on request, equal to the same computation on the target's own
final hidden states, and refuses a field it does not compute with a 422 that says what to do."""

import pytest
import torch

from spec_cli.serve import wire
from spec_cli.serve.server import TargetServer
from spec_cli.serve.wire import vocab_id
from tests.draft.norm_eagle.implementation import target_fields
from tests.serve.harness import draft_vocab, load_backend, random_batch


@pytest.fixture(scope="module")
def logic(tiny_llama_dir):
    backend = load_backend(tiny_llama_dir)
    server = TargetServer(backend, fields=target_fields)
    body = wire.encode({"selected_token_ids": draft_vocab()}).tobytes()
    assert server.handle("POST", "/v1/vocab_mapping", {}, body).status == 200
    yield server
    backend.close()


def _generate(logic, meta):
    ids, am, lm = random_batch(2, 16, seed=1)
    body = wire.encode(
        {"input_ids": ids, "attention_mask": am, "loss_mask": lm},
        {"vocab_id": vocab_id(draft_vocab()), **meta},
    ).tobytes()
    return logic.handle("POST", "/v1/generate", {}, body), am


def test_the_server_computes_the_asked_field_from_the_target(logic):
    answer, am = _generate(logic, {"final_hidden": True, "extras": ["hidden_norm"]})
    assert answer.status == 200
    tensors, _ = wire.decode(bytearray(answer.body()))
    norm, final = tensors["extra.hidden_norm"], tensors["final_hidden"]
    assert list(norm.shape) == [2, 16, 1]
    expected = torch.where(
        am.bool(), final.float().norm(dim=-1), 0.0
    )  # pad positions carry nothing
    torch.testing.assert_close(norm[..., 0], expected)
    plain, _ = _generate(logic, {})  # not asked: not sent
    assert not any(k.startswith("extra.") for k in wire.decode(bytearray(plain.body()))[0])


def test_a_field_the_server_does_not_compute_is_refused(logic):
    answer, _ = _generate(logic, {"extras": ["image_features"]})
    assert answer.status == 422
    body = wire.loads(answer.body())
    assert "computes no per-token field image_features" in str(body)
    assert "--algorithm" in str(body)
    bad, _ = _generate(logic, {"extras": "hidden_norm"})
    assert bad.status == 400 and "extras must be a list" in str(wire.loads(bad.body()))
