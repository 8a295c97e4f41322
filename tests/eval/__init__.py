"""Tiny targets and drafts for the spec eval tests, built in memory.

- `peaky_target`: the tiny random Llama of tests/tiny.py with its lm_head scaled up, so its greedy
  continuations have structure (like a trained model's) instead of being near-uniform noise;
- `fitted_draft`: an Eagle3Draft over a subset vocabulary whose lm_head is fitted by least squares to
  the target's next tokens on the target's own greedy text, so it often agrees (multi-token acceptances);
- `OracleDraft`: a draft that proposes a known reference continuation (optionally wrong at chosen token
  indices), for exact acceptance accounting.
"""

from __future__ import annotations

import torch

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3.model import Eagle3Draft

AUX = [1, 3, 4]  # outputs of layers 1, N//2-1, N-4 of the 8-layer tiny target


def peaky_target(path, scale: float = 40.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def make_draft(
    model,
    selected: torch.Tensor | None = None,
    seed: int = 0,
    head_scale: float = 1.0,
    cls=Eagle3Draft,
    aux: list[int] = AUX,
    **kwargs,
) -> Eagle3Draft:
    V = model.config.vocab_size
    selected = torch.arange(V) if selected is None else selected
    config = DraftConfig.from_target(model.config, selected.numel(), aux)
    torch.manual_seed(seed)
    draft = cls(config, **kwargs)
    draft.copy_embeddings(model.get_input_embeddings().weight)
    draft.set_vocab_map(selected)
    with torch.no_grad():
        draft.lm_head.weight.mul_(head_scale)
    return draft.eval()


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (transformers' generate)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def fitted_draft(model, prompts: list[list[int]], n: int = 32, vocab: int = 64) -> Eagle3Draft:
    """A draft over the `vocab` most frequent next tokens of the target's greedy text, lm_head fitted."""
    seqs = torch.tensor([p + greedy(model, p, n) for p in prompts])  # [B, T] (equal prompt lengths)
    out = model(input_ids=seqs, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1] for i in AUX], dim=-1)  # layer outputs [B, T, 3H]
    nxt = out.logits[:, 1:].argmax(-1).flatten()  # slot i (x[i+1], a[i]) predicts x[i+2]
    counts = torch.bincount(nxt, minlength=model.config.vocab_size)
    selected = counts.topk(vocab).indices.sort().values
    draft = make_draft(model, selected)
    feats = draft.norm(draft(seqs[:, 1:], aux[:, :-1])).flatten(0, 1)  # [M, H]
    t2d = torch.full((model.config.vocab_size,), -1)
    t2d[selected] = torch.arange(vocab)
    goal = torch.zeros(feats.shape[0], vocab)
    hit = t2d[nxt] >= 0
    goal[hit, t2d[nxt][hit]] = 10.0
    draft.lm_head.weight.copy_(torch.linalg.lstsq(feats, goal).solution.T)
    return draft


class OracleDraft(Eagle3Draft):
    """Proposes reference[t] for token index t (the state of slot i carries i; slot i predicts token i+2),
    or a decoy at the indices in `wrong`. Its weights still run, so the KV cache is kept as usual.
    Needs the identity vocab map (draft id == target id)."""

    def __init__(
        self, config: DraftConfig, reference: list[int], wrong: frozenset[int] = frozenset()
    ):
        super().__init__(config)
        self.reference = torch.tensor(reference)
        self.wrong = wrong
        self.noise = torch.rand(config.draft_vocab_size, generator=torch.Generator().manual_seed(3))

    def forward_step(self, input_ids, hidden, position_ids, cache, attn_mask=None):
        super().forward_step(input_ids, hidden, position_ids, cache, attn_mask)
        state = torch.zeros(*input_ids.shape, self.config.hidden_size)
        state[..., 0] = position_ids.float()
        return state

    def logits(self, state):
        t = (state[..., 0].long() + 2).clamp_max(len(self.reference) - 1)  # token index predicted
        token = self.reference[t]
        decoy = (token + 1) % self.config.draft_vocab_size
        wrong = torch.tensor([int(i) in self.wrong for i in t.flatten()]).view(t.shape)
        token = torch.where(wrong, decoy, token)
        logits = self.noise.expand(*t.shape, -1).clone()
        return logits.scatter(-1, token[..., None], 10.0)
