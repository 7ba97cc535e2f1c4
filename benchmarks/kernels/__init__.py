"""The benchmark kernels and a tiny launch spec for each.

Each .cu file here has one extern "C" entry point; `KERNELS` says how to launch
it on a small problem: its buffers (with deterministic contents) and scalars in
argument order, grid and block. benchmarks/kernel_cache_gpu.py launches every
one from the cold path and from a warm cache and compares the buffers byte for
byte, so every kernel is deterministic (no float atomics).
"""

from __future__ import annotations

import ctypes
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Buffer:
    """A device buffer of `count` elements of `dtype` ('f32', 'i32', 'u8', 'u32', 'i8', 'f16'),
    filled uniformly from [lo, hi] with a fixed seed ('zeros' when lo == hi == 0)."""

    count: int
    dtype: str = "f32"
    lo: float = -1.0
    hi: float = 1.0

    @property
    def nbytes(self) -> int:
        return self.count * _SIZES[self.dtype]

    def contents(self, seed: int) -> bytes:
        if self.lo == self.hi == 0:
            return bytes(self.nbytes)
        rng = random.Random(seed)
        if self.dtype == "f32":
            return struct.pack(
                f"<{self.count}f", *(rng.uniform(self.lo, self.hi) for _ in range(self.count))
            )
        fmt = {"i32": "i", "u32": "I", "u8": "B", "i8": "b"}[self.dtype]
        return struct.pack(
            f"<{self.count}{fmt}",
            *(rng.randint(int(self.lo), int(self.hi)) for _ in range(self.count)),
        )


_SIZES = {"f32": 4, "i32": 4, "u32": 4, "u8": 1, "i8": 1, "f16": 2}


def zeros(count: int, dtype: str = "f32") -> Buffer:
    return Buffer(count, dtype, 0, 0)


@dataclass(frozen=True)
class Kernel:
    file: str
    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Buffer | ctypes._SimpleCData[Any], ...]
    shared_mem: int = 0

    @property
    def path(self) -> Path:
        return KERNEL_DIR / self.file

    def source(self) -> str:
        return self.path.read_text()


def i32(v: int) -> ctypes.c_int:
    return ctypes.c_int(v)


def f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(v)


def u32(v: int) -> ctypes.c_uint:
    return ctypes.c_uint(v)


