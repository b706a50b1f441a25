r"""palimpsa-long-context: loss by position beyond the training length, and passkey retrieval.

    palimpsa-long-context --workdir runs/lm_palimpsa_d [--workdir runs/lm_attention ...] \
        [--corpus corpus/validation.npy] [--length 8192] [--documents 256] [--min_length 0] \
        [--batch_size 4] [--buckets 0,64,128,...] [--passkey_lengths 1024,2048,4096] \
        [--passkey_depths 0,0.25,0.5,0.75,1] [--passkey_haystacks prose,python] [--trials 10] \
        [--tasks loss,passkey] [--compare runs/earlier_run ...] [--step S]

For every --workdir (its checkpoint at --step, default the latest) it writes under
runs/X/long_context/:
- loss_by_position.{csv,json,png}: the mean next-token loss by position in held-out documents
  (`evaluation.long_context.loss_by_position`): the first --documents documents of --corpus
  (default the run's data.test_path) with at least --min_length tokens, read up to --length
  tokens (default 4 x the first run's training length), one row per document, positions
  counted from its start; per bucket the mean loss, the tokens and the documents that reach it.
  The plot (log x) has a line for every --workdir and every --compare run (a run whose
  long_context/loss_by_position.json is already written; nothing is recomputed for it);
- passkey_HAYSTACK.{json,png} for each of --passkey_haystacks (default prose; python for models
  trained on code): the accuracy of greedy retrieval of a 5-digit key hidden at each
  --passkey_depths fraction of a filler haystack of each --passkey_lengths tokens (default 1,
  2 and 4 x the training length), --trials keys each; the heatmap has the length on x and the
  depth on y.
Also `python -m palimpsa_jax.commands.long_context`.
"""
from __future__ import annotations

import csv
import json
import pathlib

from absl import app, flags

from palimpsa_jax.analysis.run import load_run, run_config
from palimpsa_jax.commands import common
from palimpsa_jax.data import Documents
from palimpsa_jax.data.tokenizer import run_tokenizer
from palimpsa_jax.evaluation import long_context as lc

TASKS = ("loss", "passkey")


