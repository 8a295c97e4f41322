"""Image-text chat data through a vision-language target's own processor (spec_cli/data/vlm.py), for the
three families whose real processors transformers builds here without torchvision (Llava, Gemma 3,
Idefics3 with its image tiling), built in the test (tests/tiny.py); images drawn here with numpy/PIL.

The independent computation is the processor's own `apply_chat_template(tokenize=True)` on the same
chats with the images in their parts: the ids (each image's placeholder expanded as the processor
expands it) and the per-token types must be its; the loss mask must cover the assistants' answers and
end-of-turn tokens, never an image token.
"""

import json
import os

import numpy as np
import pytest
import torch

from spec_cli.data import records, vlm
from spec_cli.data.tokenize import tokenize_data
from spec_cli.errors import DataError
from spec_cli.paths import spec_home
from spec_cli.targets import loading
from tests import tiny

FAMILIES = tiny.PROCESSOR_FAMILIES


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_data")
    targets = {family: tiny.save_tiny_vlm(root / family, family) for family in FAMILIES}
    data = root / "data"
    data.mkdir()
    (data / "chat.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in tiny.image_chat_records(data))
    )
    return targets, data


def tokenize(target, path, max_length=512, processor=True, **kw):
    return tokenize_data(
        path,
        loading.load_tokenizer(target),
        "fp",
        max_length,
        processor=loading.load_processor(target) if processor else None,
        **kw,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_are_the_processors_own_and_only_answers_are_supervised(world, family):
    targets, data = world
    processor = loading.load_processor(targets[family])
    tokens = tokenize(targets[family], data / "chat.jsonl", use_cache=False)
    assert tokens.metadata["skipped"] == {} and len(tokens) == 4
    assert tokens.num_images.tolist() == [1, 2, 1, 0] and tokens.metadata["num_images"] == 4
    image_id = loading.load_config(targets[family]).image_token_id
    tokenizer = loading.load_tokenizer(targets[family])
    for i, messages in enumerate(tiny.processor_messages(data)):
        want = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_tensors="pt"
        )
        ids, mask = tokens.sample(i)
        assert torch.equal(ids.long(), want["input_ids"][0])
        assert int(tokens.lengths[i]) == want["input_ids"].shape[1]  # what batch planning counts
        assert tokenizer.decode(ids[mask.bool()]) == tiny.IMAGE_CHAT_ANSWERS[i]
        assert not mask[ids == image_id].any()
        assert (ids == image_id).any() == (i < 3)
        if "token_type_ids" in want:  # Gemma 3: the model reads which tokens are an image's
            a, b = int(tokens.offsets[i]), int(tokens.offsets[i + 1])
            assert tokens.metadata["token_type_key"] == "token_type_ids"
            assert torch.equal(tokens.token_types[a:b].long(), want["token_type_ids"][0])
    # a batch's image inputs are the processor's for the same images, in the samples' order
    inputs = tokens.images([3, 1, 0], int(tokens.lengths.max()))
    want = processor.apply_chat_template(
        [tiny.processor_messages(data)[1], tiny.processor_messages(data)[0]],
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        padding=True,
    )
    assert torch.equal(inputs["pixel_values"], want["pixel_values"])
    assert tokens.images([3], 40) is None  # text rows: no image inputs at all


def test_the_cache_reloads_and_follows_the_images(world, tmp_path):
    targets, _ = world
    records_ = tiny.image_chat_records(tmp_path)
    write = lambda: (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records_)
    )
    write()
    first = tokenize(targets["llava"], tmp_path / "chat.jsonl")
    again = tokenize(targets["llava"], tmp_path / "chat.jsonl")
    assert not first.metadata["cache_hit"] and again.metadata["cache_hit"]
    assert torch.equal(again.num_images, first.num_images) and again.images is not None
    assert torch.equal(again.input_ids, first.input_ids)
    tiny.draw_image(
        tmp_path, "b.png", (40, 16), 99
    )  # same name, other pixels: the data file did not change
    changed = tokenize(targets["llava"], tmp_path / "chat.jsonl")
    assert not changed.metadata["cache_hit"]
    assert changed.metadata["images_fingerprint"] != first.metadata["images_fingerprint"]


