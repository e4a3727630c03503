"""What the tests share besides fixtures (those are in conftest.py): SASS checks, tiers texts, the experts CPU path."""
import contextlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def one_thread():
    """Tiny matrices gain nothing from threads, and on a shared CPU their synchronization costs 20x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def user_tiers(tmp_path, monkeypatch, text: str):
    """`text` as the user tier file (KERNGEN_TIERS) inside the block; the shipped table alone after it."""
    from kerngen import tiers
    user = tmp_path / "user_tiers.toml"
    user.write_text(text)
    monkeypatch.setenv("KERNGEN_TIERS", str(user))
    tiers.reload()
    try:
        yield user
    finally:
        monkeypatch.delenv("KERNGEN_TIERS")
        tiers.reload()


def assert_no_spills(files: dict) -> None:
    """Every kernel of a compiled artifact keeps its values in registers (spills are a performance bug that
    compiles and runs correctly, so only this catches them without a GPU)."""
    from kerngen import resources
    for function, use in resources.usage(files):
        assert use.get("STACK", 0) == 0, f"{function[:80]} spills: {use}"


# A user tiers file that sends every finalize to the CuTe DSL variant (few tokens: 16 CTAs per token).
CUTE_FINALIZE_TIERS = """schema = 1

[[tier]]
op = "finalize"
variant = "cute"
tokens = [1, 16]
params = { backend = "cute", ctas = 16, threads = 128, max_loads = 16, pdl = true }

[[tier]]
op = "finalize"
variant = "cute"
params = { backend = "cute", ctas = 1, threads = 256, max_loads = 8, pdl = true }
"""


def gloo_world(worker, tmp_dir, world: int) -> dict:
    """Run worker(rank, init_method, results) in `world` spawned processes (a gloo group each joins through a file
    in tmp_dir); returns the results they left, by rank."""
    import torch.multiprocessing as mp
    init = "file://" + str(tmp_dir / "rendezvous")
    with mp.Manager() as m:
        results = m.dict()
        mp.start_processes(worker, args=(init, results), nprocs=world, start_method="spawn", join=True)
        return dict(results)


def experts_on_cpu(x, routing, w13, w2, **kw):
    """kerngen.experts' rows for CPU tensors as its CPU entry points compute them (kerngen.experts takes CUDA tensors
    only): its checks, the device check aside, then its reference."""
    from kerngen.ops import experts as ex
    ex.check(x, routing, w13, w2, cuda=False, **kw)
    return ex.reference(x, routing, w13, w2, **kw)


def experts_error(**args):
    """The InputError of kerngen.experts for these (CPU) arguments, checked to be the one its CPU entry points' check
    raises (ex.check(..., cuda=False)): one check function, the same error on either path."""
    import kerngen
    from kerngen.ops import experts as ex
    errors = []
    for run in (lambda: kerngen.experts(**args), lambda: ex.check(**args, cuda=False)):
        try:
            run()
        except kerngen.InputError as e:
            errors.append(e)
        else:
            raise AssertionError(f"no InputError for {sorted(args)}")
    assert (errors[0].op, errors[0].arg, str(errors[0])) == (errors[1].op, errors[1].arg, str(errors[1]))
    return errors[0]
