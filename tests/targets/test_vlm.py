"""Vision-language targets (Llava, Qwen2-VL / 2.5 / 3, Idefics3 / SmolVLM, Gemma 3 and 4, Mistral 3,
Llama 4, Mllama) on text: their language model,
under `text_config`, is what every stage runs and reads. Tiny random VLMs built here (tests/tiny.py).

- The supervision a VLM target gives for text rows equals an independent forward of the whole
  model (transformers' own hidden states and logits): the aux states are its language model's layer
  outputs, the draft-vocab distribution its logits' softmax, shifted as for any target.
- The pipeline through the CLI: build-vocab-map -> precompute -> train -> eval (greedy output identical
  to the target's) for each family.
- Image-text rows (Llava, Gemma 3, Idefics3: real processors built in tests/tiny.py): the supervision
  equals the whole model's forward on the processor's own inputs, chat by chat; the CLI pipeline on image
  chats (cache == live, training from both, eval on image prompts identical to the target's greedy output,
  chain and tree; vLLM export written); an image prompt's first forward is the whole model's.
"""

import json
import random

import pytest
import torch

from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.cli import main
from spec_cli.data.batching import collate, collate_packed
from spec_cli.data.tokenize import tokenize_data
from spec_cli.errors import ConfigError, DataError
from spec_cli.export.support import VLLM_SERVED
from spec_cli.targets import loading
from spec_cli.targets.cache_backend import CacheBackend
from spec_cli.targets.hf_backend import HFTargetBackend
from tests import tiny
from tests.conftest import write_jsonl
from tests.draft.runs import context_parallel_equals_one_process, weights

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm")
    return {family: tiny.save_tiny_vlm(root / family, family) for family in tiny.VLM_FAMILIES}


def rows(vocab: int):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(
        5, vocab - 8, (2, 13), generator=gen
    )  # text only (the image ids sit at the end)
    am = torch.ones_like(ids)
    am[1, 9:] = 0
    return ids, am, am.clone()


@pytest.mark.parametrize("family", tiny.VLM_FAMILIES)
def test_supervision_is_the_language_models_own(vlms, family):
    folder = vlms[family]
    config = loading.load_config(folder)
    assert loading.num_layers(config) == 6 and getattr(config, "text_config", None) is not None
    backend = HFTargetBackend(folder, [1, 2, 4], device="cpu", dtype="fp32")
    vocab = backend.info["vocab_size"]
    selected = torch.arange(0, vocab, 3)
    backend.set_vocab_mapping(selected)
    ids, am, lm = rows(vocab)
    batch = backend.generate_batch(ids, am, lm)
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    H = backend.info["hidden_size"]
    assert H == config.text_config.hidden_size and out.hidden_states[0].shape[-1] == H
    real = am.bool()
    # hidden_states[j + 1]: the output of the j-th layer that ran; Mllama's text rows skip its cross-attention
    # layer (2), which then passes its input on: its output is layer 1's
    ran = [i for i in range(6) if i not in loading.cross_attention_layers(config)]
    assert len(out.hidden_states) == len(ran) + 1 and (family == "mllama") == (len(ran) == 5)
    for k, layer in enumerate([1, 2, 4]):
        state = out.hidden_states[1 + ran.index(max(i for i in ran if i <= layer))]
        torch.testing.assert_close(
            batch.aux_hidden[..., k * H : (k + 1) * H][real], state[real], rtol=1e-5, atol=1e-5
        )
    p = torch.softmax(out.logits.float(), -1)[
        ..., selected
    ]  # [B, T, Vd] under the full vocab's normaliser
    valid = real[:, 1:] & real[:, :-1]  # slot t learns the target's distribution at t + 1
    want = (p / p.sum(-1, keepdim=True))[:, 1:][valid]
    torch.testing.assert_close(batch.target_p[:, :-1][valid], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        batch.target_mass[:, :-1][valid], p.sum(-1)[:, 1:][valid], rtol=1e-5, atol=1e-6
    )
    assert torch.equal(batch.target_ids[:, :-1][valid], out.logits.argmax(-1)[:, 1:][valid])
    assert torch.equal(backend.get_input_embeddings(), model.get_input_embeddings().weight)
    backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", tiny.VLM_FAMILIES)
