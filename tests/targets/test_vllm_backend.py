"""The vLLM target backend gives the transformers backend's TargetBatch (fp32, within TOL), and
`spec precompute --target-engine vllm` writes the transformers cache (same identity, same batches), in
this process and with the model over two vLLM worker processes (`--target-tensor-parallel 2`).

One vLLM engine for the backend tests (module fixture) and one inside the CLI test: each load takes
~5-15 s on 2 cores.
"""

import random

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")

from spec_cli.artifacts import feature_cache as fc  # noqa: E402
from spec_cli.artifacts.vocab_map import load_vocab_map  # noqa: E402
from spec_cli.cli import main  # noqa: E402
from spec_cli.data.batching import collate  # noqa: E402
from spec_cli.errors import ConfigError  # noqa: E402
from spec_cli.targets.cache_backend import CacheBackend  # noqa: E402
from spec_cli.targets.hf_backend import HFTargetBackend  # noqa: E402
from spec_cli.targets.vllm_backend import VLLMTargetBackend, vllm_layer_ids  # noqa: E402
from tests import tiny  # noqa: E402
from tests.conftest import write_jsonl  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # starts vLLM in this process (over 10 s)

# Largest |vLLM - transformers| allowed per field (fp32, CPU). Measured on these tests: aux states
# <= 4.5e-8, final hidden <= 1.2e-6, logsumexp <= 9.5e-6 (values ~50: fp32 rounding), target_p
# <= 2.7e-6, target_mass <= 2.1e-6; every integer field (argmax ids, position_mask, shifted ids and
# masks) exactly equal.
TOL = {"aux_hidden": 1e-6, "final_hidden": 2e-5, "lse": 5e-5, "target_p": 2e-5, "target_mass": 2e-5}
AUX = [5, 1, 3]  # unsorted on purpose: vLLM returns its aux states sorted by layer


def max_diffs(want: dict, got: dict) -> dict:
    """{field: max abs diff} for float tensors; integer/bool tensors must be equal."""
    out = {}
    for name, a in want.items():
        b = got[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.is_floating_point():
            out[name] = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
        else:
            assert torch.equal(a, b), name
    return out


def assert_within(diffs: dict) -> None:
    print(" ".join(f"{k}={v:.1e}" for k, v in sorted(diffs.items())))
    for name, diff in diffs.items():
        assert diff <= TOL[name], (name, diff)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama vLLM's CPU attention runs (head_dim 32), with peaked next-token distributions."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("vllm-target")
    tokenizer = tiny.build_tokenizer("llama3")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "raw"))
    tokenizer.save_pretrained(str(root / "raw"))
    return tiny.peaked_copy(root / "raw", root / "tiny-llama-h64")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(tmp_path_factory.mktemp("home")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def backends(target, home):
    selected = torch.sort(
        torch.randperm(400, generator=torch.Generator().manual_seed(0))[:64]
    ).values
    hf = HFTargetBackend(target, AUX, "cpu", "fp32")
    vb = VLLMTargetBackend(target, AUX, "cpu", "fp32")
    for b in (hf, vb):
        b.set_vocab_mapping(selected)
    yield hf, vb
    vb.close()
    assert not hasattr(vb, "engine")  # the engine is shut down and released
    hf.close()


def random_batch(seed=0, B=5, T=48):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 400, (B, T), generator=gen)
    am = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate([T, 31, 9, 1, 20][:B]):
        am[b, n:] = 0
    lm = (torch.rand(B, T, generator=gen) < 0.6).long() * am
    return ids, am, lm


def test_aux_states_are_outputs_of_the_aux_layers(backends, target):
    """spec_cli's id j = output of decoder layer j = vLLM's id j + 1 (vLLM captures layer inputs)."""
    hf, vb = backends
    assert vllm_layer_ids(AUX) == (6, 2, 4)
    ids, am, _ = random_batch(1)
    aux, _hidden = vb.run_target(ids, am)
    with torch.no_grad():
        out = hf.model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    H = 64
    for b in range(ids.shape[0]):
        n = int(am[b].sum())
        for k, j in enumerate(
            AUX
        ):  # hidden_states[0] is the embedding output, [j + 1] layer j's output
            got, want = aux[b, :n, k * H : (k + 1) * H], out.hidden_states[j + 1][b, :n]
            assert float((got - want).abs().max()) <= TOL["aux_hidden"], (b, j)
            if j != AUX[k - 1]:  # and not the neighbouring layer's (an off-by-one would be far off)
                assert float((got - out.hidden_states[j][b, :n]).abs().max()) > 1e-2
        assert not aux[b, n:].any()


def test_batch_equals_the_transformers_batch(backends):
    hf, vb = backends
    assert vb.info == hf.info
    for seed in (0, 1):
        ids, am, lm = random_batch(seed)
        want, got = hf.generate_batch(ids, am, lm), vb.generate_batch(ids, am, lm)
        assert_within(max_diffs(want.tensors(), got.tensors()))
        ha, hh = hf.run_target(ids, am)
        va, vh = vb.run_target(ids, am)
        real = am.bool()
        lse_want, lse_got = hf.full_vocab_stats(hh)[1][real], vb.full_vocab_stats(vh)[1][real]
        assert_within(
            {
                "final_hidden": float((hh[real] - vh[real]).abs().max()),
                "lse": float((lse_want - lse_got).abs().max()),
            }
        )


