# ext/cpu_kernels.cpp and the kernels it binds (pybind11): one module, seven parts sharing one
# thread pool. Tensors cross as raw addresses (``tensor.data_ptr()``) with their strides; the
# wrappers in kernels/*_cpu.py own the checks. Every declared name exists in the built module
# (tests/test_native_contract.py).
from typing import Protocol

# Rows of a [outer, inner, n] layout: (data_ptr, outer stride, inner stride, inner count),
# strides in elements (kernels/_cpu_ops.rows).
_View = tuple[int, int, int, int]

class _Plan(Protocol):
    def __init__(
        self,
        block_table: int,
        query_start_loc: int,
        seq_lens: int,
        num_reqs: int,
        req_indices: int,
        num_selected: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        block_table_stride: int,
        max_blocks_per_req: int,
        num_threads: int,
    ) -> None: ...
    def run(
        self,
        out: int,
        q: int,
        k_cache: int,
        v_cache: int,
        q_token_stride: int,
        q_head_stride: int,
        out_token_stride: int,
        out_head_stride: int,
        scale: float,
        dtype: int,
        window: int = 0,
        softcap: float = 0.0,
        cache_dtype: int = 0,
    ) -> None: ...

class _Attention(Protocol):
    Plan: type[_Plan]
    def causal_prefill(
        self,
        out: int,
        q: int,
        k: int,
        v: int,
        segments: int,
        num_segments: int,
        q_token_stride: int,
        q_head_stride: int,
        k_token_stride: int,
        k_head_stride: int,
        v_token_stride: int,
        v_head_stride: int,
        out_token_stride: int,
        out_head_stride: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        num_threads: int,
        dtype: int = 0,
    ) -> None: ...
    def prefill_supported(self) -> bool: ...
    def prefill_bf16_dot(self, on: bool) -> bool: ...
    def prefill_shared_pack(self, on: bool) -> bool: ...
    def paged_chunk_kernel(self, name: str = "") -> str: ...
    def paged_chunk_pack_bytes(self, n: int = -1) -> int: ...
    def paged_chunk_items_run(self, name: str) -> int: ...
    def paged_decode_kernel(self, name: str = "") -> str: ...
    def paged_decode_key_splits(self, on: int = -1) -> bool: ...
    def paged_decode_split_items_run(self) -> int: ...

class _Gemm(Protocol):
    PANEL: int
    def supported(self) -> bool: ...
    def set_isa(self, isa: str) -> None: ...
    def get_isa(self) -> str: ...
    def num_panels(self, n: int) -> int: ...
    def pack(self, weight: int, n: int, k: int, ldw: int, packed: int) -> None: ...
    def linear(
        self,
        x: int,
        m: int,
        k: int,
        ldx: int,
        packed: int,
        n: int,
        bias: int,
        y: int,
        ldy: int,
        num_threads: int,
    ) -> None: ...

class _GemmBf16(Protocol):
    PANEL: int
    def supported(self) -> bool: ...
    def amx_bf16(self) -> bool: ...
    def num_panels(self, n: int) -> int: ...
    def packed_size(self, n: int, k: int) -> int: ...
    def pack(self, weight: int, n: int, k: int, ldw: int, packed: int) -> None: ...
    def linear(
        self,
        x: int,
        x_bf16: bool,
        m: int,
        k: int,
        ldx: int,
        packed: int,
        n: int,
        bias: int,
        y: int,
        y_bf16: bool,
        ldy: int,
        num_threads: int,
    ) -> None: ...

class _GemmFp16(Protocol):
    PANEL: int
    def supported(self) -> bool: ...
    def num_panels(self, n: int) -> int: ...
    def pack(self, weight: int, n: int, k: int, ldw: int, packed: int) -> None: ...
    def linear(
        self,
        x: int,
        m: int,
        k: int,
        ldx: int,
        packed: int,
        n: int,
        bias: int,
        y: int,
        ldy: int,
        num_threads: int,
    ) -> None: ...
    def linear_bf16(
        self,
        x: int,
        m: int,
        k: int,
        ldx: int,
        packed: int,
        n: int,
        bias: int,
        y: int,
        ldy: int,
        num_threads: int,
    ) -> None: ...

class _GemmFp8(Protocol):
    PANEL: int
    def supported(self) -> bool: ...
    def num_panels(self, n: int) -> int: ...
    def linear(
        self,
        x: int,
        x_bf16: bool,
        m: int,
        k: int,
        ldx: int,
        packed: int,
        n: int,
        scale: int,
        bias: int,
        y: int,
        y_bf16: bool,
        ldy: int,
        num_threads: int,
    ) -> None: ...

class _GemmQ(Protocol):
    PANEL: int
    BLOCK: int
    def supported(self) -> bool: ...
    def supports_int8_activations(self) -> bool: ...
    def supports_q6_kp(self) -> bool: ...
    def set_isa(self, isa: str) -> None: ...
    def get_isa(self) -> str: ...
    def num_panels(self, n: int) -> int: ...
    def record_bytes(self, qtype: int) -> int: ...
    def linear(
        self,
        x: int,
        x_bf16: bool,
        m: int,
        k: int,
        ldx: int,
        packed: int,
        qtype: int,
        n: int,
        bias: int,
        y: int,
        y_bf16: bool,
        ldy: int,
        num_threads: int,
        int8_activations: bool = ...,
    ) -> None: ...

class _Ops(Protocol):
    def rms_norm(
        self,
        out: _View,
        x: _View,
        weight: int,
        num_rows: int,
        hidden: int,
        eps: float,
        dtype: int,
        num_threads: int,
    ) -> None: ...
    def fused_add_rms_norm(
        self,
        x: _View,
        residual: _View,
        weight: int,
        num_rows: int,
        hidden: int,
        eps: float,
        dtype: int,
        num_threads: int,
    ) -> None: ...
    def rotary(
        self,
        q: _View,
        k: _View,
        positions: int,
        cos_sin_cache: int,
        num_tokens: int,
        head_dim: int,
        rotary_dim: int,
        max_pos: int,
        cache_stride: int,
        dtype: int,
        num_threads: int,
    ) -> None: ...
    def silu_and_mul(
        self,
        out: _View,
        gate_up: _View,
        num_rows: int,
        width: int,
        dtype: int,
        num_threads: int,
    ) -> None: ...
    def reshape_and_cache(
        self,
        k: _View,
        v: _View,
        key_cache: int,
        value_cache: int,
        slot_mapping: int,
        num_tokens: int,
        head_dim: int,
        num_slots: int,
        dtype: int,
        num_threads: int,
        cache_fp8: bool = False,
    ) -> None: ...

class _Lora(Protocol):
    def avx512(self) -> bool: ...
    def set_use_avx512(self, on: bool) -> None: ...
    def shrink(
        self,
        buf: int,
        x: int,
        ldx: int,
        a: int,
        slots: int,
        scales: int,
        num_tokens: int,
        in_features: int,
        rank: int,
        num_slots: int,
        dtype: int,
        num_threads: int,
    ) -> None: ...
    def expand(
        self,
        y: int,
        ldy: int,
        buf: int,
        bt: int,
        slots: int,
        num_tokens: int,
        out_features: int,
        rank: int,
        num_slots: int,
        dtype: int,
        num_threads: int,
    ) -> None: ...

attention: _Attention
gemm: _Gemm
gemm_bf16: _GemmBf16
gemm_fp16: _GemmFp16
gemm_fp8: _GemmFp8
gemm_q: _GemmQ
ops: _Ops
lora: _Lora
