"""Build data/corpus.txt and data/tokenizer.json from the Python standard library's own source.

Every Python install has this material, so anyone can rebuild the corpus without a download:
    python data/build_corpus.py
The files are committed (about 1 MB); rebuilding on another Python version gives a similar corpus.
"""
import pathlib
import sysconfig

HERE = pathlib.Path(__file__).resolve().parent
CHARS = 1_000_000          # about 1 MB of text, ~300k tokens
VOCAB = 4096               # labkit.models' tiny presets use this vocabulary size
SPECIAL = ["<|endoftext|>", "<pad>"]


def corpus():
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for path in sorted(stdlib.glob("*.py")):          # top-level modules only: no tests, no vendored code
        text = path.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        n += len(text)
        if n >= CHARS:
            break
    return "<|endoftext|>".join(parts)[:CHARS]


def main():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    text = corpus()
    (HERE / "corpus.txt").write_text(text, encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    tok.save(str(HERE / "tokenizer.json"))
    print(f"corpus {len(text):,} chars, {len(tok.encode(text).ids):,} tokens, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
