"""The target during speculative decoding: a transformers causal LM, batch size 1, with a KV cache
(`DynamicCache`) and forward hooks that capture what the draft reads: the outputs of its aux decoder
layers (target/capture.py, the hooks training's target uses; EAGLE-3: three), and for EAGLE-1/2 the
last hidden state after the final norm (a hook on that norm: what lm_head reads, at every position).

Rolling back. A verification appends the root and every drafted token; the rejected ones then leave the
cache. transformers' sliding-window cache layer keeps only its last window - 1 positions, so once a turn
reaches the window it cannot take tokens back (`crop` raises). Verification therefore keeps every layer,
sliding ones too, as a full `DynamicLayer`; the model's own masks (or, for a tree, target/masks.py's, with
each layer kind's rule on the tokens' positions) show each sliding layer only its window, so the logits
are those of the target's own decoding. Per step that costs attention over the whole prefix on sliding
layers too, as on the full ones (linear in the length; memory: the whole prefix per layer). The
target-alone baseline, which never rolls back, keeps the model's own cache.

Tree verification passes a 4D mask [1, 1, n, past + n] per layer kind (one tensor, or a dict keyed by
kind for mixed targets such as Gemma 3), which transformers uses as given. Keeping an accepted tree path
in the cache gathers its positions (they are not contiguous).
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.targets import loading
from spec_cli.targets.capture import AuxCapture, InputCapture
from spec_cli.targets.masks import CUSTOM_MASK_ATTENTION, Layout, for_model

TREE_ATTENTION = CUSTOM_MASK_ATTENTION  # attention implementations that read a custom 4D mask as is


class Target:
    def __init__(
        self,
        model: nn.Module,
        aux_layer_ids: list[int],
        final_hidden: bool = False,
        input_embeds: bool = False,
    ):
        """final_hidden: what the draft reads ends with the final hidden state (EAGLE-1/2); input_embeds:
        and then with the first decoder layer's input (MSD: token embeddings, image features in place)."""
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.aux_capture = AuxCapture(model, self.aux_layer_ids)
        self.input_capture = InputCapture(model) if input_embeds else None
        self._final: list[torch.Tensor] = []
        self._final_hook = None
        if final_hidden:  # the draft reads the target's post-norm last hidden state (EAGLE-1/2)
            norm = getattr(loading.text_decoder(model), "norm", None)
            if norm is None:
                raise ValueError(
                    f"{type(model).__name__} has no final norm to read the draft's feature from"
                )
            self._final_hook = norm.register_forward_hook(
                lambda _m, _i, out: self._final.append(out) if self.capture else None
            )
        self._cache_arg = loading.cache_argument(model)
        self.attn_implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self.layout = Layout.from_config(model.config)

    @property
    def capture(self) -> bool:
        """Off for the target-alone baseline (its aux states are not needed)."""
        return self.aux_capture.enabled

    @capture.setter
    def capture(self, on: bool) -> None:
        self.aux_capture.enabled = on
        if self.input_capture is not None:
            self.input_capture.enabled = on

    def close(self) -> None:
        self.aux_capture.close()
        if self.input_capture is not None:
            self.input_capture.close()
        if self._final_hook is not None:
            self._final_hook.remove()

    # -- cache -----------------------------------------------------------------------------------

    def new_cache(self, rollback: bool = True):
        """rollback: a full layer per decoder layer, so that `keep` can drop rejected tokens (see the
        module docstring); else the model's own cache (sliding layers keep their window only)."""
        from transformers import DynamicCache

        if rollback:
            self.layout.require(
                "speculative decoding (verifying drafts and dropping the rejected ones)",
                "evaluate a target whose layers are all full, sliding or chunked attention",
            )
            return DynamicCache()
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    @staticmethod
    def cache_length(cache) -> int:
        return int(cache.get_seq_length())

    def keep(self, cache, past: int, rows: list[int]) -> None:
        """Keep the first `past` positions and, after them, the rows `rows` (ascending) of the last
        forward, in that order: the accepted path of a verification."""
        new = self.cache_length(cache) - past
        if rows == list(range(len(rows))):  # a prefix of the verified rows (always, for a chain)
            if new > len(rows):
                cache.crop(-(new - len(rows)))  # negative: remove that many (transformers 4 and 5)
            return
        index = torch.tensor(rows, device=self.model.device) + past
        for layer in cache.layers:  # full layers only (new_cache)
            layer.keys = torch.cat([layer.keys[:, :, :past], layer.keys[:, :, index]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :past], layer.values[:, :, index]], dim=2)

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        tree_mask: torch.Tensor | None = None,
        last_only: bool = False,
        images: dict | None = None,
    ):
        """ids, positions [1, n] appended to `cache`; tree_mask [n, past + n] bool (None: causal);
        `images`: a prompt's image inputs (the prefill of an image prompt).
        Returns (logits fp32 [n, V] ([1, V] with last_only), what the draft reads [n, ...] or None: the
        aux layers' outputs, then the final hidden state when asked)."""
        mask = None
        if (
            tree_mask is not None
        ):  # each layer kind's rule on the nodes' positions (target/masks.py)
            mask = for_model(
                self.layout.tree(tree_mask, positions),
                self.attn_implementation,
                self.model.dtype,
                "tree verification (--topk 2 or more)",
            )
        extra = {} if images is None else loading.image_inputs(self.model, images, ids.device)
        # M-RoPE (Qwen-VL): an image prompt's positions come from its images' grids, and the model computes
        # them when given none; every later token sits `delta` past its index (kept with the cache)
        grid = images is not None and hasattr(self.model.base_model, "get_rope_index")
        position_ids = None if grid else positions + getattr(cache, "spec_rope_delta", 0)
        self.aux_capture.clear()
        self._final.clear()
        out = self.model(
            input_ids=ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_arg: cache},
            **extra,
        )
        if grid:
            cache.spec_rope_delta = int(self.model.base_model.rope_deltas.reshape(-1)[0])
        logits = out.logits[0].float()
        if not self.capture:
            return logits, None
        final = self._final[-1] if self._final_hook is not None else None
        aux = self.aux_capture.take(final if final is not None else out.logits)[
            0
        ]  # [n, n_aux * H_t]
        if final is not None:
            aux = torch.cat([aux, final[0].to(aux.dtype)], dim=-1)
        if self.input_capture is not None:
            aux = torch.cat([aux, self.input_capture.take()[0].to(aux.dtype)], dim=-1)
        return logits, aux


def tree_attention(parents: torch.Tensor, past: int) -> torch.Tensor:
    """Mask of one verification: row 0 is the root (the newest committed token), row i + 1 drafted node
    i. Each row attends the `past` cached positions, its ancestors and itself.
    parents [N] (-1 = the root; parents come before children) -> [N + 1, past + N + 1] bool."""
    N = parents.numel()
    tree = torch.eye(N + 1, dtype=torch.bool, device=parents.device)  # [N+1, N+1] ancestor-or-self
    tree[:, 0] = True  # the root is everyone's ancestor
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            tree[i + 1] |= tree[p + 1]  # a node sees what its parent sees
    prefix = torch.ones(N + 1, past, dtype=torch.bool, device=parents.device)
    return torch.cat([prefix, tree], dim=1)
