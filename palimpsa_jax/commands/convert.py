r"""palimpsa-convert: pretrained Mamba2 checkpoints in and out of run directories.

    palimpsa-convert --from mamba2-130m --workdir runs/mamba2_130m \
        --config.data.path=corpus/train.npy [--config.data.test_path=corpus/test.npy] \
        [--config experiments/lm/palimpsa_d.py] [--config.optim.lr=1e-4 ...] [--tokenizer FILE]
    palimpsa-convert --workdir runs/mamba2_130m --to exported/

--from: a local directory holding a mamba_ssm (state-spaces) or transformers Mamba2 checkpoint
(config.json, and model.safetensors, its shards or pytorch_model.bin); it becomes a run at step 0
in --workdir (`models.mamba2_import.import_mamba2`), with the config of --config (default: the
text experiment experiments/lm/palimpsa_d.py) whose model is the checkpoint's, and the tokenizer
next to the checkpoint (or --tokenizer). palimpsa-eval and palimpsa-generate then read it; it
fine-tunes with `palimpsa-train --config <workdir>/experiment.py --workdir <workdir> --resume
--config.train.steps=N` (set optim.* and data.* here: a resumed run keeps them).

--to: the run's latest checkpoint written as transformers' Mamba2ForCausalLM (config.json,
model.safetensors, the run's tokenizer). Also `python -m palimpsa_jax.commands.convert`.
"""
from __future__ import annotations

import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

from palimpsa_jax.commands import common
from palimpsa_jax.experiments.lm import palimpsa_d
from palimpsa_jax.models.mamba2_import import ARCHITECTURE, CheckpointFormatError, export_mamba2, import_mamba2


def _define_flags():
    flags.DEFINE_string("from", None, "Directory of a pretrained Mamba2 to import into --workdir.")
    flags.DEFINE_string("to", None, "Directory to export the run in --workdir to (transformers layout).")
    flags.DEFINE_string("workdir", None, "Directory of the run.")
    flags.DEFINE_string("tokenizer", None, "With --from: the tokenizer file (default: the checkpoint's "
                        "tokenizer.json or tokenizer.model, if any).")
    common.define_config(config_flags.DEFINE_config_file, "config", str(pathlib.Path(palimpsa_d.__file__)),
                         "With --from: the experiment file of the run, path.py[:arg].")
    flags.mark_flag_as_required("workdir")

    @flags.multi_flags_validator(["from", "to"])
    def _one_direction(values):
        if (values["from"] is None) == (values["to"] is None):
            raise flags.ValidationError("give exactly one of --from (import) and --to (export)")
        return True


def _main():
    f = flags.FLAGS
    overrides = [arg.split("=", 1)[0] for arg in sys.argv[1:] if arg.startswith("--config.")]
    fixed = [key for key in overrides if key.split(".")[1] == "model" and key.split(".")[2:3] != []
             and key.split(".")[2] in ARCHITECTURE]
    if f["to"].value is not None and (overrides or f["tokenizer"].present):
        raise app.UsageError("--to exports the run as it is: --config.<key> and --tokenizer go with --from")
    if fixed:
        raise app.UsageError(f"{', '.join(fixed)}: fixed by the checkpoint")
    try:
        if f["from"].value is not None:
            workdir = import_mamba2(f["from"].value, f.workdir, f.config, tokenizer=f.tokenizer)
            print(f"imported {f['from'].value} into {workdir} (step 0)")
        else:
            print(f"exported {f.workdir} to {export_mamba2(f.workdir, f.to)}")
    except (CheckpointFormatError, FileExistsError) as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
