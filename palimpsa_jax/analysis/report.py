"""The analysis report of a run (`palimpsa-analyze`): priors against posteriors, memory windows,
the uncertainty's calibration and the metaplasticity ratio over training, as report.md, PNGs
and analysis.json in workdir/analysis.

Everything is measured on a batch of the run's held-out data (MQAR test sequences at the
training setting, or the first rows of the text test corpus) with `analysis.inspect`.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
from flax import nnx

from palimpsa_jax import data as data_lib
from palimpsa_jax.analysis import measures, uncertainty
from palimpsa_jax.analysis.posterior import inspect
from palimpsa_jax.analysis.run import Run, checkpoint_steps, load_run

HISTOGRAM_BINS = np.linspace(0.0, 3.0, 31)     # log10(I / prior) from 1 to 1000
CONSOLIDATED = 2.0                             # "consolidated": importance above 2 x prior


def held_out_batch(config, size: int) -> dict[str, np.ndarray]:
    """`size` held-out sequences of the run: MQAR test examples at its training setting, or the
    first rows of data.test_path (text)."""
    d = config.data
    if d.kind == "mqar":
        source = data_lib.MQARSource("test", max(size, 1), d.vocab_size, d.seq_len, d.num_pairs,
                                     d.seed, d.power_a)
        items = [source[i] for i in range(size)]
        return {"tokens": np.stack([x["tokens"] for x in items]),
                "labels": np.stack([x["labels"] for x in items])}
    if not d.get("test_path"):
        raise FileNotFoundError("data.test_path: the run names no evaluation corpus to analyse on")
    rows = data_lib.PackedRows(d.test_path, d.eos_id, d.seq_len)
    items = [rows[i] for i in range(min(size, len(rows)))]
    return {name: np.stack([x[name] for x in items]) for name in items[0]}


def layer_summary(memory, positions) -> dict:
    """Per-head numbers of one Bayesian layer's memory after the batch (lists, for JSON); the
    median I / prior also after each of `positions`, to see it change along the sequence."""
    importance, mu = np.asarray(memory.final.importance), np.asarray(memory.final.mu)
    prior = np.asarray(memory.prior)
    along = {str(p + 1): np.asarray(measures.ratio_quantiles(
        np.asarray(memory.at.importance)[:, i], prior, (0.5,)))[0].tolist()
        for i, p in enumerate(positions)}
    return {
        "median_ratio_after_tokens": along,
        "prior_shape": list(prior.shape),
        "ratio_quantiles": {str(q): row.tolist() for q, row in zip(
            measures.QUANTILES, np.asarray(measures.ratio_quantiles(importance, prior)))},
        "kl_to_prior": np.asarray(measures.kl_to_prior(mu, importance, prior)).mean(0).tolist(),
        "consolidated_fraction": np.asarray(measures.consolidated_fraction(
            importance, prior, CONSOLIDATED)).mean(0).tolist(),
        "metaplasticity_ratio": np.asarray(measures.metaplasticity_ratio(importance, prior)).tolist(),
        "window_quantiles": {str(q): row.tolist() for q, row in zip(
            measures.QUANTILES, np.asarray(measures.window_quantiles(np.log(memory.alpha))))},
        "learned_prior": {"min": float(prior.min()), "median": float(np.median(prior)),
                          "max": float(prior.max())},
    }


def metaplasticity_over_training(run: Run, batch: dict, steps: list[int]) -> dict[int, dict]:
    """{step: {layer: metaplasticity ratio per head}} from the run's checkpoints at `steps`."""
    out = {}
    for step in steps:
        model = run.model if step == run.step else load_run(run.workdir, step).model
        _, layers = nnx.jit(inspect)(model, batch["tokens"], batch.get("segment_ids"))
        out[step] = {layer: np.asarray(measures.metaplasticity_ratio(
            m.final.importance, m.prior)).tolist() for layer, m in layers.items() if m.final}
    return out