def test_the_pipeline_runs_on_a_vlm_target(vlms, family, tmp_path, capsys):
    rng = random.Random(7)
    data = write_jsonl(tmp_path / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(16)])
    target, vm, cache, run = (
        vlms[family],
        tmp_path / "vm.safetensors",
        tmp_path / "cache",
        tmp_path / "run",
    )
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
                str(cache),
                "--batch-tokens",  # the size training asks: a cache keeps its own batches
                "512",
                "-q",
            ]
        )
        == 0
    )
    train = [
        "train",
        "--cache",
        str(cache),
        "-v",
        str(vm),
        "-o",
        str(run),
        "--max-steps",
        "2",
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "512",
        "--eval-every",
        "0",
        "-q",
    ]
    if (
        family == "mllama"
    ):  # its embedding table holds 8 image-token rows past the vocabulary: refused, said why
        capsys.readouterr()
        assert main(train) == 1
        assert "Mllama keeps its image tokens past the vocabulary" in capsys.readouterr().err
        return
    assert main(train) == 0
    assert (
        main(
            [
                "eval",
                "--draft",
                str(run),
                "-t",
                str(target),
                "-p",
                str(data),
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "12",
                "-o",
                str(tmp_path / "eval"),
                "-q",
            ]
        )
        == 0
    )
    overall = json.loads((tmp_path / "eval" / "eval.json").read_text())["overall"]
    assert overall["same_as_target"] == overall["turns"] >= 2  # greedy: the target's own output
    # vLLM 0.32 serves EAGLE-3 on some of these VLM classes only (its SupportsEagle3); the engine itself
    # cannot load them in this install (no torchvision), so the export is checked without it
    architecture = loading.load_config(target).architectures[0]
    served = architecture in VLLM_SERVED
    assert served == (family in ("llava", "qwen2_5_vl", "qwen3_vl", "mistral3", "gemma4", "llama4"))
    out = tmp_path / "export"
    assert main(
        ["export", str(run), "-f", "vllm", "-o", str(out), "--engine-check", "none", "-q"]
    ) == (0 if served else 1)
    if served:
        config = json.loads((out / "config.json").read_text())
        assert config["target_hidden_size"] == 32 and config[
            "eagle_aux_hidden_state_layer_ids"
        ] == [2, 3, 5]
    else:
        assert f"{architecture} does not implement SupportsEagle3" in capsys.readouterr().err


# ----------------------------------------------------------------------------- image-text rows


def image_tokens(folder, data):
    return tokenize_data(
        data,
        loading.load_tokenizer(folder),
        "fp",
        512,
        use_cache=False,
        processor=loading.load_processor(folder),
    )


