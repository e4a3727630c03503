"""On the GPU: the driver's occupancy query (what the launchers cap their grids with) agrees with kerngen.occupancy's
arithmetic on the cubin (what explain, warmup and the CPU test of the shipped rules use), for every persistent kernel
of the shipped models; and the grids launched are no larger than what every SM holds."""
import pytest
import torch

from kerngen import jit, warmup
from kerngen.launch import resident
from kerngen.ops import experts as ex
from kerngen.ops import _common
from kerngen.plan import target_arch
from tests.test_occupancy import _id, persistent_specs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


@pytest.mark.parametrize("spec", [s for s in persistent_specs() if s.arch == "sm_90a"], ids=_id)
def test_the_driver_holds_what_the_cubin_arithmetic_says(spec):
    if target_arch(0) != spec.arch:
        pytest.skip(f"this GPU is {target_arch(0)}, the spec {spec.arch}")
    rows = warmup.usage(spec, jit.build(spec).files)
    launches = warmup.op_module(spec.op).persistent(spec)
    mod = _common.resolve(spec)
    for u in rows:
        launch = launches[u.function]
        fn = mod.function(u.function, 0)
        assert resident(fn, launch.threads, launch.dynamic_smem) == u.resident, (spec.tag, u)


@pytest.mark.parametrize("spec", [s for s in persistent_specs() if s.op == "experts"][:6], ids=_id)
def test_experts_grids_fit_on_the_sms(spec):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k = ex.Kernels(spec, 0)
    fits = {u.function: u.resident for u in warmup.usage(spec, jit.build(spec).files)}
    for L in k.launchers(10 ** 6):   # more tiles than any grid: the grid is the persistent cap
        assert L.grid[0] <= fits[L.name] * sms, (spec.tag, L.name, L.grid, fits)
