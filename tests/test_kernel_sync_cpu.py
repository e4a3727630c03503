"""What orders the memory that the routing, permutation and finalize kernels share between threads and CTAs, read
from their SASS for sm_90a (no GPU): the fused kernel's barrier after clearing its masks on plain CTAs, the
histogram permutation's acquire fence and ticket reset, every slot of small_batch's flags and weights. Shipped
builds also keep their values in registers (as test_routing_cpu.py and test_compile.py check for every one); the
others are shapes a tuner or a user may pick, checked for the ordering only (NVRTC 13.5 once gave a one-CTA
kimi-k3 build with 2 warps a token an 8-byte stack frame, in one compile of 17 of the same source)."""
import math
import re

import pytest

from kerngen import jit, resources, tiers
from kerngen.cache import DiskCache
from kerngen.ops import routing as rt
from kerngen.plan import spec_for
from tests.helpers import assert_no_spills
from tests.gpu.test_routing_fused_ctas1 import CONFIGS as FUSED_CTAS1_CONFIGS

PARAMS_BASE = 0x210   # sm_90: kernel parameters start at c[0x0][0x210]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return DiskCache(tmp_path_factory.mktemp("kernel-sync-cache"))


def sass(spec, store, spills_checked=True) -> dict[str, list[str]]:
    """{function: [instruction, ...]} of a freshly built spec."""
    built = jit.build(spec, store=store)
    if spills_checked:
        assert_no_spills(built.files)
    out, body = {}, None
    for line in resources.sass(built.files).splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            body = out.setdefault(m.group(1), [])
        elif body is not None and re.match(r"\s*/\*[0-9a-f]+\*/", line):
            body.append(" ".join(re.sub(r"/\*[^*]*\*/", "", line).split()))
    return out


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split(" ", 1)[0]


def first(body, prefix, start=0):
    return next(i for i in range(start, len(body)) if opcode(body[i]).startswith(prefix))


def shipped(variant, pred=lambda s: True):
    t = tiers.load()
    specs = []
    for m in t.models.values():
        specs += [s for s in rt.model_specs(m, t, "sm_90a") if s.variant == variant and pred(s) and s not in specs]
    return specs


def fused_ctas1_specs():
    """(spec, shipped): the shipped one-CTA rules (T = 1 only) at fp32 logits, and the shapes the GPU test runs at
    2 to 16 tokens."""
    specs = [(s, True) for s in shipped("fused", lambda s: dict(s.params)["ctas"] == 1 and "-f32-" in s.tag)]
    for name in ("kimi-k3", "mixtral-8x7b"):
        m = tiers.load().model(name)
        tag, consts = rt.tag_constants(m.num_experts, m.top_k, m.routing, m.n_group, m.topk_group, m.renormalize,
                                       "float32", "float32", m.weights_dtype)
        specs += [(spec_for(tiers.Rule(op="routing", variant="fused", ranges={}, params=p), tag, consts, "sm_90a"),
                   False) for p in FUSED_CTAS1_CONFIGS]
    return specs


@pytest.mark.parametrize("spec,is_shipped", fused_ctas1_specs(),
                         ids=lambda s: f"{s.tag}-{dict(s.params)}" if hasattr(s, "tag") else str(s))
def test_fused_on_plain_ctas_clears_the_masks_behind_a_cta_barrier(spec, is_shipped, store):
    """A CTA barrier between the clear of mask_s / used_s and the grid-dependency wait (ACQBULK), so no token
    group ORs a pick into a mask before every thread has cleared its part."""
    body = sass(spec, store, spills_checked=is_shipped)["routing_fused"]
    assert first(body, "BAR.SYNC") < first(body, "ACQBULK")


def test_fused_on_clusters_adds_no_cta_barrier(store):
    """The barrier is compiled into one-CTA builds only: with a cluster, its barrier already orders the clears
    (the shipped cluster builds keep their SASS)."""
    spec = next(s for s in shipped("fused", lambda s: dict(s.params)["ctas"] == 8) if s.tag.startswith("E896"))
    body = sass(spec, store)["routing_fused"]
    assert not any(opcode(ins).startswith("BAR.SYNC") for ins in body[:first(body, "ACQBULK")])


@pytest.mark.parametrize("spec", shipped("histogram"), ids=lambda s: s.tag)
def test_histogram_last_cta_fences_after_its_ticket_and_place_resets_it(spec, store):
    f = sass(spec, store)
    offsets = f["permute_offsets"]
    ticket = first(offsets, "ATOMG")   # atomicAdd on the ticket, the kernel's only global atomic
    assert first(offsets, "MEMBAR", ticket) < first(offsets, "LDG", ticket)   # acquire before reading counts
    ticket_ptr = f"c[0x0][{PARAMS_BASE + 8 * 8:#x}]"   # Params: ids, counts, ..., hist, then ticket (9th pointer)
    place = f["permute_place"]
    assert any(ticket_ptr in ins for ins in place[:first(place, "EXIT")])
    assert any(opcode(ins).startswith("STG") and ins.endswith("RZ ;") for ins in place)


# the tuner's small_batch candidates (block_x x loads_per_group) at top_k above 32: fewer threads than K
@pytest.mark.parametrize("H,K,block_x,loads_per_group", [(1024, 64, 8, 32), (2048, 40, 16, 32), (2048, 64, 16, 32)])
def test_small_batch_writes_every_slot_with_fewer_threads_than_top_k(H, K, block_x, loads_per_group, store):
    """Each thread writes the flag and the weight of slots tid, tid + BX*GY, ...: 2 * ceil(K / (BX*GY)) shared
    stores of 32 bits before the CTA barrier."""
    rule = tiers.Rule(op="finalize", variant="small_batch", ranges={},
                      params=dict(block_x=block_x, loads_per_group=loads_per_group, pdl=True, early_read=False))
    spec = spec_for(rule, f"H{H}-K{K}-bf16-wf32", {"H": H, "K": K, "DTYPE": "bfloat16", "WDTYPE": "float32"},
                    "sm_90a")
    body = sass(spec, store, spills_checked=False)["finalize_small_batch"]
    threads = block_x * math.ceil(K / min(loads_per_group, K))
    assert threads < K
    stores = [ins for ins in body[:first(body, "BAR.SYNC")] if opcode(ins) == "STS"]
    assert len(stores) == 2 * math.ceil(K / threads)
