"""Write the small offline CLIP vocab/merges used by the tiny targets.

CLIP's byte-level BPE needs every byte symbol (with and without the end-of-word mark) in its vocab;
a few merges for common prompt words keep token counts realistic. Run once; the output is committed.
"""

import json
import sys
from pathlib import Path

WORDS = ["a", "the", "red", "fox", "photo", "of", "cat", "dog", "in", "snow", "astronaut", "horse"]


def bytes_to_unicode() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def main(out: Path) -> None:
    symbols = bytes_to_unicode()
    vocab_list = symbols + [s + "</w>" for s in symbols]
    merges: list[str] = []
    for word in WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merged = parts[0] + parts[1]
            merge = f"{parts[0]} {parts[1]}"
            if merge not in merges:
                merges.append(merge)
                vocab_list.append(merged)
            parts = [merged] + parts[2:]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    print(f"{len(vocab)} tokens, {len(merges)} merges -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
