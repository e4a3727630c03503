"""The tier loader under random input: every document either loads or raises TierError, never another
exception. A seeded mutator (no hypothesis): byte edits of the shipped tiers.toml, and value swaps in its
parsed tree written back as TOML."""
import copy
import json
import math
import random
import tomllib

import pytest

from kerngen import env, tiers
from kerngen.errors import TierError

SEED = 20261201
BYTE_CASES = VALUE_CASES = 300
ODD_BYTES = [b"[", b"]", b"[[", b"]]", b"=", b'"', b"'", b"\n", b"{", b"}", b",", b"\xff", b"\xc3", b"\x00", b"#",
             b"inf", b"nan", b"1e999", b"99999999999999999999999", b"-", b".", b"tier", b"models", b"[" * 400]
VALUES = [0, -1, 1, 7, 8, 2**31, 2**63 - 1, -2**63, 0.0, -0.0, 1.5, 1e308, math.inf, -math.inf, math.nan, True, False,
          "", "x", "../../x/evil", "cute", "nvrtc", "small_batch", "fused", "softmax_topk", "\x00", "é", [], [1],
          [1, 2], [2, 1], [0, 2**40], [[1, 2]], ["a", "b"], [1, "a"], {}, {"a": 1}, {"backend": "cute"},
          {"warps": "8"}]


def _toml(v) -> str:
    """A value as inline TOML (strings as JSON, which TOML basic strings accept)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"


def _document(doc: dict) -> str:
    return "".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in doc.items())


def _containers(node, out, depth=0):
    """Every dict and list in the tree (the places a mutation can land), by depth."""
    if isinstance(node, (dict, list)):
        out.setdefault(depth, []).append(node)
        for child in (node.values() if isinstance(node, dict) else node):
            _containers(child, out, depth + 1)
    return out


def _mutate_value(rng: random.Random, doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        levels = _containers(doc, {})   # a depth first, so the top-level tables are hit as often as a param
        node = rng.choice(levels[rng.choice(list(levels))])
        if not node:
            continue
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        action = rng.random()
        if action < 0.6:
            node[key] = copy.deepcopy(rng.choice(VALUES))
        elif action < 0.8:
            del node[key]
        elif isinstance(node, dict):
            node[rng.choice(["color", "op", "variant", "params", "tokens", "top_k", "schema", "tile"])] = \
                copy.deepcopy(rng.choice(VALUES))
        else:
            node.append(copy.deepcopy(rng.choice(node)))
    return doc


def _mutate_bytes(rng: random.Random, text: bytes) -> bytes:
    b = bytearray(text)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(b) + 1)
        action = rng.random()
        if action < 0.3:
            b[i:i + 1] = bytes([rng.randrange(256)])
        elif action < 0.6:
            b[i:i] = rng.choice(ODD_BYTES)
        elif action < 0.8:
            del b[i:i + rng.randint(1, 40)]
        else:
            lines = bytes(b).split(b"\n")
            j = rng.randrange(len(lines))
            lines.insert(j, lines[j])
            b = bytearray(b"\n".join(lines))
    return bytes(b)


def _outcome(path, data: bytes, case: str):
    path.write_bytes(data)
    try:
        models, rules = tiers.parse(path)
    except TierError:
        return "error"
    except Exception as e:  # the bug this test exists for
        pytest.fail(f"{case}: {type(e).__name__}: {e}\n--- document ---\n{data[:3000]!r}")
    assert all(isinstance(m, tiers.Model) for m in models.values()) and all(isinstance(r, tiers.Rule) for r in rules)
    return "loaded"


def test_byte_mutations_load_or_raise_tier_error(tmp_path):
    rng = random.Random(SEED)
    base = env.shipped_tiers().read_bytes()
    outcomes = [_outcome(tmp_path / "t.toml", _mutate_bytes(rng, base), f"byte case {i} (seed {SEED})")
                for i in range(BYTE_CASES)]
    assert outcomes.count("error") > BYTE_CASES // 3 and "loaded" in outcomes   # the mutator reaches both


def test_value_mutations_load_or_raise_tier_error(tmp_path):
    rng = random.Random(SEED + 1)
    base = tomllib.loads(env.shipped_tiers().read_text())
    assert tiers.parse(_write(tmp_path / "same.toml", _document(base)))   # the writer round-trips the table
    outcomes = [_outcome(tmp_path / "t.toml", _document(_mutate_value(rng, base)).encode(),
                         f"value case {i} (seed {SEED + 1})") for i in range(VALUE_CASES)]
    assert outcomes.count("error") > VALUE_CASES // 3 and "loaded" in outcomes


def _write(path, text: str):
    path.write_text(text)
    return path
