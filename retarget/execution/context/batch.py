"""A whole batch in, this rank's share of the sequence through the model, the whole loss out.

Every rank of a context-parallel group is handed the same whole batch. `split_call` keeps this
rank's positions of each sequence-shaped argument of a causal LM call (input_ids /
inputs_embeds, position_ids, labels) and states the global positions explicitly, so rotary
embeddings see where each token sits:

- labels are shifted over the whole sequence before the split (the token after a shard's last
  position belongs to another rank), handed to the model as `shift_labels` (transformers'
  loss takes them as they are), and `num_items_in_batch` is the whole sequence's count of
  labels, so each rank's loss is its share of the whole sequence's mean;
- an attention_mask is dropped when it pads nothing, or pads only on the right of each row
  under causal attention (a real token never attends a later position, so it never meets
  the pads; the pads' own rows differ, which is why their labels must be -100, as
  transformers' collators write them); left padding and other masks are refused;
- use_cache is off (a training forward has no use for a cache of one shard).

`whole_loss` turns a rank's share into the whole loss: its value is the sum of the shares over
the group; its gradient is the rank's share times the group size, so that the average DDP or
FSDP2 take over all ranks (data-parallel and context-parallel alike) is the gradient of the
whole sequence's loss, each cp rank having contributed its positions (and, through the
attention op's backward, its keys' and values' part in the others' positions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from retarget.execution.context.attention import ContextLayout

#: transformers' label ignore index.
IGNORE = -100


def sequence_length(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The sequence length of a causal-LM call (input_ids or inputs_embeds), None if none."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, Tensor) and ids.ndim >= 2:
        return ids.shape[1]
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[1] if isinstance(embeds, Tensor) else None


def split_call(
    layout: ContextLayout, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """This rank's share of a call's sequence (see the module docstring)."""
    if len(args) > 1:
        raise ValueError(
            "cp: the model was called with positional arguments after input_ids; pass them by "
            "name (model(input_ids=..., labels=...)) so the sequence split finds them"
        )
    kwargs = dict(kwargs)
    if args:
        kwargs["input_ids"] = args[0]
    length = sequence_length((), kwargs)
    if length is None:
        raise ValueError("cp: the call has neither input_ids nor inputs_embeds to split")
    chunks = layout.chunks(length)
    if length % chunks:
        raise ValueError(
            f"cp[size={layout.size}]: a call with a sequence of {length} positions does not "
            f"split into {chunks} equal chunks; pad or cut sequences to a multiple of {chunks} "
            "(generate() runs one position at a time: generate with the model unwrap() returns)"
        )
    mine = layout.positions(layout.rank, length)
    for name in ("input_ids", "inputs_embeds"):
        if isinstance(kwargs.get(name), Tensor):
            kwargs[name] = kwargs[name][:, mine.to(kwargs[name].device)]
    device = next(t.device for t in kwargs.values() if isinstance(t, Tensor))
    mine = mine.to(device)
    _check_padding(layout, kwargs.pop("attention_mask", None), kwargs.get("labels"))
    positions = kwargs.get("position_ids")
    kwargs["position_ids"] = positions[..., mine] if positions is not None else mine[None, :]
    shifted = kwargs.get("shift_labels")
    labels = kwargs.get("labels")
    if shifted is None and labels is not None:
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    if shifted is not None:
        kwargs.setdefault("num_items_in_batch", int((shifted != IGNORE).sum()))
        kwargs["shift_labels"] = kwargs["labels"] = shifted[:, mine]
    kwargs["use_cache"] = False
    return (), kwargs


def _check_padding(layout: ContextLayout, mask: Tensor | None, labels: Tensor | None) -> None:
    """Accept a mask the split attention can drop (see the module docstring), else refuse."""
    if mask is None or (mask.ndim == 2 and bool(mask.all())):
        return
    where = f"cp: attention_mask of shape {tuple(mask.shape)}"
    keep = mask.to(torch.int32) if mask.ndim == 2 else None
    right_padded = keep is not None and bool((keep[:, 1:] <= keep[:, :-1]).all())
    if not (right_padded and layout.causal):
        why = "pads on the left or masks inside a row" if keep is not None else "is not 2-D"
        if keep is not None and right_padded:
            why = "pads a model whose attention is not causal"
        raise ValueError(
            f"{where} {why}; context parallelism builds its masks from positions and takes "
            "right padding only (causal attention): pad on the right, or pack the sequences"
        )
    if labels is not None and bool((labels[keep == 0] != IGNORE).any()):
        raise ValueError(
            f"{where} pads positions whose labels are not {IGNORE}; under cp the pads' rows "
            f"are not masked, so their labels must be {IGNORE} (as transformers' collators "
            "write them)"
        )


def whole_loss(layout: ContextLayout, share: Tensor) -> Tensor:
    """The whole sequence's loss from this rank's share (see the module docstring)."""
    total = share.detach().clone()
    if layout.live:
        dist.all_reduce(total, group=layout.group)
    if not share.requires_grad:
        return total
    scaled = share * layout.size
    return total + (scaled - scaled.detach())


def with_whole_loss(layout: ContextLayout, output: Any) -> Any:
    """`output` (a ModelOutput, a dict or a tuple from return_dict=False) with its loss whole."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, Tensor) and loss.ndim == 0:
            output["loss"] = whole_loss(layout, loss)
        return output
    if (
        isinstance(output, tuple)
        and output
        and isinstance(output[0], Tensor)
        and output[0].ndim == 0
    ):
        return (whole_loss(layout, output[0]), *output[1:])
    return output


def local_example(layout: ContextLayout, example_args: tuple, example_kwargs: dict[str, Any]):
    """A compile_for example as this rank will run it (for capture at the rank's shapes)."""
    with torch.no_grad():
        return split_call(layout, example_args, example_kwargs)
