"""Engine configuration: one dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pydaemon.config.kv_offloading import check_kv_offloading
from pydaemon.config.speculative import SpeculativeConfig
from pydaemon.logprobs_limit import DEFAULT_MAX_LOGPROBS, check_max_logprobs_setting

# The out-of-the-box model (model_loader/default_model.py finds its file).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
PREEMPTION_MODES = ("auto", "recompute", "swap")
LOAD_FORMATS = ("auto", "dummy")
# as pydaemon.quantization.config.QUANTIZATIONS (no torch import here)
QUANTIZATIONS = (None, "fp8", "fp8_emulated", "awq", "gptq", "compressed-tensors", "mxfp4")
BLOCK_SIZES = (8, 16, 32)
# Said before anything loads (pydaemon.quantization.config checks the GPU's capability later).
FP8_NEEDS_CUDA = (
    "quantization 'fp8' needs a CUDA GPU of compute capability 8.9 or newer (FP8 tensor "
    "cores); 'fp8_emulated' runs the same FP8 weights through dequantized matmuls on any "
    "device (slow: meant for tests)"
)
MAX_LORA_RANK = 512
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
KV_CACHE_DTYPES = (
    "auto",
    "fp8",
    "fp8_e4m3",
)  # as pydaemon.quantization.kv_cache_fp8 (no torch import here)


@dataclass
class EngineConfig:
    """Everything an LLMEngine needs; the daemon's flags and TOML keys use the same names. The
    engine reads it and splits it once into what each layer below owns (the workers'
    RunnerConfig, the scheduler's SchedulerConfig: pydaemon/engine/layer_configs.py).

    ``max_num_batched_tokens`` is the per-step token budget (decodes first, then prefill
    chunks); ``None`` picks 4096 on CUDA and 512 on CPU (and at least max_num_seqs). ``num_kv_blocks`` overrides the
    KV-cache size derived from ``gpu_memory_utilization`` (CUDA) or ``cpu_kv_cache_space``
    (GiB, CPU). ``swap_space`` (GiB) sizes the CPU swap pool used by swap preemption.
    ``tensor_parallel_size`` > 1 shards the model over that many processes (one per GPU, or
    gloo on CPUs), started by the engine itself. On CUDA, decode steps replay CUDA graphs
    (pydaemon/worker/cuda_graphs.py) unless ``enforce_eager``; a decode step whose longest context
    exceeds ``max_seq_len_to_capture`` runs eagerly. ``kv_cache_dtype`` "fp8" (= "fp8_e4m3")
    stores the KV cache as e4m3 with per-layer scales (from the checkpoint, else 1.0): about
    twice the blocks for the same memory; "auto" stores it in the model's dtype.
    ``calculate_kv_scales`` (fp8 cache only) measures the scales the checkpoint lacks on the
    first step, then keeps them (pydaemon/worker/kv_scale_calibration.py).
    ``async_scheduling`` schedules and launches each step while the previous one runs on the
    GPU (pydaemon/engine/async_stepper.py); ``None`` turns it on for CUDA with one GPU and off otherwise (on
    a CPU there is nothing to overlap, but ``True`` runs the same path, for tests). With
    tensor parallelism ``True`` turns it on (every rank fills placeholders from rank 0's
    sampled ids, broadcast on the device); ``None`` leaves it off there until it has been
    measured over NCCL.
    ``pipeline_parallel_size`` > 1 splits the layers into that many stages (each of
    ``tensor_parallel_size`` ranks: ``world_size`` ranks in all); the engine keeps several
    batches in flight so that the stages overlap (pydaemon/engine/batch_queue.py).
    ``enable_expert_parallel`` partitions a MoE model's experts over the tensor-parallel ranks
    (whole experts per rank) instead of slicing every expert. ``distributed_executor_backend``
    places the ranks: "mp" spawns them on this host (one rank alone runs in this process),
    "ray" runs each as a Ray actor placed by a placement group over the Ray cluster this
    process joins (several hosts; a local one when none runs).
    ``quantization``: None (as the checkpoint is), "fp8" (FP8 weights, CUDA sm_89+),
    "fp8_emulated" (the same, emulated: any device), or a 4-bit checkpoint's own method
    ("awq", "gptq", "compressed-tensors", "mxfp4": such checkpoints run as stored without it;
    with ``load_format="dummy"`` it draws random weights in that layout).
    ``enable_lora`` serves LoRA adapters (pydaemon/worker/lora_manager.py): ``max_loras``
    device slots (the most distinct adapters in one batch), ranks up to ``max_lora_rank``, and
    at most ``max_cpu_loras`` adapters loaded at once (each loaded adapter's checked weights
    stay in host memory until it is unloaded; None: no limit).
    KV tiers (vLLM's names; config/kv_offloading.py): ``kv_offloading_size`` GiB of host
    memory keep the prefix-cache blocks evicted from the device (the CPU tier, beside the swap
    space in one host pool; a hit there is loaded back while other requests run);
    ``kv_offloading_backend`` "native" only; ``kv_offloading_dir`` and
    ``kv_offloading_disk_size`` GiB: a disk tier behind it, found again by a restarted daemon
    with the same model and settings. Sizes are over every tensor-parallel rank together.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space: float = 1.0
    swap_space: float = 4.0
    max_num_seqs: int = 512
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: str = "auto"
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    watermark: float = 0.01
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    kv_cache_dtype: str = "auto"
    async_scheduling: bool | None = None
    quantization: str | None = None
    calculate_kv_scales: bool = False
    # vLLM's speculative_config dict (config/speculative.py); None: no speculation.
    speculative_config: dict | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    kv_offloading_dir: str | None = None
    kv_offloading_disk_size: float | None = None
    # Seconds a grammar may compile (structured outputs) before its requests fail; one client's
    # compile never delays another's by more than ~2 s (structured_output/compile_lanes.py).
    structured_outputs_compile_timeout: float = 30.0
    # vLLM's --max-logprobs: the most logprobs / prompt_logprobs a request may ask for (-1:
    # the vocabulary)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{name} {why} (got {getattr(self, name)!r})")

        for name, allowed in (
            ("device", DEVICES),
            ("dtype", DTYPES),
            ("preemption_mode", PREEMPTION_MODES),
            ("load_format", LOAD_FORMATS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("distributed_executor_backend", DISTRIBUTED_EXECUTOR_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                raise bad(name, f"must be one of {', '.join(allowed)}")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be None or one of {', '.join(QUANTIZATIONS[1:])}")
        if self.quantization == "fp8" and self.device == "cpu":
            raise ValueError(FP8_NEEDS_CUDA + "; device is 'cpu'")
        if self.block_size not in BLOCK_SIZES:
            raise bad("block_size", f"must be one of {BLOCK_SIZES}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be a positive integer or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.cpu_kv_cache_space <= 0:
            raise bad("cpu_kv_cache_space", "must be positive (GiB)")
        if self.swap_space < 0:
            raise bad("swap_space", "must be >= 0 (GiB)")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be a positive integer")
        if not 0 < self.structured_outputs_compile_timeout < float("inf"):
            raise bad("structured_outputs_compile_timeout", "must be a finite number > 0 (s)")
        check_max_logprobs_setting(self.max_logprobs)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be a positive integer or None")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be a positive integer or None")
        if not 0.0 <= self.watermark < 1.0:
            raise bad("watermark", "must be in [0, 1)")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "must be a positive integer")
        self._check_pipeline(bad)
        if not isinstance(self.enforce_eager, bool):
            raise bad("enforce_eager", "must be true or false")
        if (
            not isinstance(self.max_seq_len_to_capture, int)
            or isinstance(self.max_seq_len_to_capture, bool)
            or self.max_seq_len_to_capture < 1
        ):
            raise bad("max_seq_len_to_capture", "must be a positive integer")
        if not isinstance(self.calculate_kv_scales, bool):
            raise bad("calculate_kv_scales", "must be true or false")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise bad(
                "calculate_kv_scales",
                "measures the scales of an FP8 KV cache: it needs kv_cache_dtype 'fp8', and "
                "kv_cache_dtype is 'auto'",
            )
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the key
        self._check_lora(bad)
        check_kv_offloading(self, bad)
        if self.async_scheduling not in (None, True, False):
            raise bad("async_scheduling", "must be true, false or None (auto)")
        if not self.model:
            raise bad(
                "model", f"must name {DEFAULT_MODEL!r}, 'demo', a model directory or a .gguf file"
            )

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_pipeline(self, bad) -> None:
        if not isinstance(self.enable_expert_parallel, bool):
            raise bad("enable_expert_parallel", "must be true or false")
        if self.pipeline_parallel_size == 1:
            return
        # Features whose state lives in one stage's runner only: not split over stages yet.
        if self.speculative_config is not None:
            raise bad(
                "pipeline_parallel_size",
                "cannot be combined with speculative decoding (speculative_config) yet",
            )
        if self.enable_lora:
            raise bad("pipeline_parallel_size", "cannot be combined with enable_lora yet")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed, or None."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def _check_lora(self, bad) -> None:
        if not isinstance(self.enable_lora, bool):
            raise bad("enable_lora", "must be true or false")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "must be a positive integer")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise bad("max_lora_rank", f"must be at most {MAX_LORA_RANK}")
        if self.max_cpu_loras is not None and (
            not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras
        ):
            raise bad("max_cpu_loras", "must be an integer >= max_loras, or None")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
