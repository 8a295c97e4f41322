"""The target run by vLLM in this process (`--target-engine vllm`), giving the same TargetBatch as the
transformers backend.

Why not vLLM's own extraction path. vLLM 0.32 extracts hidden states with the speculative method
`extract_hidden_states` (a cache-only "draft" that writes the aux states into its KV cache) and
`ExampleHiddenStatesConnector` (a KV connector that copies them out into a safetensors file per
request). On a CPU build the connector fails: its copy out asks for pinned memory
(`RuntimeError: pin_memory=True requires a CUDA or other accelerator backend; no pinned memory allocator
is available on this system.`), and it copies a request only at the engine step after the one that
finished it, so a prompt-only `generate` leaves a lock file that `load_hidden_states` waits on forever.
It also yields only the aux states, not the final normed state the lm_head reads.

So vLLM's engine runs in-process (the uni executor, spec_cli.engine.vllm) and its model is asked for
what vLLM itself gives an EAGLE-3 draft: `set_aux_hidden_state_layers` makes the model's forward
return (final normed hidden, [aux states]) and this backend's wrapper of that forward keeps them,
placing each token by (request, position) from the model runner's batch. vLLM counts an aux id as the
INPUT of layer i (hidden + residual before it); spec_cli's ids are layer OUTPUTS (docs/eagle.md "Aux
layers"), so spec_cli layer j is vLLM id j + 1. Each row (each document of a packed row: block-causal
with positions restarting per document is the same as separate prompts) is one prompt-only request
(max_tokens=1), so vLLM runs one prefill over it, in chunks when it is long. The lm_head, its final
norm and the input embeddings are read from the engine's own embedding modules (vLLM keeps those
weights; its CPU linears are repacked), and the supervision is computed by the same code as the
transformers backend (LocalTargetBackend).

With `--target-tensor-parallel N` the model runs over N worker processes (vLLM's multiprocessing
executor, tensor_parallel_size N) for a target bigger than one GPU. The same capture then runs inside
each worker (spec_cli/targets/vllm_worker.py, vLLM's worker extension): every rank holds the whole
hidden states after the all-reduce, so rank 0 keeps each request's tokens and hands them back after
the batch, as raw bytes (collective_rpc). The language head and the embedding are put together from
the ranks' vocab shards. Tested against the transformers cache within the same tolerances.

With `capture_prefixes` (spec regenerate --features) the engine keeps vLLM's prefix caching on and every
state any request computes, prefill or decode, is filed by its token prefix (target/prefix_states.py):
`generate` writes answers and keeps their states, and `run_target` then runs each row as a prompt whose
cached blocks vLLM skips, taking those positions' states from what was kept. `cache_salt` (vLLM's
per-request salt of its block hashes) scopes the cache: requests with another salt never hit those blocks.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import torch

from spec_cli.engine import vllm as engine
from spec_cli.engine import vllm_runner
from spec_cli.errors import ConfigError, TargetError
from spec_cli.targets import loading
from spec_cli.targets.hf_backend import LocalTargetBackend, describe_target, resolve_aux_layers
from spec_cli.targets.prefix_states import PrefixStates
from spec_cli.targets.vllm_worker import (
    input_embedding,
    language_model,
    no_embedding,
    step_positions,
    step_rows,
    unpack,
)

_request_ids = itertools.count()
# capture_prefixes: KV blocks of 32 tokens. Prefix caching reuses whole blocks, so a row's positions past
# its last block in common with what was computed run again; vLLM's CPU default is 128 (its CPU
# attention prefers multiples of 32), its GPU default 16.
CAPTURE_BLOCK = 32


def vllm_layer_ids(aux_layers: list[int]) -> tuple[int, ...]:
    """spec_cli aux ids (output of layer j) -> vLLM's eagle_aux_hidden_state_layer_ids (input of j+1)."""
    return tuple(j + 1 for j in aux_layers)


