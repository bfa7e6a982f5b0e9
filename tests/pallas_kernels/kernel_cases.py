"""Random paged-KV test cases for the kernel tests: pools, shuffled block tables, stale slots.

A case is built from dense per-sequence K/V; the dense copies are the oracle's input. Every slot
of the pool that no live token owns (block 0, free blocks, the tail of each last block) is filled
with `stale` (NaN by default), and padded block-table entries point at block 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# On a GPU the kernels are compiled through Triton (experiments/gpu_check.sh); elsewhere interpreted.
INTERPRET = jax.default_backend() != "gpu"


@dataclasses.dataclass
class PagedCase:
    """One layer's pool plus the tables of a batch of sequences, and the dense truth."""

    k_pages: np.ndarray  # [Hkv, N, Bs, D]
    v_pages: np.ndarray  # [Hkv, N, Bs, D]
    block_tables: np.ndarray  # i32[S, M]
    context_lens: np.ndarray  # i32[S]
    k_dense: list[np.ndarray]  # per sequence [Hkv, len, D]
    v_dense: list[np.ndarray]  # per sequence [Hkv, len, D]

    def device(self, dtype):
        """(k_pages, v_pages, block_tables, context_lens) as jax arrays, pools cast to `dtype`."""
        return (jnp.asarray(self.k_pages, dtype), jnp.asarray(self.v_pages, dtype),
                jnp.asarray(self.block_tables), jnp.asarray(self.context_lens))


def make_case(rng: np.random.Generator, context_lens, *, block_size: int, num_kv_heads: int, head_dim: int,
              max_blocks: int | None = None, spare_blocks: int = 3, stale: float = np.nan) -> PagedCase:
    """Place sequences of the given lengths in a pool at a random permutation of its blocks."""
    lens = np.asarray(context_lens, np.int32)
    needed = [-(-int(n) // block_size) for n in lens]
    max_blocks = max_blocks or max(max(needed), 1)
    num_blocks = 1 + sum(needed) + spare_blocks  # block 0 is the reserved padding target
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pages, v_pages = np.full(shape, stale, np.float32), np.full(shape, stale, np.float32)
    order = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(lens), max_blocks), np.int32)
    k_dense, v_dense, used = [], [], 0
    for s, (n, nb) in enumerate(zip(lens, needed)):
        tables[s, :nb] = order[used:used + nb]
        used += nb
        k = rng.standard_normal((num_kv_heads, int(n), head_dim)).astype(np.float32)
        v = rng.standard_normal((num_kv_heads, int(n), head_dim)).astype(np.float32)
        for t in range(int(n)):
            k_pages[:, tables[s, t // block_size], t % block_size] = k[:, t]
            v_pages[:, tables[s, t // block_size], t % block_size] = v[:, t]
        k_dense.append(k)
        v_dense.append(v)
    return PagedCase(k_pages, v_pages, tables, lens, k_dense, v_dense)


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, scale: float) -> np.ndarray:
    """Float64 oracle: q [Q, Hq, D] at `positions` attends causally to k, v [Hkv, L, D] -> [Q, Hq, D]."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[0]
    group = num_q_heads // num_kv_heads
    out = np.zeros(q.shape, np.float64)
    for h in range(num_q_heads):
        kh, vh = k[h // group].astype(np.float64), v[h // group].astype(np.float64)
        for i, pos in enumerate(positions):
            s = kh[:pos + 1] @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ vh[:pos + 1] / p.sum()
    return out


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
