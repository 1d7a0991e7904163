"""A ClusterSpec from Slurm's node table, and the GPU model a GRES type names."""

from __future__ import annotations

from mlwe.backends.slurm.commands import SlurmCommands
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.spec import ClusterSpec, NodeSpec


def gpu_model_of(gres_type: str, catalog: GpuCatalog = DEFAULT_CATALOG) -> str | None:
    """The catalogue model a GRES type names (``t4`` -> ``T4``, ``a100_80gb`` -> ``A100-80GB``)."""
    def norm(s: str) -> str:
        return "".join(c for c in s.lower() if c.isalnum())

    want = norm(gres_type)
    for name in catalog.names():
        if norm(name) == want:
            return name
    family = [n for n in catalog.names() if norm(n.split("-")[0]) == want]
    if family:
        return max(family, key=lambda n: (catalog[n].vram_mib, catalog[n].rank))
    return None


def discover_cluster(commands: SlurmCommands, partition: str | None = None,
                     catalog: GpuCatalog = DEFAULT_CATALOG) -> ClusterSpec:
    """A ClusterSpec of Slurm's nodes (in ``partition``, if given) as Slurm reports them.

    A node whose GPUs are of a type the catalogue does not know is refused with
    the reason (extend the catalogue, or write the cluster file by hand)."""
    specs = []
    problems = []
    for n in sorted(commands.nodes(), key=lambda n: n.name):
        if partition and partition not in n.partitions:
            continue
        gpus = {t: c for t, c in n.gpus.items() if c > 0}
        model = None
        if len(gpus) > 1:
            problems.append(f"node {n.name}: several GPU types {sorted(gpus)} (mlwe nodes have"
                            " one model)")
            continue
        if gpus:
            gtype = next(iter(gpus))
            model = gpu_model_of(gtype, catalog)
            if model is None:
                problems.append(f"node {n.name}: GRES type {gtype!r} is no known GPU model"
                                f" (known: {', '.join(catalog.names())})")
                continue
        specs.append(NodeSpec(name=n.name, cpu=str(n.cpus), memory=f"{max(1, n.memory_mib)}Mi",
                              gpus=sum(gpus.values()), gpu_model=model,
                              labels={"slurm/partition": ",".join(n.partitions)}))
    if problems:
        raise ValueError("cannot describe the Slurm cluster: " + "; ".join(problems))
    if not specs:
        raise ValueError("Slurm reports no node" + (f" in partition {partition}" if partition
                                                     else ""))
    return ClusterSpec(nodes=tuple(specs))
