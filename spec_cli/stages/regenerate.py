"""`spec regenerate`: the target answers every user turn of the chat data itself, so that a draft is
trained on what the target actually writes.

Each conversation keeps its system and user messages in order and drops the original answers. The
target answers wherever the original had an assistant turn after user turn(s), and after a final user
turn; consecutive user messages are answered once, assistant messages before the first user message are
dropped. Turn i+1 is asked after the target's OWN answer to turn i: turn i of every conversation in a
chunk is generated together (length-sorted batches), then turn i+1.

Limits (--max-length counts the whole conversation). An answer may take
min(--max-new-tokens, --max-length - prompt length) tokens. One that reaches it without an end-of-turn
token is kept with `"finish_reason": "length"` (finished ones: "stop") and ends its conversation: the
loss mask then supervises its text but not the end-of-turn token the template closes it with
(data/template.py). A conversation also ends where its next prompt no longer fits; a record whose first
prompt does not fit is skipped. (Tokenised, a conversation can be a token or two longer than
--max-length: the template's closing tokens after a cut answer, which are not supervised.)

Sampling (--temperature > 0) draws answer i of record r from its own generator seeded by
(--seed, r, i): the same record gets the same answer whatever it is batched with, the chunk it falls in
or a resume (vLLM: the same seed per request, through vLLM's per-request generator; the two target
engines' samples differ).

Resume. Records go in chunks of --chunk-size; each finished chunk is one part file, written atomically
in OUT.parts/ beside state.json (the run's identity: inputs and settings). A rerun with the same
identity keeps the finished parts; at the end the parts are joined into OUT atomically, the provenance
sidecar OUT.meta.json is written and OUT.parts removed. So an interrupted run, rerun, ends with the
same bytes as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spec_cli import __version__, assets, threads
from spec_cli.artifacts import feature_cache as fc
from spec_cli.artifacts import guard, outputs
from spec_cli.artifacts.io import atomic_path, sha256_path, write_json
from spec_cli.console import info, progress
from spec_cli.data import chat_templates, records, vlm
from spec_cli.data.images import check_images, open_image
from spec_cli.data.template import render
from spec_cli.errors import ArtifactError, ConfigError, DataError, TargetError
from spec_cli.eval.speculative import eos_ids
from spec_cli.targets import loading

KIND = "regenerated_chat_data"
# Bump when what is generated from the same inputs and settings changes: old parts are then not reused.
REGENERATE_VERSION = "1"
ENGINES = ("transformers", "vllm")

# Why a record was skipped, beyond data/records.py's reasons
PLAIN_TEXT = "plain text (no turns to answer)"
NO_USER = "no user turn"
TOO_LONG = "prompt longer than --max-length"

_TEST_CHUNK_DELAY = float(os.environ.get("SPEC_TEST_CHUNK_DELAY", "0") or 0)


@dataclass
class RegenerateConfig:
    target: str
    data: str
    output: Path
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 512
    max_length: int = 2048
    max_samples: int | None = None
    batch_size: int | None = None  # sequences per batch (vLLM: sequences it runs at once)
    batch_tokens: int = 16384  # transformers: B x (padded prompt + new tokens) per batch
    chunk_size: int = 128  # records per part file (the unit of resume)
    engine: str = "transformers"
    device: str | None = None
    dtype: str | None = None
    overwrite: bool = False
    threads: int | None = None  # intra-op threads; None: auto (spec_cli.threads.choose)
    chat_template: str | None = None  # a Jinja file or a family name; None: the target's own
    # --features CACHE: also write OUT's feature cache from the generation's own states (vLLM)
    features: Path | None = None
    vocab_map: Path | None = (
        None  # the cache's vocab map: read, or built from OUT when the file is absent
    )
    draft_vocab_size: int = 32000  # for the vocab map built from OUT
    algorithm: str = "eagle3"  # the draft the cache is for (its aux layers and fields)
    aux_layers: str | None = None


@dataclass
class RegenerateResult:
    output: Path
    meta: dict  # the sidecar
    seconds: float
    computed_parts: int
    reused_parts: int
    already_complete: bool = False
    features: object | None = None  # --features: the PrecomputeResult of the cache
    features_from_generation: float | None = (
        None  # --features: share of the rows' positions vLLM skipped
    )


@dataclass
class Conversation:
    index: int  # the record's row in the data file (source_index)
    asks: list[list[dict]]  # asked before answer i: the system and user messages since answer i-1
    messages: list[dict] = field(default_factory=list)  # the output so far
    ended: bool = False


# ----------------------------------------------------------------------------- conversations


def plan_asks(messages: list[dict]) -> tuple[list[list[dict]], int]:
    """(the messages asked before each answer, leading assistant messages dropped). An answer is due
    where the original has an assistant turn after user message(s), and after a final user message."""
    asks, pending, leading = [], [], 0
    for message in messages:
        if message["role"] != "assistant":
            pending.append({"role": message["role"], "content": message["content"]})
        elif any(m["role"] == "user" for m in pending):
            asks.append(pending)
            pending = []
        elif not asks:
            leading += 1  # before any user message: nothing it answers
    if any(m["role"] == "user" for m in pending):
        asks.append(pending)  # a trailing system message alone asks nothing
    return asks, leading


def prompt_ids(tokenizer, messages: list[dict], processor=None) -> list[int]:
    """The chat template's rendering with the generation prompt, tokenised as the stages tokenise it
    (the template writes any bos itself, so no special tokens are added twice). A chat with image parts
    ({"type": "image", "image": source}) goes through the target's `processor` (data.vlm.ImagePrompt)."""
    if processor is not None and vlm.has_image_parts(messages):
        pictures = [
            open_image(part["image"])
            for m in messages
            if isinstance(m["content"], list)
            for part in m["content"]
            if part["type"] == "image"
        ]
        return vlm.image_prompt(
            processor, vlm.chat_template_tokenizer(processor, tokenizer), messages, pictures
        )
    return tokenizer(
        render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]


