"""Train a byte-level BPE tokenizer on local text and save it as a Hugging Face `tokenizer.json` (no network).

    .venv/bin/python tools/train_bpe.py 'jaxpar/**/*.py' --vocab-size 2048 --out runs/data/bpe.json

Inputs: text files, directories (every file in them, recursively) or quoted glob patterns. The tokenizer is GPT-2
style (byte-level pre-tokenizer and decoder, so any text round-trips), with `<s>` (id 0) and `</s>` (id 1) as
special tokens that the `jaxpar-data` tokenize command uses as BOS and EOS. For a real corpus train on a sample of
it; the `tokenizers` library's trainer (of the `data` extra) reads the files itself, in parallel.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys


def input_files(inputs: list[str]) -> list[str]:
    """The regular files `inputs` name (files, directories walked recursively, glob patterns), sorted, unique.

    Raises:
      SystemExit: an input matches no file.
    """
    files = set()
    for item in inputs:
        if os.path.isdir(item):
            found = [os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs]
        elif os.path.isfile(item):
            found = [item]
        else:
            found = [f for f in glob.glob(item, recursive=True) if os.path.isfile(f)]
        if not found:
            raise SystemExit(f"train_bpe: {item!r} matches no file; give text files, directories or glob patterns")
        files.update(found)
    return sorted(files)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, directories or quoted glob patterns")
    p.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary, special tokens included")
    p.add_argument("--out", required=True, help="where to write tokenizer.json")
    args = p.parse_args(argv)
    if args.vocab_size < 258:
        p.error(f"--vocab-size {args.vocab_size}: a byte-level BPE needs at least 258 ids (256 bytes + <s>, </s>)")
    from jaxpar.config.extras import MissingExtra, require

    try:
        require("tokenizers", "tools/train_bpe.py")
    except MissingExtra as e:
        raise SystemExit(str(e)) from None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(input_files(args.inputs), trainer)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out}: {tok.get_vocab_size()} ids (<s> = 0, </s> = 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
