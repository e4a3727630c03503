"""Why the quantized experts kernels widen weights exactly: their bit placement (templates/experts/mma.cu.j2,
e4m3x2_placed, e2m1x2_placed, group_factor, row_factor) emulated here with the same masks and shifts on every code,
checked against kerngen.ops.experts.dequantize; the template is read to pin the constants emulated."""
import re

import torch

from kerngen import env
from kerngen.ops import experts as ex

TEMPLATE = (env.templates_dir() / "experts" / "mma.cu.j2").read_text()
M = 0xFFFFFFFF


def bf16_halves(word: int) -> tuple[float, float]:
    """The two bf16 values of a 32-bit word (low half first), as floats."""
    t = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return t[0].item(), t[1].item()


def bf16x2(v: float) -> int:
    b = torch.tensor([v], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
    return b | b << 16


def mul_bf16x2(a: int, b: int) -> tuple[float, float]:
    """mul.rn.bf16x2 (subnormals kept): an exact product when it is a bf16 value, as here."""
    (a0, a1), (b0, b1) = bf16_halves(a), bf16_halves(b)
    r = torch.tensor([a0 * b0, a1 * b1], dtype=torch.float64)
    assert torch.equal(r.to(torch.bfloat16).double(), r), "the product must be exact"
    return r[0].item(), r[1].item()


def prmt(a: int, b: int, sel: int) -> int:
    src = (a | b << 32).to_bytes(8, "little")
    return int.from_bytes(bytes(src[(sel >> 4 * i) & 7] for i in range(4)), "little")


def test_the_template_holds_the_emulated_constants():
    for pattern in (r"\(t & 0x80008000u\) \| \(\(t >> 4\) & 0x07F007F0u\)", r"BIAS = 0x7B807B80u",
                    r"j % 2 \? 0x3424u : 0x1404u", r"t = w << \(12 - 4 \* P\)",
                    r"\(t & 0x80008000u\) \| \(\(t >> 6\) & 0x01C001C0u\)", r"const int e = 253 \+ \(int\)s - \(int\)m",
                    r"P % 2 \? 0x7632u : 0x5410u", r"m \? \(int\)\(m << 23\) : 0x00400000"):
        assert re.search(pattern, TEMPLATE), pattern


def e4m3x2_placed(r: int, sel: int) -> int:
    t = prmt(r, 0, sel)
    return (t & 0x80008000) | ((t >> 4) & 0x07F007F0)


def test_every_e4m3_code_widens_exactly():
    codes = [c for c in range(256) if c & 0x7F != 0x7F]   # NaN excepted
    want = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()
    got = {}
    for i in range(0, len(codes) - 3, 2):
        r = codes[i] | codes[i + 1] << 8 | codes[(i + 2) % len(codes)] << 16 | codes[(i + 3) % len(codes)] << 24
        for sel, (lo, hi) in ((0x1404, (i, i + 1)), (0x3424, ((i + 2) % len(codes), (i + 3) % len(codes)))):
            a, b = mul_bf16x2(e4m3x2_placed(r, sel), 0x7B807B80)
            got[lo], got[hi] = a, b
    assert [got[i] for i in range(len(codes))] == want


def e2m1x2_placed(w: int, P: int) -> int:
    t = (w << (12 - 4 * P)) & M
    return (t & 0x80008000) | ((t >> 6) & 0x01C001C0)


def test_every_e2m1_code_at_every_place_widens_exactly():
    """Values P and P + 4 of a word (nibble i = value i) land in one bf16x2 as value * 2^-126: every code at every
    place (other nibbles random), times 2^126 gives the code's value."""
    g = torch.Generator().manual_seed(0)
    for c in range(16):
        for P in range(4):
            for _ in range(4):
                nib = torch.randint(0, 16, (8,), generator=g).tolist()
                nib[P], nib[P + 4] = c, 15 - c
                w = sum(n << 4 * i for i, n in enumerate(nib))
                lo, hi = mul_bf16x2(e2m1x2_placed(w, P), bf16x2(2.0 ** 126))
                assert (lo, hi) == (ex.E2M1[c], ex.E2M1[15 - c])


def group_factor(s: int, m: int) -> int:
    e = 253 + s - m
    b = e << 7 if e > 0 else 0
    return b | b << 16


def row_factor(m: int) -> float:
    bits = m << 23 if m else 0x00400000
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def test_scale_bytes_split_between_the_weight_and_the_row_exactly():
    """The weight in the mma is e2m1 * 2^(s - m) (bf16, exact), the row factor 2^(m - 127) (fp32): their product is
    the dequantized weight for every scale byte s <= m with m - s <= 126 and m <= 252 (6 * 2^125, the largest value
    a bf16 weight holds exactly)."""
    for m in (0, 1, 2, 100, 127, 128, 129, 200, 252):
        for s in sorted({m, m - 1, m - 24, m - 126, 0} & set(range(max(0, m - 126), m + 1))):
            f = group_factor(s, m)
            for c in range(1, 16):
                lo, _ = mul_bf16x2(e2m1x2_placed(c, 0), f)   # the code as value 0 of a word
                got = torch.tensor(lo, dtype=torch.float32) * row_factor(m)   # the fp32 sums times the row factor
                want = ex.dequantize(torch.full((1, 1, 1, 16), c, dtype=torch.uint8),
                                     torch.full((1, 1, 1), s, dtype=torch.uint8))[0, 0, 0]
                assert got.item() == want.item(), (m, s, c)


def test_the_activations_are_paired_as_the_weights():
    """b_word's permute pairs activations (P, P + 4) of each 8, as e2m1x2_placed pairs the weights."""
    words = [0x00010000, 0x00030002, 0x00050004, 0x00070006]   # x0..x7 as 16-bit values 0..7, two a word
    for P in range(4):
        v = prmt(words[P // 2], words[P // 2 + 2], 0x7632 if P % 2 else 0x5410)
        assert (v & 0xFFFF, v >> 16) == (P, P + 4)
