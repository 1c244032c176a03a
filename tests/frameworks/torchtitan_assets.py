"""A local tokenizer and text dataset for the TorchTitan tests (nothing is downloaded).

``make(folder)`` writes ``folder/tokenizer`` (a ``tokenizers`` WordLevel model:
``tokenizer.json`` and the ``tokenizer_config.json`` naming its BOS/EOS tokens,
what TorchTitan's ``HuggingFaceTokenizer`` reads) and ``folder/data/train.json``
(JSON lines ``{"text": ...}``, what its ``c4_test`` loader reads through
``dataloader.dataset_path``). Deterministic: the same files on every call.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_WORDS = 200
_DOCS = 200
_WORDS_PER_DOC = (20, 80)


def make(folder: Path) -> tuple[Path, Path]:
    """Write the tokenizer and dataset under ``folder``; returns (tokenizer dir, data dir)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok_dir, data_dir = folder / "tokenizer", folder / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    vocab = [f"w{i}" for i in range(_WORDS)]
    texts = [
        " ".join(rnd.choice(vocab) for _ in range(rnd.randint(*_WORDS_PER_DOC)))
        for _ in range(_DOCS)
    ]
    with open(data_dir / "train.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok_dir, data_dir