def read_conversations(
    data_path: Path, tokenizer, max_length: int, max_samples: int | None, processor=None
) -> tuple[list[Conversation], dict]:
    """The first `max_samples` usable records as conversations, and the counts of what was read. With a
    vision-language target's `processor`, image-text records are asked with their images (each image
    part naming its file by an absolute path, so the output reads them from wherever it is)."""
    conversations, skipped, read, leading = [], Counter(), 0, 0
    base = vlm.image_base(data_path)
    for i, record in enumerate(records.load_records(data_path)):
        if max_samples is not None and len(conversations) >= max_samples:
            break
        read += 1
        if processor is not None and records.has_images(record):
            kind, value = vlm.sourced_image_chat(record, base, require_assistant=False)
        else:
            kind, value = records.normalise(record, require_assistant=False)
        reason = value if kind == "skip" else PLAIN_TEXT if kind == "text" else None
        if reason is None:
            asks, dropped = plan_asks(value)
            reason = NO_USER if not asks else None
        if reason is None:
            try:
                first = prompt_ids(tokenizer, asks[0], processor)
            except DataError:
                raise
            except (
                Exception
            ):  # jinja errors: e.g. roles that do not alternate, unsupported system turn
                reason = records.TEMPLATE
            else:
                reason = TOO_LONG if len(first) >= max_length else None
        if reason is not None:
            skipped[reason] += 1
            continue
        leading += dropped
        conversations.append(Conversation(i, asks))
    return conversations, {
        "records_read": read,
        "skipped": dict(sorted(skipped.items())),
        "leading_assistant_dropped": leading,
    }


# ----------------------------------------------------------------------------- transformers target engine


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """One id from logits [V]: softmax at the temperature, cut to the smallest set of most probable
    ids whose mass reaches top_p (nucleus), drawn with the record's own generator."""
    p = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # an id stays if the mass before it is < top_p
        p = torch.zeros_like(p).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(p, 1, generator=generator))


