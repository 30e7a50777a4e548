"""What one server serves (`Served`) and its limits (`Limits`): the state every route reads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .engine import Engine
from .engine_process import EngineProcess
from .prompts import PromptBuilder


@dataclass
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_prompt_tokens: int | None = None  # None: the model's length less one
    max_tokens: int = 4096
    default_max_tokens: int = 1024
    max_n: int = 8


@dataclass
class Served:
    """What one server serves: the model under one name (its config and generation config: the weights live
    with the engine), its prompts, its engine, its limits."""

    name: str
    config: object
    generation_config: object
    tokenizer: object
    builder: PromptBuilder
    engine: Engine | EngineProcess
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_len(self) -> int:
        length = self.engine.max_len  # the engine's cache, once it started
        if length is not None:
            return int(length)
        config = self.config.get_text_config()
        return int(getattr(config, "max_position_embeddings", None) or 32768)

    @property
    def eos_ids(self) -> list[int]:
        eos = self.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        return [int(e) for e in eos if e is not None and e >= 0]


def served_of(request) -> Served:
    """The `Served` of the app that got ``request`` (`app.build_app` puts it in the app's state)."""
    return request.app.state.served
