"""Does the predictive variance mean something on text? A small Palimpsa-D language model
trained on real text (bytes as tokens) and analysed on held-out documents: the Spearman
correlation of each token's predictive variance with its loss, and the loss by variance bucket
(`palimpsa_jax.analysis`, the report of `palimpsa-analyze`).

    python -m benchmarks.text_uncertainty --source /usr/lib/python3.12 --workdir runs/text_bytes

The corpus is every file under --source matching --patterns (Python sources and documentation:
text no one here wrote), one document per file, its UTF-8 bytes the token ids (0-255; the end of
a document is id 256); a file goes to the test split when the hash of its path says so
(--test-fraction). The model is the small LM of `experiments/lm/palimpsa_d.py` with a
257-token vocabulary.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import time

import numpy as np

from palimpsa_jax.analysis import report
from palimpsa_jax.data import write_corpus
from palimpsa_jax.experiments.lm import palimpsa_d
from palimpsa_jax.training import train_and_evaluate

EOS = 256
MAX_FILE_BYTES = 1 << 20


def byte_corpus(source: pathlib.Path, patterns, out: pathlib.Path, test_fraction: float
                ) -> dict[str, int]:
    """Writes out/{train,test}.npy from the files under `source`; returns their sizes."""
    split = {"train": [], "test": []}
    for path in sorted(p for pattern in patterns for p in source.rglob(pattern) if p.is_file()):
        data = path.read_bytes()
        if not data or len(data) > MAX_FILE_BYTES:
            continue
        digest = int.from_bytes(hashlib.sha256(str(path.relative_to(source)).encode()).digest()[:8],
                                "big")
        split["test" if digest / 2**64 < test_fraction else "train"].append(
            np.frombuffer(data, np.uint8))
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, documents in split.items():
        if not documents:
            raise ValueError(f"--source: no {name} documents under {source} matching {patterns}")
        write_corpus(out / f"{name}.npy", documents, eos_id=EOS)
        sizes[f"{name}_documents"] = len(documents)
        sizes[f"{name}_tokens"] = int(sum(len(d) + 1 for d in documents))
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=pathlib.Path, required=True)
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    parser.add_argument("--patterns", nargs="+", default=["*.py", "*.rst", "*.md", "*.txt"])
    parser.add_argument("--test-fraction", type=float, default=0.02)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--sequences", type=int, default=256, help="held-out rows analysed")
    args = parser.parse_args(argv)

    sizes = byte_corpus(args.source, args.patterns, args.workdir / "corpus", args.test_fraction)
    print(json.dumps(sizes))
    c = palimpsa_d.get_config()
    c.model.vocab_size = EOS + 1
    c.data.update(path=str(args.workdir / "corpus/train.npy"),
                  test_path=str(args.workdir / "corpus/test.npy"), eos_id=EOS)
    c.train.steps = args.steps
    c.optim.warmup_steps = min(c.optim.warmup_steps, args.steps // 10)
    c.checkpoint.every_steps = c.eval.every_steps = args.steps // 4
    c.log.progress = False
    start = time.perf_counter()
    final = train_and_evaluate(c, args.workdir / "run")
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.0f} s: "
          f"eval loss {final['eval/loss']:.4f} nats/byte")
    result = report.analyze(args.workdir / "run", size=args.sequences)
    u = result["uncertainty"]
    print(f"layer {u['layer']}: Spearman(variance, loss) {u['spearman_variance_loss']:.3f}, "
          f"AUROC of variance for errors {u['auroc_of_variance_for_errors']:.3f}, "
          f"top-1 accuracy {u['accuracy']:.3f}")
    print("| variance bucket | accuracy | mean loss | tokens |\n|---|---|---|---|")
    for i, (acc, loss, count) in enumerate(zip(u["accuracy_by_bucket"], u["mean_loss_by_bucket"],
                                               u["count_by_bucket"])):
        print(f"| {u['bucket_edges'][i]:.3g} - {u['bucket_edges'][i + 1]:.3g} | {acc:.4f} | "
              f"{loss:.4f} | {count} |")


if __name__ == "__main__":
    main()