def test_an_image_is_never_cut(world):
    targets, data = world
    full = tokenize(
        targets["idefics3"], data / "chat.jsonl", use_cache=False
    )  # tiles: many tokens per image
    image_id = loading.load_config(targets["idefics3"]).image_token_id
    frame = loading.load_tokenizer(targets["idefics3"]).convert_tokens_to_ids(
        "<fake_token_around_image>"
    )
    marks = torch.tensor([image_id, frame])  # an Idefics3 image's tokens end with the frame token
    ends = [
        int(torch.nonzero(torch.isin(full.sample(i)[0], marks)).max()) + 1 if n else 0
        for i, n in enumerate(full.num_images)
    ]
    limit = min(int(full.lengths[i]) for i, e in enumerate(ends) if e)  # one image chat fits whole
    cut = tokenize(targets["idefics3"], data / "chat.jsonl", max_length=limit, use_cache=False)
    fits = [i for i, e in enumerate(ends) if e <= limit and full.sample(i)[1][:limit].any()]
    reasons = {vlm.IMAGES_CUT: sum(e > limit for e in ends)}
    reasons |= (
        {records.TRUNCATED: len(ends) - len(fits) - reasons[vlm.IMAGES_CUT]}
        if len(fits) + reasons[vlm.IMAGES_CUT] < len(ends)
        else {}
    )
    assert reasons[vlm.IMAGES_CUT] >= 1 and any(ends[i] for i in fits)
    assert cut.metadata["skipped"] == reasons and len(cut) == len(fits)
    for j, i in enumerate(fits):  # the kept ones: the same tokens, cut after their images
        assert torch.equal(cut.sample(j)[0], full.sample(i)[0][:limit])
        assert int(cut.num_images[j]) == int(full.num_images[i])


def test_images_that_cannot_be_read_stop_the_stage_before_it_writes(world, tmp_path):
    targets, _ = world
    rows = tiny.image_chat_records(tmp_path)
    (tmp_path / "b.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    rows[0]["messages"][0]["content"][0]["image_url"]["url"] = "missing.png"
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as failure:
        tokenize(targets["llava"], tmp_path / "chat.jsonl")
    message = failure.value.message
    assert (
        "2 record(s)" in message
        and "record 0: messages[0].content[0]" in message
        and "missing.png" in message
    )
    assert "record 1: images[0]" in message and "cannot be read" in message
    tokenized = spec_home() / "tokenized"
    assert not tokenized.exists() or not os.listdir(tokenized)  # nothing cached


def test_without_a_processor_image_records_are_counted_and_skipped(world):
    targets, data = world
    tokens = tokenize(targets["llava"], data / "chat.jsonl", processor=False, use_cache=False)
    assert tokens.metadata["skipped"] == {records.IMAGES: 3} and len(tokens) == 1
    assert tokens.images is None and tokens.num_images is None


def test_an_image_in_an_answer_is_skipped(world, tmp_path):
    targets, _ = world
    name = tiny.draw_image(tmp_path, "x.png", (16, 16), 5)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "draw"},
                {"role": "assistant", "content": [{"type": "image", "image": name}]},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": name}]},
                {"role": "assistant", "content": "a square"},
            ]
        },
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = tokenize(targets["gemma3"], tmp_path / "chat.jsonl", use_cache=False)
    assert tokens.metadata["skipped"] == {
        vlm.IMAGE_IN_ANSWER: 1
    } and tokens.num_images.tolist() == [1]


def test_the_alignment_keeps_supervised_tokens_and_refuses_rewritten_ones():
    plain = np.array([5, 6, 9, 7, 8])  # 9: the image marker
    mask = np.array([0, 0, 0, 1, 1], dtype=np.uint8)
    out, added = vlm.align_mask(plain, mask, np.array([5, 6, 1, 9, 9, 9, 2, 7, 8]))
    assert out.tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1] and added.tolist() == [
        0,
        0,
        1,
        0,
        1,
        1,
        1,
        0,
        0,
    ]
    with pytest.raises(vlm.TemplateMismatch):
        vlm.align_mask(plain, mask, np.array([5, 6, 9, 9, 4, 8]))  # a supervised token rewritten


