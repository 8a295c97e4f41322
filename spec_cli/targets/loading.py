"""Load a target model and its tokenizer from a transformers folder or a `.gguf` file.

A `.gguf` file is dequantised once into a cached transformers folder under SPEC_HOME, so later loads
take a fraction of a second instead of re-running the GGUF conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from spec_cli.console import warn
from spec_cli.data import chat_templates
from spec_cli.data.chat_templates import (
    tokenizer_fingerprint,  # with the target's fingerprints below
)
from spec_cli.errors import ArtifactError, ConfigError, TargetError
from spec_cli.paths import spec_home

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ----------------------------------------------------------------------------- device / dtype


def choose_device(device: str | None) -> torch.device:
    """`None`/"auto": cuda if available, else cpu."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"unknown --device {device!r}", "use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda was asked for but no CUDA GPU is visible", "use --device cpu"
        )
    return dev


def choose_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """`None`/"auto": bf16 on cuda, fp32 on cpu."""
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown --dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device`: a CUDA GPU that supports bf16, or a CPU with AMX or
    AVX512-BF16 (oneDNN: SmolLM2's batched forward is 2-3x faster in bf16 than in fp32 there). Elsewhere
    bf16 on a CPU is emulated and slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    # capped to AVX2 (ATEN_CPU_CAPABILITY=avx2 for torch's kernels, ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN's
    # matmuls): the bf16 path is emulated as on an AVX2-only CPU, whatever this one has
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "ZVECTOR", "VSX") or (
        isa and isa != "ALL" and "BF16" not in isa and "AMX" not in isa
    ):
        return False
    probes = [
        getattr(torch.cpu, name, None)
        for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    ]
    return any(probe is not None and probe() for probe in probes)


def bf16_hint(dtype_option: str | None, device: torch.device) -> str | None:
    """A line for a stage that runs the target over batches (regenerate, precompute) on a CPU where bf16
    is native but fp32 was chosen by default; None otherwise."""
    if dtype_option in (None, "", "auto") and device.type == "cpu" and fast_bf16(device):
        return (
            "this CPU runs bf16 natively (AMX / AVX512-BF16): --dtype bf16 runs the target's batched "
            "forwards 1.3-2x faster (fp32 stays the default)"
        )
    return None


# ----------------------------------------------------------------------------- locating a target


def resolve_target(target: str | Path) -> Path:
    """A transformers folder for `target` (a folder, or a .gguf converted once and cached)."""
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return convert_gguf(ggufs[0])
            raise TargetError(
                f"{path} has no config.json, so it is not a transformers model folder",
                "pass a folder saved with save_pretrained, or a .gguf file",
            )
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.exists():
        raise TargetError(
            f"--target {path} is neither a model folder nor a .gguf file",
            "pass a transformers model folder or a .gguf file",
        )
    raise TargetError(
        f"--target {target} does not exist",
        "pass a transformers model folder, a .gguf file, or `smollm2` for the built-in",
    )


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return spec_home() / "targets" / f"{gguf.stem}-{key[:12]}"


def convert_gguf(gguf: Path, out: Path | None = None) -> Path:
    """Dequantise a GGUF model into a transformers folder (cached; done once)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from spec_cli.artifacts.io import atomic_dir
    from spec_cli.console import info

    out = Path(out) if out else _gguf_cache_dir(gguf)
    if (out / "config.json").is_file():
        return out
    info(f"converting {gguf.name} to a transformers folder (once) -> {out}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many types for unsupported GGUF files
        raise TargetError(
            f"transformers cannot load {gguf}: {exc}",
            "check that the file is a complete GGUF of a supported architecture",
        ) from exc
    # save_pretrained refuses a GGUF-loaded model: rebuild it from a clean config.
    config = AutoConfig.for_model(
        **{
            k: v
            for k, v in loaded.config.to_dict().items()
            if k not in ("quantization_config", "_name_or_path")
        }
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "spec_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}) + "\n")
    return out


# ----------------------------------------------------------------------------- tokenizer / model


def load_tokenizer(path: Path, chat_template=None):
    """The target's fast tokenizer; `chat_template` (a data.chat_templates.ChatTemplate, from
    --chat-template) replaces its own template, and so enters its fingerprint."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise TargetError(
            f"cannot load a tokenizer from {path}: {exc}",
            "the target folder needs its tokenizer files",
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise TargetError(
            f"the tokenizer in {path} is a slow (Python) tokenizer",
            "spec_cli needs a fast tokenizer (tokenizer.json) for exact loss masks",
        )
    return chat_templates.apply(tokenizer, chat_template)


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_processor(path: Path):
    """A vision-language target's processor (its image processor, tokenizer and chat template), or None
    for a folder without one (a text model, or a VLM saved without its processor: its image-text records
    are then skipped and counted)."""
    if not any((Path(path) / name).is_file() for name in PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 (transformers raises many types here)
        hint = (
            "install torchvision built for this torch (this processor's image or video part needs it)"
            if "torchvision" in str(exc).lower() or "_extra_content" in str(exc)
            else "check the folder's processor files, or remove them to train on its text records only"
        )
        raise TargetError(f"cannot load the image processor in {path}: {exc}", hint) from exc
    return processor if getattr(processor, "image_processor", None) is not None else None


def processor_loader(path: Path | None):
    """A function that loads the folder's processor (load_processor), or None for a folder without one:
    the stages call it only for data with image-text records."""
    if path is None or not any((Path(path) / name).is_file() for name in PROCESSOR_FILES):
        return None
    return lambda: load_processor(path)


def image_inputs(model, images: dict, device) -> dict:
    """A processor's image inputs that `model`'s forward takes, on `device`, floats in the model's dtype
    (the rest of what a processor returns, e.g. Gemma 3's num_crops, is left out)."""
    import inspect

    accepted = inspect.signature(model.forward).parameters
    return {
        name: value.to(device, model.dtype if value.is_floating_point() else None)
        for name, value in images.items()
        if name in accepted
    }


def load_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise TargetError(
            f"cannot read the model config in {path}: {exc}", "pass a transformers model folder"
        ) from exc


def config_from_dict(data: dict):
    """A config saved as a dict (a cache manifest, a server's answer) as its own transformers class, so
    transformers standardises it as it would on load (rope layouts of 4.x included); a plain
    PretrainedConfig when the model type is unknown here."""
    from transformers import AutoConfig, PretrainedConfig

    data = {k: v for k, v in data.items() if k not in ("_name_or_path", "transformers_version")}
    try:
        return AutoConfig.for_model(**data)
    except Exception:  # noqa: BLE001 (unknown model type, a class's strict validation): as before
        return PretrainedConfig.from_dict(data)


def supervision_attention(device: torch.device, dtype: torch.dtype) -> str | None:
    """The attention a target that supervises training (precompute, spec train --target) loads with:
    flash attention 2 on a GPU in 16-bit where the flash-attn package is installed (packed rows then
    run as one varlen call per layer: hf_backend.packs_by_positions), else transformers' default (sdpa)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if torch.cuda.get_device_capability(device) < (8, 0):  # flash attention 2 needs Ampere or later
        return None
    from transformers.utils import is_flash_attn_2_available

    return "flash_attention_2" if is_flash_attn_2_available() else None


def auto_model_class(config):
    """The transformers auto class that loads a target of this config: a causal LM, or a vision-language
    model whose language model sits inside (Llava, Qwen2-VL, Idefics3 / SmolVLM, ...; its text decoder is
    what spec_cli runs and reads, with the weights as the model's own checkpoint names them)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    if kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and (
        kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or getattr(config, "vision_config", None) is not None
    ):
        # (Llama 4 and Mllama map to a text-only causal LM too, whose weight names are not those of their
        # published, multimodal checkpoints: a config with a vision part loads as the whole model)
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_model(
    path: Path, device: torch.device, dtype: torch.dtype, mesh=None, attention: str | None = None
) -> nn.Module:
    """The target as a frozen causal LM in eval mode. `mesh` (a device mesh of ranks): sharded over it
    by transformers' tensor-parallel plan for the architecture, each rank loading only its shards.
    attention: the attn_implementation to ask for (None: transformers' default); an architecture that
    does not take it loads with the default, with a warning."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = load_config(path)
    AutoModelForCausalLM = auto_model_class(config)  # noqa: N806 (the auto class this target loads with)
    if mesh is not None:
        if not getattr(config, "base_model_tp_plan", None):
            raise TargetError(
                f"transformers has no tensor-parallel plan for {(config.architectures or ['this'])[0]}",
                "use --target-parallel replica, or serve the target (`spec serve-target`)",
            )
    kwargs = (
        {"dtype": dtype}
        if mesh is None
        else {"dtype": dtype, "tp_plan": "auto", "device_mesh": mesh}
    )
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path),
                **kwargs,
                **({} if attention is None else {"attn_implementation": attention}),
            )
        except (
            ValueError,
            ImportError,
        ) as exc:  # transformers' answer to an attention the model lacks
            if attention is None:
                raise
            warn(
                f"the target does not load with {attention} ({exc}); using transformers' default attention"
            )
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except Exception as exc:
        raise TargetError(
            f"cannot load the target model from {path}: {exc}",
            "pass a decoder-only causal LM that transformers supports",
        ) from exc
    if mesh is None:
        model.to(device)
    model.eval().requires_grad_(False)
    return model


def weights_bytes(path: Path) -> int:
    """What the target's weight files hold on disk (safetensors, else any .bin/.pt/.gguf)."""
    files = [f for f in Path(path).glob("*.safetensors")] or [
        f for ext in ("*.bin", "*.pt", "*.gguf") for f in Path(path).glob(ext)
    ]
    return sum(f.stat().st_size for f in files)


def generation_config(path: Path):
    """The model folder's generation_config.json (its eos ids), or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        return None


def cache_argument(model) -> str:
    """The forward keyword a model takes its KV cache by: `cache` (transformers >= 5.20; `past_key_values`
    there is deprecated and warns at every call) or `past_key_values` (before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def max_positions(config) -> int | None:
    """The target's context length (max_position_embeddings, also in `text_config`), if it says."""
    text = (
        config
        if getattr(config, "max_position_embeddings", None)
        else getattr(config, "text_config", None)
    )
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


# ----------------------------------------------------------------------------- layers / aux ids


def num_layers(config) -> int:
    """The target's decoder depth, also when it sits in `config.text_config`."""
    n = getattr(config, "num_hidden_layers", None)
    if n is None and getattr(config, "text_config", None) is not None:
        n = getattr(config.text_config, "num_hidden_layers", None)
    if n is None:
        raise TargetError(
            "the target config has no num_hidden_layers (nor text_config.num_hidden_layers)",
            "spec_cli supports decoder-only causal LMs",
        )
    return int(n)


_NON_TEXT = ("vision", "visual", "audio", "image", "encoder")


def text_decoder(model: nn.Module) -> nn.Module:
    """The base text decoder (embeddings, layers, final norm; its output `last_hidden_state`), also where a
    VLM's get_decoder() answers its whole causal LM (Llama 4: language_model is a Llama4ForCausalLM)."""
    decoder = model.get_decoder()
    while getattr(decoder, "lm_head", None) is not None and isinstance(
        getattr(decoder, "model", None), nn.Module
    ):
        decoder = decoder.model
    return decoder


def cross_attention_layers(config) -> list[int]:
    """The decoder layers that attend to the image only (Mllama's cross-attention layers): a row without
    an image skips them. [] for other models."""
    text = getattr(config, "text_config", None) or config
    return list(getattr(text, "cross_attention_layers", None) or [])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers as an integer-indexed list (ModuleList or ModuleDict keyed by str(i))."""
    n = num_layers(model.config)
    candidates = []
    for name, module in model.named_modules():
        if not name.split(".")[-1] == "layers":
            continue
        if isinstance(module, nn.ModuleList) and len(module) == n:
            layers = list(module)
        elif isinstance(module, nn.ModuleDict) and len(module) == n:
            try:
                layers = [module[str(i)] for i in range(n)]
            except KeyError:
                continue
        else:
            continue
        off_text = any(part in name for part in _NON_TEXT)
        candidates.append((off_text, name.count("."), name, layers))
    if not candidates:
        raise TargetError(
            f"cannot find the {n} decoder layers of {type(model).__name__}",
            "spec_cli needs a transformers decoder-only causal LM",
        )
    return min(candidates, key=lambda c: c[:3])[3]


def _algorithm(algorithm):
    """A draft algorithm from its name (None: the default) or itself: it owns the aux-layer count."""
    from spec_cli.draft.algorithms import get

    return algorithm if hasattr(algorithm, "aux_layers") else get(algorithm)


def default_aux_layers(n: int, algorithm=None) -> list[int]:
    """The layers the draft algorithm reads by default on an n-layer target (EAGLE-3: outputs of
    0-indexed layers 1, N//2-1, N-4 = inputs of layers 2, N//2, N-3)."""
    return _algorithm(algorithm).default_aux_layers(n)


def parse_aux_layers(text: str | None, n: int, algorithm=None) -> list[int]:
    """`--aux-layers "1,14,26"` (0-indexed layer OUTPUTS), or the algorithm's default; validated
    against N and the number of layers the algorithm reads."""
    if text in (None, "", "auto"):
        ids = default_aux_layers(n, algorithm)  # distinct layers (vLLM captures each once)
    else:
        try:
            ids = [int(part) for part in str(text).split(",")]
        except ValueError as exc:
            raise ConfigError(
                f"--aux-layers {text!r} is not a comma-separated list of integers",
                "write e.g. --aux-layers 1,14,26",
            ) from exc
    validate_aux_layers(ids, n, algorithm)
    if text not in (None, "", "auto") and len(set(ids)) != len(ids):
        warn(
            f"--aux-layers {ids} repeats a layer: the draft reads the same hidden state twice, which "
            "vLLM cannot serve (it captures each layer once, and fc would be short of an input); "
            "spec eval in PyTorch runs it"
        )
    return ids


def validate_aux_layers(ids: list[int], n: int, algorithm=None) -> None:
    """As many ids as the algorithm reads, capturable (check_layer_ids)."""
    algo = _algorithm(algorithm)
    count = algo.aux_layers
    if n < count + 1:  # distinct outputs of layers 0..n-2
        raise TargetError(
            f"the target has only {n} decoder layers", f"{algo.name} needs at least {count + 1}"
        )
    if count == 0 and ids:
        raise ConfigError(
            f"{algo.name} reads no intermediate layer (its input is the target's final hidden "
            "state)",
            "drop --aux-layers",
        )
    if len(ids) != count:
        raise ConfigError(
            f"--aux-layers needs exactly {count} layer ids ({algo.name} reads {count}), got "
            f"{len(ids)}",
            f"e.g. the default {','.join(map(str, default_aux_layers(n, algo)))}",
        )
    check_layer_ids(ids, n)


def check_layer_ids(ids: list[int], n: int) -> None:
    """Aux layer ids of any algorithm: outputs of layers 0..n-2 (the serving engines capture a layer's
    input, so the last layer's output is never available to a draft). A layer may repeat (parse_aux_layers
    warns: vLLM captures each layer once and cannot serve such a draft); the defaults never do."""
    bad = [i for i in ids if not 0 <= i < n - 1]
    if bad:
        raise ConfigError(
            f"--aux-layers {bad} out of range: the target has {n} decoder layers",
            f"use ids in 0..{n - 2} (0-indexed layer outputs; vLLM and SGLang capture "
            "a layer's input, so the last layer's output cannot be served)",
        )


# ----------------------------------------------------------------------------- fingerprints


def check_tokenizer(recorded: dict, tokenizer, chat_template, what: str, rebuild: str) -> str:
    """The tokenizer fingerprint, after checking it is the one `recorded` (an artifact's metadata) was
    made with; a different chat template is named as such."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if recorded.get("tokenizer_fingerprint") == fingerprint:
        return fingerprint
    why = chat_templates.mismatch(recorded, tokenizer, chat_template, what)
    if why is not None:
        raise ArtifactError(*why)
    raise ArtifactError(f"{what} was built with a different tokenizer than this target's", rebuild)


_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "quantization_config",
    "_commit_hash",
    "use_cache",
}


def config_fingerprint(config) -> str:
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def vocab_size(config, tokenizer=None) -> int:
    """Rows of the target's lm_head (may exceed len(tokenizer) when the embedding is padded)."""
    v = getattr(config, "vocab_size", None)
    if v is None and getattr(config, "text_config", None) is not None:
        v = getattr(config.text_config, "vocab_size", None)
    if v is None:
        if tokenizer is None:
            raise TargetError("the target config has no vocab_size", "pass a causal LM folder")
        return len(tokenizer)
    return max(int(v), len(tokenizer)) if tokenizer is not None else int(v)


def target_fingerprint(path: Path) -> str:
    """Config + weights. The weight-file hash is cached per (path, size, mtime) under SPEC_HOME."""
    config_fp = config_fingerprint(load_config(path))
    weight_files = sorted(
        p for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf")
    )
    key = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in weight_files)
    cache_file = spec_home() / "fingerprints.json"
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    weights = known.get(key)
    if weights is None:
        from spec_cli.artifacts.io import sha256_file, write_json

        digest = hashlib.sha256()
        for p in weight_files:
            digest.update(sha256_file(p).encode())
        weights = digest.hexdigest()
        known[key] = weights
        try:
            write_json(cache_file, known)
        except OSError:
            pass
    return hashlib.sha256(f"{config_fp}|{weights}".encode()).hexdigest()[:16]


LAYER_PARTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def read_decoder_layer(path: Path, index: int) -> dict[str, torch.Tensor]:
    """The target's decoder layer `index` as stored in its safetensors files: {part: tensor} for the
    Llama-style parts (LAYER_PARTS), read by name without loading the model. The language model's layer:
    a vision tower's layers of the same number are passed over. One error when the files do not hold it
    (a GGUF or .bin target, another layer layout)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    pattern = re.compile(
        rf"^(.*\.)?layers\.{index}\.(" + "|".join(re.escape(p) for p in LAYER_PARTS) + ")$"
    )
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                match = pattern.match(key)
                if match and not re.search(r"vision|visual|image|audio", match.group(1) or ""):
                    found.setdefault(match.group(2), f.get_tensor(key))
    missing = [p for p in LAYER_PARTS if p not in found]
    if missing:
        raise TargetError(
            f"the target's safetensors in {path} do not hold layer {index}'s "
            f"{', '.join(missing)}" + ("" if files else " (there are no .safetensors files)"),
            "start the draft's layer random (leave out --init-layer-from-target), or pass a "
            "Llama-style target saved as safetensors",
        )
    return found