def _rows(
    attention_mask: torch.Tensor, seq_lens: torch.Tensor | None
) -> list[tuple[int, int, int]]:
    """(row, start, length) of each prompt to run: the real tokens of a right-padded row, or each
    document of a packed row."""
    prompts = []
    lengths = attention_mask.long().sum(1).tolist()
    for b, n in enumerate(lengths):
        if not bool(attention_mask[b, :n].all()):
            raise ConfigError(
                "the vLLM target engine needs right-padded rows (real tokens first)",
                "pad on the right, or use --target-engine transformers",
            )
        if seq_lens is None:
            if n:
                prompts.append((b, 0, n))
            continue
        start = 0
        for length in seq_lens[b].tolist():
            if length > 0:
                prompts.append((b, start, int(length)))
                start += int(length)
        if start > attention_mask.shape[1]:
            raise ConfigError(
                f"seq_lens of row {b} add up to {start}, more than the row's "
                f"{attention_mask.shape[1]} positions",
                "check the packing",
            )
    return prompts


def _check_positions(position_ids: torch.Tensor, prompts: list[tuple[int, int, int]]) -> None:
    """vLLM numbers each prompt's positions from 0: other position_ids cannot be honoured."""
    for b, start, length in prompts:
        if not torch.equal(
            position_ids[b, start : start + length].long().cpu(), torch.arange(length)
        ):
            raise ConfigError(
                "the vLLM target engine numbers positions from 0 in each row (or each "
                "packed document); these position_ids differ",
                "drop position_ids, or use --target-engine transformers",
            )


def _place(
    where: tuple[int, int, int],
    pos: torch.Tensor,
    hidden: torch.Tensor,
    aux: torch.Tensor,
    aux_rows: torch.Tensor,
    hidden_rows: torch.Tensor,
) -> None:
    """Put one request's tokens (positions `pos` in its prompt) into its row's slots: prompt tokens
    only (a request's one sampled token is not part of the row)."""
    b, start, length = where
    keep = pos < length
    slots = (start + pos[keep]).to(hidden_rows.device)
    keep = keep.to(hidden.device)
    hidden_rows[b, slots] = hidden[keep].to(hidden_rows.device, hidden_rows.dtype)
    aux_rows[b, slots] = aux[keep].to(aux_rows.device, aux_rows.dtype)


