"""Tiny tokenizers and models built in the tests (no downloads).

Each chat-template family below is written after the real one it names, so loss-mask tests cover
templates that differ in the ways that matter: role headers, trimming, system prompts folded into a
user turn, end-of-turn tokens vs eos, think blocks, and `{% generation %}` markers.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "code python model draft token 42 7 3.14 ! ? , . : ; ( ) { } = + - * / \n"
).split(" ")

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
QWEN3_THINK = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PHI3 = (  # Phi-3 / Phi-3.5 mini: role tags, <|end|> closes each turn, eos after the last one
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
GENERATION_MARKERS = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# family -> (template, special tokens, bos, eos, end-of-turn token, model config class name)
TEMPLATES = {
    "chatml": (
        CHATML,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        "<|im_end|>",
        "Qwen2Config",
    ),
    "llama3": (
        LLAMA3,
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|eot_id|>",
        "LlamaConfig",
    ),
    "gemma": (
        GEMMA,
        ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<eos>",
        "<end_of_turn>",
        "Gemma2Config",
    ),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>"], "<s>", "</s>", "</s>", "MistralConfig"),
    "qwen3-think": (
        QWEN3_THINK,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        "<|im_end|>",
        "Qwen3Config",
    ),
    "phi3": (
        PHI3,
        ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        None,
        "<|endoftext|>",
        "<|end|>",
        "Phi3Config",
    ),
    "generation-markers": (
        GENERATION_MARKERS,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        "<|im_end|>",
        "LlamaConfig",
    ),
}


def random_text(rng: random.Random, n_min: int = 3, n_max: int = 30) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(n_min, n_max))).strip() or "ok"


def random_sharegpt(rng: random.Random, turns: int | None = None) -> dict:
    turns = turns or rng.randint(1, 3)
    conv = []
    for _ in range(turns):
        conv.append({"from": "human", "value": random_text(rng)})
        conv.append({"from": "gpt", "value": random_text(rng)})
    return {"conversations": conv}


def build_tokenizer(family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, bos, eos, _eot, _cfg = TEMPLATES[family]
    rng = random.Random(1234)
    corpus = [random_text(rng, 5, 40) for _ in range(400)] + [
        "system user assistant model think"
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=specials[0],
        chat_template=template,
    )


def tiny_config(family: str, vocab_size: int, num_layers: int = 8):
    import transformers

    cls = getattr(transformers, TEMPLATES[family][5])
    ids = (
        dict(pad_token_id=0, bos_token_id=None, eos_token_id=0) if family == "phi3" else {}
    )  # Phi3Config: 32000
    return cls(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **ids,
    )


def save_tiny_target(path: Path, family: str, with_model: bool = True, seed: int = 0) -> Path:
    """A folder with the family's tokenizer and a config (and random weights when `with_model`)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(family)
    config = tiny_config(family, len(tokenizer))
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    if with_model:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    else:
        config.save_pretrained(str(path))
    return path