def analyze(workdir, *, size: int = 256, step: int | None = None, out: pathlib.Path | None = None
            ) -> dict:
    """Writes workdir/analysis/{report.md, analysis.json, *.png}; returns analysis.json's dict."""
    run = load_run(workdir, step)
    out = pathlib.Path(out or pathlib.Path(workdir) / "analysis")
    out.mkdir(parents=True, exist_ok=True)
    batch = held_out_batch(run.config, size)
    T = batch["tokens"].shape[1]
    positions = (T // 4 - 1, T // 2 - 1, T - 1)
    logits, layers = nnx.jit(inspect, static_argnums=3)(
        run.model, batch["tokens"], batch.get("segment_ids"), positions)
    bayesian = {layer: m for layer, m in layers.items() if m.final is not None}
    result = {"workdir": str(workdir), "step": run.step, "sequences": int(len(batch["tokens"])),
              "tokens": int(T), "layers": {}}
    for layer, memory in layers.items():
        if memory.final is None:
            result["layers"][layer] = {"window_quantiles": {str(q): row.tolist() for q, row in zip(
                measures.QUANTILES, np.asarray(measures.window_quantiles(np.log(memory.alpha))))}}
        else:
            result["layers"][layer] = layer_summary(memory, positions)
    if bayesian:
        last = max(bayesian)
        tokens = uncertainty.scored_tokens(logits, batch["labels"], bayesian[last].variance)
        calib = uncertainty.calibration(tokens)
        result["uncertainty"] = {"layer": last, "auroc_of_variance_for_errors": calib.auroc,
                                 "spearman_variance_loss": calib.spearman,
                                 "bucket_edges": calib.edges.tolist(),
                                 "accuracy_by_bucket": calib.accuracy.tolist(),
                                 "mean_loss_by_bucket": calib.mean_loss.tolist(),
                                 "count_by_bucket": calib.count.tolist(),
                                 "accuracy": float(tokens.correct.mean())}
        steps = checkpoint_steps(workdir)
        result["metaplasticity_over_training"] = metaplasticity_over_training(run, batch, steps)
        _plots(out, bayesian, tokens, calib, result)
    (out / "analysis.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "report.md").write_text(_markdown(result, bool(bayesian)))
    return result


def _plots(out, bayesian, tokens, calib, result) -> None:
    from matplotlib.figure import Figure

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name)

    fig = Figure(figsize=(4 * len(bayesian), 3.2), dpi=100)
    for ax, (layer, m) in zip(np.atleast_1d(fig.subplots(1, len(bayesian))), bayesian.items()):
        mean = np.asarray(m.mean_importance).mean(0)          # (T, H)
        prior = np.asarray(m.prior).reshape(mean.shape[1], -1).mean(1)
        image = ax.imshow((mean / prior).T, aspect="auto", origin="lower", cmap="viridis")
        ax.set(xlabel="token", ylabel="head", title=f"layer {layer}: mean I / prior")
        fig.colorbar(image, ax=ax)
    save(fig, "importance_over_tokens.png")

    fig = Figure(figsize=(4 * len(bayesian), 3.2), dpi=100)
    for ax, (layer, m) in zip(np.atleast_1d(fig.subplots(1, len(bayesian))), bayesian.items()):
        counts = measures.ratio_histogram(m.final.importance, m.prior, HISTOGRAM_BINS)
        centres = (HISTOGRAM_BINS[1:] + HISTOGRAM_BINS[:-1]) / 2
        for head, row in enumerate(counts):
            ax.plot(centres, row / max(row.sum(), 1), alpha=0.7, label=f"head {head}")
        ax.set(xlabel="log10(I / prior) after the sequence", ylabel="fraction of synapses",
               title=f"layer {layer}")
    ax.legend(fontsize=6)
    save(fig, "importance_histograms.png")

    fig = Figure(figsize=(8, 3.2), dpi=100)
    ax_kl, ax_window = fig.subplots(1, 2)
    for layer, summary in result["layers"].items():
        if "kl_to_prior" in summary:
            ax_kl.plot(summary["kl_to_prior"], "o-", label=f"layer {layer}")
        ax_window.plot(summary["window_quantiles"]["0.5"], "o-", label=f"layer {layer}")
    ax_kl.set(xlabel="head", ylabel="KL(posterior || prior), nats", title="KL by head")
    ax_window.set(xlabel="head", ylabel="median window 1/(1-alpha), tokens", yscale="log",
                  title="memory window (median over tokens)")
    ax_kl.legend(fontsize=7)
    ax_window.legend(fontsize=7)
    save(fig, "kl_and_windows.png")

    fig = Figure(figsize=(8, 3.2), dpi=100)
    ax_acc, ax_loss = fig.subplots(1, 2)
    centres = np.arange(len(calib.accuracy))
    ax_acc.bar(centres, calib.accuracy)
    ax_acc.set(xlabel="variance bucket (equal counts, ascending)", ylabel="accuracy",
               ylim=(0, 1), title=f"AUROC of variance for errors: {calib.auroc:.3f}")
    ax_loss.scatter(tokens.variance, tokens.loss, s=4, alpha=0.4)
    ax_loss.set(xscale="log", xlabel="predictive variance (mean over heads, rows)",
                ylabel="loss of the token", title=f"Spearman {calib.spearman:.3f}")
    save(fig, "uncertainty.png")

    over = result["metaplasticity_over_training"]
    if over:
        fig = Figure(figsize=(5, 3.2), dpi=100)
        ax = fig.subplots()
        for layer in next(iter(over.values())):
            ax.plot(list(over), [np.median(over[s][layer]) for s in over], "o-",
                    label=f"layer {layer}")
        ax.set(xlabel="training step", ylabel="metaplasticity ratio q90/q10 of I/prior",
               title="median over heads, per checkpoint")
        ax.legend(fontsize=7)
        save(fig, "metaplasticity_over_training.png")


def _markdown(result: dict, bayesian: bool) -> str:
    lines = [f"# Analysis of {result['workdir']} at step {result['step']}", "",
             f"On {result['sequences']} held-out sequences of {result['tokens']} tokens.", ""]
    lines += ["| layer | head | median I/prior | q90 I/prior | KL to prior (nats) | consolidated "
              "(I > 2 prior) | metaplasticity q90/q10 | median window |", "|" + "---|" * 8]
    for layer, s in result["layers"].items():
        windows = s["window_quantiles"]["0.5"]
        for head, window in enumerate(windows):
            if "kl_to_prior" in s:
                lines.append(f"| {layer} | {head} | {s['ratio_quantiles']['0.5'][head]:.3f} | "
                             f"{s['ratio_quantiles']['0.9'][head]:.3f} | {s['kl_to_prior'][head]:.1f} | "
                             f"{s['consolidated_fraction'][head]:.3f} | "
                             f"{s['metaplasticity_ratio'][head]:.2f} | {window:.1f} |")
            else:
                lines.append(f"| {layer} | {head} | | | | | | {window:.1f} |")
    if bayesian:
        u = result["uncertainty"]
        lines += ["", f"## Uncertainty (layer {u['layer']}, the last Bayesian layer)", "",
                  f"Accuracy {u['accuracy']:.4f}; AUROC of the predictive variance for errors "
                  f"{u['auroc_of_variance_for_errors']:.3f}; Spearman correlation of variance and "
                  f"loss {u['spearman_variance_loss']:.3f}.", "",
                  "| variance bucket | accuracy | mean loss | tokens |", "|---|---|---|---|"]
        for i, (acc, loss, count) in enumerate(zip(u["accuracy_by_bucket"],
                                                   u["mean_loss_by_bucket"], u["count_by_bucket"])):
            lines.append(f"| {u['bucket_edges'][i]:.3g} - {u['bucket_edges'][i + 1]:.3g} | "
                         f"{acc:.4f} | {loss:.4f} | {count} |")
        layers = list(next(iter(result["metaplasticity_over_training"].values()), {}))
        lines += ["", "## Metaplasticity ratio over training (median over heads)", "",
                  "| step | " + " | ".join(f"layer {layer}" for layer in layers) + " |",
                  "|---|" + "---|" * len(layers)]
        for step, per_layer in result["metaplasticity_over_training"].items():
            lines.append(f"| {step} | " + " | ".join(f"{np.median(v):.2f}" for v in per_layer.values())
                         + " |")
        lines += ["", *(f"![{name}]({name}.png)" for name in (
            "importance_over_tokens", "importance_histograms", "kl_and_windows", "uncertainty",
            "metaplasticity_over_training"))]
    return "\n".join(lines) + "\n"