class VLLMTargetBackend(LocalTargetBackend):
    """The target in a vLLM engine; aux states and the final normed state come from vLLM's forward."""

    def __init__(
        self,
        target_dir: Path,
        aux_layers: list[int] | str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        max_model_len: int | None = None,
        memory: float | None = None,
        tensor_parallel: int = 1,
        capture_prefixes: bool = False,
        max_num_seqs: int | None = None,
        seed: int = 0,
        seeded: bool = False,
    ):
        vllm = engine.require("--target-engine vllm")
        if tensor_parallel < 1:
            raise ConfigError(
                f"--target-tensor-parallel {tensor_parallel} must be at least 1",
                "1 runs the target in this process",
            )
        if capture_prefixes and tensor_parallel > 1:
            raise ConfigError(
                "keeping the states of generated answers runs the target in this process",
                "drop --target-tensor-parallel, or run spec precompute on the regenerated data",
            )
        self._vllm = vllm
        self.states = PrefixStates() if capture_prefixes else None
        self.cache_salt: str | None = None  # capture_prefixes: the salt of this backend's requests
        self.row_positions = [0, 0]  # run_target's rows: positions run for them, positions in them
        self.filed = 0
        self.tensor_parallel = int(tensor_parallel)
        from vllm.platforms import current_platform

        self.device = device if isinstance(device, torch.device) else loading.choose_device(device)
        if self.device.type != current_platform.device_type:
            raise ConfigError(
                f"vLLM {engine.version()} here runs on {current_platform.device_type}, not "
                f"--device {self.device}",
                f"pass --device {current_platform.device_type}, or use --target-engine "
                "transformers",
            )
        self.dtype = (
            dtype if isinstance(dtype, torch.dtype) else loading.choose_dtype(dtype, self.device)
        )
        config = loading.load_config(target_dir)
        self.aux_layers = resolve_aux_layers(aux_layers, loading.num_layers(config))
        architecture = (config.architectures or [""])[0]
        ok, why = engine.target_supports_eagle3(architecture)
        if not ok:
            raise TargetError(why, "use --target-engine transformers for this target")
        text = config.text_config if getattr(config, "num_hidden_layers", None) is None else config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self._sampling = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self._sink = None  # (request -> row, aux rows, hidden rows) while a batch runs
        self.engine = engine.Engine(
            target_dir,
            dtype=self.dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=memory,
            tensor_parallel_size=self.tensor_parallel,
            prefix_caching=capture_prefixes,
            max_num_seqs=max_num_seqs,
            seed=seed,
            block_size=CAPTURE_BLOCK if capture_prefixes else None,
            seeded=seeded,
            worker_extension_cls="spec_cli.targets.vllm_worker.CaptureExtension"
            if self.tensor_parallel > 1
            else None,
        )
        try:
            (self._attach_workers if self.tensor_parallel > 1 else self._attach)(
                int(text.vocab_size)
            )
            self.info = describe_target(
                target_dir, config, architecture, self.lm_head_weight, self.aux_layers, self.dtype
            )
        except BaseException:
            self.close()
            raise

    def _attach(self, vocab_size: int) -> None:
        """Reach the engine's model (uni executor: it lives in this process), turn on its aux capture
        and wrap its forward."""
        if (
            self.engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
            and self.states is None
        ):
            raise RuntimeError("prefix caching would skip the forward over cached tokens")
        self._runner = vllm_runner.model_runner(self.engine.llm)
        if self._runner is None:
            raise TargetError(
                "vLLM's engine runs in another process here, so its model cannot be reached",
                "unset VLLM_ENABLE_V1_MULTIPROCESSING (spec_cli runs the engine in this process)",
            )
        vllm_runner.follow_steps(self._runner)
        model = vllm_runner.target_model(self._runner)
        lm = language_model(model)
        # vLLM pads its embedding tables to a multiple of 64 rows; the target's vocab is the first rows
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        if (
            weight is None
            or weight.ndim != 2
            or not weight.is_floating_point()
            or weight.shape[0] < vocab_size
        ):
            raise TargetError(
                f"vLLM's {type(model).__name__} keeps no plain lm_head weight (quantized?)",
                "use --target-engine transformers for this target",
            )
        self.lm_head_weight = weight[:vocab_size].to(self.device)  # [V, H]
        bias = getattr(head, "bias", None)
        self.lm_head_bias = (
            bias[:vocab_size].to(self.device) if isinstance(bias, torch.Tensor) else None
        )
        embed = input_embedding(lm)
        if embed is None:
            raise TargetError(
                no_embedding(model), "use --target-engine transformers for this target"
            )
        self._embed = embed[:vocab_size]
        self.final_norm = getattr(lm, "norm", None)
        # sorted, once each: the order vLLM returns them in; self._order puts them in --aux-layers order
        ids = vllm_layer_ids(self.aux_layers)
        model.set_aux_hidden_state_layers(ids)
        captured = tuple(sorted(set(ids)))
        self._order = [captured.index(i) for i in ids]
        self._model, self._forward = model, model.forward
        model.forward = self._capturing_forward

    def _attach_workers(self, vocab_size: int) -> None:
        """The same with the model over worker processes (spec_cli/targets/vllm_worker.py): the workers
        keep the states, the language head and the embedding come from their vocab shards."""
        llm = self.engine.llm
        weights = llm.collective_rpc("spec_weights")  # one answer per rank, in rank order
        errors = [w["error"] for w in weights if "error" in w]
        if errors:
            raise TargetError(errors[0], "use --target-engine transformers for this target")

        def whole(name):
            parts = [w[name] for w in weights]
            return (
                None
                if parts[0] is None
                else torch.cat([unpack(p) for p in parts])[:vocab_size].to(self.device)
            )

        self.lm_head_weight = whole("lm_head")
        self.lm_head_bias = whole("bias")
        self._embed = whole("embed")
        scale = weights[0]["norm_scale"]
        self.norm_scale = None if scale is None else unpack(scale)
        if self.lm_head_weight.shape[0] < vocab_size:
            raise TargetError(
                f"vLLM's language head has {self.lm_head_weight.shape[0]} rows, the vocab "
                f"{vocab_size}",
                "use --target-engine transformers for this target",
            )
        llm.collective_rpc("spec_attach", args=(list(vllm_layer_ids(self.aux_layers)),))

    def _capturing_forward(self, *args, **kwargs):
        """The engine model's forward: put this step's hidden and aux states of each token into the
        running batch's rows (by request and position), and hand the runner the hidden state alone,
        as it expects."""
        out = self._forward(*args, **kwargs)
        if not isinstance(out, tuple):
            return out
        hidden, aux = out
        if self.states is not None:  # every request's tokens, by prefix
            # one move to the host per step, not one per request (each would be a sync on a GPU); on a
            # CPU this is the engine's own buffer, and PrefixStates.add copies each request's slice
            n = hidden.shape[0]
            host = [t[:n].detach().cpu() for t in (step_positions(args, kwargs), hidden, *aux)]
            for rid, pos, h, a in step_rows(
                self._runner, args, kwargs, host[1], host[2:], self._order, positions=host[0]
            ):
                self.states.add(rid, pos, h, a)
            return hidden
        sink = self._sink
        if sink is not None:
            where, aux_rows, hidden_rows = sink
            for rid, pos, h, a in step_rows(self._runner, args, kwargs, hidden, aux, self._order):
                if rid in where:
                    _place(where[rid], pos, h, a, aux_rows, hidden_rows)
        return hidden

    # ------------------------------------------------------------------ interface
    def get_input_embeddings(self) -> torch.Tensor:
        return self._embed.to(self.device)

    @torch.no_grad()
    def run_target(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_hidden [B, T, 3*H], final normed hidden [B, T, H]) in the model's dtype; zero at
        padding."""
        if getattr(self, "engine", None) is None:
            raise RuntimeError("the vLLM target backend is closed")
        B, T = input_ids.shape
        prompts = _rows(attention_mask.cpu(), None if seq_lens is None else seq_lens.cpu())
        if position_ids is not None:
            _check_positions(position_ids, prompts)
        H = self.info["hidden_size"]
        aux = torch.zeros(B, T, len(self.aux_layers) * H, dtype=self.dtype, device=self.device)
        hidden = torch.zeros(B, T, H, dtype=self.dtype, device=self.device)
        ids = input_ids.long().cpu()
        if self.states is not None:
            self._rows_by_prefix(ids, prompts, aux, hidden)
            return aux, hidden
        llm_engine = self.engine.llm.llm_engine
        where: dict[str, tuple[int, int, int]] = {}  # vLLM request id -> (row, start, length)
        names: list[str] = []
        self._sink = (where, aux, hidden)
        try:
            for b, start, length in prompts:
                names.append(f"spec-target-{next(_request_ids)}")
                try:
                    rid = llm_engine.add_request(
                        names[-1],
                        {"prompt_token_ids": ids[b, start : start + length].tolist()},
                        self._sampling,
                    )
                except Exception as exc:  # noqa: BLE001 (its validation error; e.g. past max_model_len)
                    raise ConfigError(
                        f"vLLM refused a row of {length} tokens: {engine.engine_reason(exc)}",
                        "use a smaller --max-length",
                    ) from exc
                where[rid] = (b, start, length)
            while llm_engine.has_unfinished_requests():
                llm_engine.step()
            if self.tensor_parallel > 1:  # the workers kept them: rank 0 answers
                kept = next(
                    k
                    for k in self.engine.llm.collective_rpc("spec_take", args=(list(where),))
                    if k is not None
                )
                for rid, (pos, h, a) in kept.items():
                    _place(where[rid], unpack(pos), unpack(h), unpack(a), aux, hidden)
        except BaseException:  # an error or Ctrl-C mid-batch: leave no request in the engine
            with contextlib.suppress(Exception):
                llm_engine.abort_request(names)
            raise
        finally:
            self._sink = None
        return aux, hidden

    # ------------------------------------------------------------------ capture_prefixes
    def _submit(
        self, requests: list[tuple[list[int], object]], salt: str | None
    ) -> list[list[int]]:
        """Run (prompt ids, SamplingParams) requests to the end; file every state they computed by its
        prefix -> each request's generated ids."""
        llm_engine = self.engine.llm.llm_engine
        names, rids = [], {}
        done: dict[str, list[int]] = {}
        try:
            for tokens, params in requests:
                names.append(f"spec-target-{next(_request_ids)}")
                prompt = {"prompt_token_ids": list(tokens)}
                if salt is not None:
                    prompt["cache_salt"] = salt
                try:
                    rids[names[-1]] = llm_engine.add_request(names[-1], prompt, params)
                except Exception as exc:  # noqa: BLE001 (its validation error; e.g. past max_model_len)
                    raise ConfigError(
                        f"vLLM refused a prompt of {len(tokens)} tokens: {engine.engine_reason(exc)}",
                        "use a smaller --max-length",
                    ) from exc
            while llm_engine.has_unfinished_requests():
                for out in llm_engine.step():
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
        except BaseException:  # an error or Ctrl-C mid-batch: leave no request in the engine
            with contextlib.suppress(Exception):
                llm_engine.abort_request(list(rids.values()))
            for rid in rids.values():
                self.states.discard(rid)
            raise
        answers = [done.get(name, []) for name in names]
        self.filed = sum(
            self.states.commit(rids[name], list(tokens) + answer)
            for (tokens, _), name, answer in zip(requests, names, answers)
        )
        return answers

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> list[list[int]]:
        """engine.Engine.generate_batch's answers (cut after the first eos, kept, or at max_tokens),
        keeping the states of every prompt and answer token by prefix (capture_prefixes). (Not named
        generate_batch: that is every target backend's TargetBatch.)"""
        if self.states is None:
            raise RuntimeError("generate keeps states: open the backend with capture_prefixes=True")
        params = [
            self._vllm.SamplingParams(
                temperature=float(temperature),
                top_p=float(top_p),
                max_tokens=int(n),
                seed=None if seeds is None else int(seeds[i]),
                stop_token_ids=sorted(eos_ids) or None,
                skip_special_tokens=False,
                detokenize=False,
            )
            for i, n in enumerate(max_tokens)
        ]
        try:
            return self._submit(list(zip(prompts, params)), self.cache_salt)
        except (ConfigError, KeyboardInterrupt):
            raise
        except (
            Exception
        ) as exc:  # e.g. a shape the CPU kernels do not support, found at the first step
            raise TargetError(
                f"vLLM {engine.version()} failed generating: {engine.engine_reason(exc)}",
                "see the engine's reason; SPEC_DEBUG=1 shows vLLM's log",
            ) from exc

    def _rows_by_prefix(
        self,
        ids: torch.Tensor,
        prompts: list[tuple[int, int, int]],
        aux: torch.Tensor,
        hidden: torch.Tensor,
    ) -> None:
        """Each row as a prompt under this backend's salt (vLLM skips its cached blocks), its states
        put together by prefix; a row some position of which nothing kept covers runs again whole, under
        a salt of its own."""
        rows = [ids[b, start : start + length].tolist() for b, start, length in prompts]
        todo = list(range(len(rows)))
        self.row_positions[1] += sum(len(r) for r in rows)
        for salt in (self.cache_salt, f"spec-whole-{next(_request_ids)}"):
            self._submit([(rows[i], self._sampling) for i in todo], salt)
            self.row_positions[0] += self.filed  # positions these rows' own requests ran
            todo = [
                i
                for i in todo
                if self.states.fill(
                    rows[i],
                    hidden[prompts[i][0], prompts[i][1] :],
                    aux[prompts[i][0], prompts[i][1] :],
                )
            ]
            if not todo:
                return
        raise TargetError(
            f"vLLM computed no state for some positions of {len(todo)} row(s), run whole",
            "report it; run spec precompute on the regenerated data meanwhile",
        )

    def close(self) -> None:
        if getattr(self, "states", None) is not None:
            self.states.clear()
        model = self.__dict__.pop("_model", None)
        if model is not None:
            with contextlib.suppress(Exception):
                del model.forward  # back to the class's forward
        self.__dict__.pop("_runner", None)
        self.__dict__.pop("_embed", None)
        eng = self.__dict__.pop("engine", None)
        if eng is not None:
            eng.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
