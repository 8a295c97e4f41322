"""A tiny feature cache written with spec_cli's own shard / head / manifest writers and random features,
laid out as `spec precompute` lays one out (ragged tokens, samples in batch order); the tests keep
what was stored to compare with what is read back."""

from __future__ import annotations

from pathlib import Path

import torch

from spec_cli.artifacts import feature_cache as fc

H, V, VD = 8, 50, 10  # hidden size, target vocab, draft vocab


def identity(encoding: str = "hidden", **overrides) -> dict:
    values = {
        "target_fingerprint": "t" * 16,
        "chat_template_sha256": "c" * 64,
        "tokenizer_fingerprint": "k" * 16,
        "vocab_map_fingerprint": "v" * 16,
        "aux_layers": [1, 3, 4],
        "encoding": encoding,
        "dtype": "float32",
        "storage_dtype": "float32",
        "data_fingerprint": "d" * 16,
        "max_length": 64,
        "batch_tokens": 64,
        "shard_tokens": 40,
    }
    return {**values, **overrides}


def random_samples(n: int, seed: int = 0) -> list[torch.Tensor]:
    """n distinct token sequences of 3 to 9 tokens (the cache finds a row by its tokens)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = int(torch.randint(2, 9, (1,), generator=gen))
        samples.append(
            torch.cat([torch.tensor([i + 1]), torch.randint(1, V, (length,), generator=gen)])
        )
    return samples


def write_cache(
    folder: Path,
    samples: list[torch.Tensor],
    shards: list[list[list[int]]],
    encoding: str = "hidden",
    seed: int = 0,
) -> dict:
    """shards[s] is shard s's batches, each a list of indices into `samples`. Returns what was stored:
    {"identity", "shards": [tensors per shard], "entries", "head", "loss_masks", "selected"}."""
    gen = torch.Generator().manual_seed(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ident = identity(encoding)
    loss_masks = [(torch.rand(len(s), generator=gen) < 0.7).to(torch.uint8) for s in samples]
    stored, entries = [], []
    for index, batches in enumerate(shards):
        order = [i for batch in batches for i in batch]
        n = sum(len(samples[i]) for i in order)
        tensors = {
            "input_ids": torch.cat([samples[i] for i in order]).to(torch.int32),
            "loss_mask": torch.cat([loss_masks[i] for i in order]),
            "aux_hidden": torch.randn(n, 3 * H, generator=gen),
            "argmax": torch.randint(0, V, (n,), generator=gen).to(torch.int32),
            "sample_offsets": torch.cumsum(torch.tensor([0] + [len(samples[i]) for i in order]), 0),
            "batch_offsets": torch.cumsum(torch.tensor([0] + [len(b) for b in batches]), 0),
            "sample_index": torch.tensor(order, dtype=torch.int64),
        }
        if encoding == "hidden":
            tensors["final_hidden"] = torch.randn(n, H, generator=gen)
            tensors["lse"] = torch.rand(n, generator=gen) + 5.0
        else:
            tensors["target_p"] = torch.softmax(torch.randn(n, VD, generator=gen), -1)
            tensors["target_mass"] = torch.rand(n, generator=gen)
        stored.append(tensors)
        entries.append(fc.write_shard(folder, index, tensors, ident))
    selected = torch.sort(torch.randperm(V, generator=gen)[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    head = {
        "lm_head_selected": torch.randn(VD, H, generator=gen),
        "embed_tokens": torch.randn(V, H, generator=gen),
        "final_norm": torch.rand(H, generator=gen) + 0.5,
    }
    fc.write_head(
        folder,
        head["lm_head_selected"],
        None,
        selected,
        t2d,
        None,
        head["embed_tokens"],
        head["final_norm"],
    )
    fc.write_manifest(
        folder,
        ident,
        {
            "architecture": "LlamaForCausalLM",
            "vocab_size": V,
            "hidden_size": H,
            "num_layers": 8,
            "draft_vocab_size": VD,
        },
        entries,
    )
    return {
        "identity": ident,
        "shards": stored,
        "entries": entries,
        "head": head,
        "loss_masks": loss_masks,
        "selected": selected,
    }