@pytest.mark.parametrize("family", tiny.PROCESSOR_FAMILIES)
def test_image_rows_get_the_whole_models_own_supervision(vlms, family, tmp_path):
    """Aux states with each image's features in place of its placeholders, equal to the whole model's
    forward on the processor's own inputs (one chat at a time); a batch mixes image and text rows."""
    folder = vlms[family]
    data = write_jsonl(tmp_path / "chat.jsonl", tiny.image_chat_records(tmp_path))
    tokens = image_tokens(folder, data)
    backend = HFTargetBackend(folder, [1, 2, 4], device="cpu", dtype="fp32")
    vocab = backend.info["vocab_size"]
    selected = torch.arange(0, vocab, 3)
    backend.set_vocab_mapping(selected)
    order = [1, 3, 0, 2]  # longest first as the planner would, a text row among them
    ids, am, lm = collate(tokens, order)
    batch = backend.generate_batch(ids, am, lm, images=tokens.images(order, ids.shape[1]))
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    processor = loading.load_processor(folder)
    H = backend.info["hidden_size"]
    for row, i in enumerate(order):
        want = processor.apply_chat_template(
            tiny.processor_messages(tmp_path)[i],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            out = model(**want, output_hidden_states=True)
        n = want["input_ids"].shape[1]
        assert int(am[row].sum()) == n and torch.equal(ids[row, :n], want["input_ids"][0])
        for k, layer in enumerate([1, 2, 4]):
            torch.testing.assert_close(
                batch.aux_hidden[row, :n, k * H : (k + 1) * H],
                out.hidden_states[layer + 1][0],
                rtol=1e-5,
                atol=2e-5,
            )
        p = torch.softmax(out.logits[0].float(), -1)[:, selected]
        torch.testing.assert_close(
            batch.target_p[row, : n - 1], (p / p.sum(-1, keepdim=True))[1:], rtol=1e-4, atol=1e-6
        )
        assert torch.equal(batch.target_ids[row, : n - 1], out.logits[0].argmax(-1)[1:])
    text_only = backend.generate_batch(
        ids, am, lm
    )  # the placeholders' own embeddings instead of the images
    image_rows = torch.tensor([bool(tokens.num_images[i]) for i in order])
    assert not torch.allclose(text_only.aux_hidden[image_rows], batch.aux_hidden[image_rows])
    torch.testing.assert_close(text_only.aux_hidden[~image_rows], batch.aux_hidden[~image_rows])
    backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", tiny.PROCESSOR_FAMILIES)
def test_the_pipeline_trains_on_image_chats(vlms, family, tmp_path, capsys):
    """Each family with a real processor through the CLI on image-text chats: the vocab map counts their
    answers, precompute stores the supervision with the images in place (== the live target's), training
    runs from that cache and live (Llava also streamed and packed from the cache), eval is the target's
    greedy output, and the vLLM export is written where vLLM serves EAGLE-3 on the class (Llava)."""
    rng = random.Random(3)
    records = tiny.image_chat_records(tmp_path) * 3 + [tiny.random_sharegpt(rng) for _ in range(6)]
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    target, vm, cache = vlms[family], tmp_path / "vm.safetensors", tmp_path / "cache"
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
                str(cache),
                "--batch-tokens",  # the size training asks: a cache keeps its own batches
                "512",
                "--storage-dtype",
                "fp32",
                "--dtype",
                "fp32",
                "-q",
            ]
        )
        == 0
    )
    manifest = json.loads((cache / "manifest.json").read_text())
    assert ":images " in manifest["data_fingerprint"]
    tokens = image_tokens(target, data)
    live = HFTargetBackend(target, manifest["aux_layers"], device="cpu", dtype="fp32")
    cached = CacheBackend(cache)
    live.set_vocab_mapping(load_vocab_map(vm).selected_token_ids)
    order = [1, 0, 13, 2]
    ids, am, lm = collate(tokens, order)
    want, got = (
        live.generate_batch(ids, am, lm, images=tokens.images(order, ids.shape[1])),
        cached.generate_batch(ids, am, lm),
    )
    torch.testing.assert_close(got.aux_hidden[am.bool()], want.aux_hidden[am.bool()])
    runs = [("from-cache", ["--cache", str(cache)]), ("live", ["-t", str(target), "-d", str(data)])]
    if family == "llava":
        runs += [
            ("stream", ["-t", str(target), "-d", str(data), "--stream"]),
            ("packed-cache", ["--cache", str(cache), "--pack"]),
        ]  # (chats' supervision, packed)
    for run, source in runs:
        assert (
            main(
                [
                    "train",
                    *source,
                    "-v",
                    str(vm),
                    "-o",
                    str(tmp_path / run),
                    "--max-steps",
                    "2",
                    "--ttt-steps",
                    "2",
                    "--batch-tokens",
                    "512",
                    "--eval-every",
                    "0",
                    "-q",
                ]
            )
            == 0
        )
    if family == "llava":
        streamed = weights(
            tmp_path / "stream"
        )  # producer threads feed the same batches: the same draft
        assert all(
            torch.equal(value, streamed[name]) for name, value in weights(tmp_path / "live").items()
        )
    prompts = write_jsonl(tmp_path / "prompts.jsonl", tiny.image_chat_records(tmp_path))
    processor = loading.load_processor(target)
    for shape in (
        ["--depth", "3"],
        ["--depth", "3", "--topk", "2"],
    ):  # a chain and a tree of candidates
        out = tmp_path / f"eval{len(shape)}"
        assert (
            main(
                [
                    "eval",
                    "--draft",
                    str(tmp_path / "live"),
                    "-t",
                    str(target),
                    "-p",
                    str(prompts),
                    *shape,
                    "--max-new-tokens",
                    "12",
                    "-o",
                    str(out),
                    "-q",
                ]
            )
            == 0
        )
        overall = json.loads((out / "eval.json").read_text())["overall"]
        assert overall["same_as_target"] == overall["turns"] == 5  # greedy: the target's own output
        lengths = [
            r["prompt_tokens"]
            for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())
        ]
        first = processor.apply_chat_template(
            tiny.processor_messages(tmp_path)[0][:1],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
        )
        assert lengths[0] == len(
            first["input_ids"][0]
        )  # the image's placeholders expanded, as the processor does
    assert (
        main(
            [
                "eval",
                "--draft",
                str(tmp_path / "live"),
                "-t",
                str(target),
                "-p",
                str(prompts),
                "--engine",
                "vllm",
                "-o",
                str(tmp_path / "no"),
                "-q",
            ]
        )
        == 1
    )
    assert "runs image prompts in PyTorch only" in capsys.readouterr().err
    served = loading.load_config(target).architectures[0] in VLLM_SERVED
    assert served == (family == "llava")
    assert main(
        [
            "export",
            str(tmp_path / "live"),
            "-f",
            "vllm",
            "-o",
            str(tmp_path / "export"),
            "--engine-check",
            "none",
            "-q",
        ]
    ) == (0 if served else 1)
    if served:
        assert (
            json.loads((tmp_path / "export" / "config.json").read_text())["draft_vocab_size"] == 64
        )
    else:
        assert "does not implement SupportsEagle3" in capsys.readouterr().err
    # packed live: each chat's own mask and positions (Gemma 3: its images' tokens both ways), the same draft
    # as packed from the cache precompute made chat by chat
    common = [
        "-v",
        str(vm),
        "--pack",
        "--max-steps",
        "2",
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "512",
        "--eval-every",
        "0",
        "-q",
    ]
    assert (
        main(
            [
                "train",
                "-t",
                str(target),
                "-d",
                str(data),
                "--dtype",
                "fp32",
                "-o",
                str(tmp_path / "packed"),
                *common,
            ]
        )
        == 0
    )
    assert (
        main(["train", "--cache", str(cache), "-o", str(tmp_path / "packed-from-cache"), *common])
        == 0
    )
    cached = weights(tmp_path / "packed-from-cache")
    for name, value in weights(tmp_path / "packed").items():
        torch.testing.assert_close(value, cached[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_an_image_prompts_first_forward_is_the_whole_models(vlms, family, tmp_path):
    """spec eval's prompt for a chat with images (two images by the second turn) is the processor's, and
    the target's first forward takes the images: logits and aux states equal the whole model's forward."""
    from spec_cli.eval import prompts, speculative
    from spec_cli.eval.target import Target

    folder = vlms[family]
    path = write_jsonl(tmp_path / "prompts.jsonl", tiny.image_chat_records(tmp_path))
    conv = prompts.load_conversations(str(path))[1]
    assert len(conv.turns) == 2 and len(conv.images) == 2
    conv.answers.append("a dog")
    processor = loading.load_processor(folder)
    ids = prompts.prompt_ids(loading.load_tokenizer(folder), conv, 1, processor)
    want = processor.apply_chat_template(
        tiny.processor_messages(tmp_path)[1][:3],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert ids == want["input_ids"][0].tolist()
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    target = Target(model, [1, 2, 4])
    target.capture = True
    logits, aux = speculative.prefill(target, target.new_cache(), torch.tensor(ids), ids.images)
    with torch.no_grad():
        out = model(**want, output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits[0, -1].float(), rtol=1e-5, atol=1e-5)
    H = out.hidden_states[0].shape[-1]
    torch.testing.assert_close(aux[:, H : 2 * H], out.hidden_states[3][0], rtol=1e-5, atol=2e-5)
    blind, _ = speculative.prefill(target, target.new_cache(), torch.tensor(ids))
    assert not torch.allclose(blind, logits)
    with pytest.raises(DataError, match="has no processor"):
        prompts.prompt_ids(loading.load_tokenizer(folder), conv, 1, None)


@pytest.mark.parametrize("family", tiny.QWEN_VL_FAMILIES)
def test_qwen_vl_image_rows_get_m_rope_supervision(vlms, family, tmp_path):
    """Qwen-VL (M-RoPE: an image's tokens take (time, height, width) positions from its grid, the text
    after it continues from the largest): the aux states of image rows equal the whole model's forward,
    which places them so; a batch of an image row and a text row, right-padded. The processor is built in
    memory (tests/tiny.py: its video part needs torchvision)."""
    folder = vlms[family]
    processor = tiny.qwen_vl_processor(folder, family)
    data = write_jsonl(tmp_path / "chat.jsonl", tiny.image_chat_records(tmp_path))
    tokens = tokenize_data(
        data, loading.load_tokenizer(folder), "fp", 512, use_cache=False, processor=processor
    )
    assert tokens.num_images.tolist() == [1, 2, 1, 0]
    backend = HFTargetBackend(folder, [1, 2, 4], device="cpu", dtype="fp32")
    backend.set_vocab_mapping(torch.arange(backend.info["vocab_size"]))
    order = [1, 3, 2]
    ids, am, lm = collate(tokens, order)
    batch = backend.generate_batch(ids, am, lm, images=tokens.images(order, ids.shape[1]))
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    H = backend.info["hidden_size"]
    for row, i in enumerate(order):
        want = processor.apply_chat_template(
            tiny.processor_messages(tmp_path)[i],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        n = want["input_ids"].shape[1]
        assert torch.equal(ids[row, :n], want["input_ids"][0])
        with torch.no_grad():
            out = model(**want, output_hidden_states=True)
        for k, layer in enumerate([1, 2, 4]):
            torch.testing.assert_close(
                batch.aux_hidden[row, :n, k * H : (k + 1) * H],
                out.hidden_states[layer + 1][0],
                rtol=1e-5,
                atol=2e-5,
            )
    # with plain positions (0..T-1) the image row's states differ: the grid's positions are in use
    with torch.no_grad():
        plain = model(
            **processor.apply_chat_template(
                tiny.processor_messages(tmp_path)[1],
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
            ),
            position_ids=torch.arange(int(am[0].sum()))[None],
            output_hidden_states=True,
        )
    assert not torch.allclose(
        plain.hidden_states[2][0], batch.aux_hidden[0, : int(am[0].sum()), :H], atol=1e-4
    )
    backend.close()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_qwen_vl_image_prompts_decode_as_the_model_generates(vlms, family, tmp_path):
    """spec eval on a Qwen-VL image prompt: the prefill lets the model place the image by its grid, and every
    later token sits past its index by the model's own offset (kept with the cache), so the target alone
    decodes what transformers' generate() decodes, and speculative decoding (an EAGLE-3 chain and tree from
    a random draft, which verification corrects) gives the same tokens."""
    from spec_cli.draft.eagle3.model import Eagle3Draft
    from spec_cli.eval import prompts, speculative
    from spec_cli.eval.target import Target

    folder = vlms[family]
    processor = tiny.qwen_vl_processor(folder, family)
    path = write_jsonl(tmp_path / "prompts.jsonl", tiny.image_chat_records(tmp_path))
    conv = prompts.load_conversations(str(path))[1]
    conv.answers.append("a dog")
    prompt = prompts.prompt_ids(
        loading.load_tokenizer(folder), conv, 1, processor
    )  # two images by now
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    want = processor.apply_chat_template(
        tiny.processor_messages(tmp_path)[1][:3],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert prompt == want["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(
            **want,
            max_new_tokens=10,
            do_sample=False,
            min_new_tokens=10,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, len(prompt) :]
    target = Target(model, [1, 2, 4])
    alone = speculative.generate_target(target, prompt, speculative.Settings(max_new_tokens=10))
    assert alone.tokens == generated.tolist()
    cache = target.new_cache()  # step by step: each step's logits are generate()'s
    logits, _ = speculative.prefill(target, cache, torch.tensor(prompt), prompt.images)
    for j, token in enumerate(generated[:4].tolist()):
        torch.testing.assert_close(
            logits.reshape(-1), out.logits[j][0].float(), rtol=1e-4, atol=1e-4
        )
        logits, _ = target.forward(
            torch.tensor([[token]]), torch.tensor([[len(prompt) + j]]), cache
        )
    config = loading.load_config(folder)
    from spec_cli.draft.config import DraftConfig

    torch.manual_seed(0)
    draft = Eagle3Draft(
        DraftConfig.from_target(
            config,
            loading.vocab_size(config, loading.load_tokenizer(folder)),
            [1, 2, 4],
            num_hidden_layers=1,
        )
    ).eval()
    draft.copy_embeddings(model.get_input_embeddings().weight.detach())
    for settings in (
        speculative.Settings(max_new_tokens=10),
        speculative.Settings(max_new_tokens=10, topk=2, depth=3),
    ):
        assert speculative.generate(target, draft, prompt, settings).tokens == alone.tokens


def test_a_served_target_supervises_image_rows_as_the_live_one(vlms, tmp_path, capsys):
    """`spec serve-target` of a VLM sends its processor's files with its tokenizer's; a trainer reads the
    image chats with them and sends each batch's image inputs along: the answer equals the in-process
    target's bit for bit, and `spec train --remote` trains on image chats."""
    from spec_cli.serve.client import RemoteBackend
    from spec_cli.serve.http import HTTPHandle
    from spec_cli.serve.run import tokenizer_files
    from spec_cli.serve.server import TargetServer

    folder = vlms["gemma3"]  # (its token types go along too)
    live = HFTargetBackend(folder, [1, 2, 4], device="cpu", dtype="fp32")
    files = tokenizer_files(loading.load_tokenizer(folder), loading.load_processor(folder))
    assert "processor_config.json" in files  # (the image processor's settings in it)
    handle = HTTPHandle(
        TargetServer(
            live, target_config=loading.load_config(folder).to_dict(), tokenizer_files=files
        ),
        "127.0.0.1",
        0,
        request_timeout=30.0,
    )
    try:
        remote = RemoteBackend(handle.url, tensor_plane=False)
        tokenizer = remote.load_tokenizer(tmp_path / "tok")
        processor = loading.load_processor(remote.tokenizer_folder)
        assert remote.reads_images and processor is not None
        data = write_jsonl(tmp_path / "chat.jsonl", tiny.image_chat_records(tmp_path) * 2)
        tokens = tokenize_data(
            data,
            tokenizer,
            remote.info["tokenizer_fingerprint"],
            512,
            use_cache=False,
            processor=processor,
        )
        local = image_tokens(folder, data)
        assert torch.equal(tokens.input_ids, local.input_ids) and torch.equal(
            tokens.loss_mask, local.loss_mask
        )
        selected = torch.arange(0, live.info["vocab_size"], 3)
        remote.set_vocab_mapping(selected)
        order = [1, 3, 0]
        ids, am, lm = collate(tokens, order)
        images = tokens.images(order, ids.shape[1])
        served = remote.generate_batch(ids, am, lm, images=images)
        live.set_vocab_mapping(selected)
        here = live.generate_batch(ids, am, lm, images=images)
        for name, value in here.tensors().items():
            assert torch.equal(served.tensors()[name], value), name
        vm = tmp_path / "vm.safetensors"
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(folder),
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
        assert (
            main(
                [
                    "train",
                    "--remote",
                    handle.url,
                    "-d",
                    str(data),
                    "-v",
                    str(vm),
                    "-o",
                    str(tmp_path / "run"),
                    "--max-steps",
                    "2",
                    "--ttt-steps",
                    "2",
                    "--batch-tokens",
                    "512",
                    "--eval-every",
                    "0",
                    "--no-tensor-plane",
                    "-q",
                ]
            )
            == 0
        )
        remote.close()
    finally:
        handle.stop(grace=1.0)
        live.close()


@pytest.mark.slow
def test_a_cache_reads_image_rows_by_sample_not_by_tokens(vlms, tmp_path):
    """Two chats with the same words about two images of one size have the same token ids (the same
    number of placeholders) and different supervision: a feature cache hands each its own."""
    target = vlms["llava"]
    chats = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "image": tiny.draw_image(tmp_path, f"{s}.png", (16, 16), s),
                        },
                        {"type": "text", "text": "what is it?"},
                    ],
                },
                {"role": "assistant", "content": "a square"},
            ]
        }
        for s in (1, 2)
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", chats + [tiny.random_sharegpt(random.Random(0))])
    vm, cache = tmp_path / "vm.safetensors", tmp_path / "cache"
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
                str(cache),
                "--batch-tokens",  # the size training asks: a cache keeps its own batches
                "512",
                "--storage-dtype",
                "fp32",
                "--dtype",
                "fp32",
                "-q",
            ]
        )
        == 0
    )
    tokens = image_tokens(target, data)
    assert torch.equal(tokens.sample(0)[0], tokens.sample(1)[0])
    cached = CacheBackend(cache)
    live = HFTargetBackend(
        target,
        json.loads((cache / "manifest.json").read_text())["aux_layers"],
        device="cpu",
        dtype="fp32",
    )
    live.set_vocab_mapping(load_vocab_map(vm).selected_token_ids)
    in_cache = cached.tokens().source_index.tolist()
    found = []
    for i in (0, 1):
        ids, am, lm = collate(tokens, [i])
        want = live.generate_batch(ids, am, lm, images=tokens.images([i], ids.shape[1]))
        got = cached.generate_batch(ids, am, lm, samples=[in_cache.index(i)])
        torch.testing.assert_close(got.aux_hidden, want.aux_hidden)
        found.append(
            cached.generate_batch(ids, am, lm).aux_hidden
        )  # by tokens: one of the two, for both
    assert torch.equal(found[0], found[1])
    live.close()


