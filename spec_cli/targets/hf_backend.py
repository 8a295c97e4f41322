"""The in-process Hugging Face target backend, and the head math every in-process target shares.

The three aux layers are captured with forward hooks on those decoder layers (target/capture.py; the
model is never asked for every layer's hidden states), and full-vocab logits are scanned a chunk of
tokens at a time (never a full fp32 [B*T, V] tensor). `LocalTargetBackend` holds what does not depend
on the engine that runs the decoder (lm_head statistics, the draft-vocab distribution, batch
assembly), so the transformers and vLLM backends (spec_cli/targets/vllm_backend.py) turn hidden states
into supervision with the same code.
"""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path

import torch

from spec_cli.artifacts import vocab_map
from spec_cli.batch import TargetBatch
from spec_cli.data.vlm import TOKEN_TYPE_KEYS
from spec_cli.draft.contract import INPUT_EMBEDS
from spec_cli.errors import ConfigError
from spec_cli.targets import loading
from spec_cli.targets.backend import IMAGE_ROWS, TargetBackend, require_images
from spec_cli.targets.capture import AuxCapture, InputCapture
from spec_cli.targets.masks import CUSTOM_MASK_ATTENTION, Layout, for_model, image_blocks
from spec_cli.targets.supervision import (
    assemble_batch,
    draft_distribution,
    full_vocab_stats,
    selected_logits,
)

PACKING = "packing several documents into one row (--pack)"
# models whose token_type_ids mark image tokens that attend each other both ways (and nothing else)
BIDIRECTIONAL_IMAGES = ("gemma3",)


def final_norm_scale(norm, hidden_size: int) -> torch.Tensor | None:
    """The effective per-channel scale of an RMSNorm module (also Gemma's 1 + weight form), read by
    normalising a vector of ones (its RMS is 1). None for other norms (LayerNorm subtracts the mean)."""
    if norm is None or "rmsnorm" not in type(norm).__name__.lower():
        return None
    weight = next(norm.parameters(), None)
    if weight is None:
        return None
    with torch.no_grad():
        ones = torch.ones(1, hidden_size, device=weight.device, dtype=torch.float32)
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)) or 0.0)
        return (norm(ones.to(weight.dtype)).float()[0] * (1.0 + eps) ** 0.5).cpu()


def describe_target(
    target_dir: Path,
    config,
    architecture: str,
    lm_head_weight: torch.Tensor,
    aux_layers: list[int],
    dtype: torch.dtype,
) -> dict:
    """The target facts a backend reports (`TargetBackend.info`); they do not depend on the engine."""
    return {
        "architecture": architecture,
        "vocab_size": int(lm_head_weight.shape[0]),
        "hidden_size": int(lm_head_weight.shape[1]),
        "num_layers": loading.num_layers(config),
        "aux_layers": list(aux_layers),
        "dtype": str(dtype).replace("torch.", ""),
        "target_fingerprint": loading.target_fingerprint(target_dir),
        "tokenizer_fingerprint": loading.tokenizer_fingerprint(loading.load_tokenizer(target_dir)),
    }


def resolve_aux_layers(aux_layers: list[int] | str | None, n: int) -> list[int]:
    """A list of ids (the stage chose them with its draft algorithm), or --aux-layers text read with
    the default algorithm's count and defaults; validated against an n-layer target."""
    if isinstance(aux_layers, (list, tuple)):
        loading.check_layer_ids(list(aux_layers), n)
        return list(aux_layers)
    return loading.parse_aux_layers(aux_layers, n)


