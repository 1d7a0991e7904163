"""The backend registry: the kinds it names, the error for any other, what ``sim`` builds,
and that naming a kind loads no backend's dependencies."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from mlwe.core.clock import ManualClock
from mlwe.core.spec import ClusterSpec, NodeSpec
from mlwe.runtime import settings
from mlwe.runtime.backends import BACKENDS, UnknownBackend, backend_kinds, make_backend
from mlwe.sim.live import LiveSimBackend

CLUSTER = ClusterSpec(nodes=(NodeSpec(name="cpu-0", cpu=4, memory="8Gi"),))


def test_kinds_in_registration_order() -> None:
    assert backend_kinds() == ("sim", "local", "ray", "slurm")
    assert tuple(BACKENDS) == backend_kinds()


def test_serve_settings_accept_exactly_the_registered_kinds() -> None:
    assert get_args(settings.Backend) == backend_kinds()


def test_unknown_kind_names_itself_and_the_known_ones() -> None:
    with pytest.raises(UnknownBackend) as exc:
        make_backend("kubernetes", ManualClock(), CLUSTER)
    assert str(exc.value) == (
        "unknown backend 'kubernetes': known backends are sim, local, ray, slurm"
    )
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    ("options", "telemetry_s", "default_s", "seed"),
    [
        pytest.param({}, 5.0, 600.0, 0, id="defaults"),
        pytest.param({"default_duration_s": 5.0}, 5.0, 5.0, 0, id="pipelines"),
        pytest.param(
            {"seed": 7, "telemetry_s": 2.0, "default_duration_s": 300.0}, 2.0, 300.0, 7,
            id="serve",
        ),
    ],
)
def test_sim_is_the_live_simulator_with_the_options_given(
    options: dict[str, float], telemetry_s: float, default_s: float, seed: int
) -> None:
    be = make_backend("sim", ManualClock(), CLUSTER, **options)  # type: ignore[arg-type]
    assert isinstance(be, LiveSimBackend)
    assert be.default_duration_s == default_s
    assert be.seed == seed
    assert be.sim.config.telemetry_interval_s == telemetry_s
    assert be.sim.config.eviction_delay_s == 2.0
    assert be.sim.config.seed == seed
    be.close()


def test_the_registry_loads_no_backend_until_one_is_made() -> None:
    code = (
        "import sys, mlwe.runtime.backends\n"
        "heavy = [m for m in ('ray', 'psutil', 'mlwe.backends.local.backend',"
        " 'mlwe.backends.ray', 'mlwe.backends.slurm') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
