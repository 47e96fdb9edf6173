"""Write a small offline Qwen2/Qwen3-style tokenizer (byte-level BPE, the chat markers as special
tokens, a chat template) for the tiny targets whose text encoder is a Qwen model (Flux.2 Klein,
Z-Image, Qwen-Image: each target folder holds a copy); with `--mistral`, the same tokenizer with
Mistral 3's chat format, whose messages hold lists of text parts (FLUX.2 [dev]'s Mistral Small 3.1
text encoder, `targets/configs/tiny-flux2-dev`); with `--vision`, Qwen2.5-VL's image markers added as
special tokens after the trained ones (Qwen-Image-Edit's processor and text encoder,
`targets/configs/tiny-qwen-image-edit`: its text encoder config names their ids).

The BPE is trained on a fixed text, so the output is the same on every run. Run once; the output
(tokenizer.json + tokenizer_config.json) is committed.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

WORDS = ["a", "the", "red", "fox", "photo", "of", "cat", "dog", "in", "snow", "astronaut", "horse", "user",
         "assistant", "system", "image", "describe"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen2.5-VL's markers around an image's tokens, in the order its config's ids name them:
# vision_start_token_id, vision_end_token_id, image_token_id, video_token_id.
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen3's template, less tools and multi-turn reasoning: what a one-message prompt renders to.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


# Mistral 3's format, less images and tools: a system prompt and a user turn, each a list of text parts.
MISTRAL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set text = message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + '</s>' }}{%- endif %}"
    "{%- endfor %}"
)


def main(out: Path, template: str = CHAT_TEMPLATE, vision: bool = False) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(WORDS)] * 8, trainer=trainer)
    extra = VISION if vision else []
    tokenizer.add_special_tokens(extra)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 1024, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "bos_token": None, "add_prefix_space": False,
              "additional_special_tokens": SPECIAL[1:] + extra, "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = ", ".join(f"{t}={tokenizer.token_to_id(t)}" for t in extra)
    print(f"{tokenizer.get_vocab_size()} tokens -> {out}" + (f" ({ids})" if ids else ""))


if __name__ == "__main__":
    flags = sys.argv[1:-1]
    main(Path(sys.argv[-1]), MISTRAL_TEMPLATE if "--mistral" in flags else CHAT_TEMPLATE, vision="--vision" in flags)
