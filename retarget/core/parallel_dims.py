"""The parallel dimensions of a run: every degree in one record, and the one place that makes
device meshes and process groups from them.

    >>> dims = ParallelDims(world_size=8, pp=2, dp_shard=2, tp=2, used=("pp", "dp", "tp"))
    >>> dims.mesh_shape()
    (('pp', 2), ('dp', 2), ('tp', 2))

The degrees multiply to the world: pp x dp_replicate x dp_shard x cp x tp = world_size, checked
when the record is made (ValueError naming the degrees and the world). ep, expert parallelism,
adds no factor: its ranks are carved out of dp_shard x cp (as torchtitan lays it out), so it must
divide that product; the record checks it and builds nothing for it yet.

`ParallelDims.resolve(target, world)` works every degree out of the target once, checking each
against the world and refusing (TargetNotSupportedError, or ValueError for hsdp's sizes) with
the part and key that do not fit; `Program.parallel_dims()` resolves it on first use, inside the
first pass that reads it, so its refusal surfaces as that pass's. The planners read their degree
from it (split_context cp, shard_tp tp, split_stages pp, shard_fsdp the data-parallel mesh) and
the appliers take every mesh and process group from its `Meshes`, here; nothing else works a
degree or a mesh shape out. `unplanned(plan)` names a dimension whose planner made no record (a
pass disabled), which apply_plan refuses rather than lay out a mesh nothing fills.

The degree `world_size` is the world the plan lays out: the processes, except for a plan made in
one process for more (tp[size=2] planned in a world of one lays out 2; nothing is applied).

The mesh has one dimension per part the plan uses, outermost first, in torchtitan's order: "pp",
then data parallelism, then "cp", then "tp" innermost (tp's collectives run in every layer; its
ranks are consecutive, as they would share a machine). Data parallelism is one dimension, "dp"
(fsdp/zero2/zero3 shard over it, ddp replicates over it), or two, "replicate" and "shard", for
hsdp. A used dimension stays in the mesh at degree 1 (fsdp+tp[size=2] on 2 processes is a (1, 2)
mesh; hsdp[replicate=2,shard=1] a (2, 1) one), so an applier never asks which dimensions exist.

`Meshes` makes the DeviceMesh on first use (DDP alone never needs one) and the derived meshes and
groups on first use too, each once. Making a group is collective: every rank runs the same apply
code and asks for the same ones in the same order.

    what                      who reads it
    fsdp()                    fully_shard: "dp", the flattened "dp_cp" under cp, or hsdp's 2-D
    mesh["tp"]                torch's tp styles, async tp, the tp+pp stage blocks
    mesh["pp"]                the pipeline schedule's group
    mesh["cp"]                the attention op's group
    data()                    loaders and gather_for_metrics: the ranks that read different batches
    holders_group(holders)    weights tied across pp stages: their gradients are summed
    split(name, ...)          a dimension viewed as several (tp+fsdp's replicated fused parts)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from retarget.core.errors import TargetNotSupportedError
from retarget.core.world import World
from retarget.targets.grammar import Target
from retarget.targets.strategies import DDP_STRATEGIES, FSDP_STRATEGIES

#: Mesh dimension names, outermost first.
ORDER = ("pp", "replicate", "shard", "dp", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Every parallel degree of a run (module docstring); made once, checked on construction."""

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    """Copies of the model that average gradients (ddp; hsdp's replicate)."""
    dp_shard: int = 1
    """Ranks one parameter is sharded over by data parallelism (fsdp; hsdp's shard)."""
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallelism: experts split over ep ranks carved out of dp_shard x cp."""
    used: tuple[str, ...] = ()
    """The mesh's dimensions (names of ORDER): those the plan's parts shard or replicate over."""

    def __post_init__(self) -> None:
        degrees = self.degrees()
        for name, degree in [*degrees.items(), ("ep", self.ep)]:
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"ParallelDims: {name}={degree!r} must be a whole number >= 1")
        product = math.prod(degrees.values())
        if product != self.world_size:
            shown = " x ".join(f"{k}={v}" for k, v in degrees.items() if v > 1) or "1"
            raise ValueError(
                f"ParallelDims: {shown} lays out {product} processes, but the world has "
                f"{self.world_size}; the degrees must multiply to the number of processes"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ParallelDims: ep={self.ep} must divide dp_shard x cp = "
                f"{self.dp_shard * self.cp} (the ranks expert parallelism is carved out of)"
            )
        unknown = [name for name in self.used if name not in ORDER]
        if unknown or ("dp" in self.used and "shard" in self.used):
            raise ValueError(f"ParallelDims: used={self.used!r}: names from {ORDER}, one dp form")

    def degrees(self) -> dict[str, int]:
        """The factors of the world, outermost first."""
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    @property
    def dp(self) -> int:
        """The data-parallel degree: the ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    def size_of(self, name: str) -> int:
        """The degree of mesh dimension `name`."""
        return {
            "pp": self.pp,
            "replicate": self.dp_replicate,
            "shard": self.dp_shard,
            "dp": self.dp,
            "cp": self.cp,
            "tp": self.tp,
        }[name]

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """(name, degree) of each mesh dimension, outermost first."""
        return tuple((name, self.size_of(name)) for name in ORDER if name in self.used)

    @classmethod
    def resolve(cls, target: Target, world: World) -> ParallelDims:
        """Every degree `target` asks for in `world`, checked (module docstring)."""
        data = next((n for n in FSDP_STRATEGIES if n in target), None)
        replicated = next((n for n in DDP_STRATEGIES if n in target), None)
        cp = _cp_degree(target, world)
        tp = _tp_degree(target, world, data)
        pp = _pp_degree(target, world, tp, data)
        used = [name for name in ("pp", "cp", "tp") if name in target]
        replicate = shard = 1
        if data == "hsdp":
            part = target.get("hsdp")
            replicate, shard = world.hsdp_mesh(part.get("replicate"), part.get("shard"))
            used += ["replicate", "shard"]
        elif data is not None:
            # pp[size=0] (the whole world) leaves one rank per stage
            shard = max(world.size // (tp * pp * cp), 1)
            used.append("dp")
        elif replicated is not None:
            replicate = max(world.size // (tp * pp * cp), 1)
            used.append("dp")
        degrees = (pp, replicate, shard, cp, tp)
        return cls(
            world_size=math.prod(degrees),
            pp=pp,
            dp_replicate=replicate,
            dp_shard=shard,
            cp=cp,
            tp=tp,
            used=tuple(name for name in ORDER if name in used),
        )

    def unplanned(self, plan: Any) -> list[str]:
        """The used dimensions whose planner left no record on `plan` (core.plans.Plan)."""
        records = {
            "pp": plan.pp,
            "cp": plan.cp,
            "tp": plan.tp,
            "dp": plan.fsdp or plan.ddp,
            "replicate": plan.fsdp,
            "shard": plan.fsdp,
        }
        return [name for name in self.used if records[name] is None]

    def describe(self) -> str:
        shape = self.mesh_shape()
        if not shape:
            return f"{self.world_size} process{'es' if self.world_size != 1 else ''}, no mesh"
        return f"mesh {' x '.join(n for n, _ in shape)} {tuple(s for _, s in shape)}"


def _cp_degree(target: Target, world: World) -> int:
    """cp[size=N]: N ranks per context-parallel group (0: the whole world), N >= 2 dividing it."""
    if "cp" not in target:
        return 1
    size = target.get("cp").get("size") or world.size
    if size < 2 or world.size % size:
        raise TargetNotSupportedError(
            f"cp[size={size}]: the context-parallel degree must be at least 2 and divide the "
            f"{world.describe()}; launch a multiple of {max(size, 2)} processes "
            "or set cp[size=...]"
        )
    return size


def _tp_degree(target: Target, world: World, data: str | None) -> int:
    """tp[size=N]: N ranks per tp group; alone it fills the world (size 0 says so)."""
    if "tp" not in target:
        return 1
    size, pipeline = target.get("tp").get("size"), "pp" in target
    if size == 0:
        if pipeline:
            raise TargetNotSupportedError(
                "tp+pp: say the tensor-parallel degree, tp[size=N] (each stage runs on N "
                "ranks; the pipeline spans the processes / N)"
            )
        if data:
            raise TargetNotSupportedError(
                f"{data}+tp: say the tensor-parallel degree, tp[size=N] (the "
                "data-parallel degree is then the processes / N)"
            )
        return world.size
    if world.size > 1 and world.size % size:
        raise TargetNotSupportedError(f"tp[size={size}] does not divide the {world.size} processes")
    if world.size > 1 and not (data or pipeline) and size != world.size:
        raise TargetNotSupportedError(
            f"tp[size={size}] alone on {world.size} processes would leave "
            f"{world.size // size} copies that never synchronise: use fsdp+tp[size="
            f"{size}] to shard data parallel over the rest, or tp[size={world.size}]"
        )
    return size


def _pp_degree(target: Target, world: World, tp: int, data: str | None) -> int:
    """pp[size=N]: N stages' ranks (0: the processes over tp); fills them unless fsdp shards."""
    if "pp" not in target:
        return 1
    # tp+pp: each stage runs on the ranks of a tp group; the pipeline spans world / tp
    span = world.size // tp
    size = target.get("pp").get("size") or span
    if size < 2 or span % size or (size != span and not data):
        beside = (
            f"a divisor of the {world.describe()} (fsdp shards each stage over the rest)"
            if data
            else f"the {world.describe()} (or add fsdp: fsdp+pp[size=N] shards "
            "each stage over world / N ranks)"
        )
        raise TargetNotSupportedError(
            f"pp[size={size}]: the pipeline degree must be at least 2 and {beside}"
            + (" (the processes over tp[size=...])" if "tp" in target else "")
        )
    return size


class Meshes:
    """The device mesh of a ParallelDims and what is derived from it, each made once, on first
    use (module docstring). The only maker of meshes and process groups in retarget, besides the
    default (world) group execution.process starts."""

    def __init__(self, dims: ParallelDims, device_type: str):
        self.dims = dims
        self.device_type = device_type
        self._mesh: Any = None
        self._derived: dict[Any, Any] = {}

    @property
    def mesh(self) -> Any:
        """The named DeviceMesh of every used dimension (None when the plan uses none)."""
        if self._mesh is None and self.dims.used:
            from torch.distributed.device_mesh import init_device_mesh

            names, sizes = zip(*self.dims.mesh_shape(), strict=True)
            self._mesh = init_device_mesh(self.device_type, sizes, mesh_dim_names=names)
        return self._mesh

    def __getitem__(self, names: str | tuple[str, ...]) -> Any:
        """The sub-mesh of one dimension or several (the mesh itself when they are all)."""
        key = (names,) if isinstance(names, str) else tuple(names)
        if key == tuple(self.dims.used):
            return self.mesh
        return self.mesh[key[0] if len(key) == 1 else key]

    def has(self, name: str) -> bool:
        return name in self.dims.used

    def fsdp(self) -> Any:
        """What fully_shard shards over: the data-parallel dimension(s), flattened with cp's
        (under cp FSDP2 spans dp x cp, its ranks holding different positions of one batch)."""
        if self.has("shard"):
            return self["replicate", "shard"]
        if self.has("cp"):
            return self._flat(("dp", "cp"), "dp_cp")
        return self["dp"]

    def data(self) -> tuple[int, int, Any] | None:
        """(rank, size, group) among the ranks that read different batches; None when that is
        every rank (the process itself)."""
        if self.dims.dp == self.dims.world_size:
            return None
        if not self.has("dp"):  # tp, pp or both fill the world: every rank reads one batch
            return (0, 1, None)
        dp = self["dp"]
        return (dp.get_local_rank(), dp.size(), dp.get_group())

    def holders_group(self, holders: tuple[int, ...]) -> Any:
        """The process group of the pp stages `holders` (pp coordinates) at this rank's position
        in the other dimensions; made on every rank, one group per position."""
        import torch.distributed as dist

        key = ("holders", holders)
        if key not in self._derived:
            mesh = self.mesh
            # global ranks, [pp][the other dims flattened]
            grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1).tolist()
            groups = [dist.new_group([grid[h][d] for h in holders]) for d in range(len(grid[0]))]
            me = dist.get_rank()
            self._derived[key] = groups[next(row.index(me) for row in grid if me in row)]
        return self._derived[key]

    def split(self, name: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
        """Dimension `name` viewed as several (DeviceMesh._unflatten), made once."""
        key = ("split", name, sizes, names)
        if key not in self._derived:
            self._derived[key] = self[name]._unflatten(0, sizes, names)
        return self._derived[key]

    def _flat(self, names: tuple[str, ...], flat_name: str) -> Any:
        key = ("flat", names)
        if key not in self._derived:
            self._derived[key] = self[names]._flatten(flat_name)
        return self._derived[key]