def test_an_image_reaches_to_its_last_special_token_whichever_copy_the_alignment_kept():
    class Tok:  # the one special token: the image placeholder, 9
        all_special_ids = [9]
        added_tokens_decoder = {}

    plain, mask = np.array([5, 9, 7, 8]), np.array([0, 0, 1, 1], dtype=np.uint8)
    expanded = np.array([5, 9, 9, 9, 7, 8])
    out, added = vlm.align_mask(plain, mask, expanded)
    assert out.tolist() == [0, 0, 0, 0, 1, 1] and added.sum() == 2
    assert (
        vlm.image_reach(Tok, expanded, added) == 4
    )  # a cut at 3 would drop a copy, whichever was "kept"
    assert (
        vlm.image_reach(Tok, plain, np.zeros(4, dtype=np.uint8)) == 0
    )  # nothing inserted: no image


def test_a_cache_hit_reads_the_images_where_the_data_is_now(world, tmp_path):
    targets, _ = world
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    (first / "chat.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in tiny.image_chat_records(first))
    )
    made = tokenize(targets["llava"], first / "chat.jsonl")
    first.rename(second)  # the data moved: same bytes, same key
    again = tokenize(targets["llava"], second / "chat.jsonl")
    assert again.metadata["cache_hit"] and torch.equal(again.input_ids, made.input_ids)
    assert again.images([0], int(again.lengths[0]))["pixel_values"].shape[0] == 1


def test_the_processor_is_made_only_for_data_with_images(world, tmp_path):
    targets, data = world
    tokenizer = loading.load_tokenizer(targets["llava"])

    def cannot():  # as Qwen-VL's processor without torchvision
        raise DataError("cannot load the image processor", "install torchvision")

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps(tiny.random_sharegpt(__import__("random").Random(0))) + "\n")
    assert (
        len(tokenize_data(text, tokenizer, "fp", 512, use_cache=False, load_processor=cannot)) == 1
    )
    with pytest.raises(DataError, match="cannot load the image processor"):
        tokenize_data(
            data / "chat.jsonl", tokenizer, "fp", 512, use_cache=False, load_processor=cannot
        )
    made = tokenize_data(
        data / "chat.jsonl",
        tokenizer,
        "fp",
        512,
        use_cache=False,
        load_processor=lambda: loading.load_processor(targets["llava"]),
    )
    assert made.metadata["num_images"] == 4


def test_a_text_familys_chat_template_is_refused_for_image_data(world):
    from spec_cli.data import chat_templates

    targets, data = world
    tokenizer = loading.load_tokenizer(targets["llava"], chat_templates.resolve("chatml"))
    with pytest.raises(DataError, match="from --chat-template does not place an image") as failure:
        tokenize_data(
            data / "chat.jsonl",
            tokenizer,
            "fp",
            512,
            use_cache=False,
            processor=loading.load_processor(targets["llava"]),
        )
    assert "drop --chat-template for image-text data" in failure.value.hint


def test_the_wait_for_tokenising_counts_the_images_a_file_refers_to(tmp_path):
    """Other ranks wait for rank 0's tokenising up to a bound: image-text records add SECONDS_PER_IMAGE per
    image (opened and preprocessed), however few bytes their references take; text files as before; a
    mark split across the reading chunks counts once."""
    import random

    from spec_cli.data import tokenize as tok
    from tests.conftest import write_jsonl

    rng = random.Random(0)
    text = write_jsonl(tmp_path / "text.jsonl", [tiny.random_sharegpt(rng) for _ in range(20)])
    assert tok.tokenize_seconds_bound(text) == pytest.approx(
        text.stat().st_size / tok.MIN_BYTES_PER_S
    )
    records = tiny.image_chat_records(tmp_path)  # OpenAI image parts and ShareGPT <image> markers
    chats = write_jsonl(tmp_path / "chat.jsonl", records * 50)
    marks = sum(chats.read_bytes().count(m) for m in tok.IMAGE_MARKS)
    assert marks >= 50 * 4  # the records' images: 1, 2, 1 and none
    assert tok.tokenize_seconds_bound(chats) == pytest.approx(
        chats.stat().st_size / tok.MIN_BYTES_PER_S + marks * tok.SECONDS_PER_IMAGE
    )
    assert tok._image_marks(chats, chunk=7) == marks  # marks across chunk edges
