"""What transformers' common tests read from a model class without running it: the outputs its modules record
(`_can_record_outputs`) and the fields its forward declares it returns (the return annotation, read raw: a
string annotation declares nothing). transformers' `test_moe_models_record_router_logits` looks for its own
experts decorator in the modeling source to decide whether to run, so on our classes it skips; this is its
check."""

from __future__ import annotations

from typing import get_args

import pytest
from transformers import PreTrainedModel


def _declared_fields(cls) -> set[str]:
    returned = cls.forward.__annotations__.get("return")
    return set().union(*(getattr(t, "__dataclass_fields__", {}).keys() for t in (get_args(returned) or (returned,))))


@pytest.mark.parametrize("family", ["qwen", "ink"])
def test_moe_classes_record_and_declare_router_logits(family, request):
    model = request.getfixturevalue(family)
    for module in (model, model.model):
        recorded = set().union(*((m._can_record_outputs or {}).keys() for m in module.modules()
                                 if isinstance(m, PreTrainedModel)))
        assert "router_logits" in recorded, type(module).__name__
        assert {"router_logits", "hidden_states", "attentions"} <= _declared_fields(type(module)), type(module).__name__
