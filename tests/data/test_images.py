"""Images in chat records (spec_cli/data/images.py): every place a record may put one, each way a source
may name one, and the up-front check's one error naming the records whose images cannot be used.
The images are drawn here with PIL."""

import base64
import io
import json
import random

import pytest
from PIL import Image

from spec_cli.data import images
from spec_cli.errors import DataError


def png(color=(200, 30, 30), size=(12, 8)) -> bytes:
    image = Image.new("RGB", size, color)
    for x in range(size[0]):  # a gradient, so the pixels are not all one value
        image.putpixel((x, 0), (x * 20 % 256, 0, 255 - x))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "red.png").write_bytes(png())
    (tmp_path / "imgs" / "gray.png").write_bytes(png((90, 90, 90), (5, 5)))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (tmp_path / "cut.png").write_bytes(png()[:60])  # a valid header, then truncated
    return tmp_path


def test_every_place_an_image_can_be(folder):
    data_url = "data:image/png;base64," + base64.b64encode(png()).decode()
    openai = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "imgs/red.png"}},
                    {"type": "text", "text": "what is this?"},
                    {"type": "image", "image": data_url},
                    {"type": "input_image", "image_url": str(folder / "imgs" / "gray.png")},
                ],
            },
            {"role": "assistant", "content": "a square"},
        ]
    }
    refs = images.image_refs(openai)
    assert [r.where for r in refs] == [
        "messages[0].content[0]",
        "messages[0].content[2]",
        "messages[0].content[3]",
    ]
    opened = [images.open_image(r.source, folder) for r in refs]
    assert [i.size for i in opened] == [(12, 8), (12, 8), (5, 5)] and {i.mode for i in opened} == {
        "RGB"
    }
    assert opened[0].tobytes() == Image.open(io.BytesIO(png())).convert("RGB").tobytes()
    sharegpt = {
        "images": ["imgs/red.png", "file://" + str(folder / "imgs" / "gray.png")],
        "conversations": [
            {"from": "human", "value": "<image>\nand <image>: same?"},
            {"from": "gpt", "value": "no"},
        ],
    }
    assert [r.where for r in images.image_refs(sharegpt)] == ["images[0]", "images[1]"]
    assert (
        images.check_images(
            [openai, sharegpt, {"image": "imgs/red.png", "conversations": []}], folder
        )
        == 6
    )
    big = Image.frombytes(
        "RGB", (64, 64), random.Random(3).randbytes(64 * 64 * 3)
    )  # noise: PNG keeps it big
    encoded = io.BytesIO()
    big.save(encoded, format="PNG")
    bare = base64.b64encode(encoded.getvalue()).decode()  # longer than a file name may be
    assert len(bare) > 4096 and images.open_image(bare, folder).tobytes() == big.tobytes()
    with pytest.raises(DataError, match="not a readable file|is not a file"):
        images.open_image("x" * 5000 + ".png", folder)
    assert images.image_refs({"messages": [{"role": "user", "content": "text only"}]}) == []


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"images": ["missing.png"], "conversations": []},
            "record 0: images[0]: the image 'missing.png' is not a file",
        ),
        (
            {"image": "broken.png", "conversations": []},
            "record 0: image[0]: the image 'broken.png' cannot be read",
        ),
        (
            {"image": "cut.png", "conversations": []},
            "record 0: image[0]: the image 'cut.png' cannot be read",
        ),
        (
            {"image": "https://example.com/a.png", "conversations": []},
            "is remote; spec_cli reads training data offline",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": "data:image/png;base64,@@"}],
                    }
                ]
            },
            "the data URL data:image/png;base64,@@... is not base64 image data",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0] is an image part without an image",
        ),
        (
            {
                "images": ["imgs/red.png"],
                "conversations": [{"from": "human", "value": "<image> <image>"}],
            },
            "has 2 <image> marker(s) for 1 image(s)",
        ),
        (
            {"images": "imgs/red.png", "conversations": [{"from": "human", "value": "x"}]},
            None,
        ),  # one path: fine
        (
            {"images": [3], "conversations": []},
            "image / images field is not a path or a list of paths",
        ),
    ],
)
def test_unusable_images_are_one_error_naming_the_record(folder, record, message):
    if message is None:
        assert images.check_images([record], folder) == 1
        return
    with pytest.raises(DataError) as err:
        images.check_images([{"messages": [{"role": "user", "content": "fine"}]}, record], folder)
    text = err.value.one_line().replace("record 1", "record 0")
    assert message in text and err.value.hint


def test_the_check_names_at_most_five_records(folder, tmp_path):
    bad = [{"image": f"gone-{i}.png", "conversations": []} for i in range(9)]
    with pytest.raises(DataError) as err:
        images.check_images(bad, folder)
    text = err.value.message
    assert text.startswith("5 record(s) with images that cannot be used (and more): record 0:")
    assert "record 4:" in text and "record 5:" not in text
    line = json.dumps(bad[0])  # (the records as a data file holds them)
    assert images.image_refs(json.loads(line))[0].source == "gone-0.png"
