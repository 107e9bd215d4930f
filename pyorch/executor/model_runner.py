"""The model runner: applies scheduler diffs to its per-request state, builds one step's inputs,
runs the model over the paged KV cache, and samples on the device.

One code path serves CPU and CUDA: the ops dispatch by device.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Optional, Protocol, cast

import numpy as np
import torch
from torch import nn

from pyorch.config import EngineConfig, kv_cache_torch_dtype
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.core_types import LogprobsLists
from pyorch.executor.cascade import min_graph_step_kv_bytes, plan_cascade
from pyorch.executor.cuda_graph import (
    CUDAGraphRunner,
    default_capture_sizes,
    default_max_mixed_size,
    normalize_capture_sizes,
)
from pyorch.executor.input_batch import BlockTable, CachedRequestState, StepBuffers
from pyorch.executor.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheSpec,
    gpu_kv_budget_bytes,
    num_blocks_from_bytes,
)
from pyorch.executor.memory_profile import profile_activation_peak
from pyorch.executor.step import ModelRunnerOutput, StepHandle
from pyorch.forward_context import AttentionMetadata, CascadeMetadata, set_forward_context
from pyorch.layers.attention import Attention
from pyorch.layers.pooler import Pooler, PoolingState
from pyorch.layers.sampler import Sampler, compute_prompt_logprobs, sample_rows
from pyorch.layers.token_bitmask import apply_grammar_bitmask
from pyorch.metrics.stats import StepTimings
from pyorch.structured_output.manager import GrammarOutput
from pyorch.utils import cdiv

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    """What the runner calls on a model (a pyorch.models.registry class, an nn.Module)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