ROWS, COLS = 64, 256
KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "gemm_tiled.cu",
        "gemm_tiled_f32",
        (4, 4, 1),
        (16, 16, 1),
        (Buffer(64 * 48), Buffer(48 * 64), zeros(64 * 64), i32(64), i32(64), i32(48)),
    ),
    Kernel(
        "gemv.cu",
        "gemv_warp_f32",
        (16, 1, 1),
        (128, 1, 1),
        (Buffer(ROWS * COLS), Buffer(COLS), zeros(ROWS), i32(ROWS), i32(COLS)),
    ),
    Kernel(
        "softmax.cu",
        "softmax_rows_f32",
        (ROWS, 1, 1),
        (128, 1, 1),
        (Buffer(ROWS * COLS, lo=-8, hi=8), zeros(ROWS * COLS), i32(COLS)),
    ),
    Kernel(
        "layer_norm.cu",
        "layer_norm_f32",
        (ROWS, 1, 1),
        (128, 1, 1),
        (Buffer(ROWS * COLS), Buffer(COLS), Buffer(COLS), zeros(ROWS * COLS), i32(COLS), f32(1e-5)),
    ),
    Kernel(
        "rms_norm.cu",
        "rms_norm_f32",
        (ROWS, 1, 1),
        (128, 1, 1),
        (Buffer(ROWS * COLS), Buffer(COLS), zeros(ROWS * COLS), i32(COLS), f32(1e-6)),
    ),
    Kernel(
        "fused_add_rms_norm.cu",
        "fused_add_rms_norm_f32",
        (ROWS, 1, 1),
        (128, 1, 1),
        (
            Buffer(ROWS * COLS),
            Buffer(ROWS * COLS),
            Buffer(COLS),
            zeros(ROWS * COLS),
            i32(COLS),
            f32(1e-6),
        ),
    ),
    Kernel(
        "rotary.cu",
        "rotary_embedding_f32",
        (16, 4, 1),
        (32, 1, 1),
        (Buffer(16 * 4 * 64), Buffer(16, "i32", 0, 4096), i32(4), i32(64), f32(10000.0)),
    ),
    Kernel(
        "reduce_sum.cu",
        "reduce_sum_partials_f32",
        (8, 1, 1),
        (256, 1, 1),
        (Buffer(1 << 14), zeros(8), i32(1 << 14)),
    ),
    Kernel(
        "row_argmax.cu",
        "row_argmax_f32",
        (16, 1, 1),
        (128, 1, 1),
        (Buffer(ROWS * COLS, lo=-20, hi=20), zeros(ROWS, "i32"), i32(ROWS), i32(COLS)),
    ),
    Kernel(
        "scan_block.cu",
        "scan_inclusive_block_i32",
        (8, 1, 1),
        (256, 1, 1),
        (Buffer(2048, "i32", 0, 9), zeros(2048, "i32"), i32(2000)),
    ),
    Kernel(
        "scan_warp.cu",
        "scan_exclusive_warp_i32",
        (8, 1, 1),
        (256, 1, 1),
        (Buffer(2048, "i32", 0, 1), zeros(2048, "i32"), zeros(8, "i32"), i32(2048)),
    ),
    Kernel(
        "gelu_bias.cu",
        "gelu_bias_f32",
        (32, 1, 1),
        (256, 1, 1),
        (Buffer(ROWS * COLS, lo=-4, hi=4), Buffer(COLS), zeros(ROWS * COLS), i32(ROWS), i32(COLS)),
    ),
    Kernel(
        "silu_mul.cu",
        "silu_mul_f32",
        (32, 1, 1),
        (256, 1, 1),
        (Buffer(ROWS * 2 * COLS, lo=-6, hi=6), zeros(ROWS * COLS), i32(ROWS), i32(COLS)),
    ),
    Kernel(
        "transpose.cu",
        "transpose_f32",
        (8, 2, 1),
        (32, 8, 1),
        (Buffer(ROWS * COLS), zeros(ROWS * COLS), i32(ROWS), i32(COLS)),
    ),
    Kernel(
        "histogram.cu",
        "histogram256_u8",
        (8, 1, 1),
        (256, 1, 1),
        (Buffer(1 << 15, "u8", 0, 255), zeros(256, "u32"), i32(1 << 15)),
    ),
    Kernel(
        "topk.cu",
        "topk4_rows_f32",
        (ROWS, 1, 1),
        (32, 1, 1),
        (Buffer(ROWS * COLS, lo=-10, hi=10), zeros(ROWS * 4), zeros(ROWS * 4, "i32"), i32(COLS)),
    ),
    Kernel(
        "attention_scores.cu",
        "attention_scores_causal_f32",
        (4, 4, 2),
        (16, 16, 1),
        (
            Buffer(2 * 64 * 32),
            Buffer(2 * 64 * 32),
            zeros(2 * 64 * 64),
            i32(64),
            i32(32),
            f32(32**-0.5),
        ),
    ),
    Kernel(
        "cross_entropy.cu",
        "cross_entropy_f32",
        (ROWS, 1, 1),
        (128, 1, 1),
        (
            Buffer(ROWS * COLS, lo=-5, hi=5),
            Buffer(ROWS, "i32", 0, COLS - 1),
            zeros(ROWS),
            i32(COLS),
        ),
    ),
    Kernel(
        "adamw.cu",
        "adamw_step_f32",
        (16, 1, 1),
        (256, 1, 1),
        (
            Buffer(8192),
            Buffer(8192, lo=-0.1, hi=0.1),
            Buffer(8192, lo=-0.01, hi=0.01),
            Buffer(8192, lo=0, hi=0.001),
            i32(8192),
            f32(1e-3),
            f32(0.9),
            f32(0.999),
            f32(1e-8),
            f32(0.01),
            i32(10),
        ),
    ),
    Kernel(
        "dropout.cu",
        "dropout_hash_f32",
        (16, 1, 1),
        (256, 1, 1),
        (Buffer(8192), zeros(8192), zeros(8192, "u8"), i32(8192), f32(0.1), u32(1234)),
    ),
    Kernel(
        "embedding.cu",
        "embedding_gather_f32",
        (32, 1, 1),
        (64, 1, 1),
        (Buffer(512 * 128), Buffer(32, "i32", 0, 511), zeros(32 * 128), i32(512), i32(128)),
    ),
    Kernel(
        "conv1d_causal.cu",
        "conv1d_causal_depthwise_f32",
        (4, 16, 1),
        (128, 1, 1),
        (Buffer(16 * 512), Buffer(16 * 4), Buffer(16), zeros(16 * 512), i32(16), i32(512)),
    ),
    Kernel(
        "quantize_int8.cu",
        "quantize_rows_int8",
        (ROWS, 1, 1),
        (128, 1, 1),
        (Buffer(ROWS * COLS, lo=-3, hi=3), zeros(ROWS * COLS, "i8"), zeros(ROWS), i32(COLS)),
    ),
    Kernel(
        "cast_f16.cu",
        "cast_f32_to_f16",
        (16, 1, 1),
        (256, 1, 1),
        (Buffer(4096, lo=-100, hi=100), zeros(4096, "f16"), i32(4096)),
    ),
)
