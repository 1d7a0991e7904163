"""The GPU model catalogue: which models exist and how much VRAM each has.

Users extend it (a site with A10s or an in-house model name) by building a
new catalogue with ``DEFAULT_CATALOG.extend(...)``; the default is immutable so
no import can change another's view of the hardware.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str
    vram_mib: int
    #: Relative value of the card, used only to prefer placing a job that
    #: accepts several models on the least valuable one that fits.
    rank: int = 0


class GpuCatalog:
    """An immutable mapping of GPU model name to :class:`GpuModel`."""

    __slots__ = ("_models",)

    def __init__(self, models: Iterable[GpuModel]) -> None:
        table: dict[str, GpuModel] = {}
        for m in models:
            if not m.name or m.vram_mib <= 0:
                raise ValueError(f"GPU model {m.name!r} needs a name and a positive VRAM size")
            table[m.name] = m
        self._models: Mapping[str, GpuModel] = MappingProxyType(table)

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __getitem__(self, name: str) -> GpuModel:
        try:
            return self._models[name]
        except KeyError:
            raise KeyError(
                f"unknown GPU model {name!r}; known models: {', '.join(sorted(self._models))}"
            ) from None

    def get(self, name: str) -> GpuModel | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return sorted(self._models)

    def extend(self, models: Iterable[GpuModel]) -> GpuCatalog:
        """A new catalogue with ``models`` added (or replacing same-named ones)."""
        return GpuCatalog([*self._models.values(), *models])

    def __len__(self) -> int:
        return len(self._models)


DEFAULT_CATALOG = GpuCatalog(
    [
        GpuModel("P100", 16384, rank=1),
        GpuModel("T4", 16384, rank=2),
        GpuModel("V100-16GB", 16384, rank=3),
        GpuModel("V100-32GB", 32768, rank=4),
        GpuModel("L4", 24576, rank=3),
        GpuModel("A10", 24576, rank=4),
        GpuModel("A100-40GB", 40960, rank=6),
        GpuModel("A100-80GB", 81920, rank=7),
        GpuModel("H100-80GB", 81920, rank=8),
        GpuModel("H200-141GB", 144384, rank=9),
    ]
)