class TransformersEngine:
    """The target in transformers: left-padded batches, a KV cache, finished rows dropped as they end."""

    def __init__(self, target_dir: Path, device: torch.device, dtype: torch.dtype, pad_id: int):
        self.model = loading.load_model(target_dir, device, dtype)
        self.cache_arg = loading.cache_argument(self.model)
        self.device, self.pad_id = device, pad_id
        self.rope_delta = (
            0  # M-RoPE (Qwen-VL): how far past its index a token after an image prompt sits
        )

    def _forward(self, ids, mask, positions, cache, images: dict | None = None) -> torch.Tensor:
        """`images`: an image prompt's image inputs (its prefill); M-RoPE models then place the prompt by
        its images' grids themselves, and every later token sits rope_delta past its index."""
        extra = {} if images is None else loading.image_inputs(self.model, images, self.device)
        grid = images is not None and hasattr(self.model.base_model, "get_rope_index")
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=None if grid else positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: cache},
            **extra,
        )
        if grid:
            self.rope_delta = int(self.model.base_model.rope_deltas.reshape(-1)[0])
        return out.logits[:, -1].float()  # [B, V]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> list[list[int]]:
        """Each prompt's new tokens, cut after the first eos (kept) or at its max_tokens. Prompts with
        images (data.vlm.ImagePrompt) run one at a time (their image inputs are per prompt)."""
        from transformers import DynamicCache

        if len(prompts) > 1 and any(getattr(p, "images", None) for p in prompts):
            return [
                self.generate_batch(
                    [p], [m], temperature, top_p, None if seeds is None else [seeds[i]], eos_ids
                )[0]
                for i, (p, m) in enumerate(zip(prompts, max_tokens))
            ]
        images = getattr(prompts[0], "images", None)
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token is at column T
            ids[b, T - len(p) :] = torch.tensor(p)
            mask[b, T - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator().manual_seed(s) for s in seeds] if temperature > 0 else None
        cache = DynamicCache(config=self.model.config)
        self.rope_delta = 0
        logits = self._forward(ids, mask, positions, cache, images)  # [B, V]
        position = positions[:, -1:] + self.rope_delta  # [B, 1]
        rows = list(range(B))  # the prompts still generating, in the cache's row order
        new: list[list[int]] = [[] for _ in prompts]
        while True:
            if temperature == 0:
                picked = logits.argmax(-1).tolist()
            else:
                picked = [
                    sample(logits[i], temperature, top_p, generators[r]) for i, r in enumerate(rows)
                ]
            keep = []
            for i, (r, token) in enumerate(zip(rows, picked)):
                new[r].append(token)
                if token not in eos_ids and len(new[r]) < max_tokens[r]:
                    keep.append(i)
            if not keep:
                return new
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, position = mask[index], position[index]
                rows, picked = [rows[i] for i in keep], [picked[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            position = position + 1
            logits = self._forward(
                torch.tensor(picked, device=self.device)[:, None], mask, position, cache
            )

    def close(self) -> None:
        self.__dict__.pop("model", None)


def length_batches(
    lengths: list[int], budgets: list[int], batch_tokens: int, batch_size: int | None
) -> list[list[int]]:
    """Indices sorted by prompt length and grouped so that B x (longest prompt + largest budget) <=
    batch_tokens (one that alone is wider goes alone) and B <= batch_size."""
    batches, current, longest, widest = [], [], 0, 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        grown_longest, grown_widest = max(longest, lengths[i]), max(widest, budgets[i])
        full = (len(current) + 1) * (grown_longest + grown_widest) > batch_tokens or (
            batch_size is not None and len(current) >= batch_size
        )
        if current and full:
            batches.append(current)
            current, grown_longest, grown_widest = [], lengths[i], budgets[i]
        current.append(i)
        longest, widest = grown_longest, grown_widest
    if current:
        batches.append(current)
    return batches


# ----------------------------------------------------------------------------- one chunk


def answer_seed(seed: int, index: int, turn: int) -> int:
    """The seed of record `index`'s answer to turn `turn`: independent of batching and resume."""
    digest = hashlib.sha256(f"{seed}:{index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def answer_chunk(
    engine,
    tokenizer,
    chunk: list[Conversation],
    cfg: RegenerateConfig,
    eos: frozenset[int],
    bar,
    processor=None,
) -> dict:
    """Answer every turn of the chunk's conversations, turn by turn -> the part file's content."""
    counts = Counter({"turns_answered": 0, "tokens_generated": 0, "answers_cut_by_length": 0})
    ended = Counter()  # conversations that end before their last turn, by why (beyond a cut answer)
    start = time.perf_counter()
    for turn in range(max(len(c.asks) for c in chunk)):
        asks = []  # (conversation, messages asked, prompt ids, budget)
        for c in chunk:
            if c.ended or turn >= len(c.asks):
                continue
            messages = c.messages + c.asks[turn]
            try:
                prompt = prompt_ids(tokenizer, messages, processor)
            except DataError:
                raise
            except Exception:  # a template that refuses the longer chat (turn 0 passed when read)
                prompt = None
            if prompt is None or len(prompt) >= cfg.max_length:
                c.ended = True
                ended[
                    records.TEMPLATE if prompt is None else "next prompt longer than --max-length"
                ] += 1
                bar.advance(len(c.asks) - turn)  # the turns it will not answer
                continue
            asks.append(
                (c, messages, prompt, min(cfg.max_new_tokens, cfg.max_length - len(prompt)))
            )
        if cfg.engine == "vllm":
            batches = [list(range(len(asks)))] if asks else []  # vLLM schedules them itself
        else:
            batches = length_batches(
                [len(a[2]) for a in asks], [a[3] for a in asks], cfg.batch_tokens, cfg.batch_size
            )
        for batch in batches:
            seeds = (
                [answer_seed(cfg.seed, asks[i][0].index, turn) for i in batch]
                if cfg.temperature > 0
                else None
            )
            outputs = engine.generate_batch(
                [asks[i][2] for i in batch],
                [asks[i][3] for i in batch],
                cfg.temperature,
                cfg.top_p,
                seeds,
                eos,
            )
            unanswered = 0
            for i, tokens in zip(batch, outputs):
                c, messages, _, _ = asks[i]
                stop = next((k for k, t in enumerate(tokens) if t in eos), None)
                text = tokenizer.decode(
                    tokens[:stop], skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
                finish = "length" if stop is None else "stop"
                c.messages = messages + [
                    {"role": "assistant", "content": text, "finish_reason": finish}
                ]
                counts["turns_answered"] += 1
                counts["tokens_generated"] += len(tokens)
                if finish == "length":  # an unfinished answer: nothing can follow it
                    c.ended = True
                    counts["answers_cut_by_length"] += 1
                    unanswered += len(c.asks) - turn - 1
            bar.advance(len(batch) + unanswered, count=sum(len(o) for o in outputs))
    return {
        "records": [{"messages": c.messages, "source_index": c.index} for c in chunk],
        "counts": {**counts, "ended_early": dict(sorted(ended.items()))},
        "seconds": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- files


def sidecar_path(output: Path) -> Path:
    return output.with_name(output.name + ".meta.json")


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def part_path(folder: Path, k: int) -> Path:
    return folder / f"part-{k:05d}.json"


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _difference(mine: dict, theirs: dict | None) -> str:
    """The settings that differ, for the error message ('' when none)."""
    if theirs is None:
        return "no readable record of how it was made"
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return ", ".join(f"{k} {theirs.get(k)!r} here, {mine.get(k)!r} now" for k in keys[:3]) + (
        f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
    )


def finished_part(folder: Path, k: int, chunk: list[Conversation]) -> dict | None:
    """Part k when it is complete and holds exactly this chunk's records, else None (recomputed)."""
    part = _read_json(part_path(folder, k))
    if part is None or part.get("chunk") != k or not isinstance(part.get("records"), list):
        return None
    if [r.get("source_index") for r in part["records"]] != [c.index for c in chunk]:
        return None
    return part


def _open_parts(folder: Path, identity: dict, overwrite: bool) -> None:
    """The work folder for this identity: kept when it is this run's, refused when it is another's."""
    if folder.exists() and (overwrite or not any(folder.iterdir())):
        _remove_parts(folder)
    if folder.exists():
        state = _read_json(folder / "state.json")
        if state is None or state.get("identity") != identity:
            raise ArtifactError(
                f"{folder} holds an unfinished regenerate run with other inputs or settings "
                f"({_difference(identity, (state or {}).get('identity'))})",
                "rerun it with its own settings, pass --overwrite to start over, or use another -o",
            )
        return
    folder.mkdir(parents=True)
    write_json(folder / "state.json", {"identity": identity})


def _write_part(folder: Path, k: int, part: dict) -> None:
    """Keys in the order they were made (no sort_keys): a part read back writes the same bytes."""
    with atomic_path(part_path(folder, k)) as tmp:
        tmp.write_text(
            json.dumps({"chunk": k, **part}, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def _write_output(output: Path, parts: list[dict]) -> None:
    with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for part in parts:
            for record in part["records"]:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- the stage


def _check(cfg: RegenerateConfig) -> None:
    if cfg.engine not in ENGINES:
        raise ConfigError(
            f"--engine {cfg.engine!r} is not one of {', '.join(ENGINES)}", "e.g. --engine vllm"
        )
    if cfg.temperature < 0:
        raise ConfigError(f"--temperature {cfg.temperature} is negative", "use 0 (greedy) or more")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"--top-p {cfg.top_p} is not in (0, 1]", "e.g. --top-p 0.95 (1: no cut)")
    if cfg.max_length < 2:
        raise ConfigError(
            f"--max-length {cfg.max_length} is too small", "use at least 2 (default 2048)"
        )
    positive = {
        "--max-new-tokens": cfg.max_new_tokens,
        "--batch-tokens": cfg.batch_tokens,
        "--chunk-size": cfg.chunk_size,
        "--batch-size": cfg.batch_size,
        "--max-samples": cfg.max_samples,
    }
    for name, value in positive.items():
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value} is not positive", f"pass {name} 1 or more")
    written = {
        "-o": (cfg.output, outputs.CHAT_DATA),
        "--features": (cfg.features, outputs.FEATURE_CACHE),
    }
    read = {"--target": cfg.target, "--data": cfg.data, "--chat-template": cfg.chat_template}
    if (
        cfg.features is not None and cfg.vocab_map is not None
    ):  # an existing map is read, a new one written
        if Path(cfg.vocab_map).exists():
            read["--vocab-map"] = cfg.vocab_map
        else:
            written["--vocab-map"] = (cfg.vocab_map, outputs.VOCAB_MAP)
    outputs.check(written, read, replace_flag="--overwrite")
    _check_output(Path(cfg.output))
    if cfg.features is not None:
        if cfg.engine != "vllm":
            raise ConfigError(
                "--features keeps the states vLLM computes while it answers (--engine vllm)",
                "pass --engine vllm, or regenerate here and run spec precompute on the output",
            )
        if cfg.vocab_map is None:
            raise ConfigError(
                "--features writes a feature cache, which needs a vocab map",
                "pass --vocab-map PATH: an existing map, or where to write the one built from "
                "the regenerated text (--draft-vocab-size)",
            )
        folder = Path(cfg.features)
        if folder.is_file():
            raise ConfigError(
                f"--features {cfg.features} is a file; a feature cache is a folder",
                "pass a folder path (e.g. --features cache)",
            )
        if (
            folder.is_dir()
        ):  # before the answers, not after: precompute would refuse the folder then
            own = set(fc.own_files(folder)) | {fc.MANIFEST, guard.LOCK}
            other = sorted(
                p.name for p in folder.iterdir() if p.name not in own and not p.name.startswith(".")
            )
            if other:
                raise ConfigError(
                    f"--features {cfg.features} holds files a feature cache does not write "
                    f"({', '.join(other[:3])})",
                    "pass a new or empty folder",
                )


def _check_output(output: Path) -> None:
    """-o is the chat file to write: refuse a folder, a parent that is a file, or one not writable, up front."""
    hint = "pass -o a .jsonl file path (e.g. -o regenerated.jsonl)"
    if output.is_dir():
        raise ConfigError(f"-o {output} is a folder; regenerate writes one chat data file", hint)
    parent = output.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"-o {output}: {parent} is a file, not a folder", hint)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"-o {output}: {parent} is not writable", f"{hint} in a folder you may write"
        )


def _remove_parts(folder: Path) -> None:
    """Remove a work folder this stage made (state.json, part files, hidden temp files), nothing else."""
    own = (
        [
            p.name
            for p in folder.iterdir()
            if re.fullmatch(r"(part-\d{5}\.json|rows-\d{5}\.safetensors)", p.name)
        ]
        if folder.is_dir()
        else []
    )
    guard.replace_folder(folder, "state.json", "regenerate work folder", own=own)
    for leftover in folder.iterdir():  # replace_folder keeps a lock file
        leftover.unlink()
    folder.rmdir()


def run(cfg: RegenerateConfig) -> RegenerateResult:
    start = time.perf_counter()
    _check(cfg)
    if cfg.engine == "vllm":
        from spec_cli.engine import vllm

        vllm.require("spec regenerate --engine vllm")  # before anything slow
    data_path = Path(assets.resolve_data_arg(cfg.data)).expanduser()
    if not data_path.exists():
        raise DataError(
            f"data not found: {data_path}",
            "pass a .jsonl, .json or .parquet file, a saved dataset folder, or `sharegpt`",
        )
    target_dir = loading.resolve_target(assets.resolve_target_arg(cfg.target))
    output = Path(cfg.output)
    template = chat_templates.resolve(cfg.chat_template)
    tokenizer = loading.load_tokenizer(target_dir, template)
    chat_templates.require(
        tokenizer, target_dir, "the prompts"
    )  # regenerate asks through the template
    config = loading.load_config(target_dir)
    context = loading.max_positions(config)
    if context and cfg.max_length > context:
        info(
            f"--max-length {cfg.max_length} is more than the target's context ({context}): using {context}"
        )
        cfg = replace(cfg, max_length=context)
    device = loading.choose_device(cfg.device)
    dtype = loading.choose_dtype(cfg.dtype, device)
    if hint := loading.bf16_hint(cfg.dtype, device):
        info(hint)
    eos = eos_ids(
        tokenizer, loading.generation_config(target_dir)
    ) | chat_templates.end_of_turn_ids(tokenizer, template)
    if not eos:
        raise TargetError(
            f"the target in {target_dir} names no eos / end-of-turn token",
            "its tokenizer or generation_config.json needs an eos_token_id",
        )

    # ---- image-text records: asked with their images through the target's processor (transformers only)
    processor, images_sha = None, None
    load = loading.processor_loader(target_dir)
    if load is not None:
        dataset = records.load_records(data_path)
        if any(records.has_images(record) for record in dataset):
            if cfg.engine == "vllm":
                raise ConfigError(
                    "the data holds image-text chats, which spec regenerate asks through the "
                    "transformers target only",
                    "pass --engine transformers",
                )
            processor = load()
            digest = hashlib.sha256()
            check_images(
                dataset, vlm.image_base(data_path), digest=digest
            )  # one error, before anything runs
            images_sha = digest.hexdigest()
    identity = {
        "kind": KIND,
        "version": REGENERATE_VERSION,
        "target_fingerprint": loading.target_fingerprint(target_dir),
        "tokenizer_fingerprint": loading.tokenizer_fingerprint(tokenizer),
        "data_sha256": sha256_path(data_path),
        "engine": cfg.engine,
        "dtype": str(dtype).replace("torch.", ""),
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "max_length": cfg.max_length,
        "max_samples": cfg.max_samples,
        "chunk_size": cfg.chunk_size,
        **({"images_sha256": images_sha} if images_sha else {}),
    }
    if (
        cfg.features is not None and Path(cfg.vocab_map).exists()
    ):  # a map it cannot use: before any answer
        from spec_cli.artifacts.vocab_map import load_vocab_map

        loading.check_tokenizer(
            load_vocab_map(cfg.vocab_map).metadata,
            tokenizer,
            template,
            f"the vocab map {cfg.vocab_map}",
            "pass --vocab-map a path that does not exist "
            "yet, and the map is built from the regenerated text",
        )
    aux_layers = None
    if (
        cfg.features is not None
    ):  # the rows' states: these aux layers, from an engine with prefix caching
        aux_layers = loading.parse_aux_layers(
            cfg.aux_layers, loading.num_layers(config), cfg.algorithm
        )
        identity["features"] = {"aux_layers": aux_layers, "prefix_caching": True}

    # ---- a finished file is reused; another one is never replaced without --overwrite
    sidecar, folder = sidecar_path(output), parts_dir(output)
    if output.exists() and not folder.exists() and not cfg.overwrite:
        meta = _read_json(sidecar)
        if (
            meta is not None
            and meta.get("identity") == identity
            and meta.get("output_sha256") == sha256_path(output)
        ):
            info(f"{output} is already complete (same inputs and settings)")
            features = None
            if cfg.features is not None and not (Path(cfg.features) / fc.MANIFEST).is_file():
                info(
                    f"its feature cache {cfg.features} is not complete: the target runs the text again"
                )
                keeping = _open_engine(cfg, target_dir, device, dtype, tokenizer, eos, aux_layers)
                try:
                    features = _write_features(cfg, keeping.backend, output, [])
                finally:
                    keeping.close()
            return RegenerateResult(
                output,
                meta,
                time.perf_counter() - start,
                0,
                meta["parts"],
                True,
                features=None if features is None else features[0],
            )
        raise ArtifactError(
            f"{output} already exists and was made from other inputs or settings "
            f"({_difference(identity, (meta or {}).get('identity'))})",
            "pass --overwrite to replace it, or another -o",
        )

    conversations, read = read_conversations(
        data_path, tokenizer, cfg.max_length, cfg.max_samples, processor
    )
    if not conversations:
        reasons = ", ".join(f"{k}: {v}" for k, v in read["skipped"].items()) or "no records"
        raise DataError(
            f"{data_path} has no records to answer ({reasons})",
            "records need user turns (ShareGPT `conversations`, OpenAI `messages`) whose first "
            "prompt fits in --max-length",
        )
    _open_parts(folder, identity, cfg.overwrite)

    chunks = [
        conversations[s : s + cfg.chunk_size] for s in range(0, len(conversations), cfg.chunk_size)
    ]
    parts = {
        k: p for k, chunk in enumerate(chunks) if (p := finished_part(folder, k, chunk)) is not None
    }
    todo = [k for k in range(len(chunks)) if k not in parts]
    total_turns = sum(len(c.asks) for k in todo for c in chunks[k])
    # how long it takes depends on the machine: the work is said now, the time left as chunks answer
    info(
        f"regenerate: {len(conversations)} records in {len(chunks)} chunk(s) of {cfg.chunk_size}"
        + (f"; reusing {len(parts)} finished chunk(s) from {folder}" if parts else "")
        + (
            f"; {total_turns} turns to answer, up to {cfg.max_new_tokens} new tokens each"
            if todo
            else ""
        )
    )

    engine, timing, features = None, {}, None
    choice = threads.choose_for_run(cfg.threads)  # before the model loads (vLLM then sets its own)
    previous = torch.get_num_threads()
    torch.set_num_threads(choice.threads)
    nonce = os.urandom(
        6
    ).hex()  # this run's cache salts: a later run's requests never hit its blocks
    try:
        if todo or cfg.features is not None:
            engine = _open_engine(cfg, target_dir, device, dtype, tokenizer, eos, aux_layers)
            used = torch.get_num_threads()
            timing = {
                "threads": used,
                "threads_reason": choice.reason
                if used == choice.threads
                else f"set by {cfg.engine} (asked for {choice.threads}: {choice.reason})",
            }
            meter = threads.Meter()
        with progress("regenerating", total=total_turns, unit="turns", rate="tokens") as bar:
            for k in todo:
                if cfg.features is not None:
                    engine.backend.cache_salt = f"spec-regenerate-{nonce}-{k}"
                parts[k] = answer_chunk(engine, tokenizer, chunks[k], cfg, eos, bar, processor)
                if cfg.features is not None:  # before the part: a finished part has its rows
                    begin = time.perf_counter()
                    _keep_rows(engine.backend, tokenizer, parts[k], cfg, rows_path(folder, k))
                    parts[k]["rows_seconds"] = time.perf_counter() - begin
                _write_part(folder, k, parts[k])
                if _TEST_CHUNK_DELAY:  # lets tests interrupt a tiny run between chunks
                    time.sleep(_TEST_CHUNK_DELAY)
        if todo:  # how this run's tokens/s were measured
            timing["busy"] = meter.stop(
                timing["threads"], threads.available_cores(), device.type == "cpu"
            )
        ordered = [parts[k] for k in range(len(chunks))]
        _write_output(output, ordered)
        if cfg.features is not None:
            engine.backend.cache_salt = f"spec-regenerate-{nonce}-rows"
            features = _write_features(
                cfg, engine.backend, output, [rows_path(folder, k) for k in range(len(chunks))]
            )
    finally:  # also on an error or Ctrl-C: vLLM holds the model and its KV cache
        if engine is not None:
            engine.close()
        if cfg.engine == "transformers":  # vLLM replaces torch.set_num_threads once loaded
            torch.set_num_threads(previous)

    meta = _provenance(
        cfg, identity, read, ordered, target_dir, data_path, tokenizer, device, output
    )
    meta.update(
        parts=len(chunks),
        parts_reused=len(chunks) - len(todo),
        seconds=time.perf_counter() - start,
        **timing,
    )
    if features is not None:  # rows_seconds: putting the rows' states together (this run's chunks)
        meta["features"] = {
            "cache": str(Path(cfg.features).resolve()),
            "vocab_map": str(Path(cfg.vocab_map).resolve()),
            "aux_layers": aux_layers,
            **features[1],
            "rows_seconds": sum(p.get("rows_seconds", 0.0) for p in ordered),
        }
    write_json(sidecar, meta)
    _remove_parts(folder)
    return RegenerateResult(
        output,
        meta,
        meta["seconds"],
        len(todo),
        len(chunks) - len(todo),
        features=None if features is None else features[0],
        features_from_generation=None if features is None else features[1]["from_generation"],
    )


def _open_engine(
    cfg: RegenerateConfig, target_dir: Path, device, dtype, tokenizer, eos, aux_layers=None
):
    if cfg.features is not None:  # the target with its states kept by prefix
        from spec_cli.targets.vllm_backend import VLLMTargetBackend

        # a row of --max-length tokens runs as a prompt, and vLLM asks room for one sampled token after it
        context = loading.max_positions(loading.load_config(target_dir))
        return Keeping(
            VLLMTargetBackend(
                target_dir,
                aux_layers,
                dtype=dtype,
                capture_prefixes=True,
                max_model_len=cfg.max_length + 1
                if not context or cfg.max_length < context
                else cfg.max_length,
                max_num_seqs=cfg.batch_size,
                seed=cfg.seed,
                seeded=cfg.temperature > 0,
            )
        )
    if cfg.engine == "vllm":
        from spec_cli.engine import vllm

        return vllm.Engine(
            target_dir,
            None,
            dtype=dtype,
            max_model_len=cfg.max_length,
            seed=cfg.seed,
            max_num_seqs=cfg.batch_size,
            seeded=cfg.temperature > 0,
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return TransformersEngine(target_dir, device, dtype, pad)


# ----------------------------------------------------------------------------- --features


class Keeping:
    """The vLLM target backend that keeps its states (--features), answering as regenerate's engines do."""

    def __init__(self, backend):
        self.backend = backend

    def generate_batch(self, *args) -> list[list[int]]:
        return self.backend.generate(*args)

    def close(self) -> None:
        self.backend.close()


def rows_path(folder: Path, k: int) -> Path:
    return folder / f"rows-{k:05d}.safetensors"


def _keep_rows(backend, tokenizer, part: dict, cfg: RegenerateConfig, path: Path) -> None:
    """The chunk's records tokenised as precompute will read them from OUT, their states put together
    from what the generation computed (vLLM runs only the positions it did not), written to `path`."""
    from spec_cli.data.template import encode_record, special_token_strings
    from spec_cli.targets.replay_backend import write_rows

    specials = special_token_strings(tokenizer)
    rows = []
    for record in part["records"]:
        encoded = encode_record(tokenizer, json.loads(json.dumps(record)), cfg.max_length, specials)
        if not isinstance(encoded, str):  # a skipped record is skipped by precompute too
            rows.append([int(t) for t in encoded[0]])
    hidden, aux = [], []
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for members in length_batches([len(r) for r in rows], [0] * len(rows), cfg.batch_tokens, None):
        width = max(len(rows[i]) for i in members)
        ids = torch.zeros(len(members), width, dtype=torch.long)
        mask = torch.zeros(len(members), width, dtype=torch.long)
        for b, i in enumerate(members):
            ids[b, : len(rows[i])] = torch.tensor(rows[i])
            mask[b, : len(rows[i])] = 1
        a, h = backend.run_target(ids, mask)
        for b, i in enumerate(members):
            kept[i] = (h[b, : len(rows[i])].cpu(), a[b, : len(rows[i])].cpu())
    for i in range(len(rows)):
        hidden.append(kept[i][0])
        aux.append(kept[i][1])
    write_rows(path, rows, hidden, aux)
    backend.states.clear()


def _write_features(cfg: RegenerateConfig, backend, output: Path, rows_files: list[Path]):
    """OUT's feature cache, written by precompute's code from the kept rows -> (PrecomputeResult, counts)."""
    from spec_cli.stages import build_vocab_map, precompute
    from spec_cli.targets.replay_backend import ReplayBackend

    vocab_map = Path(cfg.vocab_map)
    if not vocab_map.exists():
        info(
            f"vocab map: building {vocab_map} from {output} (--draft-vocab-size {cfg.draft_vocab_size})"
        )
        build_vocab_map.run(
            build_vocab_map.BuildVocabMapConfig(
                target=cfg.target,
                data=str(output),
                output=vocab_map,
                draft_vocab_size=cfg.draft_vocab_size,
                max_length=cfg.max_length,
                chat_template=cfg.chat_template,
            )
        )
    replay = ReplayBackend(backend, [f for f in rows_files if f.is_file()])
    result = precompute.run(
        precompute.PrecomputeConfig(
            target=cfg.target,
            data=str(output),
            vocab_map=vocab_map,
            output=Path(cfg.features),
            algorithm=cfg.algorithm,
            aux_layers=cfg.aux_layers,
            max_length=cfg.max_length,
            device=cfg.device,
            dtype=cfg.dtype,
            target_engine="vllm",
            threads=cfg.threads,
            chat_template=cfg.chat_template,
        ),
        target=replay,
    )
    computed, total = backend.row_positions
    counts = {
        "rows_replayed": replay.replayed,
        "rows_computed": replay.computed,
        "from_generation": 1 - computed / total if total else None,
        "cache_seconds": result.seconds,
    }
    replay.close()
    return result, counts


def _provenance(
    cfg: RegenerateConfig,
    identity: dict,
    read: dict,
    parts: list[dict],
    target_dir: Path,
    data_path: Path,
    tokenizer,
    device,
    output: Path,
) -> dict:
    """The sidecar: what was made from what, with which settings, and the counts."""
    ended = Counter()
    for part in parts:
        ended.update(part["counts"]["ended_early"])
    total = {
        key: sum(p["counts"][key] for p in parts)
        for key in ("turns_answered", "tokens_generated", "answers_cut_by_length")
    }
    generation_seconds = sum(p["seconds"] for p in parts)
    engine = {"name": cfg.engine}
    if cfg.engine == "vllm":
        from spec_cli.engine import vllm

        engine["version"] = vllm.version()
    template = str(tokenizer.chat_template)
    return {
        "kind": KIND,
        "spec_cli_version": __version__,
        "output": str(output),
        "output_sha256": sha256_path(output),
        "target": str(target_dir),
        "target_fingerprint": identity["target_fingerprint"],
        "tokenizer_fingerprint": identity["tokenizer_fingerprint"],
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "chat_template_source": chat_templates.source_of(
            tokenizer, chat_templates.resolve(cfg.chat_template)
        ),
        "data": str(data_path.resolve()),
        "data_sha256": identity["data_sha256"],
        "engine": engine,
        "device": str(device) if cfg.engine == "transformers" else None,
        "dtype": identity["dtype"],
        "settings": {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "sampling": "greedy"
            if cfg.temperature == 0
            else "answer i of record r: its own generator seeded from (seed, r, i)",
            "max_new_tokens": cfg.max_new_tokens,
            "max_length": cfg.max_length,
            "max_samples": cfg.max_samples,
            "batch_size": cfg.batch_size,
            "batch_tokens": cfg.batch_tokens,
            "chunk_size": cfg.chunk_size,
        },
        "identity": identity,
        "counts": {
            "records_read": read["records_read"],
            "records_written": sum(len(p["records"]) for p in parts),
            "skipped": read["skipped"],
            "leading_assistant_dropped": read["leading_assistant_dropped"],
            **total,
            "conversations_ended_early": dict(sorted(ended.items())),
        },
        "generation_seconds": generation_seconds,
        "tokens_per_second": total["tokens_generated"] / generation_seconds
        if generation_seconds
        else 0.0,
    }