class LocalTargetBackend(TargetBackend):
    """A target whose decoder runs in this process. Subclasses set device, dtype, aux_layers, info,
    lm_head_weight [V, H], lm_head_bias, softcap and final_norm (the decoder's final norm module or
    None), and implement run_target; the supervision is computed here, the same for every engine."""

    device: torch.device
    dtype: torch.dtype
    lm_head_weight: torch.Tensor
    lm_head_bias: torch.Tensor | None = None
    softcap: float | None = None
    final_norm = None
    norm_scale: torch.Tensor | None = (
        None  # the final norm's scale where the module is elsewhere (vLLM TP)
    )
    selected: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = (
        None  # the last forward's, when a field reads them (INPUT_EMBEDS)
    )

    @property
    def wants_input_embeds(self) -> bool:
        return any(f.reads == INPUT_EMBEDS for f in self.extra_fields.values())

    def field_values(
        self, fields: dict, hidden: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor
    ) -> dict:
        """name -> the field computed from the last forward (TargetField.compute)."""
        out = {}
        for name, f in fields.items():
            first = hidden
            if f.reads == INPUT_EMBEDS:
                if self.input_embeds is None:
                    raise ConfigError(
                        f"the target field {name!r} reads the target's input embeddings, which "
                        f"{type(self).__name__} does not capture",
                        "use the in-process transformers target (--target-engine transformers)",
                    )
                first = self.input_embeds
            out[name] = f.compute(first, aux, ids)
        return out

    def run_target(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_hidden [B, T, 3*H], final normed hidden [B, T, H]) in the model's dtype."""
        raise NotImplementedError

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        selected = selected_token_ids.long().to(self.device)
        if selected.numel() and int(selected.max()) >= self.info["vocab_size"]:
            raise ConfigError(
                "the vocab map has ids beyond this target's vocab",
                "build the vocab map with this target's tokenizer",
            )
        self.selected = selected
        self.t2d = vocab_map.t2d_from_ids(selected, self.info["vocab_size"])
        self.lm_head_selected = self.lm_head_weight[selected].contiguous()  # [Vd, H]
        self.bias_selected = None if self.lm_head_bias is None else self.lm_head_bias[selected]

    def get_output_head(self) -> dict[str, torch.Tensor] | None:
        if self.selected is None:
            return None
        head = {"lm_head_selected": self.lm_head_selected.detach()}
        scale = (
            self.norm_scale
            if self.norm_scale is not None
            else final_norm_scale(self.final_norm, self.info["hidden_size"])
        )
        if scale is not None:
            head["final_norm"] = scale
        return head

    def full_vocab_stats(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return full_vocab_stats(hidden, self.lm_head_weight, self.lm_head_bias, self.softcap)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return selected_logits(hidden, self.lm_head_selected, self.bias_selected, self.softcap)

    def generate_batch(
        self,
        input_ids,
        attention_mask,
        loss_mask,
        position_ids=None,
        seq_lens=None,
        images: dict | None = None,
    ) -> TargetBatch:
        if self.selected is None:
            raise RuntimeError("set_vocab_mapping() must be called before generate_batch()")
        if images is None:
            aux, hidden = self.run_target(input_ids, attention_mask, position_ids, seq_lens)
        else:  # image-text rows (data/vlm.py): only a target that runs its vision part takes them
            require_images(self)
            aux, hidden = self.run_target(
                input_ids, attention_mask, position_ids, seq_lens, images=images
            )
        with torch.no_grad():
            argmax, lse = self.full_vocab_stats(hidden)
            target_p, target_mass = draft_distribution(self.draft_logits(hidden), lse)
            ids = input_ids.to(self.device)
            extras = self.field_values(self.extra_fields, hidden, aux, ids)
            return assemble_batch(
                aux,
                ids,
                attention_mask.to(self.device),
                loss_mask.to(self.device),
                target_p,
                target_mass,
                argmax,
                self.t2d,
                position_ids,
                seq_lens,
                hidden if self.keep_final_hidden else None,
                extras,
            )


def packs_by_positions(implementation: str, layout) -> bool:
    """Packed documents go to the target as offsets and positions, no mask, for attentions that read no
    custom mask (flash attention: one varlen call per row and layer) when the layout allows it
    (`Layout.packs_by_positions`); sdpa and eager take the per-kind masks (exact for every layout)."""
    return implementation not in CUSTOM_MASK_ATTENTION and layout.packs_by_positions()


def varlen_offsets(lengths: list[int], T: int) -> tuple[list[int], int]:
    """(cumulative offsets, longest) of a packed row's documents of `lengths` (0 = none) in T slots, each
    padding token a document of its own (as masks.document_ids places them)."""
    sizes = [n for n in lengths if n > 0]
    sizes += [1] * (T - sum(sizes))
    return [0, *itertools.accumulate(sizes)], max(sizes)


class HFTargetBackend(LocalTargetBackend):
    """The target in transformers, whole on this process's device, or (`mesh`: torchrun) sharded by
    tensor parallelism over the ranks of this machine. Sharded, the ranks run every forward together:
    each step the machine's ranks exchange their batches (host tensors, through the group's gloo
    side) and run them one after another, each keeping the outputs of its own; the cost per rank is
    that of a replica, the weights per rank 1/ranks of them (the language head is kept whole on
    each rank for the supervision's full-vocabulary statistics: V x H, 2.1 GB for Llama-3.1-70B)."""

    reads_images = True  # image-text rows run through the whole model: the image features in place

    def __init__(
        self,
        target_dir: Path,
        aux_layers: list[int] | str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        mesh=None,
    ):
        self.device = device if isinstance(device, torch.device) else loading.choose_device(device)
        self.dtype = (
            dtype if isinstance(dtype, torch.dtype) else loading.choose_dtype(dtype, self.device)
        )
        config = loading.load_config(target_dir)
        # validated before the (slow) model load
        self.aux_layers = resolve_aux_layers(aux_layers, loading.num_layers(config))
        # flash attention only where packed rows can go to it as offsets (no chunked layers)
        attention = (
            loading.supervision_attention(self.device, self.dtype)
            if Layout.from_config(config).packs_by_positions()
            else None
        )
        self.model = loading.load_model(target_dir, self.device, self.dtype, mesh, attention)
        self.group = (
            None if mesh is None else mesh.get_group()
        )  # the ranks a forward runs on together
        self.decoder = loading.text_decoder(self.model)
        self.final_norm = getattr(self.decoder, "norm", None)
        head = self.model.get_output_embeddings()
        weight = head.weight
        self.lm_head_weight = (
            weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        )  # [V, H]
        self.lm_head_bias = getattr(head, "bias", None)
        text = config.text_config if getattr(config, "num_hidden_layers", None) is None else config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.aux_capture = AuxCapture(self.model, self.aux_layers)
        self.input_capture = InputCapture(self.model)  # on when a field reads the input embeddings
        self.selected = None
        self.layout = Layout.from_config(
            self.model.config
        )  # the attention each layer runs (--pack)
        self.info = describe_target(
            target_dir,
            config,
            (config.architectures or [type(self.model).__name__])[0],
            self.lm_head_weight,
            self.aux_layers,
            self.dtype,
        )

    # ------------------------------------------------------------------ interface
    def get_input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def run_target(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        images: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_hidden [B, T, 3*H], final normed hidden [B, T, H]) in the model's dtype. `images`: the
        rows' image inputs (data.vlm.ImageInputs). Sharded over ranks (`mesh`), every rank of the group
        calls it as often as the others: one with nothing to run passes input_ids None (`idle`) and gets
        None."""
        if self.group is None:
            return self._forward(input_ids, attention_mask, position_ids, seq_lens, images)
        import torch.distributed as dist

        mine = (
            None
            if input_ids is None
            else (
                *(
                    None if t is None else t.cpu()
                    for t in (input_ids, attention_mask, position_ids, seq_lens)
                ),
                images,
            )
        )
        batches = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(batches, mine, group=self.group)  # every rank's batch, in rank order
        me, kept, embeds = dist.get_rank(self.group), None, None
        for r, batch in enumerate(batches):
            if (
                batch is None
            ):  # that rank has nothing to run this time (precompute: its shards are done)
                continue
            out = self._forward(*batch)  # together: each layer's all-reduce spans the ranks
            if r == me:
                kept, embeds = (
                    out,
                    self.input_embeds,
                )  # the others' outputs are dropped as soon as they are made
        self.input_embeds = embeds  # this rank's (each forward overwrote it)
        return kept

    def idle(self) -> None:
        """Take part in the other ranks' forward with no batch of this rank's own (sharded target)."""
        if self.group is not None:
            self.run_target(None, None)

    @torch.no_grad()
    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        images: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = input_ids.to(self.device)
        mask = attention_mask.to(self.device)
        self.input_capture.enabled = self.wants_input_embeds
        aux, last = self._run(input_ids, mask, position_ids, seq_lens, images)
        self.input_embeds = self.input_capture.take()
        return aux, last

    def _run(
        self, input_ids, mask, position_ids, seq_lens, images
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if images is not None:
            if (
                seq_lens is not None
            ):  # packed image rows: the documents' masks and positions, as for text
                mask, position_ids = self._packed_images(input_ids, seq_lens, position_ids, images)
            return self._with_images(input_ids, mask, position_ids, images)
        if (
            seq_lens is not None
        ):  # packed rows: each layer kind's mask per document, positions restart
            self.layout.require(PACKING, "train without --pack (one document per row)")
            masks, doc_positions = self.layout.packed(seq_lens.to(self.device), input_ids.shape[1])
            implementation = self.model.config._attn_implementation or "sdpa"
            if packs_by_positions(
                implementation, self.layout
            ):  # flash attention: one varlen call per layer
                return self._packed_rows(input_ids, seq_lens, doc_positions)
            mask = for_model(masks, implementation, self.dtype, PACKING)
            position_ids = doc_positions if position_ids is None else position_ids.to(self.device)
        elif position_ids is not None:
            position_ids = position_ids.to(self.device)
        self.aux_capture.clear()
        out = self.decoder(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False
        )
        return self.aux_capture.take(out.last_hidden_state), out.last_hidden_state

    def _packed_images(self, input_ids, seq_lens, position_ids, images: dict):
        """(mask, positions) of packed image rows: each document's mask and positions from 0, as text rows
        get them; Gemma 3's images' tokens also see each other both ways (its own mask's rule); for M-RoPE
        (Qwen-VL) each document's (time, height, width) positions as the model places them for that chat
        alone (`_m_rope_positions`). Refused for other per-token types (e.g. PaliGemma's prefix)."""
        what = f"{PACKING} of {IMAGE_ROWS}"
        m_rope = hasattr(self.model.base_model, "get_rope_index")
        blocks = None
        if (
            "token_type_ids" in images
            and getattr(self.model.config, "model_type", "") in BIDIRECTIONAL_IMAGES
        ):
            blocks = image_blocks(
                images["token_type_ids"]
            )  # Gemma 3: an image's tokens see each other both ways
        elif any(k in images for k in TOKEN_TYPE_KEYS if not (m_rope and k == "mm_token_type_ids")):
            raise ConfigError(
                f"{what}: {type(self.model).__name__} masks image tokens by per-token types this "
                "packing does not know",
                "train without --pack",
            )
        self.layout.require(what, "train without --pack (one document per row)")
        implementation = self.model.config._attn_implementation or "sdpa"
        if implementation not in CUSTOM_MASK_ATTENTION:
            raise ConfigError(
                f"{what} needs the documents' masks, which {implementation} does not take",
                "train without --pack, or load the target with sdpa attention",
            )
        masks, doc_positions = self.layout.packed(
            seq_lens.to(self.device), input_ids.shape[1], blocks
        )
        mask = for_model(masks, implementation, self.dtype, what)
        if m_rope:
            doc_positions = self._m_rope_positions(input_ids, seq_lens, images)
        return mask, doc_positions if position_ids is None else position_ids

    def _m_rope_positions(self, input_ids, seq_lens, images: dict) -> torch.Tensor:
        """[3, B, T] M-RoPE positions of packed rows: each document's from the model's own get_rope_index
        on that document alone, with its images' grids (taken in order: an image spans t*h*w / merge^2
        tokens); text-only documents and the padding count 0, 1, 2, ... on all three axes."""
        base = self.model.base_model
        types, grids = images["mm_token_type_ids"], images.get("image_grid_thw")
        merge = getattr(getattr(self.model.config, "vision_config", None), "spatial_merge_size", 1)
        spans = [] if grids is None else (grids.prod(-1) // merge**2).tolist()
        B, T = input_ids.shape
        out = torch.arange(T).expand(3, B, T).clone()
        taken = 0  # images already placed
        for b in range(B):
            start = 0
            for n in [*seq_lens[b].tolist(), T - int(seq_lens[b].sum())]:
                if n <= 0:
                    continue
                doc_types = types[b, start : start + n]
                count, mine = (
                    int((doc_types == 1).sum()),
                    0,
                )  # 1: an image's token (2 would be a video's)
                while count > 0:
                    count -= spans[taken + mine]
                    mine += 1
                if mine:
                    pos, _ = base.get_rope_index(
                        input_ids[b : b + 1, start : start + n].to(self.device),
                        mm_token_type_ids=doc_types[None].to(self.device),
                        image_grid_thw=grids[taken : taken + mine].to(self.device),
                        attention_mask=torch.ones(1, n, dtype=torch.long, device=self.device),
                    )
                    out[:, b, start : start + n] = pos[:, 0].cpu()
                else:
                    out[:, b, start : start + n] = torch.arange(n)
                taken += mine
                start += n
        return out.to(self.device)

    def _with_images(
        self, input_ids, mask, position_ids, images: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model's forward (vision tower, projector, language model): each image's features
        replace its placeholder tokens' embeddings, as the engine computes them when it serves the
        target; positions the model's own (Qwen-VL's M-RoPE reads the image grid)."""
        model = self.model.base_model
        accepted = inspect.signature(model.forward).parameters
        inputs = {
            name: value.to(self.device, self.dtype if value.is_floating_point() else None)
            for name, value in images.items()
            if name in accepted
        }
        if position_ids is not None:
            inputs["position_ids"] = position_ids.to(self.device)
        self.aux_capture.clear()
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=False, **inputs)
        return self.aux_capture.take(out.last_hidden_state), out.last_hidden_state

    def _packed_rows(self, input_ids, seq_lens, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows for an attention that takes no mask: row by row (the varlen call cuts one row),
        each as its documents' offsets and positions restarting per document (padding tokens one each)."""
        aux, last, embeds = [], [], []
        for b in range(input_ids.shape[0]):
            cu, longest = varlen_offsets(seq_lens[b].tolist(), input_ids.shape[1])
            cu = torch.tensor(cu, dtype=torch.int32).to(self.device)
            self.aux_capture.clear()
            out = self.decoder(
                input_ids=input_ids[b : b + 1],
                attention_mask=None,
                position_ids=positions[b : b + 1],
                use_cache=False,
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=longest,
                max_length_k=longest,
            )
            aux.append(self.aux_capture.take(out.last_hidden_state))
            last.append(out.last_hidden_state)
            embeds.append(self.input_capture.take())
        if self.input_capture.enabled:
            self.input_capture.put(torch.cat(embeds))
        return torch.cat(aux), torch.cat(last)

    def close(self) -> None:
        self.aux_capture.close()
        self.input_capture.close()
        self.model = None
