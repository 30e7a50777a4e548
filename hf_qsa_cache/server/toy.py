"""A character-level tokenizer with a chat template, for random checkpoints that the server can load without
downloading anything (the tests, the benchmark, trying the server out).

`toy_tokenizer(vocab_size)` maps each printable ASCII character to one id and fills the rest of the
vocabulary with special tokens, so every id a random model generates decodes to something.
`save_toy_checkpoint(path, model, tokenizer)` writes the model, the tokenizer and, for the multimodal classes,
the media processors' configs, as a checkpoint that `hf-qsa-serve PATH` serves.
"""

from __future__ import annotations

import string

PAD, EOS, BOS, TEXT_END = "<pad>", "<|im_end|>", "<|im_start|>", "<|endoftext|>"
CHARACTERS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?'-:;\n"


def chat_template(image: str = "", audio: str = "") -> str:
    """ChatML turns; an image part becomes ``image`` and an audio part ``audio`` (placeholder strings that the
    server expands to one token per feature)."""
    return (
        "{%- for m in messages -%}" + BOS + "{{ m['role'] }}\n"
        "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for c in m['content'] -%}"
        "{%- if c['type'] == 'text' -%}{{ c['text'] }}"
        "{%- elif c['type'] == 'image' -%}" + image +
        "{%- elif c['type'] == 'audio' -%}" + audio +
        "{%- endif -%}{%- endfor -%}{%- endif -%}" + EOS + "\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}" + BOS + "assistant\n{%- endif -%}"
    )


def toy_tokenizer(vocab_size: int, specials: dict[str, int] | None = None, template: str | None = None):
    """A fast tokenizer of ``vocab_size`` ids: ``<pad>`` 0, ``<|im_end|>`` 1 (eos), ``<|im_start|>`` 2,
    ``<|endoftext|>`` 3, one id per character of `CHARACTERS`, ``specials`` at the ids given, and filler special
    tokens elsewhere. Unknown characters become ``<pad>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fixed = {PAD: 0, EOS: 1, BOS: 2, TEXT_END: 3, **(specials or {})}
    taken = set(fixed.values())
    if len(taken) != len(fixed) or max(taken) >= vocab_size:
        raise ValueError(f"special token ids must be distinct and below vocab_size={vocab_size}: {fixed}")
    free = (i for i in range(vocab_size) if i not in taken)
    vocab = dict(fixed)
    for char in CHARACTERS:
        index = next(free, None)
        if index is None:
            raise ValueError(f"vocab_size={vocab_size} is too small for {len(CHARACTERS)} characters and {len(fixed)} "
                             f"special tokens")
        vocab[char] = index
    fillers = [f"<|extra_{i}|>" for i in free]
    vocab.update({token: int(token[8:-2]) for token in fillers})
    backend = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    special = [t for t in fixed if t != PAD] + fillers
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS,
                                        additional_special_tokens=special)
    tokenizer.chat_template = template if template is not None else chat_template()
    return tokenizer


def save_toy_checkpoint(path, model, tokenizer, image_processor=None, feature_extractor=None) -> str:
    """Write ``model`` (its generation config says: eos is ``<|im_end|>``, greedy), ``tokenizer`` and the media
    processors a multimodal model needs into ``path``."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if image_processor is not None:
        image_processor.save_pretrained(path)
    if feature_extractor is not None:
        feature_extractor.save_pretrained(path)
    return str(path)