def _define_flags():
    flags.DEFINE_multi_string("workdir", None, "Directory of a run to evaluate (repeatable).")
    flags.DEFINE_multi_string("compare", [], "A run whose saved loss_by_position.json joins the plot.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_string("corpus", None, "Held-out corpus .npy (default: the run's data.test_path).")
    flags.DEFINE_integer("length", None, "Positions evaluated (default: 4 x the training length).",
                         lower_bound=1)
    flags.DEFINE_integer("documents", 256, "Documents of the corpus evaluated (the first ones).",
                         lower_bound=1)
    flags.DEFINE_integer("min_length", 0, "Only documents of at least this many tokens.", lower_bound=0)
    flags.DEFINE_integer("batch_size", 4, "Documents (loss) or prompts (passkey) per forward.", lower_bound=1)
    flags.DEFINE_list("buckets", None, "Bucket edges of positions (default 0, 1, 2, 4, ..., length).")
    flags.DEFINE_list("passkey_lengths", None, "Passkey prompt lengths (default 1, 2, 4 x training).")
    flags.DEFINE_list("passkey_depths", ["0", "0.25", "0.5", "0.75", "1"], "Needle depths in [0, 1].")
    flags.DEFINE_list("passkey_haystacks", ["prose"], f"Passkey haystacks, of {','.join(lc.HAYSTACKS)}.")
    flags.DEFINE_integer("trials", 10, "Passkey keys per length and depth.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the passkey keys.")
    flags.DEFINE_list("tasks", list(TASKS), f"What to measure, of {','.join(TASKS)}.")
    flags.mark_flag_as_required("workdir")
    for name in ("workdir", "compare"):
        flags.register_validator(name, lambda dirs: all((pathlib.Path(w) / "config.json").is_file()
                                                        for w in dirs or ()),
                                 f"--{name} must name run directories (each holding config.json)")
    flags.register_validator("buckets", lambda b: b is None or all(x.isdigit() for x in b),
                             "--buckets must be comma-separated integers")
    flags.register_validator("passkey_lengths", lambda b: b is None or all(x.isdigit() for x in b),
                             "--passkey_lengths must be comma-separated integers")
    flags.register_validator("passkey_depths", lambda b: all(_is_depth(x) for x in b),
                             "--passkey_depths must be comma-separated numbers in [0, 1]")
    flags.register_validator("passkey_haystacks", lambda h: bool(h) and set(h) <= set(lc.HAYSTACKS),
                             f"--passkey_haystacks must be among {list(lc.HAYSTACKS)}")
    flags.register_validator("tasks", lambda t: set(t) <= set(TASKS), f"--tasks must be among {TASKS}")


def _is_depth(text: str) -> bool:
    try:
        return 0 <= float(text) <= 1
    except ValueError:
        return False


def _label(workdir, step: int) -> str:
    return f"{pathlib.Path(workdir).name} step {step}"


def _saved_loss(workdir) -> tuple[str, lc.PositionLoss]:
    """The label and table of a run's long_context/loss_by_position.json."""
    path = pathlib.Path(workdir) / "long_context" / "loss_by_position.json"
    if not path.is_file():
        raise FileNotFoundError(f"--compare {workdir}: {path} does not exist (run palimpsa-long-context "
                                f"on it first)")
    saved = json.loads(path.read_text())
    return _label(workdir, saved["step"]), lc.PositionLoss.from_rows(saved["buckets"])


def _loss(run, out: pathlib.Path, length: int, f) -> lc.PositionLoss:
    d = run.config.data
    corpus = f.corpus or d.get("test_path")
    if not corpus:
        raise FileNotFoundError(f"--corpus: the run {run.workdir} names no data.test_path; give a corpus")
    documents = lc.long_documents(Documents(corpus, d.eos_id), min_length=f.min_length, count=f.documents)
    if not documents:
        raise FileNotFoundError(f"--corpus {corpus} has no document of at least --min_length={f.min_length} "
                                f"tokens")
    try:
        table = lc.loss_by_position(run.model, documents, length=length, batch_size=f.batch_size,
                                    buckets=None if f.buckets is None else [int(x) for x in f.buckets])
    except ValueError as e:           # edges outside [0, --length]
        raise app.UsageError(f"--buckets: {e}") from None
    rows = table.rows()
    with open(out / "loss_by_position.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {"workdir": str(run.workdir), "step": run.step, "corpus": str(corpus), "length": length,
               "documents": len(documents), "min_length": f.min_length, "buckets": rows}
    (out / "loss_by_position.json").write_text(json.dumps(summary, indent=1) + "\n")
    return table


def _passkey(run, out: pathlib.Path, lengths: list[int], haystack: str, f) -> lc.PasskeyResult:
    try:
        result = lc.passkey_accuracy(run.model, run_tokenizer(run.workdir), lengths=lengths,
                                     depths=[float(x) for x in f.passkey_depths], trials=f.trials, seed=f.seed,
                                     batch_size=f.batch_size, haystack=lc.HAYSTACKS[haystack])
    except ValueError as e:           # a length too short for the needle and the question
        raise app.UsageError(f"--passkey_lengths: {e}") from None
    (out / f"passkey_{haystack}.json").write_text(json.dumps(
        {"workdir": str(run.workdir), "step": run.step, "haystack": haystack, **result.to_json()},
        indent=1) + "\n")
    lc.plot_passkey(result, out / f"passkey_{haystack}.png",
                    title=f"{run.workdir.name} step {run.step}, {haystack} haystack")
    return result


def _main():
    f = flags.FLAGS
    training = int(run_config(f.workdir[0]).data.seq_len)
    length = f.length or 4 * training
    lengths = [int(x) for x in f.passkey_lengths] if f.passkey_lengths else [training, 2 * training, 4 * training]
    curves = dict(_saved_loss(w) for w in f.compare)
    plots = []
    for workdir in f.workdir:
        run = load_run(workdir, f.step)
        out = run.workdir / "long_context"
        out.mkdir(parents=True, exist_ok=True)
        if "loss" in f.tasks:
            table = curves[_label(workdir, run.step)] = _loss(run, out, length, f)
            plots.append(out / "loss_by_position.png")
            print(f"{workdir} step {run.step}: loss by position up to {length} tokens")
            for first, last, mean, count, documents in zip(*table):
                print(f"  {first:>7}-{last:<7} {mean:.4f} ({count} tokens, {documents} documents)")
        for haystack in f.passkey_haystacks if "passkey" in f.tasks else ():
            result = _passkey(run, out, lengths, haystack, f)
            print(f"{workdir} step {run.step}: passkey accuracy, {haystack} haystack (rows: depth, "
                  "columns: length)")
            print("  depth  " + " ".join(f"{x:>7}" for x in result.lengths))
            for depth, row in zip(result.depths, result.accuracy):
                print(f"  {depth:<6g} " + " ".join(f"{x:7.2f}" for x in row))
        print(f"wrote {out}/")
    for path in plots:            # every plot shows every run
        lc.plot_loss_by_position(curves, path, training_length=training)


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
