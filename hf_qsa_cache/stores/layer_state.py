"""`LayerState`: the stores of one decoder layer, by name."""

from __future__ import annotations


class LayerState:
    """The stores of one decoder layer (attribute names say what they hold)."""

    def __init__(self, layer_type: str, **stores):
        self.layer_type = layer_type
        self.stores = stores
        for name, store in stores.items():
            setattr(self, name, store)

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == "hybrid_sliding"

    def __repr__(self):
        return f"LayerState({self.layer_type}, {sorted(self.stores)})"
