"""Accelerate's Accelerator properties that the other mixins do not define.

A mixin of `Accelerator`. Each member has Accelerate's name and meaning on this Accelerator, or
raises an error that names it and says why it cannot be honoured (never AttributeError):
tests/compat/accelerate/test_accelerator_parity.py enumerates accelerate.Accelerator's public
members and holds every one to that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from retarget.compat.accelerate.arguments import DistributedType
from retarget.compat.accelerate.parity_state import GradientStateView
from retarget.targets.strategies import FSDP_STRATEGIES

#: fp8 backends as Accelerate's FP8BackendType names them.
_FP8_BACKENDS = {"te": "TE", "msamp": "MSAMP", "torchao": "AO"}


class ParityMembers:
    """dataloader settings, parallelism facts, scaler, gradient_state and the members of
    Accelerate's features retarget does not have (LOMO, Ulysses adapters)."""

    # -- dataloader settings (DataLoaderConfiguration) --------------------------------------

    @property
    def dispatch_batches(self) -> bool:
        return self.shard_options["dispatch_batches"]

    @property
    def non_blocking(self) -> bool:
        """The DataLoaderConfiguration's value; a hint: batches are copied with torch's default
        `.to(device)`, which only differs in speed (CUDA pinned memory), never in the values."""
        return bool(getattr(self.dataloader_config, "non_blocking", False))

    @property
    def use_seedable_sampler(self) -> bool:
        """Whether prepared loaders shuffle from seed + epoch (retarget's seeded order)."""
        return self.shard_options["order"] == "seeded"

    @property
    def use_stateful_dataloader(self) -> bool:
        """False: prepared loaders keep their own position (torchdata is not used)."""
        return False

    # -- what the target distributes -------------------------------------------------------

    @property
    def deepspeed_plugin(self) -> Any:
        """The DeepSpeedPlugin given (realised as a ZeRO target), or None."""
        return self.state.deepspeed_plugin

    @property
    def is_fsdp2(self) -> bool:
        return self.target.strategy in FSDP_STRATEGIES

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def multi_device(self) -> bool:
        """Several processes on accelerator devices (Accelerate's MULTI_GPU and kin)."""
        return self.distributed_type == DistributedType.MULTI_GPU

    @property
    def fp8_backend(self) -> str:
        """The FP8 implementation ("TE", "MSAMP", "AO"; retarget's own name otherwise; "NO")."""
        part = self.target.get("fp8")
        if part is None:
            return "NO"
        backend = str(dict(part.options).get("backend", "auto"))
        return _FP8_BACKENDS.get(backend, backend.upper())

    @property
    def parallelism_config(self) -> Any:
        """The ParallelismConfig given (None: the target says how the model is parallelised)."""
        return getattr(self, "_parallelism_config", None)

    @property
    def torch_device_mesh(self) -> None:
        """None, as in Accelerate without a parallelism_config."""
        return None

    @property
    def should_save_model(self) -> bool:
        return self.state.is_local_main_process

    def _mesh_sizes(self, name: str) -> tuple[int, int, int, int]:
        """(dp_replicate, dp_shard, cp, tp) sizes of Accelerate's mesh order, from the
        parallelism_config given, else from a target with tp or cp; RuntimeError as in
        Accelerate when neither says it."""
        config = getattr(self, "_parallelism_config", None)
        if config is not None:
            fields = ("dp_replicate_size", "dp_shard_size", "cp_size", "sp_size", "tp_size")
            replicate, shard, cp, sp, tp = (getattr(config, f, 1) or 1 for f in fields)
            return replicate, shard, max(cp, sp), tp
        sizes = {
            n: self._part_size(n) for n in ("tp", "cp", "pp") if self.target.get(n) is not None
        }
        if not sizes:
            raise RuntimeError(f"{name}: no parallelism is configured (parallelism_config, tp, cp)")
        tp, cp, pp = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("pp", 1)
        return 1, self.num_processes // (tp * cp * pp), cp, tp

    def _part_size(self, name: str) -> int:
        """The size the target's part `name` gives (0 or unset: every process; absent: 1)."""
        part = self.target.get(name)
        if part is None:
            return 1
        return int(dict(part.options).get("size", 0)) or self.num_processes

    def _rank_on(self, name: str, dim: int) -> int:
        """This process's coordinate on dim `dim` of (replicate, shard, cp, tp), tp innermost
        (under fsdp+pp within its stage's ranks: pp is the outermost dim)."""
        sizes = self._mesh_sizes(name)
        rank, coords = self.process_index % (self.num_processes // self._part_size("pp")), []
        for size in reversed(sizes):
            coords.append(rank % size)
            rank //= size
        return coords[::-1][dim]

    tensor_parallel_rank = property(lambda self: self._rank_on("tensor_parallel_rank", 3))
    context_parallel_rank = property(lambda self: self._rank_on("context_parallel_rank", 2))
    data_parallel_rank = property(lambda self: self._rank_on("data_parallel_rank", 0))
    data_parallel_shard_rank = property(lambda self: self._rank_on("data_parallel_shard_rank", 1))

    @property
    def pipeline_parallel_rank(self) -> int:
        """The stage this process runs under a pp target: its coordinate on the outermost
        mesh dim (pp alone: the process index; fsdp+pp[size=N]: index // (world / N))."""
        if self.target.get("pp") is None:
            raise RuntimeError(
                "pipeline_parallel_rank: the target has no pipeline parallelism (pp[size=N])"
            )
        return self.process_index // (self.num_processes // self._part_size("pp"))

    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Accelerate shards `buffers` along the sequence in place for the model's call; here
        the compiled model cuts each whole batch to this rank's share itself (under cp the
        model takes the whole sequence and returns the whole loss), so the buffers stay whole
        and nothing needs restoring: the same code runs, with or without cp."""
        yield

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        raise NotImplementedError(
            "lomo_backward: LOMO optimizers are not supported (prepare refuses them); use "
            "accelerator.backward(loss) with a torch optimizer"
        )

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: nn.Module) -> Any:
        raise NotImplementedError(
            "deepspeed_ulysses_dl_adapter: DeepSpeed Ulysses sequence parallelism is not supported"
        )

    def verify_device_map(self, model: nn.Module) -> bool:
        """Whether `model` (or a submodule) was dispatched across several devices with a
        device_map (such a model cannot be prepared for distributed training)."""
        return any(len(getattr(m, "hf_device_map", {})) > 1 for m in model.modules())

    # -- Accelerate's instance attributes ----------------------------------------------------

    def _handler(self, name: str) -> Any:
        return next((h for h in self.kwargs_handlers.values() if type(h).__name__ == name), None)

    ddp_handler = property(lambda self: self._handler("DistributedDataParallelKwargs"))
    init_handler = property(lambda self: self._handler("InitProcessGroupKwargs"))
    scaler_handler = property(lambda self: self._handler("GradScalerKwargs"))
    fp8_recipe_handler = property(lambda self: self._handler("FP8RecipeKwargs"))
    ao_recipe_handler = property(lambda self: self._handler("AORecipeKwargs"))
    te_recipe_handler = property(lambda self: self._handler("TERecipeKwargs"))
    msamp_recipe_handler = property(lambda self: self._handler("MSAMPRecipeKwargs"))
    device_placement = True
    """Always: the runtime places models and batches (device_placement=False is refused)."""
    has_lomo_optimizer = False
    rng_types = ("generator",)
    """What prepared loaders keep in sync across processes (Accelerate's default)."""

    @property
    def has_fp8_handler(self) -> bool:
        names = ("FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs")
        return any(self._handler(name) is not None for name in names)

    @property
    def fp8_enabled(self) -> bool:
        return self.mixed_precision == "fp8"

    @property
    def native_amp(self) -> bool:
        """Whether torch's autocast runs the mixed precision (bf16, fp16)."""
        return self.mixed_precision in ("bf16", "fp16")

    @property
    def delayed_fp8_autocast(self) -> bool:
        """Accelerate's rule: TE's FP8 autocast waits for the DDP/FSDP wrapper."""
        distributed = self.distributed_type in (DistributedType.MULTI_GPU, DistributedType.FSDP)
        return self.fp8_backend == "TE" and distributed

    @property
    def log_with(self) -> list[Any]:
        """The trackers asked for (as given to log_with=)."""
        return list(self._trackers.specs)

    # -- training state Accelerate exposes as attributes ----------------------------------

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint gets (checkpoint_<n>)."""
        from retarget.runtime.state.checkpoint import numbered_checkpoints

        project = self.project_configuration.checkpoints()
        existing = numbered_checkpoints(project) if project is not None else []
        return int(existing[-1].name.rpartition("_")[2]) + 1 if existing else 0

    @property
    def gradient_state(self) -> GradientStateView:
        return GradientStateView(self)

    @property
    def scaler(self) -> Any:
        """The torch GradScaler of the prepared model's fp16 loss scaling, else None (what
        Accelerate's is; the runtime's LossScaler drives it)."""
        if not self._models:
            if self.mixed_precision == "fp16":
                raise RuntimeError(
                    "scaler: the fp16 loss scaler is created when prepare() compiles the "
                    "model; read accelerator.scaler after prepare"
                )
            return None
        scaler = self._models[0].runtime.scaler
        return None if scaler is None else scaler.grad_scaler
