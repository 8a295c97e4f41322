"""MSD (spec_cli/draft/msd/): the draft that reads the target's input embeddings (image features in place).

- The objective against an independent computation: EAGLE-1's reference forward (tests/draft/eagle) fed
  the batch's input embeddings of the next tokens in place of an embedding table.
- The `input_embeds` target field is what the target's first decoder layer reads: the whole model's own
  hidden_states[0], images merged (Llava, Gemma 3 with its scaled embeddings).
- Decoding reads exactly what training read: catch_up's states on an image prompt equal the draft's
  step-0 forward over the same row's supervision.
- The curriculum: its shares and phases by hand, its choices a function of the step alone (the same for a
  fresh object, i.e. a resume, and for every rank), each source's batches taken in its own epochs.
- Through the CLI on image chats: precompute (cache == live), training along the curriculum, a resume
  across its switch equal to the straight run, eval (chain and tree) identical to the target's greedy
  output, and `spec export` refusing with the reason.
"""

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from spec_cli.batch import TargetBatch
from spec_cli.cli import main
from spec_cli.data.batching import collate
from spec_cli.data.tokenize import tokenize_data
from spec_cli.draft import algorithms
from spec_cli.draft.algorithm import INPUT_EMBEDS
from spec_cli.draft.msd.curriculum import MULTIMODAL, TEXT, Curriculum
from spec_cli.draft.msd.implementation import catch_up, target_fields
from spec_cli.draft.msd.model import MsdDraft
from spec_cli.draft.msd.objective import MsdObjective
from spec_cli.draft.unroll import shift_left
from spec_cli.errors import ConfigError
from spec_cli.targets import loading
from spec_cli.targets.cache_backend import CacheBackend
from spec_cli.targets.hf_backend import HFTargetBackend
from spec_cli.train_options import ObjectiveOptions
from tests import tiny
from tests.conftest import write_jsonl
from tests.draft import one_thread  # noqa: F401 (autouse fixture)
from tests.draft.eagle.test_model import H, V, eagle_config, reference
from tests.draft.eagle.test_objective import batch_of
from tests.draft.runs import (
    context_parallel_commands,
    context_parallel_equals_one_process,
    log,
    weights,
)


def msd_draft(seed: int = 0, **overrides) -> MsdDraft:
    torch.manual_seed(seed)
    draft = MsdDraft(eagle_config(algorithm="msd", **overrides))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return draft


def batch_with_embeds(lengths: list[int], T: int, seed: int = 0) -> TargetBatch:
    """EAGLE-1's test batch, with the target's input embeddings."""
    batch = batch_of(lengths, T, seed)
    batch.extras = {
        INPUT_EMBEDS: torch.randn(
            len(lengths), T, H, generator=torch.Generator().manual_seed(seed + 99)
        )
    }
    return batch


