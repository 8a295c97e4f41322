"""Request handling without sockets: endpoints, every validation rule, the token, vocab maps."""

import pytest
import torch

from spec_cli.serve import wire
from spec_cli.serve.run import tokenizer_files
from spec_cli.serve.server import Limits, TargetServer
from spec_cli.serve.wire import vocab_id
from spec_cli.targets import loading
from tests.serve.harness import draft_vocab, load_backend, random_batch

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "X-Spec-Client": "test-client"}


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    b = load_backend(tiny_llama_dir)
    yield b
    b.close()


@pytest.fixture(scope="module")
def logic(backend, tiny_llama_dir):
    server = TargetServer(
        backend,
        target_config=loading.load_config(tiny_llama_dir).to_dict(),
        tokenizer_files=tokenizer_files(loading.load_tokenizer(tiny_llama_dir)),
        token=TOKEN,
        limits=Limits(
            max_batch_tokens=1024, max_batch_size=8, max_seq_len=256, max_body_bytes=1 << 20
        ),
    )
    answer = post(server, "/v1/vocab_mapping", {"selected_token_ids": draft_vocab()})
    assert answer.status == 200, answer.body()
    return server


def post(logic, path, tensors=None, meta=None, headers=AUTH, body=None):
    if body is None:
        body = wire.encode(tensors, meta).tobytes() if tensors is not None else b""
    return logic.handle("POST", path, headers, body)


def get(logic, path, headers=AUTH):
    return logic.handle("GET", path, headers, b"")


def as_json(response) -> dict:
    return wire.loads(response.body())


def generate(logic, tensors, meta=None):
    return post(
        logic, "/v1/generate", tensors, {"vocab_id": vocab_id(draft_vocab()), **(meta or {})}
    )


def good_request(B=3, T=20, seed=0):
    ids, am, lm = random_batch(B, T, seed)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def test_info_health_tokenizer_embeddings(logic, backend):
    health = get(logic, "/v1/health")
    assert health.status == 200 and as_json(health)["status"] == "ok"
    info = as_json(get(logic, "/v1/info"))
    for key in (
        "architecture",
        "vocab_size",
        "hidden_size",
        "aux_layers",
        "target_fingerprint",
        "tokenizer_fingerprint",
        "target_config",
        "limits",
        "protocol",
    ):
        assert info[key] == {**backend.info, "protocol": wire.PROTOCOL}.get(key, info[key]), key
    assert info["vocab_size"] == 400 and info["aux_layers"] == [1, 3, 4]
    assert info["target_config"]["num_hidden_layers"] == 8 and info["limits"]["max_batch_size"] == 8
    tok = as_json(get(logic, "/v1/tokenizer"))
    assert "tokenizer.json" in tok["files"]
    assert tok["tokenizer_fingerprint"] == backend.info["tokenizer_fingerprint"]
    tensors, _ = wire.decode(bytearray(get(logic, "/v1/input_embeddings").body()))
    assert torch.equal(tensors["weight"], backend.get_input_embeddings())


def test_generate_answers_exactly_the_in_process_batch(logic, backend):
    request = good_request()
    answer = generate(logic, request)
    assert answer.status == 200 and answer.content_type == wire.TENSOR_TYPE
    tensors, meta = wire.decode(bytearray(answer.body()))
    expected = backend.generate_batch(**request).tensors()  # same backend, same mapping
    assert set(tensors) == set(expected)
    for name, t in expected.items():
        assert torch.equal(tensors[name], t) and tensors[name].dtype == t.dtype, name


def test_token_is_required_on_every_endpoint(logic):
    for path, method in [
        ("/v1/health", "GET"),
        ("/v1/info", "GET"),
        ("/v1/generate", "POST"),
        ("/v1/input_embeddings", "GET"),
        ("/v1/disconnect", "POST"),
    ]:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": TOKEN},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": f"bearer {TOKEN}"},
        ):
            answer = logic.handle(method, path, headers, b"")
            assert answer.status == 401, (path, headers)
            assert (
                "token" in as_json(answer)["error"]
                and answer.headers["WWW-Authenticate"] == "Bearer"
            )
    assert get(logic, "/v1/health").status == 200


def with_(request, **changes):
    out = dict(request)
    for name, value in changes.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def ones(B, T):
    return {
        name: torch.ones(B, T, dtype=torch.long)
        for name in ("input_ids", "attention_mask", "loss_mask")
    }


