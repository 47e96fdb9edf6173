"""Write a small offline T5 (SentencePiece-Unigram) tokenizer for the tiny Flux and SD3 targets.

The pieces are single letters and a few prompt words; scores favour whole words. Run once; the
output (tokenizer.json + tokenizer_config.json) is committed.
"""

import json
import string
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

WORDS = ["a", "the", "red", "fox", "photo", "of", "cat", "dog", "in", "snow", "astronaut", "horse"]


def main(out: Path) -> None:
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -1.0) for w in WORDS]
    vocab += [(c, -5.0) for c in string.ascii_letters + string.digits + string.punctuation]
    vocab += [("▁" + c, -4.0) for c in string.ascii_letters]
    first: dict[str, float] = {}
    for piece, score in vocab:  # "▁a" is both a word and a letter: keep the first
        first.setdefault(piece, score)
    vocab = list(first.items())
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace(" +", " "), normalizers.Strip()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": 512, "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>", "extra_ids": 0, "additional_special_tokens": []}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{tokenizer.get_vocab_size()} pieces -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