def test_the_objective_is_eagle1s_on_the_targets_input_embeddings():
    draft = msd_draft(num_hidden_layers=2)
    assert not hasattr(draft, "embed_tokens")  # no table of its own
    options = ObjectiveOptions(ttt_steps=1, feature_weight=1.0, token_weight=0.1)
    batch = batch_with_embeds([9, 6], T=10)
    out = MsdObjective(draft, options)(batch)
    W = {k: v.detach() for k, v in draft.state_dict().items()}
    feature, token, hits, n = 0.0, 0.0, 0, 0
    for b in range(2):
        T = int(batch.attention_mask[b].sum())
        e_next = torch.cat(
            [batch.extras[INPUT_EMBEDS][b, 1:T], torch.zeros(1, H)]
        )  # slot t reads e[t + 1]
        state, logits = reference(
            {**W, "embed_tokens.weight": e_next},
            draft.config,
            torch.arange(T),
            batch.final_hidden[b, :T],
        )
        for t in batch.loss_mask[b, :T].nonzero().flatten().tolist():
            feature += F.smooth_l1_loss(state[t], batch.final_hidden[b, t + 1])
            token += -(batch.target_p[b, t] * logits[t].log_softmax(-1)).sum()
            hits += int(logits[t].argmax() == batch.target_ids[b, t])
            n += 1
    torch.testing.assert_close(
        out.loss,
        torch.as_tensor(feature / n + 0.1 * token / n, dtype=torch.float32),
        rtol=1e-5,
        atol=1e-6,
    )
    assert int(out.correct[0]) == hits
    # the token ids play no part: only the embeddings the target gave
    other = batch_with_embeds([9, 6], T=10)
    other.extras, other.final_hidden, other.target_p = (
        batch.extras,
        batch.final_hidden,
        batch.target_p,
    )
    torch.testing.assert_close(MsdObjective(draft, options)(other).loss, out.loss)
    batch.extras = {}
    with pytest.raises(ConfigError, match="input embeddings"):
        MsdObjective(draft, options)(batch)
    with pytest.raises(ConfigError, match="holds no token embeddings"):
        draft.copy_embeddings(torch.zeros(V, H))


def test_the_curriculums_shares_phases_and_choices():
    c = Curriculum(text_steps=3, ratio=0.6, ramp_steps=4, seed=5)
    assert [c.share(s) for s in range(9)] == pytest.approx(
        [0, 0, 0, 0.15, 0.3, 0.45, 0.6, 0.6, 0.6]
    )
    assert [c.phase(s) for s in (0, 2, 3, 5, 6, 40)] == [
        "text",
        "text",
        "ramp",
        "ramp",
        "mixed",
        "mixed",
    ]
    choices = [c.source(s) for s in range(400)]
    assert set(choices[:3]) == {TEXT} and set(choices) == {TEXT, MULTIMODAL}
    assert abs(sum(choices[100:]) / 300 - 0.6) < 0.1  # the share, drawn per step
    fresh = Curriculum(3, 0.6, 4, 5)  # a resumed run (or another rank) builds its own
    assert [fresh.source(s) for s in range(400)][::-1] == choices[::-1]
    assert fresh.steps_before(250, MULTIMODAL) == sum(choices[:250]) and fresh.steps_before(
        250, TEXT
    ) == 250 - sum(choices[:250])
    assert [Curriculum(3, 0.6, 4, 6).source(s) for s in range(400)] != choices  # the seed matters
    assert Curriculum(0, 1.0, 0, 1).uses(10) == (False, True) and Curriculum(5, 0.0, 0, 1).uses(
        10
    ) == (True, False)


def test_the_schedule_follows_the_curriculum_on_every_rank():
    from spec_cli.trainer.sources import Schedule

    text, image = [[i] for i in range(5)], [[10 + i] for i in range(3)]
    c = Curriculum(text_steps=2, ratio=0.5, ramp_steps=0, seed=1)

    def schedule(rank):
        s = Schedule(text + image, [], total_steps=40, grad_accum=2, seed=1, rank=rank, world=2)
        s.curriculum, s.pools = Curriculum(2, 0.5, 0, 1), (text, image)
        return s

    ranks = [schedule(0), schedule(1)]
    for step in range(40):
        got = [[s.indices(step * 2 + m)[0] for m in range(2)] for s in ranks]
        kind = c.source(step)
        assert all(
            (i >= 10) == (kind == MULTIMODAL) for r in got for i in r
        )  # every rank: the step's source
    # each source's batches in its own epochs: the first len(pool) picks of a source are the whole pool
    picks = {TEXT: [], MULTIMODAL: []}
    for step in range(40):
        kind = c.source(step)
        picks[kind] += [s.indices(step * 2 + m)[0] for m in range(2) for s in ranks]
    assert sorted(picks[TEXT][:5]) == list(range(5)) and sorted(picks[MULTIMODAL][:3]) == [
        10,
        11,
        12,
    ]


