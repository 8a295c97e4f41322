"""The aux states a draft reads (EAGLE-3 and P-EAGLE: three), captured with forward hooks on the
chosen decoder layers of a transformers model (the model is never asked for every layer's hidden
states).

Every in-process target uses this one hook: training supervision (`HFTargetBackend`) and decoding
(`eval.target.Target`). Ids are spec_cli's: 0-indexed decoder layer OUTPUTS.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.targets import loading


class AuxCapture:
    """Hooks on the decoder layers `layer_ids` of `model`; `take()` after a forward gives their outputs
    concatenated in the order of `layer_ids`."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self.enabled = (
            True  # off: the hooks keep nothing (a forward whose aux states are not needed)
        )
        self._captured: dict[int, torch.Tensor] = {}
        layers = loading.decoder_layers(model)
        # Layers a forward may skip (Mllama's cross-attention layers, on rows without an image): one that
        # did not run passes its input on unchanged, so its output is the last earlier layer's that ran
        skippable = set(loading.cross_attention_layers(model.config))
        self._fallback = {}
        for i in self.layer_ids:
            j = i
            while j in skippable:
                j -= 1
            if j != i and j >= 0:
                self._fallback[i] = j
        watched = sorted(set(self.layer_ids) | set(self._fallback.values()))
        self._hooks = [layers[i].register_forward_hook(self._hook(i)) for i in watched]

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self.enabled:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def clear(self) -> None:
        self._captured.clear()

    def take(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """The last forward's aux states, [..., len(layer_ids) * H] in the model's dtype, then forgets
        them; `like` (a hidden state of that forward, [..., H]) shapes the empty result of no layers."""
        if not self.layer_ids:  # a draft that reads no intermediate layer (EAGLE-1/2)
            if like is None:
                raise ValueError("AuxCapture of no layers: pass `like` to shape the empty result")
            return like.new_zeros(*like.shape[:-1], 0)
        aux = torch.cat(
            [
                self._captured[i] if i in self._captured else self._captured[self._fallback[i]]
                for i in self.layer_ids
            ],
            dim=-1,
        )
        self._captured.clear()
        return aux

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class InputCapture:
    """A hook on the first decoder layer keeping what it reads: the language model's input embeddings
    (scaled as the model scales them; in a vision-language model each image's features in place of its
    placeholders). Off unless `enabled`; `take()` gives the last forward's [B, T, H] and forgets it."""

    def __init__(self, model: nn.Module):
        self.enabled = False
        self._captured: torch.Tensor | None = None
        first = loading.decoder_layers(model)[0]
        self._hook = first.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, _module, args, kwargs):
        if self.enabled:
            self._captured = args[0] if args else kwargs["hidden_states"]

    def take(self) -> torch.Tensor | None:
        captured, self._captured = self._captured, None
        return captured

    def put(self, embeds: torch.Tensor) -> None:
        """What `take` gives next (a forward made of several, e.g. one per packed row)."""
        self._captured = embeds

    def close(self) -> None:
        self._hook.remove()
