"""Tokenizers for text runs, from local files only (nothing is downloaded).

A `Tokenizer` is one of
- a Hugging Face `tokenizer.json` (the `tokenizers` library), e.g. GPT-2's or Llama-3's;
- a SentencePiece model (`*.model`), e.g. the Llama-2 tokenizer the paper used;
- a byte-level BPE trained on the corpus itself (`train_bpe`), kept as a `tokenizer.json`.

`encode` adds no special tokens: a corpus appends `eos_id` after every document itself
(palimpsa_jax.data.text). A run keeps its tokenizer in its workdir (`save`, then
`run_tokenizer(workdir)`), so evaluation and generation decode with the tokenizer it trained on.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Iterable, Sequence

# End-of-document tokens looked for, in this order, when the caller names none.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
FILE_NAMES = {"huggingface": "tokenizer.json", "sentencepiece": "tokenizer.model"}


class Tokenizer:
    """Text <-> token ids with a known end-of-document id.

    kind: "huggingface" | "sentencepiece"; vocab_size: ids are in [0, vocab_size);
    eos_id: the end-of-document id. Pickles as its file (worker processes reload it).
    """

    def __init__(self, path: str | os.PathLike, *, eos_token: str | None = None,
                 eos_id: int | None = None):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} does not exist")
        self.kind = "sentencepiece" if self.path.suffix == ".model" else "huggingface"
        self.eos_token = eos_token
        found = self._load()
        if eos_id is None and found is None:
            raise ValueError(f"tokenizer {self.path} has no end-of-document token of "
                             f"{list(EOS_TOKENS)} (nor a SentencePiece eos): pass eos_token or eos_id")
        if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < self.vocab_size):
            raise ValueError(f"eos_id must be an id in [0, {self.vocab_size}) of {self.path}, "
                             f"got {eos_id!r}")
        self.eos_id = int(found if eos_id is None else eos_id)

    def _load(self) -> int | None:
        """Loads the file; returns the id of the end-of-document token (None: none known)."""
        if self.kind == "sentencepiece":
            import sentencepiece

            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
            self.vocab_size = int(self._sp.get_piece_size())
            eos = self._sp.eos_id() if self.eos_token is None else self._sp.piece_to_id(self.eos_token)
            if self.eos_token is not None and self._sp.id_to_piece(eos) != self.eos_token:
                raise ValueError(f"tokenizer {self.path} has no token {self.eos_token!r}")
            return eos if eos >= 0 else None
        else:
            import tokenizers

            try:
                self._hf = tokenizers.Tokenizer.from_file(str(self.path))
            except Exception as e:   # the Rust library raises its own exception type
                raise ValueError(f"tokenizer {self.path} is not a Hugging Face tokenizer.json "
                                 f"or a SentencePiece .model: {e}") from None
            self._hf.encode_special_tokens = True   # text such as "<|endoftext|>" is ordinary text
            self.vocab_size = int(self._hf.get_vocab_size(with_added_tokens=True))
            names = EOS_TOKENS if self.eos_token is None else (self.eos_token,)
            ids = [self._hf.token_to_id(name) for name in names]
            found = [i for i in ids if i is not None]
            if self.eos_token is not None and not found:
                raise ValueError(f"tokenizer {self.path} has no token {self.eos_token!r}")
            return found[0] if found else None

    def __getstate__(self) -> dict:
        return {"path": self.path, "kind": self.kind, "eos_token": self.eos_token,
                "eos_id": self.eos_id}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()
        self.eos_id = state["eos_id"]

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, {self.path}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id})")

    def encode(self, text: str) -> list[int]:
        """The token ids of text, no special tokens added."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """encode of each text (the Hugging Face tokenizer runs them in parallel threads)."""
        if self.kind == "sentencepiece":
            return self._sp.encode(list(texts))
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids (special tokens dropped)."""
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> pathlib.Path:
        """Copies the tokenizer file to directory/tokenizer.json (or tokenizer.model); returns it."""
        target = pathlib.Path(directory) / FILE_NAMES[self.kind]
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.resolve() != self.path.resolve():
            shutil.copyfile(self.path, target)
        return target


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike, *,
              eos_token: str = "<|endoftext|>", min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE of vocab_size ids (eos_token among them, id 0) trained on texts,
    written to path (a tokenizer.json)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = len(pre_tokenizers.ByteLevel.alphabet())
    if not isinstance(vocab_size, int) or vocab_size < alphabet + 1:
        raise ValueError(f"vocab_size must be an integer of at least {alphabet + 1} (the 256 "
                         f"bytes and eos_token), got {vocab_size!r}")
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bpe.save(str(path))
    return Tokenizer(path, eos_token=eos_token)


def run_tokenizer(workdir: str | os.PathLike) -> Tokenizer:
    """The tokenizer a run trained with (workdir/tokenizer.json or workdir/tokenizer.model),
    its eos_id the run's data.eos_id (workdir/config.json) where the run has one."""
    config = pathlib.Path(workdir) / "config.json"
    eos_id = json.loads(config.read_text()).get("data", {}).get("eos_id") if config.is_file() else None
    for name in FILE_NAMES.values():
        path = pathlib.Path(workdir) / name
        if path.is_file():
            return Tokenizer(path, eos_id=eos_id)
    raise FileNotFoundError(f"{workdir} holds no tokenizer ({' or '.join(FILE_NAMES.values())}): "
                            f"train with data.tokenizer set, or copy the tokenizer there")
