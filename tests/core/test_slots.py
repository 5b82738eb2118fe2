"""core/slots.py: values kept in a module's __dict__ stay out of its state and children."""

from __future__ import annotations

from torch import nn

from retarget.core.slots import PROGRAM, RECORD, Slot


def test_a_slot_keeps_a_module_out_of_the_modules_state_and_children():
    model = nn.Linear(2, 2)
    keys, children = list(model.state_dict()), list(model.named_modules())
    held = nn.Linear(3, 3)
    assert RECORD.set(model, held) is held and RECORD.get(model) is held
    assert list(model.state_dict()) == keys and list(model.named_modules()) == children
    assert RECORD.pop(model) is held and RECORD.get(model) is None
    assert RECORD.pop(model, "gone") == "gone"


def test_setdefault_and_distinct_keys():
    model = nn.Linear(2, 2)
    first = Slot("bindings_test").setdefault(model, {})
    assert Slot("bindings_test").setdefault(model, {"other": 1}) is first
    assert PROGRAM.key == "_retarget_program" and PROGRAM.get(model, 7) == 7