# ----------------------------------------------------------------------------- on a tiny VLM


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("msd")
    targets = {family: tiny.save_tiny_vlm(root / family, family) for family in ("llava", "gemma3")}
    data = root / "data"
    data.mkdir()
    rng = random.Random(3)
    write_jsonl(
        data / "chat.jsonl",
        tiny.image_chat_records(data) * 4 + [tiny.random_sharegpt(rng) for _ in range(12)],
    )
    write_jsonl(data / "prompts.jsonl", tiny.image_chat_records(data))
    return targets, data


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_the_input_embeddings_are_what_the_first_layer_reads(vlm, family):
    targets, data = vlm
    folder = targets[family]
    tokens = tokenize_data(
        data / "prompts.jsonl",
        loading.load_tokenizer(folder),
        "fp",
        512,
        use_cache=False,
        processor=loading.load_processor(folder),
    )
    backend = HFTargetBackend(folder, [], device="cpu", dtype="fp32")
    backend.set_vocab_mapping(torch.arange(backend.info["vocab_size"]))
    backend.extra_fields = dict(target_fields)
    order = [1, 3, 0]
    ids, am, lm = collate(tokens, order)
    batch = backend.generate_batch(ids, am, lm, images=tokens.images(order, ids.shape[1]))
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    processor = loading.load_processor(folder)
    for row, i in enumerate(order):
        want = processor.apply_chat_template(
            tiny.processor_messages(data)[i], tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            first = model(**want, output_hidden_states=True).hidden_states[0][
                0
            ]  # the first layer's input
        n = first.shape[0]
        torch.testing.assert_close(batch.extras[INPUT_EMBEDS][row, :n], first)
    if family == "gemma3":  # the model's scaling, not the raw table
        raw = model.get_input_embeddings().weight[ids[1, :4]]
        assert not torch.allclose(batch.extras[INPUT_EMBEDS][1, :4], raw)
    backend.close()


def test_decoding_reads_what_training_read(vlm):
    """catch_up over an image prompt (the eval target's prefill, with its KV cache) gives the state the
    draft's step-0 forward gives over the same row's training supervision (the transformers backend): the
    image features reach the draft the same way; only the newest token's input is the target's embedding
    of it (in training that slot has no next token)."""
    from spec_cli.eval import prompts, speculative
    from spec_cli.eval.target import Target

    targets, data = vlm
    folder = targets["gemma3"]
    vocab = loading.vocab_size(loading.load_config(folder), loading.load_tokenizer(folder))
    config = algorithms.get("msd").config(
        loading.load_config(folder), vocab, [], num_hidden_layers=1, algorithm="msd"
    )
    torch.manual_seed(0)
    draft = MsdDraft(config).eval()
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    draft.use_target_embeddings(model.get_input_embeddings())
    conv = prompts.load_conversations(str(data / "prompts.jsonl"))[0]
    prompt = prompts.prompt_ids(
        loading.load_tokenizer(folder), conv, 0, loading.load_processor(folder)
    )
    target = Target(model, [], final_hidden=True, input_embeds=True)
    target.capture = True
    logits, aux = speculative.prefill(
        target, target.new_cache(), torch.tensor(prompt), prompt.images
    )
    root = logits.argmax().view(1)
    backend = HFTargetBackend(folder, [], device="cpu", dtype="fp32")
    backend.set_vocab_mapping(torch.arange(backend.info["vocab_size"]))
    backend.keep_final_hidden, backend.extra_fields = True, dict(target_fields)
    ids = torch.tensor(prompt)[None]
    batch = backend.generate_batch(
        ids, torch.ones_like(ids), torch.ones_like(ids), images=prompt.images
    )
    with torch.no_grad():
        e_next = shift_left(batch.extras[INPUT_EMBEDS], 1)
        e_next[0, -1] = model.get_input_embeddings()(root)[0]
        whole = draft(e_next, batch.final_hidden)  # [1, P, H] step 0 as training runs it
        last = catch_up(draft, draft.new_cache(), torch.cat([ids[0, 1:], root]), aux)
    torch.testing.assert_close(last, whole[:, -1:], rtol=1e-5, atol=1e-5)
    backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_the_pipeline_on_image_chats(vlm, family, tmp_path, capsys):
    targets, data = vlm
    target = targets[family]
    chat, vm, cache = data / "chat.jsonl", tmp_path / "vm.safetensors", tmp_path / "cache"
    vocab = loading.load_config(target).text_config.vocab_size
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(target),
                "-d",
                str(chat),
                "--draft-vocab-size",
                str(vocab),
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
                "--algorithm",
                "msd",
                "--encoding",
                "hidden",
                "-t",
                str(target),
                "-d",
                str(chat),
                "-v",
                str(vm),
                "-o",
                str(cache),
                "--storage-dtype",
                "fp32",
                "--dtype",
                "fp32",
                "--batch-tokens",
                "256",
                "-q",
            ]
        )
        == 0
    )
    manifest = json.loads((cache / "manifest.json").read_text())
    assert len(manifest["image_samples"]) == 12
    common = [
        "-v",
        str(vm),
        "--algorithm",
        "msd",
        "--max-steps",
        "6",
        "--text-steps",
        "2",
        "--multimodal-ratio",
        "0.5",
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "256",
        "--eval-every",
        "0",
        "--dtype",
        "fp32",
        "-q",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    tokens = tokenize_data(
        chat,
        loading.load_tokenizer(target),
        "fp",
        2048,
        use_cache=False,
        processor=loading.load_processor(target),
    )
    live, cached = HFTargetBackend(target, [], device="cpu", dtype="fp32"), CacheBackend(cache)
    live.set_vocab_mapping(torch.arange(vocab))
    for backend in (live, cached):
        backend.keep_final_hidden, backend.extra_fields = True, dict(target_fields)
    order = [1, 0, 2]  # image chats
    ids, am, lm = collate(tokens, order)
    want, got = (
        live.generate_batch(ids, am, lm, images=tokens.images(order, ids.shape[1])),
        cached.generate_batch(ids, am, lm),
    )
    real = am.bool()
    torch.testing.assert_close(
        got.extras[INPUT_EMBEDS][real], want.extras[INPUT_EMBEDS][real]
    )  # cache == live
    torch.testing.assert_close(got.final_hidden[real], want.final_hidden[real])
    live.close()
    assert (
        main(["train", "--cache", str(cache), "-o", str(straight), "--save-every", "2", *common])
        == 0
    )
    shutil.copytree(straight, resumed)
    for later in sorted((resumed / "checkpoints").iterdir())[1:]:
        shutil.rmtree(
            later
        )  # back to step 2: the text steps done, the switch to image-text still ahead
    assert main(["train", "--cache", str(cache), "-o", str(resumed), "--resume", *common]) == 0
    for name, value in weights(straight).items():
        assert torch.equal(value, weights(resumed)[name]), name
    state = json.loads(
        (sorted((straight / "checkpoints").iterdir())[-1] / "trainer_state.json").read_text()
    )
    on_images = Curriculum(2, 0.5, 0, seed=0).steps_before(6, MULTIMODAL)  # --seed 0
    assert (
        state["curriculum"]["steps_on_image_text"] == on_images
        and state["curriculum"]["steps_on_text"] == 6 - on_images
    )
    assert 0 < on_images < 4  # the 4 steps after the switch drew both sources
    assert [r["step"] for r in log(straight) if r.get("split") == "train"][-1] == 6
    assert (
        main(["train", "-t", str(target), "-d", str(chat), "-o", str(tmp_path / "live"), *common])
        == 0
    )
    for shape in (["--depth", "3"], ["--depth", "3", "--topk", "2"]):
        out = tmp_path / f"eval{len(shape)}"
        assert (
            main(
                [
                    "eval",
                    "--draft",
                    str(straight),
                    "-t",
                    str(target),
                    "-p",
                    str(data / "prompts.jsonl"),
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
        assert overall["same_as_target"] == overall["turns"] == 5
    capsys.readouterr()
    text = write_jsonl(
        tmp_path / "plain.jsonl", [tiny.random_sharegpt(random.Random(2)) for _ in range(4)]
    )
    assert (
        main(
            [
                "precompute",
                "--algorithm",
                "msd",
                "--target-engine",
                "vllm",
                "-t",
                str(target),
                "-d",
                str(text),
                "-v",
                str(vm),
                "-o",
                str(tmp_path / "no-cache"),
                "-q",
            ]
        )
        == 1
    )
    assert (
        "the vllm target backend does not capture" in capsys.readouterr().err
    )  # before vLLM loads anything
    assert main(["export", str(straight), "-f", "vllm", "-o", str(tmp_path / "export"), "-q"]) == 1
    assert "MSD drafts have no export: no serving engine runs MSD drafts" in capsys.readouterr().err
    text_only = [
        "-t",
        str(target),
        "-d",
        str(data / "prompts.jsonl"),
        "-v",
        str(vm),
        "--algorithm",
        "msd",
        "--max-steps",
        "4",
        "--multimodal-ratio",
        "1",
        "--text-steps",
        "0",
        "-o",
        str(tmp_path / "x"),
        "-q",
    ]
    write_jsonl(tmp_path / "text.jsonl", [tiny.random_sharegpt(random.Random(1)) for _ in range(6)])
    text_only[3] = str(tmp_path / "text.jsonl")
    assert main(["train", *text_only]) == 1
    assert "steps on image-text batches and the data has none" in capsys.readouterr().err


def test_a_served_target_gives_the_input_embeddings(vlm, tmp_path):
    """`spec serve-target --algorithm msd` computes the input_embeds field on request, images in place:
    the same tensors as the in-process target."""
    from spec_cli.serve.client import RemoteBackend
    from spec_cli.serve.http import HTTPHandle
    from spec_cli.serve.run import tokenizer_files
    from spec_cli.serve.server import TargetServer

    targets, data = vlm
    folder = targets["gemma3"]
    live = HFTargetBackend(folder, [], device="cpu", dtype="fp32")
    files = tokenizer_files(loading.load_tokenizer(folder), loading.load_processor(folder))
    handle = HTTPHandle(
        TargetServer(
            live,
            target_config=loading.load_config(folder).to_dict(),
            tokenizer_files=files,
            fields=algorithms.get("msd").target_fields,
        ),
        "127.0.0.1",
        0,
        request_timeout=30.0,
    )
    try:
        remote = RemoteBackend(handle.url, tensor_plane=False)
        tokens = tokenize_data(
            data / "prompts.jsonl",
            loading.load_tokenizer(folder),
            "fp",
            512,
            use_cache=False,
            processor=loading.load_processor(folder),
        )
        selected = torch.arange(live.info["vocab_size"])
        order = [1, 3]
        ids, am, lm = collate(tokens, order)
        images = tokens.images(order, ids.shape[1])
        remote.set_vocab_mapping(selected)
        remote.keep_final_hidden, remote.extra_fields = True, dict(target_fields)
        served = remote.generate_batch(ids, am, lm, images=images)
        live.set_vocab_mapping(selected)
        live.keep_final_hidden, live.extra_fields = True, dict(target_fields)
        here = live.generate_batch(ids, am, lm, images=images)
        assert torch.equal(served.extras[INPUT_EMBEDS], here.extras[INPUT_EMBEDS])
        assert torch.equal(served.final_hidden, here.final_hidden)
        remote.close()
    finally:
        handle.stop(grace=1.0)
        live.close()


@pytest.fixture(scope="module")
def llava_msd(vlm, tmp_path_factory):
    """Llava's chats, the full-vocabulary map MSD proposes through and an fp32 `--algorithm msd` cache of
    them, made once for the torchrun tests below."""
    targets, data = vlm
    target, chat = targets["llava"], data / "chat.jsonl"
    root = tmp_path_factory.mktemp("llava-msd")
    vm, cache = root / "vm.safetensors", root / "cache"
    vocab = loading.load_config(target).text_config.vocab_size
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(target),
                "-d",
                str(chat),
                "--draft-vocab-size",
                str(vocab),
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
                "--algorithm",
                "msd",
                "--encoding",
                "hidden",
                "-t",
                str(target),
                "-d",
                str(chat),
                "-v",
                str(vm),
                "-o",
                str(cache),
                "--batch-tokens",  # the size training asks: a cache keeps its own batches
                "256",
                "--storage-dtype",
                "fp32",
                "--dtype",
                "fp32",
                "-q",
            ]
        )
        == 0
    )
    return target, chat, vm, cache


# the module's torchrun runs, in one launch: MSD under --context-parallel 2 (live and cached) and DDP x2
# with and without a rank whose curriculum differs
CP_COMMON = [
    "--algorithm",
    "msd",
    "--max-steps",
    "4",
    "--text-steps",
    "1",
    "--multimodal-ratio",
    "0.5",
    "--ttt-steps",
    "2",
    "--batch-tokens",
    "256",
    "--eval-every",
    "0",
]


@pytest.fixture(scope="module")
def msd_torchrun(llava_msd, tmp_path_factory):
    from tests.launch import torchrun

    target, chat, vm, cache = llava_msd
    root = tmp_path_factory.mktemp("msd-torchrun")
    cp_common = ["-v", str(vm), *CP_COMMON, "--precision", "fp32", "--lr", "3e-3", "-q"]
    cp_runs = {
        "live": ["-t", str(target), "-d", str(chat), "--dtype", "fp32"],
        "cache": ["--cache", str(cache)],
    }
    ddp = ["--cache", str(cache), "-v", str(vm), *CP_COMMON, "-q"]
    torchrun(
        [
            *context_parallel_commands(cp_runs, cp_common, root / "cp"),
            ["train", *ddp, "-o", str(root / "ddp")],
            ["-m", "tests.draft.curriculum_rank_skew", "train", *ddp, "-o", str(root / "skewed")],
        ],
        root / "launch",
    )
    return {"root": root, "cp_runs": cp_runs, "cp_common": cp_common}


@pytest.mark.slow
def test_msd_under_context_parallelism_trains_what_one_process_trains(msd_torchrun):
    """torchrun x2, --context-parallel 2, MSD on Llava image and text chats through the curriculum (text
    steps, then image-text batches): each rank reads the input embeddings of its slots (live: sent by the
    group's first rank; cached: read for it), shifted one slot within its ranges' halo, and the group
    trains the draft one process trains on the same batches, step for step."""
    r = msd_torchrun
    context_parallel_equals_one_process(
        r["cp_runs"], r["cp_common"], r["root"] / "cp", launched=True
    )


@pytest.mark.slow
def test_torchrun_ranks_draw_the_same_curriculum_or_stop(msd_torchrun):
    """DDP x2 under torchrun on Llava chats: every rank draws the same source at every step (checked over
    the ranks at the start: the sources of all steps and the pools, hashed) and the run trains; a rank
    whose curriculum differs at one step makes the run stop with one line on every rank, before a step."""
    root = msd_torchrun["root"]
    state = json.loads(
        (sorted((root / "ddp" / "checkpoints").iterdir())[-1] / "trainer_state.json").read_text()
    )
    assert state["world_size"] == 2 and state["curriculum"]["steps_on_image_text"] > 0
    assert not (root / "skewed" / "checkpoints").exists()
