"""The one frozen, validated configuration of a :class:`tvmkv.PagedAttentionKVCache`."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .tir import ROPE_MODES
from .tir.rope_scaling import RopeScaling, kernel_variant
from .tir.spec import KernelSpec, MlaSpec, dtype_bytes

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the largest float32
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
LOG2E = math.log2(math.e)  # the kernels' softmax runs in base 2 (tir._kernel_common.LOG2E, without TVM)


@dataclass(frozen=True)
class CacheConfig:
    """Static configuration of a paged KV cache (see docs/layout.md).

    ``num_pages`` defaults to enough pages for ``max_total_seq_len`` tokens plus one partially
    filled page per sequence of a full batch. ``decode_splits`` (``None``: automatic) caps how many
    ways a decode step cuts its sequences (docs/layout.md, "Split decode"); ``stable_decode_splits`` plans
    those cuts for CUDA-graph replay (docs/cuda_graphs.md); ``device_planning`` plans a decode step whose batch
    changed, and a prefill or mixed step, on the device from a page table kept there (docs/layout.md, "Device
    page table"). ``rope_scaling`` (None,
    TVM's / Hugging Face's dict, or a :class:`tvmkv.tir.RopeScaling`) and ``rotary_dim`` (None: the
    whole head) choose the RoPE variant of rope mode "normal" (docs/layout.md, "RoPE"); after
    construction ``rope_scaling`` is always a RopeScaling and ``rotary_dim`` an int. ``kv_dtype``
    ("float8_e4m3fn" / "float8_e5m2", with ``dtype`` float16 or bfloat16) stores the pages in fp8 under
    per-layer, per-KV-head scales (docs/layout.md, "fp8 pages"); "" (or ``dtype``): pages of ``dtype``.
    """

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    max_batch_size: int = 32
    max_total_seq_len: int = 2048
    prefill_chunk_size: int = 512
    dtype: str = "float16"
    kv_dtype: str = ""  # page dtype when it differs from dtype: fp8 pages (docs/layout.md, "fp8 pages")
    rope_mode: str = "none"
    rope_scale: float = 1.0
    rope_theta: float = 1e4
    support_sliding_window: bool = False
    target_kind: str = "llvm"
    cuda_arch: str | None = None
    device_id: int = 0  # the GPU the cache lives on (cuda:N; a tensor-parallel worker's own); 0 on llvm
    # the model's id of this cache's first layer: a pipeline stage holds layers [first_layer, first_layer +
    # num_layers) and every call names them by the model's ids (TVM's layer_indptr; docs/layout.md)
    first_layer: int = 0
    num_pages: int | None = None
    decode_splits: int | None = None
    stable_decode_splits: bool = False  # split plans for CUDA-graph replay (decode_split.plan_split, stable)
    device_planning: bool = True  # changed decode batches and prefill steps planned on the device (runtime.device_plan)
    layer_windows: tuple = ()  # per-layer sliding window (0: full attention); () = every layer full
    rope_scaling: RopeScaling | dict | None = None  # normalized to a resolved RopeScaling
    rotary_dim: int | None = None  # normalized to the rotated dims (head_dim when all rotate)
    # MLA (DeepSeek-V2 latent attention; docs/layout.md "MLA pages"): kv_lora_rank > 0 makes every layer
    # MLA: one kv head, head_dim = kv_lora_rank + qk_rope_head_dim; mla_self_dims = (Dq, Dv) of the
    # prefill's self attention, () to infer them from its first call
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    mla_self_dims: tuple = ()

    def __post_init__(self):
        for name in ("num_layers", "max_batch_size", "max_total_seq_len", "prefill_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if self.mla_self_dims and (not isinstance(self.mla_self_dims, tuple) or len(self.mla_self_dims) != 2):
            raise ValueError(f"mla_self_dims={self.mla_self_dims!r} must be () or a pair (qk_dim, v_dim)")
        if self.is_mla:
            if self.kv_dtype not in ("", self.dtype):
                raise ValueError(
                    f"kv_dtype={self.kv_dtype!r} on an MLA cache: fp8 pages are built for the standard cache only; "
                    "leave kv_dtype empty"
                )
            self.mla_spec  # validates heads, dims, page_size, dtype, target  # noqa: B018
            if self.num_kv_heads != 1 or self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim:
                raise ValueError(
                    f"an MLA cache has num_kv_heads=1 and head_dim=kv_lora_rank + qk_rope_head_dim "
                    f"({self.kv_lora_rank} + {self.qk_rope_head_dim}); got num_kv_heads={self.num_kv_heads}, "
                    f"head_dim={self.head_dim}"
                )
            if self.rope_mode == "inline" or self.support_sliding_window or any(self.layer_windows):
                raise ValueError(
                    "MLA caches store the rotated k_pe as given (rope_mode 'none' or 'normal') and support no "
                    "sliding windows (as in TVM)"
                )
        else:
            if self.qk_rope_head_dim or self.mla_self_dims:
                raise ValueError(
                    f"qk_rope_head_dim={self.qk_rope_head_dim} / mla_self_dims={self.mla_self_dims!r} apply to MLA "
                    "caches only: pass kv_lora_rank > 0 too"
                )
            object.__setattr__(self, "kv_dtype", self.kernel_spec.kv_dtype)  # "" when it names dtype
            self.kernel_spec  # validates heads, head_dim, page_size, dtype, kv_dtype, target  # noqa: B018
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_mode not in ROPE_MODES:
            raise ValueError(f"rope_mode={self.rope_mode!r} is not one of {ROPE_MODES}")
        for name in ("rope_scale", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name}={value!r} must be a positive finite float")
            if not FLOAT32_TINY <= float(value) <= FLOAT32_MAX:  # (NaN fails too) the kernels compute in float32
                raise ValueError(
                    f"{name}={value!r} must be a positive finite float within float32's normal range "
                    f"[{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}] (the kernels compute RoPE in float32)"
                )
            object.__setattr__(self, name, float(value))  # frozen: normalized once, here
        # the largest RoPE angle, position * rope_scale / rope_theta ** (2i / head_dim) at an int32
        # position, must stay finite in float32 (an infinite angle stores NaN keys)
        fastest = self.rope_scale * max(1.0, self.rope_theta ** (2 / self.head_dim - 1))
        if fastest * INT32_MAX > FLOAT32_MAX:
            raise ValueError(
                f"rope_scale={self.rope_scale!r} with rope_theta={self.rope_theta!r}: the RoPE angle position * "
                "rope_scale / rope_theta ** (2i / head_dim) overflows float32 at int32 positions (keep rope_scale "
                f"/ min_i rope_theta ** (2i / head_dim) <= {FLOAT32_MAX / INT32_MAX:.3g})"
            )
        rs = RopeScaling.parse(self.rope_scaling, rotary_dim=self.rotary_dim).resolved(self.head_dim)
        object.__setattr__(self, "rope_scaling", rs)  # frozen: normalized once, here
        object.__setattr__(self, "rotary_dim", rs.rotary_dim)
        self.rope_variant  # raises for inline + a non-default variant, longrope without factors  # noqa: B018
        if self.num_pages is not None:
            if not isinstance(self.num_pages, int) or self.num_pages <= 0:
                raise ValueError(f"num_pages={self.num_pages!r} must be a positive int or None")
            need = -(-self.max_total_seq_len // self.page_size)
            if self.num_pages < need:
                raise ValueError(
                    f"num_pages={self.num_pages} cannot hold one sequence of max_total_seq_len="
                    f"{self.max_total_seq_len} tokens (needs {need} pages of {self.page_size}); "
                    "raise num_pages or lower max_total_seq_len"
                )

        if self.layer_windows:
            ws = self.layer_windows
            if not isinstance(ws, tuple) or len(ws) != self.num_layers:
                raise ValueError(
                    f"layer_windows={ws!r} must be a tuple of {self.num_layers} window sizes (one per layer, 0 for "
                    "full attention)"
                )
            if any(not isinstance(w, int) or isinstance(w, bool) or not 0 <= w <= INT32_MAX for w in ws):
                raise ValueError(
                    f"layer_windows={ws!r}: each window must be an int in [0, 2**31 - 1] (0: full attention; the "
                    "kernels take it as int32, and a window longer than every sequence is full attention too)"
                )
        if self.decode_splits is not None and (
            not isinstance(self.decode_splits, int) or isinstance(self.decode_splits, bool) or self.decode_splits < 1
        ):
            raise ValueError(
                f"decode_splits={self.decode_splits!r} must be None (automatic), 1 (never split) or an int > 1"
            )
        if not isinstance(self.stable_decode_splits, bool):
            raise TypeError(f"stable_decode_splits={self.stable_decode_splits!r} must be True or False")
        if not isinstance(self.device_planning, bool):
            raise TypeError(f"device_planning={self.device_planning!r} must be True or False")
        if not isinstance(self.device_id, int) or isinstance(self.device_id, bool) or self.device_id < 0:
            raise ValueError(f"device_id={self.device_id!r} must be an int >= 0 (the N of cuda:N)")
        if not isinstance(self.first_layer, int) or isinstance(self.first_layer, bool) or self.first_layer < 0:
            raise ValueError(f"first_layer={self.first_layer!r} must be an int >= 0 (a pipeline stage's first layer)")
        if self.device_id and self.target_kind != "cuda":
            raise ValueError(f"device_id={self.device_id} applies to target 'cuda' only; leave it 0 on the CPU")

    @property
    def layer_ids(self) -> range:
        """The model's ids of this cache's layers, in order (``first_layer`` on): what the per-layer calls
        (``attention_with_fused_qkv``, ``kv_scales``, ``requantize_pages``, ...) take for local layer ``i``."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    def layer_index(self, layer_id: int, name: str = "layer_id") -> int:
        """The index into this cache's layers (``pages[i]``) of the model's layer ``layer_id`` (an int);
        ValueError, naming ``name``, the range and the stage, for a layer this cache does not hold."""
        i = layer_id - self.first_layer
        if not 0 <= i < self.num_layers:
            first, n = self.first_layer, self.num_layers
            stage = f" (this cache is the pipeline stage of layers {first} .. {first + n - 1})" if first else ""
            raise ValueError(f"{name} {layer_id} is out of range [{first}, {first + n}){stage}")
        return i

    @property
    def is_mla(self) -> bool:
        """Whether every layer is an MLA layer (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def mla_spec(self) -> MlaSpec:
        """The kernel spec of an MLA cache (``mla_self_dims`` included when given)."""
        sq, sv = self.mla_self_dims or (0, 0)
        return MlaSpec(
            self.num_qo_heads,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.page_size,
            self.dtype,
            self.target_kind,
            self_qk_dim=sq,
            self_v_dim=sv,
        )

    @property
    def kernel_spec(self) -> KernelSpec:
        return KernelSpec(
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            self.dtype,
            self.target_kind,
            self.kv_dtype,
        )

    @property
    def rope_variant(self) -> RopeScaling | None:
        """The RoPE variant the kernels bake (``load_kernels``'s ``rope_scaling``); None: the default."""
        return kernel_variant(self.rope_scaling, self.head_dim, self.rope_mode)

    @property
    def has_local_layers(self) -> bool:
        """Whether some layer attends within a sliding window of its own (``layer_windows``)."""
        return any(self.layer_windows)

    @property
    def total_pages(self) -> int:
        """Pages in each layer's pool."""
        if self.num_pages is not None:
            return self.num_pages
        return -(-self.max_total_seq_len // self.page_size) + self.max_batch_size

    @property
    def qkv_heads(self) -> int:
        return self.num_qo_heads + 2 * self.num_kv_heads

    @property
    def itemsize(self) -> int:
        """Bytes of one element of the cache's dtype (q/k/v, pages, outputs)."""
        return dtype_bytes(self.dtype)

    @property
    def page_dtype(self) -> str:
        """Dtype of the pages: ``kv_dtype`` when given (fp8 pages), else ``dtype``."""
        return self.kv_dtype or self.dtype

    @property
    def fp8_pages(self) -> bool:
        """The pages hold fp8 codes under per-layer, per-KV-head scales (docs/layout.md, "fp8 pages")."""
        return self.kv_dtype != ""

    @property
    def page_itemsize(self) -> int:
        """Bytes of one page element: 1 for fp8 pages, else ``itemsize``."""
        return dtype_bytes(self.page_dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one layer (K and V; MLA: the latent rows)."""
        if self.is_mla:
            return self.page_size * self.head_dim * self.itemsize
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * self.page_itemsize

    @property
    def page_shape(self) -> tuple:
        """Shape of one layer's page array (docs/layout.md, "Pages", "MLA pages")."""
        if self.is_mla:
            return (self.total_pages, self.page_size, self.head_dim)
        return (self.total_pages, 2, self.num_kv_heads, self.page_size, self.head_dim)
