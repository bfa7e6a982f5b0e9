"""Per-GPU work of one decoder layer under Megatron tensor parallelism: what the cost model charges.

Shared by the cost model and by the offline fit on Vidur's measurements (`fit_vidur`), so that the
constants are fitted on exactly the byte and FLOP counts the simulator later multiplies them by.
"""

from __future__ import annotations

from jpaged.config.presets import ModelSpec

# GEMM kernels per layer in vLLM: fused QKV, attention output, MLP up (LLaMA: fused gate+up), MLP down.
GEMMS_PER_LAYER = 4


def gemm_params_per_layer(spec: ModelSpec, tp: int) -> list[int]:
    """Weights of the layer's GEMMs on one GPU, in elements: [qkv, out, mlp up, mlp down].

    Column-split (qkv, up) and row-split (out, down) matrices both hold 1 / tp of the weights.
    """
    h, f = spec.hidden_size, spec.intermediate_size
    up = (2 if spec.family == "llama" else 1) * h * f  # LLaMA's gate and up projections run as one GEMM
    return [h * (spec.q_size + 2 * spec.kv_size) // tp, spec.q_size * h // tp, up // tp, f * h // tp]


def elementwise_elements_per_token(spec: ModelSpec, tp: int) -> float:
    """Activation elements the layer's non-GEMM, non-attention kernels read plus write per token.

    LLaMA (Vidur's measured op set): two RMSNorms (read + write h each), one residual add (read 2h,
    write h; vLLM fuses the other into the second norm), RoPE on q and k (read + write), SiLU-and-mul
    (read 2f, write f). OPT: two LayerNorms, two residual adds, ReLU (read f, write f); biases are
    fused into the GEMMs. Norms and adds run on the full hidden state on every GPU; RoPE and the
    activation on this GPU's shard.
    """
    h, f = spec.hidden_size, spec.intermediate_size
    if spec.family == "llama":
        return 4 * h + 3 * h + (2 * (spec.q_size + spec.kv_size) + 3 * f) / tp
    return 4 * h + 6 * h + 2 * f / tp
