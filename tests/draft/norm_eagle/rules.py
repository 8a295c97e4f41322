"""How a `plain` NORM-EAGLE export is read: its own rule, not the writer's code. The folder must hold
exactly the draft's parameters (but the embedding) at the DraftConfig's shapes, equal to the
checkpoint's rounded to the export dtype, and the draft built from it must fuse aux states as the
checkpoint does."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.errors import ArtifactError, ExportCheckError
from spec_cli.export.check import CheckReport
from spec_cli.export.reader import ReadExport, template_record

ARCHITECTURE = "NormEagleDraft"


def recognise(raw: dict) -> str | None:
    return "plain" if (raw.get("architectures") or [None])[0] == ARCHITECTURE else None


def _draft(folder: Path) -> tuple[Eagle3Draft, dict, list[str]]:
    raw = json.loads((folder / "config.json").read_text())
    draft = Eagle3Draft(DraftConfig.from_dict(raw["draft_config"]))
    tensors = load_file(str(folder / "model.safetensors"))
    expected = {
        k: tuple(v.shape) for k, v in draft.state_dict().items() if k != "embed_tokens.weight"
    }
    problems = [f"{k} is missing" for k in sorted(set(expected) - set(tensors))]
    problems += [f"{k} is not a parameter" for k in sorted(set(tensors) - set(expected))]
    problems += [
        f"{k} has shape {list(tensors[k].shape)}, the config's is {list(expected[k])}"
        for k in sorted(set(expected) & set(tensors))
        if tuple(tensors[k].shape) != expected[k]
    ]
    if not problems:
        draft.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
        )
    return draft.eval(), raw, problems


def check(folder: Path, fmt: str, src, dtype: torch.dtype) -> CheckReport:
    draft, _, problems = _draft(Path(folder))
    reference = Eagle3Draft(src.config)
    reference.load_state_dict(
        {k: v.to(dtype).float() if v.is_floating_point() else v for k, v in src.state.items()},
        strict=False,
    )
    aux = torch.randn(
        16,
        len(src.config.aux_layer_ids) * src.config.target_hidden_size,
        generator=torch.Generator().manual_seed(0),
    )
    same = 0
    if not problems:
        with torch.no_grad():
            ours, theirs = draft.project(aux), reference.eval().project(aux)
        same = int(torch.isclose(ours, theirs, rtol=0, atol=0).all(-1).sum())
        if same != len(aux):
            problems.append(
                f"the fused aux states differ from the checkpoint's at {len(aux) - same} of {len(aux)}"
            )
    if problems:
        raise ExportCheckError(
            "the plain export would not serve as trained: " + "; ".join(problems),
            "nothing was written",
        )
    return CheckReport(
        format=fmt,
        params_loaded=len(draft.state_dict()) - 1,
        aux_layer_outputs=list(src.config.aux_layer_ids),
        positions=len(aux),
        confident=len(aux),
        agreement_fp32=same / len(aux),
    )


def read(folder: Path, fmt: str, target_config) -> ReadExport:
    draft, raw, problems = _draft(Path(folder))
    if problems:
        raise ArtifactError(
            f"{folder} is not a complete plain export: {'; '.join(problems)}",
            "export the checkpoint again",
        )
    block = raw.get("spec_cli") or {}
    c = draft.config
    recorded = {
        "vocab_size": c.vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "target_num_layers": c.target_num_layers,
        "target_fingerprint": c.target_fingerprint,
        "tokenizer_fingerprint": c.tokenizer_fingerprint,
        **template_record(
            c.chat_template_sha256, c.chat_template_source, c.tokenizer_base_fingerprint
        ),
    }
    return ReadExport(
        model=draft, format=fmt, step=block.get("step"), recorded=recorded, needs_embeddings=True
    )
