"""Engine configuration: one dataclass holds every knob the engine, scheduler and cache read.

Invariants: block_size is a power of two >= 1; the token budget per step is at least one block so a
prefill chunk always makes progress; `policy` and `attention_backend` are validated names.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "cache-aware", "priority", "sjf")
PREEMPTION_MODES = ("auto", "swap", "recompute")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
LOAD_FORMATS = ("auto", "dummy")
# auto: the model's dtype, except fp16 for a GGUF file's quantized weights on CPU (llama.cpp's default);
# model: the model's dtype always; fp16 values; FP8 rows (docs/kv_fp8.md)
KV_CACHE_DTYPES = ("auto", "model", "fp16", "fp8")
QUANTIZED_ACTIVATIONS = ("int8", "float32")  # how GGUF weights take their inputs (kernels/ggml_quants.ACTIVATIONS)
DEFAULT_CPU_KV_MB = 256.0
STATE_CHECKPOINT_POLICIES = ("branches", "request-ends", "every-block")  # scheduler/checkpoint_policy.py
STATE_EVICTIONS = ("lru", "saved-compute")  # which checkpoint goes first (scheduler/checkpoint_policy.py)
# window: a sliding-window layer keeps its last window's K/V as a per-sequence state; all: every token's
# K/V in the paged pool, as a full-attention layer does; window-blocks: the sliding layers' K/V paged in
# window blocks of their own, which attention reads in place and the prefix cache drops block by block;
# auto: window-blocks where the model mixes sliding and full layers and has no recurrent ones, else all
# on CUDA (where window states would take the model off CUDA graphs) unless one pool cannot hold every
# layer's head shape, else window (docs/hybrid_cache.md, "Sliding-window layers")
SLIDING_WINDOW_KV = ("auto", "window", "all", "window-blocks")


@dataclass
class EngineConfig:
    model: str | None = None  # HF model directory or GGUF file; None -> the embedded SmolLM2-135M-Instruct
    block_size: int = 16  # tokens per physical KV block
    # KV pool budget; num_blocks derives from it unless set. None: 256 MB on CPU, and on CUDA
    # gpu_memory_utilization of the device minus weights, activations and CUDA graphs
    kv_cache_memory_mb: float | None = None
    gpu_memory_utilization: float = 0.90  # CUDA: fraction of device memory the engine may use in all
    num_blocks: int | None = None  # explicit pool size (tests use tiny pools to force eviction)
    # hybrid models (recurrent layers): state slots for running sequences' recurrent states and the prefix
    # cache's checkpoints of them (docs/hybrid_cache.md). None: what the KV budget (its MB) holds as well, at
    # least 4 and at most 2 * max_num_seqs
    state_slots: int | None = None
    # hybrid models: where the prefix cache checkpoints recurrent states (scheduler/checkpoint_policy.py):
    # branches (request ends and branch points) | request-ends | every-block (prompts' block boundaries too)
    state_checkpoints: str = "branches"
    state_eviction: str = "lru"  # lru | saved-compute (recency plus the prefill a checkpoint saves)
    # waiting sequences whose cached prefixes every eviction keeps for last, read last first
    # (cache/next_reads.py); 0: least recently used alone
    eviction_lookahead: int = 64
    sliding_window_kv: str = "auto"  # SLIDING_WINDOW_KV: where sliding-window layers keep their K/V
    # --sliding-window-kv window-blocks: window blocks for the sliding layers' K/V (the running windows' and
    # the cached blocks'). None: what the KV budget (its MB) holds as well
    window_blocks: int | None = None
    max_num_batched_tokens: int = 512  # token budget per step: decodes + prefill chunks
    max_num_seqs: int = 256  # running sequences at most
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    policy: str = "fcfs"  # fcfs | cache-aware | priority | sjf (scheduler/policy.py)
    max_wait_steps: int = 64  # cache-aware: after this many steps waiting, a request goes first
    cache_aware_max_queue: int = 128  # cache-aware: with more waiting than this, rank by arrival (bounded cost)
    # priority and sjf: seconds of waiting worth one priority level / one job-size step (a doubling);
    # 0 turns aging off (strict order, which can starve)
    aging_s: float = 10.0
    # priority and sjf: a waiting request that outranks a running one by at least this many levels
    # preempts it when it cannot be admitted otherwise; 0 turns urgent preemption off
    preempt_gap: float = 1.0
    preempt_min_run_s: float = 1.0  # ... but never one that has run less than this (no thrashing)
    # priority and sjf: a request queued this many seconds ago ranks ahead of every younger one, whatever
    # their priorities (oldest first), and may preempt them: the bound on any request's wait; 0 turns it off
    max_queue_wait_s: float = 20.0
    # output-aware admission (scheduler/admission.py): blocks kept free for the running sequences'
    # expected growth, as a fraction of what they may still generate; 0 turns it off
    new_token_ratio: float = 0.7
    new_token_ratio_min: float = 0.1
    new_token_ratio_decay: float = 0.001  # per step, while nothing is preempted
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"  # auto (triton on CUDA, torch otherwise) | triton | torch
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | float16 | bfloat16
    kv_cache_dtype: str = "auto"  # auto | model | fp16 | fp8 (e4m3 with a scale per token and head): KV_CACHE_DTYPES
    # a GGUF's quantized weights in the CPU kernels (docs/quantized.md): int8 quantizes each row of inputs
    # to 8 bits per block of 32 for integer dot products, as llama.cpp does; float32 multiplies the
    # decoded weights in fp32, computing exactly what the dequantized model (--dtype float32) computes
    quantized_activations: str = "int8"
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    # every step eager: no CUDA graphs (CUDA) and no padded static-buffer decode path (model/decode_graphs.py)
    enforce_eager: bool = False
    # CPU: torch's intra-op threads; None: the cores the affinity mask and cgroup quota allow, unless
    # OMP_NUM_THREADS / MKL_NUM_THREADS is set (model/cpu_threads.py)
    cpu_threads: int | None = None
    # prepare step N+1 and post-process step N-1 while step N runs (engine/engine.py). None: on CUDA,
    # where the device runs asynchronously; off on CPU, where the forward runs on the host anyway and
    # overlap would only hand each output out one step later
    overlap: bool | None = None
    load_format: str = "auto"  # auto: the checkpoint's safetensors | dummy: random weights of its shapes
    # the host-memory tier of the KV cache (pinned on CUDA): evicted prefixes are written back to it and
    # loaded back on a hit; 0 turns it off (eviction then drops blocks)
    host_cache_mb: float = 0.0
    # how a running sequence is preempted: swap (its KV kept in the host tier, loaded back on resume),
    # recompute (cached as an evictable prefix, recomputed if evicted), or auto (swap when the host
    # tier has room and copying costs less than recomputing; recompute without a host tier)
    preemption_mode: str = "auto"
    # structured output (engine/grammar/): where a grammar allows exactly one continuation, append it in
    # one extend step instead of sampling it token by token
    forced_tokens: bool = True
    grammar_cache_size: int = 256  # compiled constraints kept (LRU), keyed by (constraint, tokenizer)
    grammar_compile_timeout_s: float = 10.0  # a compile that takes longer is killed; its request fails
    # a grammar compiles first in one of these worker processes, each under this much address space
    # (engine/grammar/limits.py); a matcher builds at most this many lexer states (~1-2 kB each)
    grammar_compile_workers: int = 2
    grammar_cache_mb: float = 128.0  # compiled grammars kept, by estimated memory (besides grammar_cache_size)
    grammar_worker_memory_mb: int = 2048
    grammar_max_lexer_states: int = 20_000
    # JSON schemas (response formats, tool parameters) as JSON Schema reads them: an object admits keys it
    # does not declare unless it says additionalProperties: false. Off: objects are closed by default, as
    # OpenAI's strict mode and xgrammar have them (radixserve/schema_objects.py)
    open_json_objects: bool = False
    # speculative decoding (scheduler/drafts.py): a decoding sequence drafts up to this many tokens from
    # the radix tree, its prediction or its own prompt and output, verified in one step; 0 turns it off
    num_speculative_tokens: int = 8
    # no drafts in a step with more decoding sequences than this (the step stops being memory-bound);
    # None: the measured default of the device (engine/speculation.py)
    speculative_max_batch: int | None = None
    # the most rows (decode tokens plus drafts) a drafting step runs: drafts fill what its decodes leave,
    # in running order; None: the measured default of the device (engine/speculation.py; none on CUDA)
    speculative_max_rows: int | None = None
    # pinned prefixes (engine/pins.py) may hold at most this fraction of the device pool's blocks, and
    # never so many that the longest sequence the engine accepts could not fit beside them
    pin_budget: float = 0.25

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.window_blocks is not None and self.window_blocks < 1:
            raise ValueError(f"window_blocks must be >= 1, got {self.window_blocks}")
        if self.eviction_lookahead < 0:
            raise ValueError(f"eviction_lookahead (--eviction-lookahead) must be >= 0, got {self.eviction_lookahead}")
        if self.state_slots is not None and self.state_slots < 1:
            raise ValueError(f"state_slots must be >= 1, got {self.state_slots}")
        for name, choices in (("state_checkpoints", STATE_CHECKPOINT_POLICIES), ("state_eviction", STATE_EVICTIONS),
                              ("sliding_window_kv", SLIDING_WINDOW_KV),
                              ("kv_cache_dtype", KV_CACHE_DTYPES), ("quantized_activations", QUANTIZED_ACTIVATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads (--cpu-threads) must be >= 1, got {self.cpu_threads}")
        if self.max_wait_steps < 1:
            raise ValueError("max_wait_steps must be >= 1")
        if not 0.0 <= self.pin_budget <= 0.9:
            raise ValueError(f"pin_budget (--pin-budget) must be in [0, 0.9], got {self.pin_budget}")
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [0, 64], got {self.num_speculative_tokens}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.speculative_max_rows is not None and self.speculative_max_rows < 2:
            raise ValueError(f"speculative_max_rows must be >= 2 (a decode and a draft), got {self.speculative_max_rows}")
        if self.cache_aware_max_queue < 1:
            raise ValueError("cache_aware_max_queue must be >= 1")
        for name in ("aging_s", "preempt_gap", "preempt_min_run_s", "max_queue_wait_s", "new_token_ratio_decay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("new_token_ratio", "new_token_ratio_min"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb <= 0:
            raise ValueError("kv_cache_memory_mb must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
        if self.host_cache_mb < 0:
            raise ValueError("host_cache_mb (--host-cache-mb) must be >= 0, 0 turning the host tier off; "
                             f"got {self.host_cache_mb}")
        if self.host_cache_mb > 0 and not self.enable_prefix_cache:
            raise ValueError("the host tier (host_cache_mb > 0) holds evicted prefixes of the prefix cache, "
                             "which is turned off; turn it on or set host_cache_mb to 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}; "
                             f"choose one of {', '.join(PREEMPTION_MODES)}")
        if self.preemption_mode == "swap" and not (self.host_cache_mb > 0 and self.enable_prefix_cache):
            raise ValueError("preemption_mode 'swap' needs the host tier: set host_cache_mb > 0 "
                             "(--host-cache-mb) and keep the prefix cache on")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
