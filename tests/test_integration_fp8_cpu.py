"""transformers' fine-grained fp8 experts (FP8Experts: e4m3 weights, fp32 scales per 128 x 128 block) served by the
"kerngen" experts implementation, on the CPU, against transformers' own experts module holding the dequantized
weights (w * block scale), in a tiny DeepSeek-V3 model built from its config."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

from tests.test_integration_transformers import TOL_FUSED, inputs, kt, moe_blocks, rel_err, run_block, tiny  # noqa: E402

FP8 = torch.float8_e4m3fn


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 weights, fp32 scales [E, N/128, K/128]), amax / 448 per block, as fp8 checkpoints hold."""
    E, N, K = w.shape
    blocks = w.float().view(E, N // 128, 128, K // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).to(FP8).view(E, N, K)
    return q, scale


def dequantized(q, scale):
    return q.float() * scale.repeat_interleave(128, 1).repeat_interleave(128, 2)


def fp8_model(seed=0):
    """A tiny DeepSeek-V3 (hidden 256, expert intermediate 128) whose experts are replaced by FP8Experts holding
    the block-quantized weights; returns (model, [(block, fp8 experts, reference experts)])."""
    model = tiny("deepseek_v3-grouped", seed=seed, hidden_size=256, moe_intermediate_size=128)
    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    pairs = []
    for block in moe_blocks(model):
        ref = block.experts
        new = cls(config=ref.config, block_size=(128, 128), activation_scheme="dynamic", scale_fmt="float",
                  has_bias=False, has_gate=True).eval()
        for name in ("gate_up_proj", "down_proj"):
            q, s = quantize(getattr(ref, name).data)
            getattr(new, name).data = q
            getattr(new, f"{name}_scale_inv").data = s
            getattr(ref, name).data = dequantized(q, s).to(getattr(ref, name).dtype)   # transformers' reference
        pairs.append((block, new, ref))
    return model, pairs


def test_fp8_experts_are_recognized():
    _, pairs = fp8_model()
    _, new, ref = pairs[0]
    assert kt.fp8_activation(new) == "silu" and kt.fp8_activation(ref) is None
    new.activation_scheme = "static"
    assert kt.fp8_activation(new) is None


@pytest.mark.parametrize("T", [1, 5, 40])
def test_kerngen_fp8_experts_match_transformers_dequantized_experts(T):
    model, pairs = fp8_model()
    block, new, ref = pairs[0]
    x = inputs(model, T, torch.float32)
    want = run_block(block, x)                    # transformers' router and its eager experts on w * scale
    block.experts = new
    kt.enable(model)
    assert new.config._experts_implementation == kt.NAME
    got = run_block(block, x)
    # kerngen.experts rounds the intermediate and its output rows to bf16 (its contract): TOL_FUSED of eager
    assert rel_err(got, want) <= TOL_FUSED, rel_err(got, want)
    block.experts = ref
    assert rel_err(run_block(block, x), want) <= 1e-5   # kerngen's router on the reference experts