R = good_request()
IDS, AM, LM = R["input_ids"], R["attention_mask"], R["loss_mask"]
PACKED = {
    "input_ids": IDS[:1],
    "attention_mask": torch.ones(1, 20, dtype=torch.long),
    "loss_mask": LM[:1],
    "seq_lens": torch.tensor([[7, 13]]),
}
BAD_GENERATE = [
    (with_(R, extra=IDS), "unknown tensor"),
    (with_(R, loss_mask=None), "missing tensor"),
    (with_(R, input_ids=IDS.int()), "input_ids must be int64"),
    (with_(R, input_ids=IDS.float()), "input_ids must be int64"),
    (with_(R, attention_mask=AM.bool()), "attention_mask must be int64"),
    (with_(R, input_ids=IDS[0]), "must have 2 dimensions"),
    (with_(R, input_ids=IDS[:, :0], attention_mask=AM[:, :0], loss_mask=LM[:, :0]), "empty"),
    (with_(R, loss_mask=LM[:, :5]), "loss_mask has shape"),
    (with_(R, attention_mask=AM[:2]), "attention_mask has shape"),
    (with_(R, input_ids=IDS.clone().index_fill_(1, torch.tensor([3]), 400)), r"\[0, 400\)"),
    (with_(R, input_ids=IDS.clone().index_fill_(1, torch.tensor([3]), -1)), r"\[0, 400\)"),
    (with_(R, attention_mask=AM * 2), "attention_mask must hold only 0 and 1"),
    (with_(R, loss_mask=LM - 1), "loss_mask must hold only 0 and 1"),
    (with_(R, loss_mask=torch.ones_like(LM)), "padding cannot be supervised"),
    (
        with_(
            R,
            attention_mask=AM.clone().index_fill_(0, torch.tensor([0]), 0),
            loss_mask=torch.zeros_like(LM),
        ),
        "no real token",
    ),
    (ones(9, 4), "batch of 9 rows exceeds"),
    (ones(1, 257), "sequence length 257 exceeds"),
    (ones(8, 256), "2048 tokens exceeds"),
    (
        with_(R, position_ids=torch.arange(20).expand(3, 20).contiguous() - 1),
        "position_ids must lie",
    ),
    (with_(R, position_ids=torch.arange(20).expand(2, 20).contiguous()), "position_ids has shape"),
    (with_(PACKED, seq_lens=torch.tensor([[7, 14]])), "sum to more than"),
    (with_(PACKED, seq_lens=torch.tensor([[7, -1]])), "non-negative"),
    (with_(PACKED, seq_lens=torch.tensor([7, 13])), "seq_lens must have 2 dimensions"),
    (with_(PACKED, seq_lens=torch.tensor([[7, 13]]).int()), "seq_lens must be int64"),
    (with_(PACKED, seq_lens=torch.tensor([[7, 13], [1, 1]])), r"seq_lens must have shape \[1, D\]"),
    (with_(PACKED, seq_lens=torch.tensor([[7, 6]])), "exactly on the first sum"),
]


@pytest.mark.parametrize("request_, why", BAD_GENERATE, ids=[w for _, w in BAD_GENERATE])
def test_bad_generate_requests_get_400_saying_why(logic, request_, why):
    import re

    answer = generate(logic, request_)
    assert answer.status == 400, answer.body()
    error = as_json(answer)["error"]
    assert re.search(why, error), error
    assert generate(logic, good_request()).status == 200  # and it keeps serving


def test_packed_request_is_served(logic, backend):
    answer = generate(logic, PACKED)
    assert answer.status == 200, answer.body()
    tensors, _ = wire.decode(bytearray(answer.body()))
    assert torch.equal(tensors["seq_lens"], PACKED["seq_lens"])
    expected = backend.generate_batch(**PACKED)
    assert torch.equal(tensors["target_p"], expected.target_p)


def test_bad_vocab_maps_paths_and_methods(logic):
    cases = [
        ({"selected_token_ids": torch.tensor([3, 2, 5])}, "strictly ascending"),
        ({"selected_token_ids": torch.tensor([3, 3, 5])}, "strictly ascending"),
        ({"selected_token_ids": torch.tensor([3, 400])}, r"\[0, 400\)"),
        ({"selected_token_ids": torch.tensor([3.0, 4.0])}, "must be int64"),
        ({"selected_token_ids": torch.tensor([], dtype=torch.long)}, "1..400 ids"),
        ({"ids": torch.tensor([1])}, "exactly one tensor"),
    ]
    for tensors, why in cases:
        answer = post(logic, "/v1/vocab_mapping", tensors)
        assert answer.status == 400 and why.split("\\")[0] in as_json(answer)["error"], as_json(
            answer
        )
    assert get(logic, "/v1/nope").status == 404
    assert get(logic, "/v1/generate").status == 405
    assert post(logic, "/v1/info").status == 405
    assert post(logic, "/v1/generate", body=b"not safetensors").status == 400
    assert post(logic, "/v1/generate", body=b"\0" * ((1 << 20) + 1)).status == 413
    answer = post(logic, "/v1/generate", good_request(), {"vocab_id": "0" * 16})
    assert answer.status == 409 and as_json(answer)["code"] == "vocab"


def test_several_vocab_maps_are_kept_and_switched(logic, backend):
    """Two trainers with different draft vocabs share one server."""
    other = draft_vocab(32, seed=5)
    assert post(logic, "/v1/vocab_mapping", {"selected_token_ids": other}).status == 200
    request = good_request(seed=3)
    mine = wire.decode(bytearray(generate(logic, request).body()))[0]  # switches back to ours
    theirs = wire.decode(
        bytearray(post(logic, "/v1/generate", request, {"vocab_id": vocab_id(other)}).body())
    )[0]
    assert mine["target_p"].shape[-1] == 64 and theirs["target_p"].shape[-1] == 32
    backend.set_vocab_mapping(other)
    assert torch.equal(theirs["target_p"], backend.generate_batch(**request).target_p)
    backend.set_vocab_mapping(draft_vocab())
    assert torch.equal(mine["target_p"], backend.generate_batch(**request).target_p)


def test_exit_on_disconnect_waits_for_the_last_client(backend):
    logic = TargetServer(backend, exit_on_disconnect=True)
    for client in ("a", "b"):
        assert logic.handle("GET", "/v1/health", {"X-Spec-Client": client}, b"").status == 200
    first = logic.handle("POST", "/v1/disconnect", {"X-Spec-Client": "a"}, b"{}")
    assert as_json(first) == {"ok": True, "shutting_down": False} and first.after is None
    last = logic.handle("POST", "/v1/disconnect", {"X-Spec-Client": "b"}, b"{}")
    assert as_json(last)["shutting_down"] and not logic.shutdown_event.is_set()
    last.after()  # the HTTP layer runs this once the answer is flushed
    assert logic.shutdown_event.is_set()
    assert logic.handle("GET", "/v1/info", {}, b"").status == 503