def test_packed_rows_equal_the_transformers_batch(backends):
    """Block-causal documents with restarting positions == one vLLM prompt per document."""
    hf, vb = backends
    ids, am, lm = random_batch(2, B=3, T=40)
    am[:] = 1
    am[2, 30:] = 0
    seq_lens = torch.tensor([[10, 20, 10], [1, 39, 0], [17, 13, 0]])
    lm = lm.clamp(max=1) * am
    want = hf.generate_batch(ids, am, lm, seq_lens=seq_lens)
    got = vb.generate_batch(ids, am, lm, seq_lens=seq_lens)
    assert_within(max_diffs(want.tensors(), got.tensors()))
    # explicit per-document positions are the same request; any others cannot be honoured
    positions = torch.cat([torch.arange(n) for n in (10, 20, 10)]).expand(3, -1).clone()
    positions[1] = torch.cat([torch.arange(1), torch.arange(39)])
    positions[2] = torch.cat(
        [torch.arange(17), torch.arange(13), torch.zeros(10, dtype=torch.long)]
    )
    again = vb.generate_batch(ids, am, lm, position_ids=positions, seq_lens=seq_lens)
    assert torch.equal(again.aux_hidden, got.aux_hidden)
    with pytest.raises(ConfigError, match="numbers positions from 0"):
        vb.run_target(ids, am, position_ids=positions + 1, seq_lens=seq_lens)


def test_head_embeddings_and_refusals(backends):
    hf, vb = backends
    assert torch.equal(vb.get_input_embeddings(), hf.get_input_embeddings())
    want, got = hf.get_output_head(), vb.get_output_head()
    assert set(want) == set(got) == {"lm_head_selected", "final_norm"}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-7)
    ids, am, _ = random_batch(3)
    left = am.flip(1)  # left padding: vLLM would number the real tokens from 0, transformers not
    with pytest.raises(ConfigError, match="right-padded"):
        vb.run_target(ids, left)


def test_precompute_with_vllm_writes_the_transformers_cache(target, tmp_path):
    rng = random.Random(3)
    data = write_jsonl(tmp_path / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(24)])
    vm = tmp_path / "vm.safetensors"
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(target),
                "-d",
                str(data),
                "--draft-vocab-size",
                "64",
                "-o",
                str(vm),
                "-q",
            ]
        )
        == 0
    )
    caches = {}
    runs = {
        "transformers": ["--target-engine", "transformers"],
        "vllm": ["--target-engine", "vllm"],
        # the model over 2 worker processes (vLLM's tensor parallel; the states come back from rank 0,
        # the head and embedding from both ranks' vocab shards)
        "vllm-tp2": ["--target-engine", "vllm", "--target-tensor-parallel", "2"],
    }
    for name, engine in runs.items():
        caches[name] = tmp_path / f"cache-{name}"
        assert (
            main(
                [
                    "precompute",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "-v",
                    str(vm),
                    "-o",
                    str(caches[name]),
                    "--batch-tokens",
                    "512",
                    "--shard-tokens",
                    "600",
                    *engine,
                    "-q",
                ]
            )
            == 0
        )
    hf_m = fc.read_manifest(caches["transformers"])
    hf_cache = CacheBackend(caches["transformers"])
    selected = load_vocab_map(vm).selected_token_ids
    hf_cache.set_vocab_mapping(selected)
    tokens = hf_cache.tokens()
    for name in ("vllm", "vllm-tp2"):
        vllm_m = fc.read_manifest(caches[name])
        assert (
            fc.identity_mismatch(hf_m, vllm_m) is None
            and vllm_m["num_shards"] == hf_m["num_shards"] > 1
        )
        assert vllm_m["target_engine"] == "vllm"
        # the stored tensors, shard by shard
        diffs = {}
        for i in range(hf_m["num_shards"]):
            want = load_file(str(caches["transformers"] / fc.shard_name(i)))
            got = load_file(str(caches[name] / fc.shard_name(i)))
            assert set(want) == set(got)
            for field, diff in max_diffs(want, got).items():
                diffs[field] = max(diff, diffs.get(field, 0.0))
        assert_within(diffs)
        # and the batches the trainer reads from them, with the language head and the embedding
        vllm_cache = CacheBackend(caches[name], verify=True)
        vllm_cache.set_vocab_mapping(selected)
        assert torch.equal(vllm_cache.get_input_embeddings(), hf_cache.get_input_embeddings())
        for field, want in hf_cache.get_output_head().items():
            torch.testing.assert_close(vllm_cache.get_output_head()[field], want, rtol=0, atol=1e-7)
        assert vllm_cache.plan() == hf_cache.plan()
        for indices in hf_cache.plan():
            ids, am, lm = collate(tokens, indices)
            assert_within(
                max_diffs(
                    hf_cache.generate_batch(ids, am, lm).tensors(),
                    vllm_cache.generate_batch(ids, am, lm).tensors(),
                )
            )
