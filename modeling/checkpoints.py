"""Loading transformers checkpoints into our classes exactly as into transformers' own classes.

transformers converts checkpoint layouts on load (per-expert MoE weights fused into one tensor,
n-gram embedding shards concatenated, a ``model.language_model.`` prefix dropped, ...) and back on
save, with conversions looked up by class name, then ``config.model_type``. But
`get_model_conversion_mapping` skips every class defined outside the ``transformers.`` package
(``is_custom_code()``) unless its class name or model_type was registered with
`register_checkpoint_conversion_mapping`. Unregistered, our classes see the on-disk names, report
the converted weights as missing and keep them at random init. `use_upstream_conversions`
registers the model_type with transformers' own mapping, unchanged: our classes then load and save
the layout transformers' classes do, and transformers' classes behave as before.

`StrictLoadingMixin` refuses a load that leaves a weight of ours uninitialised or a checkpoint
weight unused, except the parts of checkpoints we deliberately do not run (`IGNORED_CHECKPOINT_KEYS`).
"""

from __future__ import annotations

from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

# Checkpoint weights (names after conversion) that our models deliberately leave unused: multi-token
# prediction heads, the vision/audio towers of multimodal checkpoints, and the causal-LM head when
# a bare text model loads a causal-LM checkpoint.
IGNORED_CHECKPOINT_KEYS = (
    r"^mtp\.",
    r"^model\.mtp\.",
    r"^model\.visual\.",
    r"^model\.vision_tower\.",
    r"^model\.audio_tower\.",
    r"^lm_head\.",
)


def use_upstream_conversions(model_type: str) -> None:
    """Apply transformers' checkpoint conversions for ``model_type`` to our classes too.

    Registers the mapping in effect (transformers' own, or one a user registered before), unchanged.
    """
    mapping = get_checkpoint_conversion_mapping(model_type)
    if mapping is not None:  # none: transformers' classes load keys as saved, and so do ours
        register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)


def loading_problems(loading_info) -> list[str]:
    """What a finished load left wrong: weights not loaded, checkpoint weights not used, errors."""
    not_loaded = set(loading_info.missing_keys) | {key for key, *_ in loading_info.mismatched_keys}
    not_loaded |= set(loading_info.conversion_errors)
    problems = []
    if not_loaded:
        problems.append("weights missing from the checkpoint (or not convertible, or of another shape); they would "
                        "run randomly initialised:" + _listing(not_loaded))
    if loading_info.unexpected_keys:
        problems.append("checkpoint weights that map to no parameter (an unconverted layout?):"
                        + _listing(loading_info.unexpected_keys))
    errors = [f"{key}: {message.strip().splitlines()[-1]}" for key, message in loading_info.conversion_errors.items()]
    errors += list(loading_info.error_msgs)
    if errors:
        problems.append("loading errors:" + _listing(errors))
    return problems


def _listing(items) -> str:
    return "".join(f"\n  {item}" for item in sorted(items))


class StrictLoadingMixin:
    """`from_pretrained` raises a ValueError instead of returning a model with weights the checkpoint lacks."""

    _keys_to_ignore_on_load_unexpected = list(IGNORED_CHECKPOINT_KEYS)

    @classmethod
    def _finalize_model_loading(cls, model, load_config, loading_info):
        # `from_pretrained` (transformers 5.23) calls this once the weights are in place. After the parent's
        # finalisation, tied weights are no longer counted missing and ignored keys no longer unexpected.
        # The parent itself raises a RuntimeError for conversion errors and size mismatches, naming the keys
        # only in its logged report: we name them in the error.
        refusal = None
        try:
            loading_info = super()._finalize_model_loading(model, load_config, loading_info)
        except RuntimeError as error:
            refusal = error
        problems = loading_problems(loading_info)
        if problems:
            raise ValueError(
                f"{cls.__name__} cannot load {load_config.pretrained_model_name_or_path}:\n" + "\n".join(problems)
            ) from refusal
        if refusal is not None:
            raise refusal
        return loading_info
