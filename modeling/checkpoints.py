"""Loading transformers checkpoints into our classes exactly as into transformers' own classes.

transformers converts checkpoint layouts on load (per-expert MoE weights fused into one tensor,
n-gram embedding shards concatenated, a ``model.language_model.`` prefix dropped, ...) and back on
save, with conversions looked up by class name, then ``config.model_type``. But
`get_model_conversion_mapping` skips every class defined outside the ``transformers.`` package
(``is_custom_code()``) unless its class name or model_type was registered with
`register_checkpoint_conversion_mapping`. Unregistered, our classes would see the on-disk names and
report the converted weights missing (a load `StrictLoadingMixin` refuses). `use_upstream_conversions`
registers the model_type with transformers' own mapping, unchanged: our classes then load and save
the layout transformers' classes do, and transformers' classes behave as before.

Loading follows transformers' rules (`StrictLoadingMixin`): weights the checkpoint lacks are initialised,
reported (``output_loading_info=True`` -> ``missing_keys``) and logged in transformers' load report, as are
checkpoint weights that map to no parameter (``unexpected_keys``); conversion errors and size mismatches
raise. One case raises where transformers only warns: checkpoint weights present under a name that was not
converted, while the parameters of the same module are missing (`unconverted_weights`). That is how an
unregistered layout conversion shows, and it would otherwise run those modules randomly initialised.
"""

from __future__ import annotations

from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

# Checkpoint weights (names after conversion) that our models deliberately leave unused: multi-token
# prediction heads (`inkling_mtp.py` reads Inkling's for drafting) and the vision/audio towers of multimodal
# checkpoints. A causal-LM head that a bare text model does not use is reported unexpected, as transformers does.
IGNORED_CHECKPOINT_KEYS = (
    r"^mtp\.",
    r"^model\.mtp\.",
    r"^model\.visual\.",
    r"^model\.vision_tower\.",
    r"^model\.audio_tower\.",
)


def use_upstream_conversions(model_type: str) -> None:
    """Apply transformers' checkpoint conversions for ``model_type`` to our classes too.

    Registers the mapping in effect (transformers' own, or one a user registered before), unchanged.
    """
    mapping = get_checkpoint_conversion_mapping(model_type)
    if mapping is not None:  # none: transformers' classes load keys as saved, and so do ours
        register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)


def loading_problems(loading_info) -> list[str]:
    """What a load left wrong: weights not loaded, checkpoint weights not used, errors (for an error message)."""
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


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]


def _same_module(unexpected: str, missing: str, base_prefix: str) -> bool:
    """Whether a checkpoint key that loaded nothing holds (part of) the missing parameter: it lies in the missing
    parameter's module (per-expert tensors of fused experts, shards of a concatenated table, the parameter under
    another leaf name), or it is the missing key under a different prefix (``model.language_model.layers.0...``
    for ``model.layers.0...``)."""
    module = _module_of(missing)
    unexpected_module = _module_of(unexpected)
    if unexpected_module == module or (module and unexpected_module.startswith(module + ".")):
        return True
    relative = missing.removeprefix(base_prefix + ".") if base_prefix else missing
    return unexpected.endswith("." + relative)


def unconverted_weights(loading_info, base_prefix: str = "model") -> dict[str, list[str]]:
    """Missing parameters whose module has checkpoint weights that loaded nothing: ``{missing key: [checkpoint
    keys]}``. These are weights present under a name not converted to ours, the one case our classes refuse."""
    found = {}
    for missing in loading_info.missing_keys:
        keys = sorted(key for key in loading_info.unexpected_keys if _same_module(key, missing, base_prefix))
        if keys:
            found[missing] = keys
    return found


def _listing(items) -> str:
    return "".join(f"\n  {item}" for item in sorted(items))


def _is_upstream_module(module) -> bool:
    """Whether ``module``'s class is one of transformers' or derives from one."""
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


class CheckpointLoadingError(ValueError, RuntimeError):
    """A load our classes refuse. A `RuntimeError`, as transformers raises for conversion errors and size
    mismatches, and a `ValueError` naming the weights concerned."""


class StrictLoadingMixin:
    """`from_pretrained` by transformers' rules (weights the checkpoint lacks are initialised and reported, unused
    checkpoint weights reported, conversion errors and size mismatches raise), except that weights present in
    the checkpoint under names not converted to the parameters they hold raise a `CheckpointLoadingError`."""

    _keys_to_ignore_on_load_unexpected = list(IGNORED_CHECKPOINT_KEYS)

    def _initialize_weights(self, module, is_custom_code: bool = False):
        # transformers treats classes defined outside its package as remote code, whose `_init_weights` might not
        # respect the flags of loaded weights: it skips every module whose own parameters are all set. A module
        # with no parameters of its own passes that test vacuously, such as Qwen4Exp's MoE block, whose
        # `_init_weights` initialises its router: a router built from a config, or missing from a checkpoint,
        # would stay uninitialised memory. Modules of transformers' classes (ours subclass them) are initialised
        # by transformers' own rule, as in transformers' models; modules only we define keep the custom-code rule.
        if is_custom_code and _is_upstream_module(module):
            is_custom_code = False
        super()._initialize_weights(module, is_custom_code)

    @classmethod
    def _finalize_model_loading(cls, model, load_config, loading_info):
        # `from_pretrained` (transformers 5.23) calls this once the weights are in place. The parent initialises
        # what is missing, ties weights, drops tied weights from the missing keys and ignored keys from the
        # unexpected ones, and logs its load report. It raises a RuntimeError for conversion errors, size
        # mismatches (unless ignore_mismatched_sizes) and load errors, naming the keys only in its logged report:
        # we name them in the error.
        source = load_config.pretrained_model_name_or_path
        try:
            loading_info = super()._finalize_model_loading(model, load_config, loading_info)
        except RuntimeError as error:
            raise CheckpointLoadingError(
                f"{cls.__name__} cannot load {source}:\n" + "\n".join(loading_problems(loading_info))
            ) from error
        unconverted = unconverted_weights(loading_info, getattr(model, "base_model_prefix", ""))
        if unconverted:
            pairs = "".join(f"\n  {missing} <- " + ", ".join(keys) for missing, keys in sorted(unconverted.items()))
            raise CheckpointLoadingError(
                f"{cls.__name__} cannot load {source}: the checkpoint holds weights of these modules under names "
                "that map to no parameter, so the parameters would run randomly initialised (a checkpoint layout "
                "whose conversion is not registered?):" + pairs
            )
        return loading_info
