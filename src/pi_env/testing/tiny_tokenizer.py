"""A small real tokenizer for tests and benchmarks that cannot load a model's own: a byte-level
BPE (GPT-2/SmolLM2 style) trained here on text the caller gives, with SmolLM2's special tokens
at SmolLM2's ids (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2, the end of a turn and
the eos), saved as a transformers tokenizer directory with a chat template. Training is
deterministic and takes well under a second. Needs `tokenizers` and `transformers`
(pi-env[token-in])."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer_dir(
    directory: str | Path, corpus: Iterable[str], *, chat_template: str, vocab_size: int = 3000
) -> Path:
    """Train the tokenizer on `corpus`, save it (tokenizer.json, tokenizer_config.json with the
    chat template) into `directory`, and return the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(list(corpus), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = chat_template
    directory = Path(directory)
    tokenizer.save_pretrained(str(directory))
    return directory