def _step_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 63)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        sched = config.scheduler_config
        self.device = torch.device(self.model_config.device)
        self.block_size = self.cache_config.block_size
        self.max_num_tokens = sched.max_num_batched_tokens
        self.max_num_seqs = sched.max_num_seqs
        if self.model_config.max_model_len is None:
            raise ValueError("ModelRunner needs a resolved ModelConfig: max_model_len is None "
                             "(call ModelConfig.resolve() first)")
        self.max_blocks_per_seq = cdiv(self.model_config.max_model_len, self.block_size)
        self.vocab_size = self.model_config.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        # Held requests that want prompt logprobs (most steps have none: no per-row scan then).
        self._prompt_logprob_req_ids: set[str] = set()
        self.sampler = Sampler()
        # Pooling models: pooled instead of sampled (pyorch/layers/pooler.py), per request.
        self.pooler = (Pooler(self.model_config.pooler_config)
                       if self.model_config.is_pooling and self.model_config.pooler_config
                       else None)
        self._pooling: dict[str, PoolingState] = {}
        self.buffers = StepBuffers(
            self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, self.device.type
            if self.device.type == "cpu" else str(self.device)
        )
        self.model: Optional[nn.Module] = None
        self.attn_layers: list[Attention] = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_graphs: Optional[CUDAGraphRunner] = None
        self._last_step: Optional[StepHandle] = None  # the last step that sampled
        self.block_table = BlockTable(self.max_num_seqs, self.max_blocks_per_seq)
        # Time per phase of the runner's part of each step (EngineCore shares its own).
        self.timings = StepTimings()
        self._cascade_ok = False  # set when the KV cache is bound
        self._kv_bytes_per_token = 0
        self._cascade_graph_kv_bytes = 0
        self._trace_last_end: Optional[torch.cuda.Event] = None

    def release(self) -> None:
        """Drops the model, the KV cache and the CUDA graphs (shutdown), returning their device
        memory to the allocator's pool and the pool to the device; the runner cannot step again."""
        for layer in self.attn_layers:
            layer.kv_cache = None
        self.cuda_graphs = None
        self.kv_caches = []
        self.attn_layers = []
        self.model = None
        self._last_step = None
        self.requests.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def loaded_model(self) -> CausalLM:
        """self.model, once load_model() has run."""
        if self.model is None:
            raise RuntimeError("the model runner has no model yet: call load_model() first")
        # Every model class defines forward(input_ids, positions) and compute_logits(hidden),
        # which nn.Module's type can't show.
        return cast(CausalLM, self.model)

    # ---- start-up -----------------------------------------------------------------------------
    def load_model(self) -> None:
        from pyorch.model_loader import get_model

        start = time.perf_counter()
        if self.device.type == "cuda":
            # An engine dropped without shutdown() (a reference cycle keeps it until the next
            # collection) still holds its weights and KV cache: collect it before this engine
            # loads and sizes its cache from free memory.
            gc.collect()
            torch.cuda.empty_cache()
        torch.manual_seed(self.model_config.seed)
        self.model = get_model(self.model_config)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.attn_layers.sort(key=lambda layer: layer.layer_idx)
        for layer in self.attn_layers:  # the cache's storage format (fp8: e4m3 bytes)
            layer.set_kv_cache_dtype(self.cache_config.cache_dtype)
        logger.info(
            "Loaded %s (%s, %s) in %.2f s",
            self.model_config.model, self.model_config.dtype, self.device,
            time.perf_counter() - start,
        )

    def weight_bytes(self) -> int:
        """Bytes of this runner's model parameters (shared tensors counted once)."""
        params = {p.data_ptr(): p for p in cast(nn.Module, self.loaded_model).parameters()}
        return sum(p.numel() * p.element_size() for p in params.values())

    def kv_cache_spec(self) -> KVCacheSpec:
        mc = self.model_config
        # This rank's KV heads (the attention layers hold the tensor-parallel share).
        num_kv_heads = self.attn_layers[0].num_kv_heads if self.attn_layers else mc.num_kv_heads
        return KVCacheSpec(len(self.attn_layers), self.block_size, num_kv_heads, mc.head_size,
                           kv_cache_torch_dtype(self.cache_config.cache_dtype, mc.dtype))

    def initialize_kv_cache(self) -> int:
        """Sizes the KV cache by measurement (GPU) or by byte budget (CPU), allocates and binds
        it. Returns the number of blocks (including the reserved null block 0)."""
        return self.allocate_kv_cache(self.determine_num_blocks())

    def determine_num_blocks(self) -> int:
        """How many KV blocks this runner's budget holds (with tensor parallelism the executor
        takes the smallest over the ranks and passes it to allocate_kv_cache)."""
        spec = self.kv_cache_spec()
        if self.cache_config.num_blocks is not None:
            num_blocks = self.cache_config.num_blocks
        elif self.cache_config.kv_cache_memory_bytes is not None:
            num_blocks = num_blocks_from_bytes(
                spec, self.cache_config.kv_cache_memory_bytes, "kv_cache_memory_bytes")
        elif self.device.type == "cuda":
            peak = profile_activation_peak(self)
            budget = gpu_kv_budget_bytes(self.device, self.cache_config.gpu_memory_utilization,
                                         peak)
            num_blocks = num_blocks_from_bytes(spec, budget, "the GPU memory left for the KV cache")
        else:
            num_blocks = num_blocks_from_bytes(spec, DEFAULT_CPU_KV_CACHE_BYTES,
                                               "the default CPU KV budget")
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> int:
        """Allocates and binds num_blocks KV blocks (then captures the CUDA graphs)."""
        spec = self.kv_cache_spec()
        self.kv_caches = spec.allocate(num_blocks, self.device)
        for layer, cache in zip(self.attn_layers, self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.cache_config.num_blocks = num_blocks
        # Cascade attention (pyorch/executor/cascade.py) for decode steps over shared prefixes:
        # not for sliding-window layers (a window cuts the prefix per query position).
        self._kv_bytes_per_token = spec.bytes_per_block // self.block_size
        self._cascade_graph_kv_bytes = min_graph_step_kv_bytes(len(self.attn_layers),
                                                               self.weight_bytes())
        self._cascade_ok = (not self.model_config.disable_cascade_attn and bool(self.attn_layers)
                            and not any(layer.sliding_window for layer in self.attn_layers))
        tokens = (num_blocks - 1) * self.block_size
        max_model_len = self.model_config.max_model_len
        assert max_model_len is not None  # checked in __init__
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB), %d tokens; maximum concurrency for "
            "%d-token requests: %.2fx",
            num_blocks, self.block_size, num_blocks * spec.bytes_per_block / 2**30, tokens,
            max_model_len, tokens / max_model_len,
        )
        if self.device.type == "cuda" and not self.model_config.enforce_eager:
            self.capture_model()
        return num_blocks

    def capture_model(self) -> None:
        """Captures the forward pass as CUDA graphs (after the KV cache is bound: the graphs
        hold its addresses)."""
        sched = self.config.scheduler_config
        sizes = self.model_config.cuda_graph_sizes
        max_mixed = None
        if sizes is None:
            sizes = default_capture_sizes(self.max_num_seqs, self.max_num_tokens)
            max_mixed = default_max_mixed_size(self.max_num_seqs)
        sizes = normalize_capture_sizes(sizes, self.max_num_tokens)
        if not sizes:
            return
        runner = CUDAGraphRunner(self.loaded_model, sizes, self.max_num_seqs, sched.max_model_len,
                                 self.device, max_mixed_size=max_mixed)

        def inputs_for(size: int, num_seqs: int) -> dict[str, torch.Tensor]:
            layout = self.buffers.layout(size, num_seqs, self.max_blocks_per_seq)
            views = self.buffers.device_views(layout)
            views["block_table"] = views["block_table"].view(num_seqs, self.max_blocks_per_seq)
            return views

        runner.capture(inputs_for)
        self.cuda_graphs = runner

    # ---- one step -----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.block_table.release(state.table_row, len(state.block_ids))
                self._prompt_logprob_req_ids.discard(req_id)
                self._pooling.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
            state = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids), sampling_params=params,
                generator=generator, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            state.table_row = self.block_table.acquire()
            self.block_table.append(state.table_row, 0, state.block_ids)
            self.requests[new.req_id] = state
            if params.prompt_logprobs is not None:
                self._prompt_logprob_req_ids.add(new.req_id)
            if new.pooling_params is not None:
                if self.pooler is None:
                    raise ValueError(f"request {new.req_id}: pooling needs runner='pooling'")
                self._pooling[new.req_id] = self.pooler.new_state(
                    new.pooling_params, len(new.prompt_token_ids))
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[req_id]
            if new_blocks:
                self.block_table.append(state.table_row, len(state.block_ids), new_blocks)
                state.block_ids.extend(new_blocks)
            state.num_computed_tokens = num_computed

    def _prepare_inputs(
        self, req_ids: list[str], so: SchedulerOutput, graph_size: Optional[int] = None
    ) -> tuple[dict[str, torch.Tensor], AttentionMetadata, torch.Tensor, list[int]]:
        """Packs the step's inputs into the pinned host buffer and copies them to the device.

        Vectorized over the batch: positions, slot mapping, block table, sequence lengths and
        the sampled rows come from a few numpy operations on per-row arrays; only the input ids
        are gathered row by row (one scalar per decode row).

        With graph_size, the layout is the one the CUDA graph of that size reads: graph_size
        tokens, min(graph_size, max_num_seqs) sequences, full-width block table, and the padding
        made inert (no KV written, no query rows)."""
        num_tokens = so.total_num_scheduled_tokens
        num_seqs = len(req_ids)
        states = [self.requests[r] for r in req_ids]
        sched = so.num_scheduled_tokens
        # Python lists for the per-row loop below, numpy arrays for the vectorized part.
        n_list = [sched[r] for r in req_ids]
        start_list = [st.num_computed_tokens for st in states]
        known_list = [st.num_tokens for st in states]
        n = np.array(n_list, dtype=np.int64)
        start = np.array(start_list, dtype=np.int64)
        known = np.array(known_list, dtype=np.int64)
        pending = np.fromiter((st.num_pending for st in states), np.int64, num_seqs)
        rows = np.fromiter((st.table_row for st in states), np.int64, num_seqs)
        end = start + n
        used_width = max(len(st.block_ids) for st in states)
        plan = None
        gathered = None  # the step's block-table rows at used_width, when already gathered
        if self._cascade_ok and num_tokens == num_seqs:  # decodes only
            gathered = self.block_table.table[rows, :used_width]
            plan = plan_cascade(gathered, end, self.block_size, self._kv_bytes_per_token,
                                self._cascade_graph_kv_bytes if graph_size is not None else 0)
            if plan is not None:
                graph_size = None  # a cascade step runs eagerly (its shapes vary per step)
        if graph_size is None:
            width = used_width
            pad_tokens, pad_seqs = num_tokens, num_seqs
        else:
            assert self.cuda_graphs is not None  # a graph size comes from the captured graphs
            width = self.max_blocks_per_seq
            pad_tokens, pad_seqs = graph_size, self.cuda_graphs.num_seqs_for(graph_size)
        cascade_sizes = None
        if plan is not None:
            cascade_sizes = (len(plan.perm), plan.num_groups, plan.prefix_block_table.size)
        layout = self.buffers.layout(pad_tokens, pad_seqs, width, cascade_sizes)
        host = self.buffers.host_views(layout)
        table = host["block_table"].reshape(pad_seqs, width)
        # Rows hold zeros past each request's blocks (see BlockTable.release).
        table[:num_seqs] = (gathered if gathered is not None and width == used_width
                            else self.block_table.table[rows, :width])

        cu = np.cumsum(n)
        offsets = cu - n
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(offsets - start, n)
        token_rows = np.repeat(rows, n)
        bs = self.block_size
        host["positions"][:num_tokens] = positions
        host["slot_mapping"][:num_tokens] = (
            self.block_table.table[token_rows, positions // bs].astype(np.int64) * bs
            + positions % bs)
        host["seq_lens"][:num_seqs] = end
        host["query_start_loc"][0] = 0
        host["query_start_loc"][1 : num_seqs + 1] = cu
        sampled = end == known + pending  # caught up: these rows sample a token
        if self._pooling:  # pooling rows never sample (the runner pools them instead)
            sampled &= np.fromiter((st.req_id not in self._pooling for st in states), bool,
                                   num_seqs)
        sampled_rows = np.flatnonzero(sampled)
        num_logits = len(sampled_rows)
        host["logits_indices"][:num_logits] = cu[sampled_rows] - 1

        pending_dst, pending_src = self._gather_input_ids(
            host["input_ids"], states, start_list, n_list, known_list, offsets.tolist())
        num_pending = len(pending_dst)
        host["pending_dst"][:num_pending] = pending_dst
        host["pending_src"][:num_pending] = pending_src
        if pad_tokens > num_tokens:
            host["input_ids"][num_tokens:] = 0
            host["positions"][num_tokens:] = 0
            host["slot_mapping"][num_tokens:] = -1
        if pad_seqs > num_seqs:
            host["query_start_loc"][num_seqs + 1 :] = num_tokens
            host["seq_lens"][num_seqs:] = 0
            table[num_seqs:] = 0
        if plan is not None:
            host["cascade_perm"][:] = plan.perm
            host["prefix_query_start_loc"][:] = plan.prefix_query_start_loc
            host["prefix_seq_lens"][:] = plan.prefix_seq_lens
            host["prefix_block_table"][:] = plan.prefix_block_table.ravel()
            host["suffix_seq_lens"][:] = plan.suffix_seq_lens
            host["suffix_block_table"][:] = plan.suffix_block_table.ravel()
        dev = self.buffers.to_device(layout)
        if num_pending:
            # Pending tokens come from the last step's samples (_gather_input_ids checked it).
            assert self._last_step is not None and self._last_step.sampled_device is not None
            src = self._last_step.sampled_device.index_select(0, dev["pending_src"][:num_pending])
            dev["input_ids"].index_copy_(0, dev["pending_dst"][:num_pending], src)
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"], query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"], block_table=dev["block_table"].view(pad_seqs, width),
            max_query_len=int(n.max()), max_seq_len=int(end.max()),
        )
        if plan is not None:
            meta.cascade = CascadeMetadata(
                perm=dev["cascade_perm"],
                prefix_query_start_loc=dev["prefix_query_start_loc"],
                prefix_seq_lens=dev["prefix_seq_lens"],
                prefix_block_table=dev["prefix_block_table"].view(
                    plan.prefix_block_table.shape),
                prefix_max_query_len=plan.max_group_size,
                prefix_max_seq_len=int(plan.prefix_seq_lens.max()),
                suffix_seq_lens=dev["suffix_seq_lens"],
                suffix_block_table=dev["suffix_block_table"].view(num_seqs, width),
                suffix_max_seq_len=int(plan.suffix_seq_lens.max()),
            )
        return dev, meta, dev["logits_indices"][:num_logits], sampled_rows.tolist()

    def _gather_input_ids(self, input_ids: np.ndarray, states: list[CachedRequestState],
                          start_list: list[int], n_list: list[int], known_list: list[int],
                          offsets: list[int]) -> tuple[list[int], list[int]]:
        """Writes each row's known input tokens into input_ids ([num_tokens] host view); returns
        (destination index, last-step sampler row) of the tokens still in flight, which the
        device copies from the last step's samples."""
        last_rows = self._last_step.sampled_row_of if self._last_step is not None else {}
        pending_dst: list[int] = []
        pending_src: list[int] = []
        for st, a, num, k, o in zip(states, start_list, n_list, known_list,
                                       offsets, strict=True):
            b = a + num
            if num == 1 and b <= k:  # a decode row whose input token is known
                input_ids[o] = st.token_ids[a]
                continue
            m = min(b, k)
            if m > a:
                input_ids[o : o + m - a] = st.token_ids[a:m]
            if b > m:
                # The one token still in flight: the last step's sample, copied on the device.
                src = last_rows.get(st.req_id)
                if b - m != 1 or st.num_pending != 1 or src is None:
                    raise RuntimeError(
                        f"request {st.req_id}: positions [{m}, {b}) are not known to the "
                        f"runner ({st.num_pending} pending)")
                pending_dst.append(o + m - a)
                pending_src.append(src)
        return pending_dst, pending_src

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput,
                grammar: Optional[GrammarOutput] = None) -> ModelRunnerOutput:
        """Runs one step and waits for its tokens (the synchronous engine's step)."""
        return self.resolve(self.execute_model(so, grammar))

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput,
                      grammar: Optional[GrammarOutput] = None) -> "StepHandle":
        """Applies the diff, launches the step (forward, sampling, the tokens' copy to the host)
        and returns without waiting for the device: `resolve` gives the tokens. `grammar` holds
        the token bitmask rows of the constrained requests that sample this step.

        A request may be scheduled before the token of the previous step is known (async
        scheduling): its input for that position is the previous step's sample, copied on the
        device, so the previous step need not be resolved first (steps run in stream order)."""
        start = time.perf_counter()
        # (A step with nothing scheduled only delivers finished ids: no device work to trace.)
        trace = (self._trace_start(so, start)
                 if self.timings.trace is not None and so.total_num_scheduled_tokens else None)
        self._update_states(so)
        req_ids = [r for r in so.scheduled_cached_reqs.req_ids] + [
            n.req_id for n in so.scheduled_new_reqs
        ]
        if not req_ids:
            self.timings.prepare += time.perf_counter() - start
            return StepHandle(req_ids=[], sampled_rows=[])
        graph_size = None
        decode_only = so.total_num_scheduled_tokens == len(req_ids)
        if self.cuda_graphs is not None:
            graph_size = self.cuda_graphs.padded_size(so.total_num_scheduled_tokens, decode_only)
        dev, meta, logits_indices, sampled_rows = self._prepare_inputs(req_ids, so, graph_size)
        if meta.cascade is not None:
            graph_size = None  # _prepare_inputs laid the step out for an eager run
            self.timings.cascade_steps += 1
        launched = time.perf_counter()
        self.timings.prepare += launched - start
        if graph_size is not None:
            assert self.cuda_graphs is not None  # graph_size came from it
            hidden = self.cuda_graphs.replay(graph_size, decode_only)
        else:
            with set_forward_context(meta):
                hidden = self.loaded_model(dev["input_ids"], dev["positions"])

        handle = StepHandle(req_ids=req_ids, sampled_rows=sampled_rows,
                            prompt_logprobs=self._prompt_logprobs(req_ids, so, hidden),
                            trace=trace,
                            pooled=self._pool(req_ids, so, hidden) if self._pooling else {})
        if sampled_rows:
            # The model's dtype: the sampler upcasts only where it needs float32.
            logits = self.loaded_model.compute_logits(hidden[logits_indices])
            if grammar is not None:
                apply_grammar_bitmask(logits, [req_ids[i] for i in sampled_rows], grammar)
            states = [self.requests[req_ids[i]] for i in sampled_rows]
            for s in states:
                if s.generator is not None:
                    # Seeded streams are keyed by (seed, output index): the same seed gives the
                    # same tokens whatever else is batched, and after a preemption too.
                    seed = s.sampling_params.seed
                    assert seed is not None  # only seeded requests get a generator
                    s.generator.manual_seed(_step_seed(seed,
                                                       len(s.output_token_ids) + s.num_pending))
            out = sample_rows(self.sampler, logits, [s.sampling_row for s in states])
            handle.sampled_device = out.sampled_token_ids
            handle.sampled_row_of = {req_ids[i]: j for j, i in enumerate(sampled_rows)}
            handle.to_host(out.sampled_token_ids, out.logprobs)
            for s in states:
                s.num_pending += 1
            self._last_step = handle
        if trace is not None:
            trace["end"].record()
            trace["graph_size"] = graph_size
        self.timings.launch += time.perf_counter() - launched
        return handle

    def _trace_start(self, so: SchedulerOutput, now: float) -> Optional[dict[str, Any]]:
        """A step's `StepTimings.trace` record, with CUDA events around its device work (the
        record is appended when the step is resolved). None off CUDA."""
        if self.device.type != "cuda":
            return None
        t = self.timings
        record = {"t_s": now, "num_tokens": so.total_num_scheduled_tokens,
                  "num_rows": len(so.num_scheduled_tokens),
                  "decode_only": so.total_num_scheduled_tokens == len(so.num_scheduled_tokens),
                  "host_total_s": sum(getattr(t, k) for k in t.PHASES if k != "wait"),
                  "wait_total_s": t.wait,
                  "phase_s": {k: getattr(t, k) for k in t.PHASES if k != "wait"},
                  "alloc_retries_total": torch.cuda.memory_stats(self.device).get(
                      "num_alloc_retries", 0),
                  "start": torch.cuda.Event(enable_timing=True),
                  "end": torch.cuda.Event(enable_timing=True)}
        if t.gc_pauses is not None:
            record["gc_total_s"] = t.gc_pauses.total_s
            record["gc_full_total"] = t.gc_pauses.full_collections
        record["start"].record()
        return record

    def _trace_finish(self, record: dict[str, Any]) -> None:
        """Turns a resolved step's events into milliseconds and appends its record."""
        start, end = record.pop("start"), record.pop("end")
        end.synchronize()
        record["device_ms"] = start.elapsed_time(end)
        if self.timings.trace:  # device idle between the last traced step and this one
            assert self._trace_last_end is not None
            record["idle_before_ms"] = max(self._trace_last_end.elapsed_time(start), 0.0)
        self._trace_last_end = end
        if self.timings.trace is not None:
            self.timings.trace.append(record)

    def resolve(self, handle: "StepHandle") -> ModelRunnerOutput:
        """Waits for a launched step's tokens and appends them to the runner's requests."""
        req_ids, sampled_rows = handle.req_ids, handle.sampled_rows
        logprobs: list[Optional[LogprobsLists]] = [None] * len(req_ids)
        if not sampled_rows:
            if handle.trace is not None:
                self._trace_finish(handle.trace)
            return ModelRunnerOutput(req_ids, [[] for _ in req_ids], logprobs,
                                     handle.prompt_logprobs, handle.pooled_to_host())
        start = time.perf_counter()
        token_ids, entries = handle.wait()
        self.timings.wait += time.perf_counter() - start
        if handle.trace is not None:
            self._trace_finish(handle.trace)
        if len(sampled_rows) == len(req_ids):  # every row sampled: sampled_rows is 0, 1, ...
            sampled = [[t] for t in token_ids]
        else:
            sampled = [[] for _ in req_ids]
            for j, i in enumerate(sampled_rows):
                sampled[i] = [token_ids[j]]
        get_state = self.requests.get
        for j, i in enumerate(sampled_rows):
            state = get_state(req_ids[i])
            if state is None:  # dropped (finished, aborted, preempted) while in flight
                continue
            state.num_pending -= 1
            state.append_token(token_ids[j])
            if entries is not None and state.sampling_params.logprobs is not None:
                logprobs[i] = entries.slice(j, j + 1)
        return ModelRunnerOutput(req_ids, sampled, logprobs, handle.prompt_logprobs,
                                 handle.pooled_to_host())

    def _pool(self, req_ids: list[str], so: SchedulerOutput,
              hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Folds this step's hidden rows of pooling requests into their states; returns the
        pooled output of each request whose prompt this step finished."""
        assert self.pooler is not None  # _pooling holds states only with a pooler
        result: dict[str, torch.Tensor] = {}
        offset = 0
        for req_id in req_ids:
            n = so.num_scheduled_tokens[req_id]
            pooling = self._pooling.get(req_id)
            if pooling is not None:
                start = self.requests[req_id].num_computed_tokens
                pooled = self.pooler.update(pooling, hidden[offset : offset + n], start)
                if pooled is not None:  # done: the state (and its sums) can go now
                    result[req_id] = pooled
                    del self._pooling[req_id]
            offset += n
        return result

    def _prompt_logprobs(self, req_ids: list[str], so: SchedulerOutput,
                         hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of each next prompt token for requests that asked for prompt_logprobs."""
        result: dict[str, LogprobsLists] = {}
        if not self._prompt_logprob_req_ids:
            return result
        offset = 0
        for req_id in req_ids:
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            num_prompt_logprobs = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            # positions p in [start, start+n) whose next token is still a prompt token
            stop = min(start + n, state.num_prompt_tokens - 1)
            if num_prompt_logprobs is not None and stop > start:
                logits = self.loaded_model.compute_logits(
                    hidden[offset : offset + (stop - start)])
                targets = torch.as_tensor(state.token_ids[start + 1 : stop + 1],
                                          device=logits.device)
                result[req_id] = compute_prompt_logprobs(
                    logits, targets, num_prompt_logprobs).tolists()
            offset += n
        return result
