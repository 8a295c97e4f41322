"""The one interface every source of supervision implements (in-process, remote, streaming).

The trainer only ever calls these methods, so it cannot tell where its supervision came from.
"""

from __future__ import annotations

import torch

from spec_cli.batch import TargetBatch
from spec_cli.errors import ConfigError

IMAGE_ROWS = "image-text rows"


def require_images(backend) -> None:
    """ConfigError unless `backend` runs the target's vision part on image-text rows (data/vlm.py): the
    in-process transformers target does; a served target, the vLLM engine and a feature cache do not."""
    if not getattr(backend, "reads_images", False):
        raise ConfigError(
            f"{IMAGE_ROWS} need the target's vision encoder, which {type(backend).__name__} does "
            "not run",
            "supervise image-text data with the transformers target (--target-engine "
            "transformers, in this process or in `spec serve-target`), or precompute it that way",
        )


class TargetBackend:
    """Base class: subclasses implement generate_batch and get_input_embeddings."""

    #: target facts the trainer checks against the vocab map / cache (set by subclasses)
    info: dict
    #: also return the target's last hidden state after its final norm (TargetBatch.final_hidden), for
    #: drafts that read it (EAGLE-1/2); set by the trainer before the first batch
    keep_final_hidden: bool = False
    #: the per-token fields to return in TargetBatch.extras, name -> TargetField (spec_cli/draft/contract.py):
    #: what the draft algorithm asks for beyond the built-in supervision; set by the trainer (and the
    #: server) before the first batch. A backend that cannot give one raises a ConfigError naming it.
    extra_fields: dict = {}
    #: generate_batch takes `images` (the model inputs of image-text rows) and runs the vision part on them
    reads_images: bool = False

    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
    ) -> TargetBatch:
        raise NotImplementedError

    def get_input_embeddings(self) -> torch.Tensor:
        """The target's input embedding weight [V, H] (seeds the draft's frozen embeddings)."""
        raise NotImplementedError

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        """The draft vocab (target ids, ascending) the supervision is computed over."""
        raise NotImplementedError

    def get_output_head(self) -> dict[str, torch.Tensor] | None:
        """After set_vocab_mapping: {"lm_head_selected": [Vd, H]} plus, when the target's final norm is
        an RMSNorm, {"final_norm": [H]} (its effective per-channel scale). They seed the draft's lm_head
        and final norm. None: not available."""
        return None

    def close(self) -> None:
        """Release resources (models, connections)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