def peaked_copy(src: Path, dst: Path, scale: float = 40.0) -> Path:
    """A copy of a tiny random target whose lm_head is scaled up, so its next-token distributions are
    peaked (like a trained model's) rather than near-uniform: there is something for a draft to learn."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(str(dst))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(str(dst))
    return dst


def save_vllm_sized_target(path: Path) -> Path:
    """A Llama target sized for vLLM's CPU attention (head_dim 32: the CPU kernels take 32, 64, 80, ...
    only). Random weights with the attention and MLP outputs scaled up, so that each layer changes the
    residual stream a lot (at the default init neighbouring layers' states are nearly the same, and a
    draft reading the wrong layers would still accept)."""
    import torch
    import transformers

    tokenizer = build_tokenizer("llama3")
    config = transformers.LlamaConfig(
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
    path.mkdir(parents=True)
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(8)
            layer.mlp.down_proj.weight.mul_(8)
    model.save_pretrained(str(path))
    return path


# ----------------------------------------------------------------------------- vision-language targets

VLM_FAMILIES = (
    "llava",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "idefics3",
    "smolvlm",
    "gemma3",
    "mistral3",
    "gemma4",
    "llama4",
    "mllama",
)


def tiny_vlm_config(family: str, vocab_size: int, num_layers: int = 6):
    """A tiny vision-language config of `family`, its language model under text_config and the image
    placeholder the last id of the vocab (the tokenizer adds it as a special token)."""
    import transformers as T

    text = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    image = vocab_size - 1
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    if family == "llava":
        return T.LlavaConfig(
            text_config=T.LlamaConfig(**text),
            vision_config=T.CLIPVisionConfig(**vision),
            image_token_index=image,
            tie_word_embeddings=False,
        )
    if family == "qwen2_vl":
        return T.Qwen2VLConfig(
            text_config=dict(
                model_type="qwen2_vl_text",
                **text,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                bos_token_id=None,
                eos_token_id=None,
            ),
            vision_config=dict(
                depth=1,
                embed_dim=16,
                hidden_size=32,
                num_heads=2,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                in_chans=3,
            ),
            image_token_id=image,
            video_token_id=image - 1,
            vision_start_token_id=image - 2,
            vision_end_token_id=image - 3,
            tie_word_embeddings=False,
        )
    if family in ("qwen2_5_vl", "qwen3_vl"):
        mrope = (
            {"type": "mrope", "mrope_section": [1, 1, 2]}
            if family == "qwen2_5_vl"
            else {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}
        )
        cls = T.Qwen2_5_VLConfig if family == "qwen2_5_vl" else T.Qwen3VLConfig
        vision_fields = dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            out_hidden_size=32,
        ) | (
            {"fullatt_block_indexes": [0], "window_size": 16}
            if family == "qwen2_5_vl"
            else {"num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
        )
        return cls(
            text_config=dict(
                model_type=f"{family}_text",
                **text,
                rope_scaling=mrope,
                bos_token_id=None,
                eos_token_id=None,
            ),
            vision_config=vision_fields,
            image_token_id=image,
            video_token_id=image - 1,
            vision_start_token_id=image - 2,
            vision_end_token_id=image - 3,
            tie_word_embeddings=False,
        )
    if family == "smolvlm":
        return T.SmolVLMConfig(
            text_config=T.LlamaConfig(**text, pad_token_id=0),
            vision_config=vision,
            image_token_id=image,
            scale_factor=2,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
    if family == "mistral3":
        return T.Mistral3Config(
            text_config=T.MistralConfig(**text),
            vision_config=dict(
                model_type="pixtral",
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=16,
                patch_size=4,
                head_dim=8,
            ),
            image_token_index=image,
            spatial_merge_size=2,
            tie_word_embeddings=False,
        )
    if family == "idefics3":
        return T.Idefics3Config(
            text_config=T.LlamaConfig(**text, pad_token_id=0),
            vision_config=vision,
            image_token_id=image,
            pad_token_id=0,
            scale_factor=2,
            tie_word_embeddings=False,
        )
    if family == "gemma3":
        return T.Gemma3Config(
            text_config=dict(**text, sliding_window=16),
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=image,
            tie_word_embeddings=False,
        )
    if family == "gemma4":
        return T.Gemma4Config(
            text_config=dict(**text),
            tie_word_embeddings=False,
            image_token_id=image,
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                head_dim=8,
                num_key_value_heads=2,
                patch_size=4,
            ),
        )
    if family == "llama4":  # every layer a mixture of two experts, as Llama 4 Scout's
        return T.Llama4Config(
            text_config=dict(
                **text,
                num_local_experts=2,
                num_experts_per_tok=1,
                interleave_moe_layer_step=1,
                intermediate_size_mlp=64,
                no_rope_layers=[],
                attention_chunk_size=64,
                pad_token_id=0,
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=16,
                patch_size=4,
                vision_output_dim=32,
                projector_input_dim=32,
                projector_output_dim=32,
            ),
            image_token_index=image,
            tie_word_embeddings=False,
        )
    if (
        family == "mllama"
    ):  # Llama 3.2 Vision: the image reaches the text through cross-attention layers
        text = {k: v for k, v in text.items() if k != "head_dim"}
        return T.MllamaConfig(
            text_config=dict(
                **text, cross_attention_layers=[2], pad_token_id=0, bos_token_id=1, eos_token_id=2
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_global_layers=1,
                attention_heads=2,
                image_size=16,
                patch_size=4,
                vision_output_dim=32,
                intermediate_layers_indices=[0],
            ),
            image_token_index=image,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown VLM family {family!r}")


def save_tiny_vlm(path: Path, family: str, seed: int = 0, processor: bool = True) -> Path:
    """A tiny random vision-language target folder: the llama3 chat tokenizer with the image placeholder
    tokens added, the config and random weights (AutoModelForImageTextToText)."""
    import torch
    from transformers import AutoModelForImageTextToText

    tokenizer = build_tokenizer("llama3")
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                *IMAGE_MARKERS,
                "<|vision_end|>",
                "<|vision_start|>",
                "<|video_pad|>",
                "<image>",
            ]
        }
    )
    config = tiny_vlm_config(family, len(tokenizer))
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(str(path))
    if processor and family in PROCESSOR_FAMILIES:
        save_tiny_processor(path, family)
    return path


# The special tokens image markers use besides the placeholder (Gemma 3's begin/end of image, Idefics3's
# frame and global-image tokens); every tiny VLM tokenizer has them, so the ids are the same in each.
IMAGE_MARKERS = ("<start_of_image>", "<end_of_image>", "<fake_token_around_image>", "<global-img>")
# Families whose real processor transformers builds without torchvision (Qwen-VL's needs its video
# processor, which needs torchvision).
PROCESSOR_FAMILIES = ("llava", "gemma3", "idefics3")


QWEN_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def qwen_vl_processor(path: Path, family: str):
    """The Qwen-VL family's real processor for the tiny model in `path`, built in memory: transformers
    refuses to make it without its video processor, which needs torchvision (not installed here), so the
    constructor's type check is passed over for that one argument (images only). Not saved: loading
    it back (AutoProcessor) would need torchvision again."""
    import transformers as T
    from transformers import processing_utils

    tokenizer = T.AutoTokenizer.from_pretrained(
        str(path), extra_special_tokens={"image_token": "<image>", "video_token": "<|video_pad|>"}
    )
    image_processor = T.Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    )
    cls = {
        "qwen2_vl": T.Qwen2VLProcessor,
        "qwen2_5_vl": T.Qwen2_5_VLProcessor,
        "qwen3_vl": T.Qwen3VLProcessor,
    }[family]
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, value):
        return None if name == "video_processor" and value is None else check(self, name, value)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        return cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=vlm_chat_template("<|vision_start|><image><|vision_end|>"),
        )
    finally:
        processing_utils.ProcessorMixin.check_argument_for_proper_class = check


def vlm_chat_template(image: str) -> str:
    """The llama3 chat template that also renders OpenAI-style content parts, an image part as `image`."""
    return (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}" + image + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )


def save_tiny_processor(path: Path, family: str) -> None:
    """The family's real processor (its image processor at the tiny vision tower's size, the folder's
    tokenizer, a chat template that places images), saved beside the model."""
    import transformers as T

    if family == "llava":
        tokenizer = T.AutoTokenizer.from_pretrained(str(path))
        processor = T.LlavaProcessor(
            image_processor=T.CLIPImageProcessor(
                size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
            ),
            tokenizer=tokenizer,
            patch_size=4,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=vlm_chat_template("<image>"),
        )
    elif family == "gemma3":
        tokenizer = T.AutoTokenizer.from_pretrained(
            str(path),
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image>",
            },
        )
        processor = T.Gemma3Processor(
            image_processor=T.Gemma3ImageProcessor(size={"height": 16, "width": 16}),
            tokenizer=tokenizer,
            image_seq_length=4,
            chat_template=vlm_chat_template("<start_of_image>"),
        )
    elif family == "idefics3":
        tokenizer = T.AutoTokenizer.from_pretrained(str(path))
        processor = T.Idefics3Processor(
            image_processor=T.Idefics3ImageProcessor(
                size={"longest_edge": 32}, max_image_size={"longest_edge": 16}
            ),
            tokenizer=tokenizer,
            image_seq_len=4,
            chat_template=vlm_chat_template("<image>"),
        )
    else:
        raise ValueError(f"no tiny processor for {family!r}")
    processor.save_pretrained(str(path))


# ----------------------------------------------------------------------------- image-text chats


def draw_image(folder, name: str, size: tuple[int, int], seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(folder / name)
    return name


def image_chat_records(folder) -> list[dict]:
    """Each place an image can be, with the images the processor's own call takes (paths in its parts)."""
    a, b, c = (
        draw_image(folder, "a.png", (20, 28), 0),
        draw_image(folder, "b.png", (40, 16), 1),
        draw_image(folder, "c.png", (16, 16), 2),
    )
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": a}},
                        {"type": "text", "text": "what is this?"},
                    ],
                },
                {"role": "assistant", "content": "a cat on a mat"},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "<image>\nand this one"},
                {"from": "gpt", "value": "a dog"},
                {"from": "human", "value": "compare <image> please"},
                {"from": "gpt", "value": "both animals"},
            ],
            "images": [b, c],
        },
        {
            "conversations": [
                {"from": "human", "value": "describe it"},
                {"from": "gpt", "value": "red and blue"},
            ],
            "image": c,
        },  # no marker: LLaVA's convention puts it before the first user text
        {
            "conversations": [
                {"from": "human", "value": "hello there"},
                {"from": "gpt", "value": "hi, how are you"},
            ]
        },
    ]


def processor_messages(folder) -> list[list[dict]]:
    """The same four chats as the processor's apply_chat_template takes them (images as paths)."""
    path = lambda name: {"type": "image", "path": str(folder / name)}
    text = lambda t: {"type": "text", "text": t}
    return [
        [
            {"role": "user", "content": [path("a.png"), text("what is this?")]},
            {"role": "assistant", "content": "a cat on a mat"},
        ],
        [
            {"role": "user", "content": [path("b.png"), text("\nand this one")]},
            {"role": "assistant", "content": "a dog"},
            {"role": "user", "content": [text("compare "), path("c.png"), text(" please")]},
            {"role": "assistant", "content": "both animals"},
        ],
        [
            {"role": "user", "content": [path("c.png"), text("describe it")]},
            {"role": "assistant", "content": "red and blue"},
        ],
        [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "hi, how are you"},
        ],
    ]


IMAGE_CHAT_ANSWERS = [
    "a cat on a mat" + "<|eot_id|>",
    "a dog" + "<|eot_id|>" + "both animals" + "<|eot_id|>",
    "red and blue" + "<|eot_id|>",
    "hi, how are you" + "<|eot_id|>",
]