@pytest.mark.slow
def test_regenerate_answers_image_chats_with_their_images(vlms, tmp_path):
    """`spec regenerate` asks image chats with their images: each answer is transformers' own greedy
    generation from the processor's inputs, the output names its images by absolute paths (read from
    wherever it is), and it trains as image-text data (the same images per record)."""
    from spec_cli.eval.speculative import eos_ids

    target = vlms["llava"]
    folder = tmp_path / "data"
    folder.mkdir()
    data = write_jsonl(folder / "chat.jsonl", tiny.image_chat_records(folder))
    out = tmp_path / "elsewhere" / "regenerated.jsonl"
    assert (
        main(
            [
                "regenerate",
                "-t",
                str(target),
                "-d",
                str(data),
                "-o",
                str(out),
                "--max-new-tokens",
                "8",
                "--dtype",
                "fp32",
                "-q",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source_index"] for r in rows] == [0, 1, 2, 3]

    def images_of(row):
        return [
            p["image"]
            for m in row["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image"
        ]

    # (an answer cut at --max-new-tokens ends its chat: record 1 may stop before its second image)
    assert (
        images_of(rows[1])
        == [str(folder / "b.png"), str(folder / "c.png")][: len(images_of(rows[1]))]
    )
    assert images_of(rows[0]) == [str(folder / "a.png")] and images_of(rows[1])
    processor, tokenizer = loading.load_processor(target), loading.load_tokenizer(target)
    model = loading.load_model(target, torch.device("cpu"), torch.float32)
    stop = eos_ids(tokenizer, loading.generation_config(target))
    for i in (
        0,
        2,
    ):  # one user turn with an image: the answer is the model's own greedy continuation
        want = processor.apply_chat_template(
            tiny.processor_messages(folder)[i][:1],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            new = model.generate(**want, max_new_tokens=8, do_sample=False)[
                0, want["input_ids"].shape[1] :
            ].tolist()
        cut = next((k for k, t in enumerate(new) if t in stop), len(new))
        assert rows[i]["messages"][-1]["content"] == tokenizer.decode(
            new[:cut], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
    (folder / "chat.jsonl").unlink()  # the output stands on its own
    tokens = tokenize_data(out, tokenizer, "fp", 512, use_cache=False, processor=processor)
    assert (
        tokens.num_images.tolist() == [len(images_of(r)) for r in rows]
        and tokens.metadata["skipped"] == {}
    )


@pytest.mark.parametrize("family", ["llava", "idefics3", "gemma3", *tiny.QWEN_VL_FAMILIES])
def test_packed_image_rows_get_each_chats_own_supervision(vlms, family, tmp_path):
    """Image chats packed into one row (--pack): each document's aux states equal the whole model's forward
    on that chat alone (its own mask and positions from 0, its images in place; Qwen-VL: its M-RoPE
    positions from its own images' grids, which the packed row's later documents must not continue)."""
    folder = vlms[family]
    qwen = family in tiny.QWEN_VL_FAMILIES
    processor = tiny.qwen_vl_processor(folder, family) if qwen else loading.load_processor(folder)
    data = write_jsonl(tmp_path / "chat.jsonl", tiny.image_chat_records(tmp_path))
    tokens = tokenize_data(
        data, loading.load_tokenizer(folder), "fp", 512, use_cache=False, processor=processor
    )
    backend = HFTargetBackend(folder, [1, 2, 4], device="cpu", dtype="fp32")
    backend.set_vocab_mapping(torch.arange(backend.info["vocab_size"]))
    order = [1, 3, 0, 2]  # two images, text only, one image, one image
    ids, am, lm, seq_lens = collate_packed(tokens, order)
    batch = backend.generate_batch(
        ids, am, lm, seq_lens=seq_lens, images=tokens.images(order, ids.shape[1], packed=True)
    )
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    H, start = backend.info["hidden_size"], 0
    for i in order:
        want = processor.apply_chat_template(
            tiny.processor_messages(tmp_path)[i],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        n = want["input_ids"].shape[1]
        with torch.no_grad():
            out = model(**want, output_hidden_states=True)
        for k, layer in enumerate([1, 2, 4]):
            torch.testing.assert_close(
                batch.aux_hidden[0, start : start + n, k * H : (k + 1) * H],
                out.hidden_states[layer + 1][0],
                rtol=1e-5,
                atol=2e-5,
            )
        start += n
    if (
        family == "llava"
    ):  # per-token types this packing does not know (PaliGemma's prefix): one clear error
        images = {
            **tokens.images(order, ids.shape[1], packed=True),
            "token_type_ids": torch.zeros_like(ids),
        }
        with pytest.raises(ConfigError, match="per-token types this packing does not know"):
            backend.generate_batch(ids, am, lm, seq_lens=seq_lens, images=images)
    backend.close()


def chats_vocab_and_cache(target, tmp_path, *precompute: str):
    """Image chats (3 copies of tiny's 4, 3 with images) and 4 text chats, their vocab map (64) and an fp32
    feature cache (`precompute`: more options for it): (data, vocab map, cache)."""
    rng = random.Random(3)
    data = write_jsonl(
        tmp_path / "chat.jsonl",
        tiny.image_chat_records(tmp_path) * 3 + [tiny.random_sharegpt(rng) for _ in range(4)],
    )
    vm, cache = tmp_path / "vm.safetensors", tmp_path / "cache"
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
                str(cache),
                "--batch-tokens",  # the size training asks: a cache keeps its own batches
                "512",
                "--storage-dtype",
                "fp32",
                "--dtype",
                "fp32",
                *precompute,
                "-q",
            ]
        )
        == 0
    )
    return data, vm, cache


@pytest.mark.parametrize("family", ["qwen2_vl"])
def test_qwen_vl_trains_packed_live_as_from_its_per_chat_cache(vlms, family, tmp_path, monkeypatch):
    """spec train --pack on Qwen-VL image chats through the CLI: live, each packed chat gets its own M-RoPE
    positions from its images' grids; from a cache, the same packed rows read supervision precompute made
    one chat at a time. The two runs train the same draft. (The processor is built in memory and handed to
    the CLI: Qwen-VL's saved processor needs torchvision for its video part.)"""
    folder = vlms[family]
    monkeypatch.setattr(
        loading, "processor_loader", lambda path: lambda: tiny.qwen_vl_processor(folder, family)
    )
    data, vm, cache = chats_vocab_and_cache(folder, tmp_path)
    assert (
        len(json.loads((cache / "manifest.json").read_text())["image_samples"]) == 9
    )  # 3 copies of 3 chats with images
    common = [
        "-v",
        str(vm),
        "--pack",
        "--max-steps",
        "2",
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "512",
        "--eval-every",
        "0",
        "-q",
    ]
    assert (
        main(
            [
                "train",
                "-t",
                str(folder),
                "-d",
                str(data),
                "--dtype",
                "fp32",
                "-o",
                str(tmp_path / "live"),
                *common,
            ]
        )
        == 0
    )
    assert main(["train", "--cache", str(cache), "-o", str(tmp_path / "cached"), *common]) == 0
    live, cached = weights(tmp_path / "live"), weights(tmp_path / "cached")
    for (
        name,
        value,
    ) in live.items():  # (the same packing with M-RoPE positions 0, 1, 2, ... misses by 4e-4)
        torch.testing.assert_close(value, cached[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_image_rows_under_context_parallelism_train_what_one_process_trains(vlms, tmp_path):
    """torchrun x2, --context-parallel 2 on Llava image chats: from a live target (the group's first rank
    runs the whole model, its vision part included, over the whole rows and sends the other rank its
    slots), packed live, and from a cache (each rank reads its slots of each chat by sample id): each
    trains the draft one process trains on the same batches."""
    target = vlms["llava"]
    data, vm, cache = chats_vocab_and_cache(target, tmp_path)
    common = [
        "-v",
        str(vm),
        "--max-steps",
        "3",
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "512",
        "--eval-every",
        "0",
        "--precision",
        "fp32",
        "--lr",
        "3e-3",
        "-q",
    ]
    runs = {
        "live": ["-t", str(target), "-d", str(data), "--dtype", "fp32"],
        "packed": ["-t", str(target), "-d", str(data), "--dtype", "fp32", "--pack"],
        "cache": ["--cache", str(cache)],
    }
    context_parallel_equals_one_process(runs, common, tmp_path)


def test_p_eagle_trains_on_image_chats_and_decodes_as_the_target(vlms, tmp_path):
    """P-EAGLE on a VLM target (Llava): the same aux states as EAGLE-3 with the images in place, so a packed
    run from the live target trains what a packed run from its cache trains; greedy eval on image prompts is the
    target's own output; the vLLM export (P-EAGLE's parallel EAGLE-3 format) is written and self-checked."""
    target = vlms["llava"]
    data, vm, cache = chats_vocab_and_cache(target, tmp_path, "--algorithm", "peagle")
    common = [
        "-v",
        str(vm),
        "--algorithm",
        "peagle",
        "--pack",
        "--max-steps",
        "2",
        "--batch-tokens",
        "512",
        "--eval-every",
        "0",
        "--precision",
        "fp32",
        "-q",
    ]  # (packed: both read the same rows)
    assert main(["train", "--cache", str(cache), "-o", str(tmp_path / "cached"), *common]) == 0
    assert (
        main(
            [
                "train",
                "-t",
                str(target),
                "-d",
                str(data),
                "--dtype",
                "fp32",
                "-o",
                str(tmp_path / "live"),
                *common,
            ]
        )
        == 0
    )
    cached = weights(tmp_path / "cached")
    for name, value in weights(tmp_path / "live").items():
        torch.testing.assert_close(value, cached[name], rtol=1e-5, atol=1e-6, msg=name)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", tiny.image_chat_records(tmp_path))
    assert (
        main(
            [
                "eval",
                "--draft",
                str(tmp_path / "live"),
                "-t",
                str(target),
                "-p",
                str(prompts),
                "--max-new-tokens",
                "12",
                "-o",
                str(tmp_path / "eval"),
                "-q",
            ]
        )
        == 0
    )
    overall = json.loads((tmp_path / "eval" / "eval.json").read_text())["overall"]
    assert overall["same_as_target"] == overall["turns"] == 5
    assert (
        main(
            [
                "export",
                str(tmp_path / "live"),
                "-f",
                "vllm",
                "-o",
                str(tmp_path / "export"),
                "--engine-check",
                "none",
                "-q",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "export" / "config.json").read_text())["draft_vocab_size"] == 64
