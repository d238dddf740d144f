"""The engine: one base model, many LoRA adapters, continuous batching.

The loop reads like a sentence: `batch = scheduler.schedule(); slots = registry.activate(...);
tokens = runner.run(batch); scheduler.postprocess(batch)`; then outputs are appended, stop
conditions checked and finished requests release their blocks and adapters. With
`EngineConfig.async_scheduling`, steady-state decode steps are launched one ahead of the host's
reading of their tokens instead (worker/engine/async_step.py). What a request gets back, and how
its text becomes deltas, is in worker/engine/outputs.py; the device-dependent settings are resolved in
worker/engine/device_setup.py, and the KV cache is sized in worker/engine/memory_plan.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from lorafleet.worker import envs
from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig
from lorafleet.worker.engine.async_step import AsyncStepper
from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.cuda_graphs import DecodeGraphs, graph_sizes
from lorafleet.worker.engine.device_setup import (
    device_info,
    prefer_blas,
    resolve_device_defaults,
    resolve_dtype,
    resolve_lora_backend,
    resolved_defaults_line,
    want_async_scheduling,
    want_cuda_graphs,
)
from lorafleet.worker.engine.generate import run_to_completion
from lorafleet.worker.engine.memory_plan import free_at_start, log_memory_plan, memory_plan, plan_kv_blocks
from lorafleet.worker.engine.model_runner import LogitsHook, ModelRunner
from lorafleet.worker.engine.outputs import Completion, RequestOutput, TrackedRequest
from lorafleet.worker.engine.parallel import Group, ShardedLoraSlots, leader_dora, start_kv, tp_leader_model
from lorafleet.worker.engine.rank_graphs import lead_graphs
from lorafleet.worker.engine.scheduler import Scheduler, SchedulerConfig
from lorafleet.worker.engine.sequence import SamplingParams, Sequence
from lorafleet.worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from lorafleet.worker.engine.warm_up import warm_up
from lorafleet.worker.layers.attention import resolve_attention_backend
from lorafleet.worker.layers.quant import load_weights, read_quantization_config, resolve_scheme
from lorafleet.worker.lora.adapter import AdapterError
from lorafleet.worker.lora.dora import dora_refusal
from lorafleet.worker.lora.registry import AdapterRegistry
from lorafleet.worker.lora.slots import LoraSlots
from lorafleet.worker.models.dummy import checkpoint_tensors
from lorafleet.worker.models.registry import model_class
from lorafleet.worker.sampling.logits_processors import bad_word_ids
from lorafleet.worker.sampling.sampler import TokenLogprobs
from lorafleet.worker.sampling.structured import Grammars

log = logging.getLogger("lorafleet.engine")


class RequestError(ValueError):
    """A request the engine cannot take (HTTP 400); the message says why, `param` names the field
    at fault where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        tokenizer_dir: str | Path | None = None,
        lora_modules: dict[str, str] | None = None,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        group: Group | None = None,
    ) -> None:
        """`weights` replaces the folder's safetensors (benchmarks build random weights on the GPU);
        they go through the same loading path, by their Hugging Face names. `group`: this process is
        rank 0 of a tensor-parallel group (`config.tensor_parallel_size` > 1; worker/engine/parallel.py)."""
        self.config = config = config or EngineConfig()
        self.model_config = ModelConfig.from_folder(model_dir)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but no CUDA device is available")
        baseline_free = free_at_start(self.device)
        info = device_info(self.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device, info.bf16)
        self.tokenizer = Tokenizer(tokenizer_dir or model_dir)
        self.grammars = Grammars(tokenizer_dir or model_dir, self.model_config.vocab_size)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        # Unset (`lorafleet worker`'s defaults): vLLM's values for this device, logged.
        self.config = resolve_device_defaults(config, info, self.max_model_len)
        line = resolved_defaults_line(config, self.config, info)
        if line is not None:
            log.info(line)
        config = self.config
        # Longer text cannot fit even if every token were the vocabulary's longest: it is refused
        # before tokenizing (20 MB took 20 s to tokenize, only to be refused for its length).
        self.max_prompt_chars = self.max_model_len * self.tokenizer.max_token_chars

        if self.device.type == "cuda":
            prefer_blas(envs.BLAS)
        self.group = group
        if config.tensor_parallel_size > 1:
            self.model = tp_leader_model(self.model_config, model_dir, config, group, self.device, self.dtype,
                                         self.max_model_len, weights)
            self.quantization = resolve_scheme(config.quantization, read_quantization_config(model_dir))[0]
        else:
            self.model = model_class(self.model_config)(self.model_config, self.device, self.dtype, self.max_model_len)
            if weights is None:
                weights = checkpoint_tensors(self.model, self.model_config, model_dir, config.load_format,
                                             self.device, self.dtype)
            self.quantization = load_weights(self.model, weights, config.quantization, read_quantization_config(model_dir))
        self.model.lora_backend = resolve_lora_backend(config.lora_backend, self.device)
        # The LoRA side path beside the base GEMMs on a second stream (linear_lora_deferred);
        # LORAFLEET_LORA_OVERLAP=0 runs it after each GEMM on the main stream (benchmarks compare).
        overlap = envs.LORA_OVERLAP
        if self.model.lora_backend == "triton" and self.device.type == "cuda" and overlap:
            self.model.lora_stream = torch.cuda.Stream(self.device)
        self.model.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        # Before the KV cache takes the GPU's memory.
        self.use_graphs = want_cuda_graphs(config.cuda_graphs, self.device, self.model.attention_backend,
                                           self.model.lora_backend)
        if group is not None:
            self.slots = ShardedLoraSlots(self.model_config, group, config.max_loras, config.max_lora_rank, self.device,
                                          self.dtype)
        else:
            self.slots = LoraSlots(self.model_config, config.max_loras, config.max_lora_rank, self.device, self.dtype)
        self.model.lora = self.slots
        # DoRA's norms need whole base weights: under tensor parallelism every rank takes its part (a collective).
        self.registry = AdapterRegistry(self.model_config, config, self.slots, self.dtype,
                                        base_weight=None if group is not None else self.model.base_weight,
                                        loop_dora=None if group is None else leader_dora(self.model, group,
                                                                                         self.model_config))

        pool_rows = graph_sizes(config.max_num_seqs, config.max_num_batched_tokens, config.max_graph_tokens)[1]
        num_blocks = plan_kv_blocks(config, self.model_config, self.device,
                                    ModelRunner.kv_bytes_per_block(self.model, config.block_size), baseline_free,
                                    pool_rows if self.use_graphs else 0)
        if group is not None:
            start_kv(group, num_blocks, config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.max_loras, config.max_loras_per_request,
                                  config.max_num_seqs)
        if self.use_graphs:
            self.runner.graphs = self._decode_graphs()
        graph_rows = None if self.runner.graphs is None else self.runner.graphs.buckets[-1]
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_loras, config.aging_steps,
                            graph_rows),
            self.blocks,
            adapter_ready=self.registry.on_cpu,
        )
        self._eos_ids = frozenset(self.model_config.eos_token_ids or (
            (self.tokenizer.eos_id,) if self.tokenizer.eos_id is not None else ()))
        self._ids = itertools.count()
        self._tracked: dict[int, TrackedRequest] = {}
        self.logits_hook: LogitsHook | None = None
        self.generated_tokens = 0
        self.steps = 0
        # The server turns this off and reads adapters from disk in a thread (see async_engine.py).
        self.read_adapters_inline = True
        # The step in flight under async scheduling; not under tensor parallelism: its steps feed the
        # tokens sampled on rank 0's device, which the other ranks do not have.
        self.async_steps = AsyncStepper(
            self, group is None and want_async_scheduling(config.async_scheduling, self.runner.graphs is not None,
                                                          self.device))
        if config.async_scheduling and self.runner.graphs is None:
            log.warning("--async-scheduling needs the decode graph path (--cuda-graphs): every step runs synchronously")
        elif config.async_scheduling and group is not None:
            log.warning("--async-scheduling is not run under --tensor-parallel-size > 1: every step runs synchronously")
        for name, path in (lora_modules or {}).items():
            self.load_adapter(name, path, pinned=name in config.pinned_adapters)
        self._log_memory_plan(num_blocks)
        self.warmup_s: float | None = None
        if config.warmup or (config.warmup is None and self.device.type == "cuda"):
            self.warmup_s = self.warm_up()

    # -- setup ---------------------------------------------------------------------------------
    def _decode_graphs(self) -> DecodeGraphs:
        """CUDA graphs on CUDA; on CPU the same padded static-buffer path runs without capture (tests)."""
        capture = self.device.type == "cuda"
        c = self.config
        max_batch, max_rows = graph_sizes(c.max_num_seqs, c.max_num_batched_tokens, c.max_graph_tokens)
        sizes = dict(block_size=self.config.block_size, max_model_len=self.max_model_len, max_batch=max_batch,
                     max_loras=self.config.max_loras, max_loras_per_request=self.config.max_loras_per_request,
                     sink_slot=self.runner.sink_slot, capture=capture, max_rows=max_rows)
        if self.group is not None:  # every rank its own graphs, rank 0 leading (worker/engine/rank_graphs.py)
            return lead_graphs(self.model, self.runner.kv_caches, self.group, sizes)
        return DecodeGraphs(self.model, self.runner.kv_caches, **sizes)

    def _log_memory_plan(self, num_blocks: int) -> None:
        """Log where memory goes, in the seed guide's terms: weights, adapter slots, KV blocks."""
        per_block = ModelRunner.kv_bytes_per_block(self.model, self.config.block_size)
        adapters = {name: w.nbytes for name, w in self.registry.cpu.items()}
        self.memory_plan = memory_plan(self.config, self.model.weight_bytes(), self.slots.nbytes(), adapters,
                                       num_blocks, per_block)
        log_memory_plan(self.memory_plan, self.config, self.device, self.dtype, self.model.lora_backend,
                        self.model.attention_backend, None if self.runner.graphs is None else self.runner.graphs.buckets,
                        {name: self.registry.entries[name].rank for name in adapters})

    # -- adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, pinned: bool = False) -> bool:
        """Validate and register an adapter; True if new, False if already loaded with the same content."""
        weights = self.registry.read(path)  # raises AdapterError before anything is evicted
        _entry, created = self.registry.register(name, weights, pinned=pinned)
        return created

    def unload_adapter(self, name: str) -> None:
        self.registry.unregister(name)

    def warm_up(self) -> float:
        """Run what the first requests would otherwise pay for, then forget it -> seconds taken
        (worker/engine/warm_up.py)."""
        return warm_up(self)

    def forget_history(self) -> None:
        """Forget what has run (nothing may be in flight): finished requests' records, the prefix
        cache, request ids, and the counters the metrics report start again at zero."""
        if self.has_unfinished():
            raise RuntimeError("forget_history with requests in flight")
        self._tracked.clear()
        self.blocks.reset_prefix_cache()
        self.generated_tokens = 0
        self._ids = itertools.count()
        self.registry.stats = type(self.registry.stats)()
        self.scheduler.preempted_total = self.scheduler.deferred_total = 0
        self.async_steps.stats = type(self.async_steps.stats)()

    # -- requests ------------------------------------------------------------------------------
    def check_prompt_chars(self, chars: int) -> None:
        """Raises RequestError for text too long to fit the context, whatever its tokens."""
        if chars > self.max_prompt_chars:
            raise RequestError(
                f"the prompt is {chars} characters long; at most {self.max_prompt_chars} characters can fit "
                f"this model's context of {self.max_model_len} tokens"
            )

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of `prompt`, refused first if it is too long to fit (safe from any thread)."""
        self.check_prompt_chars(len(prompt))
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        adapters: Seq[tuple[str, float]] = (),
    ) -> int:
        """Queue a request; returns its id. Raises RequestError / AdapterNotFound before queueing."""
        sampling = sampling or SamplingParams()
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        for field, named in sampling.named_token_ids().items():
            bad = next((t for t in named if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{field} must be in 0..{vocab - 1}, got token id {bad}", field)
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                f"context length {self.max_model_len}"
            )
        needed_blocks = -(-(len(ids) + sampling.max_tokens) // self.config.block_size)
        if needed_blocks > self.blocks.num_blocks:
            raise RequestError(f"request needs {needed_blocks} KV blocks; the cache holds {self.blocks.num_blocks}")
        adapters = _merge_adapters(adapters)
        if len(adapters) > self.config.max_loras_per_request:
            raise RequestError(
                f"{len(adapters)} adapters requested; this worker allows max_loras_per_request="
                f"{self.config.max_loras_per_request}", "lora_adapters"
            )
        why = dora_refusal(adapters, self.registry.is_dora)
        if why is not None:
            raise RequestError(why, "lora_adapters")
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self._eos_ids)
        if sampling.min_tokens and sampling.allowed_token_ids is not None and stop_ids >= set(sampling.allowed_token_ids):
            raise RequestError("min_tokens: every token in allowed_token_ids is a stop token, so none can be sampled first",
                               "min_tokens")
        bad_ids = bad_word_ids(self.tokenizer, sampling.bad_words)
        if any(t >= vocab for w in bad_ids for t in w):  # a tokenizer may hold more tokens than the model
            raise RequestError(f"bad_words: a word has tokens outside the model's vocabulary (0..{vocab - 1})", "bad_words")
        banned = {w[0] for w in bad_ids if len(w) == 1} | (stop_ids if sampling.min_tokens else set())
        if sampling.allowed_token_ids is not None and banned >= set(sampling.allowed_token_ids):
            raise RequestError("bad_words: every token in allowed_token_ids is banned (a bad word, or a stop token "
                               "before min_tokens)", "bad_words")
        grammar = (None if sampling.constraint is None  # a constraint that does not compile: 400
                   else self.grammars.matcher(sampling.constraint, self._eos_ids, sampling.ignore_eos))
        self.registry.acquire(name for name, _ in adapters)  # raises AdapterNotFound; nothing may raise after it
        # Keyed by registration, not digest: the digest may still be hashing (it is off the load's path).
        salt = "|".join(f"{n}#{self.registry.entries[n].generation}*{s!r}" for n, s in adapters)
        seq = Sequence(seq_id=next(self._ids), prompt_ids=ids, sampling=sampling, adapters=adapters,
                       cache_salt=salt, arrival=time.monotonic(), stop_ids=stop_ids,
                       bad_word_ids=bad_ids, grammar=grammar,
                       grammar_waits=grammar is not None and sampling.constraint_after is not None)
        try:  # a seeded request's generator now: a seed torch refuses fails this request, not a step
            self.runner.generator_for(seq)
        except (RuntimeError, ValueError, OverflowError) as exc:
            self.registry.release(seq.adapter_names)
            raise RequestError(f"seed {sampling.seed} cannot seed a random generator: {exc}", "seed") from None
        self._tracked[seq.seq_id] = TrackedRequest(
            seq, IncrementalDetokenizer(self.tokenizer, ids, seq.sampling.skip_special_tokens))
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        held = self.async_steps.holds(tracked.seq)  # a step in flight still writes its K/V
        self.scheduler.abort(tracked.seq, free=not held)
        if held:
            self.async_steps.free_later(tracked.seq)
        self._release(tracked.seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.async_steps.inflight is not None

    def drain(self) -> list[RequestOutput]:
        """Read the step in flight (async scheduling) without launching another; [] if none."""
        return self.async_steps.drain()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # Adapters of requests still waiting for memory are read from disk here on the offline path;
        # the server reads them in a thread first, so this is a no-op there.
        for seq in list(self.scheduler.waiting) if self.read_adapters_inline else ():
            for name in seq.adapter_names:
                if not self.registry.on_cpu(name):
                    self.registry.ensure_cpu(name)
        outputs = []
        if self.async_steps.inflight is not None:
            outputs = self.async_steps.advance()  # launches the next step, or drains to the sync one
            if self.async_steps.inflight is not None:
                return outputs
        return outputs + self._scheduled_step()

    def _scheduled_step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        for seq in batch.preempted:  # recomputed later: its logit-edit state is rebuilt from its tokens then
            self.runner.logits_processors.forget(seq)
        if not batch:
            return []
        protected = batch.adapters
        slot_of = self.registry.activate(sorted(protected), protected)
        if self.async_steps.eligible(batch):
            return self.async_steps.enter(batch, slot_of)
        sampled = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed + n == len(s)]
        tokens, logprobs = self.runner.run(batch, slot_of, sampled, self.logits_hook)
        self.scheduler.postprocess(batch)
        # Warm the slots for adapters next in line while their requests wait (S-LoRA's prefetch).
        running = self.scheduler.running_adapters()
        self.registry.prefetch(self._next_adapters(running), protected | running)
        self.steps += 1
        outputs = []
        for seq, token, lp in zip(sampled, tokens, logprobs):
            outputs.append(self._append(seq, token, lp))
        return outputs

    def _append(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        tracked = self._tracked[seq.seq_id]
        sp = seq.sampling
        if token < 0:  # the model's logits were not finite for this request (sampling.sample)
            log.warning("request %d: non-finite logits; ending it with finish_reason=error", seq.seq_id)
            return self._finish(seq, tracked, "", "error", [], [])
        seq.output_ids.append(token)
        self.generated_tokens += 1
        reason = None
        stop_token = token in seq.stop_ids
        ended = seq.advance_grammar(token)
        if stop_token or ended:
            reason = "stop"
        elif len(seq.output_ids) >= sp.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        delta, reason = tracked.text_delta(reason, stop_token)
        if reason is not None:
            return self._finish(seq, tracked, delta, reason, [token], [lp] if lp is not None else [])
        return RequestOutput(
            request_id=seq.seq_id, new_token_ids=[token], text_delta=delta, finished=False, finish_reason=None,
            num_prompt_tokens=len(seq.prompt_ids), num_generated=len(seq.output_ids),
            logprobs=[lp] if lp is not None else [], prompt_logprobs=_first_prompt_logprobs(seq),
        )

    def _finish(self, seq: Sequence, tracked: TrackedRequest, delta: str, reason: str, tokens: list[int],
                logprobs: list[TokenLogprobs]) -> RequestOutput:
        held = self.async_steps.holds(seq)  # its row in the step in flight is discarded, blocks kept till then
        self.scheduler.finish(seq, reason, free=not held)
        if held:
            self.async_steps.free_later(seq)
        self._release(seq)
        self._tracked.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=seq.seq_id, new_token_ids=tokens, text_delta=delta, finished=True, finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_ids), num_generated=len(seq.output_ids), logprobs=logprobs,
            prompt_logprobs=_first_prompt_logprobs(seq),
        )

    def _next_adapters(self, exclude: set[str]) -> list[str]:
        """Adapters of waiting requests in queue order (the next to need a slot first)."""
        seen: dict[str, None] = {}
        for seq in self.scheduler.waiting:
            for name, _ in seq.adapters:
                if name not in exclude:
                    seen.setdefault(name, None)
        return list(seen)

    def _release(self, seq: Sequence) -> None:
        self.registry.release(seq.adapter_names)
        self.runner.forget(seq)

    # -- offline API ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str | list[int]],
        sampling: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[Seq[tuple[str, float]]] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion in shared batches; results in prompt order (worker/engine/generate.py)."""
        n = len(prompts)
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * n
        adapter_sets = adapters if adapters is not None else [()] * n
        if len(params) != n or len(adapter_sets) != n:
            raise RequestError("prompts, sampling and adapters must have the same length")
        return run_to_completion(self, prompts, params, adapter_sets)


def _first_prompt_logprobs(seq: Sequence) -> list[TokenLogprobs] | None:
    """The prompt's logprobs (entry i: prompt token i + 1's), on a request's first output only."""
    return seq.prompt_lps if seq.sampling.prompt_logprobs is not None and len(seq.output_ids) <= 1 else None


def _merge_adapters(adapters: Seq[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """Deduplicate names (summing scales): each distinct adapter is one entry and counts once."""
    merged: dict[str, float] = {}
    for name, scale in adapters:
        merged[name] = merged.get(name, 0.0) + float(scale)
    return tuple(merged.items())


__all__ = ["LLMEngine", "RequestError", "AdapterError", "SamplingParams"]
