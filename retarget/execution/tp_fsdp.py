"""fsdp+tp: what FSDP2 must be told about tp's DTensors before it shards them over "dp".

FSDP2 (`fully_shard` over the dp mesh) shards dim 0 of each rank's local tensor and describes
the result as a DTensor on the (dp, tp) mesh. Two kinds of tp parameter need more:

- **Fused parts on dim 0** (GPT-2's c_attn bias [q|k|v], tp placement
  `_StridedShard(0, split_factor=3)`: each tp rank holds [q_r|k_r|v_r]). FSDP2's dp chunks of
  that local tensor cut across the parts, and no DTensor placement describes such chunks:
  FSDP2 labels them `(_StridedShard(0, sf=tp), _StridedShard(0, sf=3))`, which names other
  elements. The local values are right (the loss is), but `full_tensor()` of the parameter and
  of its gradient, state_dict, save_model and the clipping norm read a permuted tensor. Such a
  parameter gets its own FSDP2 parameter group through `fully_shard`'s `shard_placement_fn`:
  sharded over dp on another dim when it has one dp divides (then described exactly), else
  replicated over dp (an HSDP group on a (dp, 1) mesh: FSDP2 all-reduces its gradient over dp,
  casts it under mixed precision and skips it under no-sync, as for every other parameter).
  Cost: each dp rank keeps the whole tp slice of such a parameter (a bias: 3 * hidden / tp).
- **Kept whole, read on one rank's heads** (`replicate_grad_allreduce`: Qwen3's q_norm/k_norm).
  Each tp rank's gradient is partial; under tp alone a hook on the parameter sums it, but FSDP2
  replaces the parameter. Here the parameter becomes a DTensor replicated over tp, and while
  its module runs, the module reads the local tensor through `to_local(grad_placements=
  (Partial(),))`: its gradient arrives as a Partial DTensor, which FSDP2 makes Replicate (the
  sum over tp) before it reduce-scatters over dp, as torch's SequenceParallel norms are handled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from retarget.core.parallel_dims import Meshes

# Names of the (dp, 1) mesh the parameters replicated over dp are placed on.
COPIES, WHOLE = "dp_copies", "dp_whole"


def shard_placement(meshes: Meshes) -> Callable[[nn.Parameter], Any]:
    """`fully_shard`'s shard_placement_fn over the (dp, tp) mesh of `meshes`: None (FSDP2's
    Shard(0)) for every parameter but those tp split as fused parts on dim 0 (module
    docstring)."""
    dp = meshes["dp"]
    replicated: list[HSDPMeshInfo] = []

    def placement(param: nn.Parameter) -> Any:
        if not _fused_on_dim_0(param):
            return None
        local = param.to_local()
        for dim in range(1, local.ndim):
            if local.shape[dim] % dp.size() == 0:
                return Shard(dim)
        if not replicated:
            # One mesh info for every such parameter: FSDP2 groups parameters by it.
            copies = meshes.split("dp", (dp.size(), 1), (COPIES, WHOLE))
            replicated.append(HSDPMeshInfo(mesh=copies, shard_mesh_dim=1, replicate_mesh_dim=0))
        return ShardPlacementResult(placement=Shard(0), mesh_info=replicated[0])

    return placement


def _fused_on_dim_0(param: nn.Parameter) -> bool:
    placements = getattr(param, "placements", ())
    return any(isinstance(p, _StridedShard) and p.dim == 0 for p in placements)


def sum_partial_gradients_over_tp(module: nn.Module, tp_mesh: Any) -> None:
    """Make `module`'s trainable parameters DTensors replicated over `tp_mesh`, read as local
    tensors whose gradients are Partial over tp (module docstring); call before fully_shard."""
    names = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    for name in names:
        whole = getattr(module, name).detach().clone()
        tensor = DTensor.from_local(whole, tp_mesh, [Replicate()], run_check=False)
        module.register_parameter(name, nn.Parameter(tensor))
    held: dict[str, nn.Parameter] = {}

    def read_local(mod: nn.Module, args: Any) -> None:
        for name in names:
            param = mod._parameters[name]
            held[name] = param
            # A plain tensor in _parameters for the length of the forward: the module's code
            # meets the plain activations between split modules, which a DTensor cannot.
            mod._parameters[name] = param.to_local(grad_placements=(Partial(),))  # type: ignore[assignment]

    def put_back(mod: nn.Module, args: Any, output: Any) -> None:
        for name, param in held.items():
            mod._parameters[name] = param
        held.clear()

    module.register_forward_pre_hook(read_local)
    module.register_forward_hook(put_back, always_call=True)
