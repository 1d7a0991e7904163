"""WorkloadSpec.command / env: what a real backend runs, validated at the edge."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from mlwe.core import WorkloadSpec


def test_command_and_env_round_trip() -> None:
    w = WorkloadSpec.model_validate({
        "name": "a", "command": ["python", "-m", "mlwe.programs.synthetic", "--work", "3"],
        "env": {"HF_HOME": "/data/hf", "_X1": ""},
    })
    assert w.command == ("python", "-m", "mlwe.programs.synthetic", "--work", "3")
    assert WorkloadSpec.model_validate(w.model_dump()) == w
    assert WorkloadSpec.model_validate_json(w.model_dump_json()) == w
    assert WorkloadSpec.model_validate({"name": "b"}).command == ()  # the simulator needs none


BAD = {
    "empty program": ({"command": [""]}, "command", "command[0] (the program) must not be empty"),
    "NUL in an argument": ({"command": ["a", "b\x00c"]}, "command",
                           "command[1] contains a NUL character"),
    "not a list of strings": ({"command": "python train.py"}, "command", "tuple"),
    "engine's variable": ({"env": {"MLWE_WORKLOAD_ID": "x"}}, "env",
                          "environment variable MLWE_WORKLOAD_ID is set by the engine"),
    "CUDA_VISIBLE_DEVICES": ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env",
                             "CUDA_VISIBLE_DEVICES is set by the engine"),
    "bad name": ({"env": {"2FAST": "1"}}, "env", "environment variable name '2FAST' must be"),
    "NUL in a value": ({"env": {"A": "x\x00"}}, "env", "environment variable A contains a NUL"),
}


@pytest.mark.parametrize(("fields", "loc", "message"), BAD.values(), ids=BAD.keys())
def test_bad_command_or_env_is_refused_naming_the_field(fields: dict[str, Any], loc: str,
                                                        message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        WorkloadSpec.model_validate({"name": "w", **fields})
    (err,) = exc.value.errors()
    assert err["loc"][0] == loc
    assert message in str(exc.value)


def test_the_local_programs_example_names_programs_that_exist() -> None:
    import importlib.util
    from pathlib import Path

    from mlwe.specfile import load_workloads

    path = Path(__file__).resolve().parents[2] / "examples" / "local-programs.yaml"
    specs = load_workloads(path)
    assert len(specs) == 3
    for s in specs:
        assert s.command[:2] == ("python", "-m")
        assert importlib.util.find_spec(s.command[2]) is not None, s.command[2]
