"""Turns a SchedulerOutput into tensors, moves KV blocks, runs the model, samples.

The only part of the engine that touches tensors. It never decides policy: the scheduler says
which tokens to compute and which blocks to swap or copy; the runner does exactly that.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from pydaemon.config.lora import LoRAAdapterConfig
from pydaemon.config.runner import RunnerConfig
from pydaemon.core.kv_groups import KVGroups, kv_groups
from pydaemon.core.model_info import RunnerInfo
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.attention import PagedAttention, uses_kernels
from pydaemon.layers.attention_metadata import AttentionMetadata, to_device
from pydaemon.lora_request import LoRARequest
from pydaemon.model_loader.loader import load_model
from pydaemon.models.pipeline import pp_layer_range
from pydaemon.quantization.kv_cache_fp8 import is_fp8, resolve_kv_cache_dtype
from pydaemon.worker.async_output import AsyncModelRunnerOutput
from pydaemon.worker.cuda_graph_inputs import cuda_graph_plan
from pydaemon.worker.cuda_graphs import CUDAGraphRunner, capture_all, measure_graph_memory
from pydaemon.worker.draft_model import DraftModelProposer
from pydaemon.worker.eagle_proposer import EagleProposer
from pydaemon.worker.input_batch import InputBatch, StepInput
from pydaemon.worker.kv_cache import GiB, KVCacheSpec, LayerSlotCache
from pydaemon.worker.kv_host_pool import build_host_kv
from pydaemon.worker.kv_scale_calibration import KVScales
from pydaemon.worker.kv_transfer import KVTransfer
from pydaemon.worker.lora_manager import LoRAManager, make_lora_manager
from pydaemon.worker.prompt_logprobs import (
    PromptLogprobsPlan,
    plan_prompt_logprobs,
    prompt_logprobs,
)
from pydaemon.worker.spec_decoder import SpecDecoder, VerifyPlan
from pydaemon.worker.step_sampler import StepSampler

logger = logging.getLogger(__name__)


@dataclass
class _PendingSample:
    """A step launched by ``execute_model``, awaiting ``sample_tokens``."""

    scheduler_output: SchedulerOutput
    step: StepInput | None  # None: the step ran no sequence
    logits: torch.Tensor | None  # [num_sampled_rows, vocab] float32; None on ranks > 0
    verify: VerifyPlan | None
    hidden: torch.Tensor | None = None  # [>= num_tokens, hidden_size], for EAGLE heads
    # Prompt logprobs: the rows asked for and their logits (None on ranks > 0)
    prompt: tuple[PromptLogprobsPlan, torch.Tensor | None] | None = None


def resolve_device(device: str, local_rank: int | None = None) -> torch.device:
    """``local_rank``: this rank's CUDA device index on its host (model parallel: cuda:i);
    None for a lone rank (plain "cuda")."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    if device == "cuda" and local_rank is not None:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"this rank runs on CUDA device {local_rank}, but torch sees "
                f"{torch.cuda.device_count()} device(s) on this host"
            )
        return torch.device("cuda", local_rank)
    return torch.device(device)


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        if (ps.get_tp_world_size(), ps.get_pp_world_size()) != (
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
        ):
            raise RuntimeError(
                f"this process is a rank of a model-parallel group of TP {ps.get_tp_world_size()}"
                f" x PP {ps.get_pp_world_size()}, but the config asks for TP "
                f"{config.tensor_parallel_size} x PP {config.pipeline_parallel_size}: shut the "
                "other engine down first"
            )
        local_rank = ps.get_local_rank() if ps.get_world_size() > 1 else None
        self.device = resolve_device(config.device, local_rank)
        started = time.monotonic()
        logger.info("loading the weights of %s on %s", config.model, self.device)
        self.model, self.model_config = load_model(
            config.model,
            dtype=config.dtype,
            device=self.device,
            load_format=config.load_format,
            seed=config.seed,
            quantization=config.quantization,
        )
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        logger.info(
            "weights loaded in %.1f s: %.3gM parameters (%s)",
            time.monotonic() - started,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            str(self.dtype).removeprefix("torch."),
        )
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.vocab_size = mc.vocab_size
        default_budget = max(4096 if self.device.type == "cuda" else 512, config.max_num_seqs)
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_budget
        # LoRA wrappers go in before the memory profile and the graphs, which include them.
        self.lora_manager = make_lora_manager(self.model, config, self.max_num_batched_tokens)
        # Pipeline parallel: this stage's layers only.
        start, end = pp_layer_range(mc.num_hidden_layers, ps.get_pp_rank(), ps.get_pp_world_size())
        # Windowed and global layers mixed: a block holds num_slots layers, one table per
        # group (core/kv_groups.py; runner_info tells the scheduler).
        self.kv_groups = kv_groups(mc, config)
        if self.kv_groups is not None:
            assign_kv_groups(self.model, self.kv_groups)
        self.spec = KVCacheSpec(
            num_layers=end - start if self.kv_groups is None else self.kv_groups.num_slots,
            num_kv_heads=mc.num_key_value_heads // config.tensor_parallel_size,  # this rank's
            block_size=config.block_size,
            head_dim=mc.head_dim,
            dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype),
        )
        self.kv_scales: KVScales | None = None
        if is_fp8(self.spec.dtype):
            model_dir = None if config.load_format == "dummy" else config.model
            self.kv_scales = KVScales(
                self.model,
                model_dir,
                config.calculate_kv_scales,
                layer_range=(start, end, mc.num_hidden_layers),
            )
        # Speculative decoding's draft model or EAGLE head: its weights before sizing.
        self.draft: DraftModelProposer | EagleProposer | None = None
        spec = config.speculative
        if spec is not None and spec.method == "draft_model":
            self.draft = DraftModelProposer(config, self.device, self.vocab_size)
        elif spec is not None and spec.method == "eagle":
            self.draft = EagleProposer(config, self.device, self.model, mc)
        self.num_gpu_blocks = config.num_kv_blocks or self._profile_num_blocks()
        if self.draft is not None and not config.num_kv_blocks:  # its cache takes a share
            target_bytes, draft_bytes = self.spec.block_bytes, self.draft.kv_spec.block_bytes
            self.num_gpu_blocks = self.num_gpu_blocks * target_bytes // (target_bytes + draft_bytes)
        # Model parallel: one block manager drives every rank, so all hold as many blocks.
        self.num_gpu_blocks = ps.min_across_ranks(self.num_gpu_blocks)
        max_useful = (  # every layer group has a table per sequence
            config.max_num_seqs
            * math.ceil(self.max_model_len / config.block_size)
            * self.num_groups
            + 1
        )
        self.kv_cache = self.spec.allocate(self.num_gpu_blocks, self.device)
        # The CPU pool (swap space + the CPU tier) and the disk tier (kv_host_pool.py).
        self.host_kv = build_host_kv(
            config,
            self.spec,
            max_useful,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.kv_groups,
        )
        self.num_cpu_blocks = self.host_kv.num_cpu_blocks
        self.cpu_kv_cache = self.host_kv.cpu_kv_cache
        self.input_batch = InputBatch(
            config.max_num_seqs, self.max_model_len, config.block_size, self.num_groups
        )
        self.step_sampler = StepSampler(self.input_batch, self.device)
        self.spec_decoder = None
        if spec is not None:
            if self.draft is not None:
                self.draft.allocate_cache(self.num_gpu_blocks)
            self.spec_decoder = SpecDecoder(spec, self.input_batch, self.step_sampler, self.draft)
        self._last_output: AsyncModelRunnerOutput | None = None  # the previous step's
        self._pending: _PendingSample | None = None  # launched, not sampled yet
        self.kv_transfer = KVTransfer(
            self.kv_cache, self.cpu_kv_cache, self.host_kv.disk, uses_kernels(self.kv_cache)
        )
        # Decode (and verify) graphs hold the real cache's pointers: captured after it exists (their memory
        # was kept out of the cache's budget by _profile_num_blocks).
        self.cuda_graphs: CUDAGraphRunner | None = None
        self._graphs_to_capture: CUDAGraphRunner | None = None  # after the KV scales' step
        plan = cuda_graph_plan(
            config, self.model_config, self.kv_cache, self.max_model_len, self.num_groups
        )
        if plan is not None:
            if self.spec_decoder is not None and plan.verify_query_lens:
                self.spec_decoder.pad_drafts = True  # decode steps with drafts: graph shapes
            graphs = CUDAGraphRunner(self.model, self.kv_cache, plan, self._model_cache())
            if self.kv_scales is not None and self.kv_scales.is_pending:
                self._graphs_to_capture = graphs  # graphs bake the KV scales in: not yet
            else:
                self.cuda_graphs = self._capture(graphs)
        logger.info(
            "KV cache: %d blocks of %d tokens on %s (%s, %.2f GiB), %d swap blocks on the CPU",
            self.num_gpu_blocks,
            config.block_size,
            self.device,
            self.spec.dtype,
            self.num_gpu_blocks * self.spec.block_bytes / GiB,
            self.host_kv.num_swap_blocks,
        )
        if self.host_kv.num_cpu_tier_blocks:
            logger.info(
                "KV tiers: %d CPU-tier blocks (%.2f GiB on this rank)%s",
                self.host_kv.num_cpu_tier_blocks,
                self.host_kv.num_cpu_tier_blocks * self.spec.block_bytes / GiB,
                f", {self.host_kv.num_disk_blocks} disk blocks in {self.host_kv.disk.path}"
                if self.host_kv.disk is not None
                else "",
            )

    def runner_info(self) -> RunnerInfo:
        """What the engine core sizes its scheduler with (plain data)."""
        return RunnerInfo(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            num_cpu_tier_blocks=self.host_kv.num_cpu_tier_blocks,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            kv_block_bytes=self.spec.block_bytes,
            num_disk_blocks=self.host_kv.num_disk_blocks,
            disk_records=self.host_kv.disk_records,
            kv_groups=self.kv_groups,
        )

    def shutdown(self) -> None:
        """Finishes the block copies in flight and closes the disk tier (its file keeps the
        blocks for the next run). Idempotent."""
        self.kv_transfer.close()

    # ---- LoRA adapters (the executor's control calls) ---------------------------------------
    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapterConfig) -> None:
        """Reads this rank's shard of the adapter and checks it (ValueError: not kept)."""
        self._lora_manager("add_lora").add_adapter(lora_request, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        self._lora_manager("remove_lora").remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        return [] if self.lora_manager is None else self.lora_manager.loaded_lora_ids

    def _lora_manager(self, what: str) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError(f"{what}: LoRA is not enabled (EngineConfig.enable_lora)")
        return self.lora_manager

    # ---- sizing -----------------------------------------------------------------------------
    def _profile_num_blocks(self) -> int:
        cfg = self.config
        max_useful = (  # every layer group has a table per sequence
            cfg.max_num_seqs * math.ceil(self.max_model_len / cfg.block_size) * self.num_groups + 1
        )
        if self.device.type != "cuda":
            return max(
                1, min(self.spec.num_blocks_for_bytes(cfg.cpu_kv_cache_space * GiB), max_useful)
            )
        # Run the largest step once on a throw-away cache to measure peak activation memory.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len)
        probe_blocks = math.ceil(num_tokens / cfg.block_size) + 1
        self.kv_cache = self.spec.allocate(probe_blocks, self.device)
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        # The probe's blocks are KV cache, which the budget below sizes, not activations:
        # counted in the peak, they were left unused (ceil(4096 / 16) + 1 = 257 blocks).
        probe_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        peak = torch.cuda.max_memory_allocated(self.device) - probe_bytes
        plan = cuda_graph_plan(
            cfg, self.model_config, self.kv_cache, self.max_model_len, self.num_groups
        )
        graphs = (
            0
            if plan is None
            else measure_graph_memory(self.model, self.kv_cache, plan, self._model_cache())
        )
        del self.kv_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        other_procs = total - free - torch.cuda.memory_reserved(self.device)
        # Sampling needs a few float32 [max_num_seqs, vocab] buffers on top.
        sampling = 4 * cfg.max_num_seqs * self.vocab_size * 4
        budget = total * cfg.gpu_memory_utilization - peak - other_procs - sampling - graphs
        blocks = self.spec.num_blocks_for_bytes(budget)
        if blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: peak activations {peak / GiB:.2f} GiB, "
                f"CUDA graphs {graphs / GiB:.2f} GiB, "
                f"gpu_memory_utilization={cfg.gpu_memory_utilization}; lower max_num_batched_tokens "
                "or raise gpu_memory_utilization (or --enforce-eager)"
            )
        return min(blocks, max_useful)

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        bs = self.config.block_size
        num_blocks = math.ceil(num_tokens / bs)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            num_prefills=1,
            num_prefill_tokens=num_tokens,
            num_decode_tokens=0,
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_seq_len=num_tokens,
            max_query_len=num_tokens,
            seq_lens_cpu=[num_tokens],
            query_lens_cpu=[num_tokens],
        )
        if self.num_groups > 1:  # every group on the same blocks: a probe
            g = self.num_groups
            meta.with_groups(meta.slot_mapping.expand(g, -1), meta.block_tables.expand(g, -1, -1))
        if ps.get_pp_world_size() == 1:
            hidden = self.model(ids, positions, self._model_cache(), meta)
            self.model.compute_logits(hidden[-1:])
            return
        # A pipeline stage alone (no peer is in step with it now): zeros for its input.
        hidden_size = self.model_config.hidden_size
        intermediate = None
        if not ps.is_first_pp_rank():
            intermediate = torch.zeros(
                (2, num_tokens, hidden_size), dtype=self.dtype, device=ids.device
            )
        hidden = self.model(ids, positions, self.kv_cache, meta, intermediate)
        if ps.is_last_pp_rank():
            self.model.compute_logits(hidden[-1:])

    @property
    def num_groups(self) -> int:
        return 1 if self.kv_groups is None else self.kv_groups.num_groups

    def _model_cache(self):
        """What the model reads the cache through: the tensor, or its layers' slots."""
        if self.kv_groups is None:
            return self.kv_cache
        return LayerSlotCache(self.kv_cache, self.kv_groups.layer_slot)

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> None:
        """Updates the cached state, moves blocks and launches the forward pass; returns at
        once. ``sample_tokens`` samples it (every step: the two calls alternate)."""
        if self._pending is not None:
            raise RuntimeError("execute_model: the previous step was never sampled (sample_tokens)")
        last = self._last_output
        self.input_batch.update(out, None if last is None else last.get_output)
        self.step_sampler.forget(out.finished_request_ids)
        if self.spec_decoder is not None:
            self.spec_decoder.forget(out.finished_seq_ids)
        # Swaps, tier saves and loads, copy-on-write: ordered with the step by events.
        self.kv_transfer.move(out)
        if out.num_seqs == 0:
            self._pending = _PendingSample(out, None, None, None)
            return
        verify = None  # speculative decoding: drafts proposed for this step
        if out.num_draft_tokens and self.spec_decoder is not None:
            verify = self.spec_decoder.propose(out)
        if verify is None:
            step = self.input_batch.prepare(out)
        else:
            step = self.spec_decoder.prepare(verify)
        if self.lora_manager is not None:
            seqs = self.input_batch.seqs
            loras = [seqs[seq_id].lora_request for seq_id in step.seq_ids]
            self.lora_manager.set_step(loras, step.query_lens)
        if len(step.placeholder_index) and ps.is_tensor_parallel():
            self._share_sampled_ids(last)
        measures_kv_scales = self.kv_scales is not None and self.kv_scales.arm_for(out)
        hidden, logits = self._forward(step)
        if measures_kv_scales:
            self._finish_kv_scales()
        prompt = None
        # A verify step's prefill group holds its verified decodes too: past their prompts,
        # the plan leaves them out.
        plan = plan_prompt_logprobs(step, self.input_batch)
        if plan is not None:  # every rank: the LM head's gather is collective
            prompt = (plan, self.model.compute_logits(hidden[to_device(plan.rows, self.device)]))
        self._pending = _PendingSample(out, step, logits, verify, hidden, prompt)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None = None) -> AsyncModelRunnerOutput | None:
        """Samples the step ``execute_model`` launched, with the grammar bitmask of its
        constrained rows, and starts the one device-to-host copy. -> the output on the way
        to the host; None on the ranks that do not sample (tp_rank 0 of the last pipeline
        stage samples from the gathered logits; a TP rank receives its ids when the next
        step's placeholders need them)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("sample_tokens: no step was launched (execute_model)")
        out, step = pending.scheduler_output, pending.step
        is_driver = ps.is_sampling_rank()
        if step is None:
            result = AsyncModelRunnerOutput(ModelRunnerOutput())
        elif not is_driver:
            result = self.step_sampler.expect(step, out.num_samples)
        elif pending.verify is not None:
            result = self.spec_decoder.sample(
                pending.logits, step, pending.verify, out.num_samples, grammar
            )
        else:
            result = self.step_sampler.sample(pending.logits, step, out.num_samples, grammar)
        if pending.prompt is not None and is_driver:
            result.attach_prompt_logprobs(prompt_logprobs(pending.prompt[1], pending.prompt[0]))
        # The step's disk reads, checked while its forward pass ran (every rank: they agree).
        disk_report = self.kv_transfer.disk_report(out)
        if disk_report is not None and is_driver:
            result.attach_disk_report(disk_report)
        if step is not None and self.draft is not None and self.draft.needs_target_hidden_states:
            # After sampling: a verified sequence's valid rows are its accepted run.
            self.spec_decoder.observe(step, pending.hidden, self._input_ids(step), pending.verify)
        self._last_output = result
        return result if is_driver else None

    def execute_model_sync(
        self, out: SchedulerOutput, grammar: GrammarOutput | None = None
    ) -> ModelRunnerOutput | None:
        """Both halves of a step, waiting for its output (tests, benchmarks, tools)."""
        self.execute_model(out)
        result = self.sample_tokens(grammar)
        return None if result is None else result.get_output()

    def _finish_kv_scales(self) -> None:
        """After the step whose forward measured the KV scales: the decode graphs, which
        bake them in, are captured now."""
        self.kv_scales.finish()
        if self._graphs_to_capture is not None:
            self.cuda_graphs = self._capture(self._graphs_to_capture)
            self._graphs_to_capture = None

    def _capture(self, graphs: CUDAGraphRunner) -> CUDAGraphRunner | None:
        """capture_all, with every LoRA slot active in the eager warm-ups before each capture:
        a step without adapters leaves eager steps skipping LoRA (lora_manager.set_step), and
        a layer whose Triton kernels never ran outside a capture is captured on the dense path
        instead (pydaemon/layers/lora/punica_triton.py), as after the KV scales' first step."""
        slots = self.lora_manager.slots if self.lora_manager is not None else None
        if slots is None:
            return capture_all(graphs)
        active, slots.num_active_slots = slots.num_active_slots, slots.max_loras
        try:
            return capture_all(graphs)
        finally:
            slots.num_active_slots = active

    def _share_sampled_ids(self, last: AsyncModelRunnerOutput | None) -> None:
        """Tensor parallelism: every rank fills placeholders with rank 0's samples. Rank 0
        broadcasts the last step's sampled ids, device to device, in stream order after its
        sampling (no host sync); the other ranks receive them into that step's output."""
        if last is None or last.num_samples == 0:
            raise RuntimeError("placeholder tokens but the previous step sampled nothing")
        if ps.get_tp_rank() == 0:
            ps.broadcast_from_rank0(last.sampled_token_ids.contiguous())
            return
        ids = torch.empty(last.num_samples, dtype=torch.int64, device=self.device)
        last.receive_sampled_token_ids(ps.broadcast_from_rank0(ids))

    def _forward(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (hidden states [>= num_tokens, hidden_size], the LM head's input; logits
        [len(step.sample_index), vocab] float32, None on TP ranks > 0)."""
        graphs = self.cuda_graphs
        key = None if graphs is None else graphs.key_for(step)
        if key is None:
            return self._forward_eager(step)
        # hidden: [num_tokens, hidden_size], a view of the graph's output
        hidden = graphs.run(step, key, lambda ids: self._fill_placeholders(ids, step))
        if len(step.sample_index) == len(step.input_ids):  # every row, in order: no gather
            return hidden, self.model.compute_logits(hidden)
        return hidden, self.model.compute_logits(hidden[to_device(step.sample_index, self.device)])

    def _forward_eager(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_forward`` without graphs: any step, on any device."""
        query_len = step.query_lens
        p = step.num_prefills
        dev = self.device
        meta = AttentionMetadata(
            num_prefills=p,
            num_prefill_tokens=int(query_len[:p].sum()),
            num_decode_tokens=len(step.seq_ids) - p,
            slot_mapping=to_device(step.slot_mapping, dev),
            block_tables=to_device(step.block_tables, dev),
            seq_lens=to_device(step.seq_lens, dev),
            query_start_loc=to_device(step.query_start_loc, dev),
            max_seq_len=int(step.seq_lens.max()),
            max_query_len=int(query_len.max()),
            seq_lens_cpu=step.seq_lens.tolist(),
            query_lens_cpu=query_len.tolist(),
        )
        if step.group_slot_mapping is not None:
            meta.with_groups(
                to_device(step.group_slot_mapping, dev), to_device(step.group_block_tables, dev)
            )
        if ps.get_pp_world_size() > 1:
            return self._forward_stage(step, meta)
        hidden = self.model(
            self._input_ids(step), to_device(step.positions, dev), self._model_cache(), meta
        )
        if len(step.sample_index) == 0:
            return hidden, hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        return hidden, self.model.compute_logits(hidden[to_device(step.sample_index, dev)])

    def _forward_stage(
        self, step: StepInput, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pipeline parallel: this stage's layers, between the previous stage's intermediate
        tensors (received) and the next one's (sent), in stream order on NCCL. -> as
        ``_forward``; no logits but on the last stage."""
        dev = self.device
        intermediate = None
        if not ps.is_first_pp_rank():
            shape = (2, len(step.input_ids), self.model_config.hidden_size)
            intermediate = ps.recv_from_prev_stage(torch.empty(shape, dtype=self.dtype, device=dev))
        hidden = self.model(
            self._input_ids(step), to_device(step.positions, dev), self.kv_cache, meta, intermediate
        )
        if not ps.is_last_pp_rank():
            ps.send_to_next_stage(hidden)  # [2, T, hidden_size]
            return hidden, None
        if len(step.sample_index) == 0:
            return hidden, hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        return hidden, self.model.compute_logits(hidden[to_device(step.sample_index, dev)])

    def release_cuda_graphs(self) -> None:
        """Drops the decode graphs: call before destroying the NCCL communicator their
        all-reduces captured (ncclCommDestroy waits for every graph holding it: pytorch#115388).
        Steps run eagerly afterwards."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.release()
            self.cuda_graphs = None

    def _input_ids(self, step: StepInput) -> torch.Tensor:
        """[num_tokens] int64 on the device, placeholders filled (``_fill_placeholders``)."""
        input_ids = to_device(step.input_ids, self.device)
        self._fill_placeholders(input_ids, step)
        return input_ids

    def _fill_placeholders(self, input_ids: torch.Tensor, step: StepInput) -> None:
        """input_ids: [>= num_tokens] int64 on the device, the step's tokens first. A
        placeholder (async scheduling: a token the previous step sampled and the host has not
        seen yet) is gathered from that step's sampled ids on the device: no host round trip."""
        if not len(step.placeholder_index):
            return
        last = self._last_output
        if last is None or last.sampled_token_ids is None:
            raise RuntimeError("placeholder tokens but the previous step sampled nothing")
        rows = to_device(last.sample_rows(step.placeholder_seq_ids.tolist()), self.device)
        index = to_device(step.placeholder_index, self.device)
        input_ids[index] = last.sampled_token_ids[rows]


def assign_kv_groups(model: torch.nn.Module, groups: KVGroups) -> None:
    """Tells each layer's attention which group's tables it reads (core/kv_groups.py)."""
    layers = model.model.layers
    if len(layers) != len(groups.layer_group):
        raise ValueError(f"{len(layers)} layers, {len(groups.layer_group)} in the KV groups")
    for layer, group in zip(layers, groups.layer_group, strict=True):
        attns = [m for m in layer.modules() if isinstance(m, PagedAttention)]
        if len(attns) != 1:
            raise ValueError(f"a layer with {len(attns)} paged attention modules")
        attns[0].kv_group = group
