r"""palimpsa-surgery: metaplastic surgery of a pretrained Mamba2 (arXiv 2602.09075).

    palimpsa-surgery --from mamba2-130m --workdir runs/meta_130m --layers weakest:6 \
        --probe corpus/validation.npy [--probe_rows 8] [--tokenizer FILE] \
        [--config experiments/surgery/mamba2.py[:zoo]] --config.data.path=corpus/train.npy \
        [--config.data.test_path=...] [--config.optim.lr=...]
    palimpsa-train --config runs/meta_130m/experiment.py --workdir runs/meta_130m --resume

--from: a pretrained Mamba2 directory (mamba_ssm or transformers layout, as palimpsa-convert
reads it) or a run directory (its latest checkpoint). The memory window of every layer is
measured on --probe_rows rows of data.seq_len tokens of the corpus --probe (a file, glob or
list) and printed; --layers picks the layers to convert to Palimpsa-M: weakest:K (the K largest
windows), all, none (the same fine-tuning run without surgery, the comparison's control) or
indices 0,5,7. The converted model is written as a run at step 0 in --workdir with the config of
--config (`models.surgery.metaplastic_surgery`) and workdir/surgery.json (windows, layers).
Also `python -m palimpsa_jax.commands.surgery`.
"""
from __future__ import annotations

import pathlib
import sys

from absl import flags
from ml_collections import config_flags

from palimpsa_jax.commands import common
from palimpsa_jax.experiments.surgery import mamba2
from palimpsa_jax.models.mamba2_import import CheckpointFormatError
from palimpsa_jax.models.surgery import metaplastic_surgery


def _define_flags():
    flags.DEFINE_string("from", None, "A pretrained Mamba2 directory or a run directory.")
    flags.DEFINE_string("workdir", None, "Directory of the converted run.")
    flags.DEFINE_string("layers", "weakest:8", "weakest:K, all, none or comma-separated layer indices.")
    flags.DEFINE_string("probe", None, "Corpus (file, glob or list of .npy token files) to measure the "
                        "layers' memory windows on.")
    flags.DEFINE_integer("probe_rows", 8, "Rows of data.seq_len tokens of --probe.")
    flags.DEFINE_string("tokenizer", None, "The tokenizer file (default: the source's).")
    common.define_config(config_flags.DEFINE_config_file, "config", str(pathlib.Path(mamba2.__file__)),
                         "The fine-tuning experiment file, path.py[:arg].")
    for name in ("from", "workdir", "probe"):
        flags.mark_flag_as_required(name)


def _main():
    f = flags.FLAGS
    try:
        record = metaplastic_surgery(f["from"].value, f.workdir, f.config, layers=f.layers,
                                     probe_path=f.probe, probe_count=f.probe_rows, tokenizer=f.tokenizer)
    except (CheckpointFormatError, FileExistsError, ValueError) as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    print("layer  mixer        window (median, tokens)")
    for layer, (mixer, window) in enumerate(zip(record["mixers"], record["windows"])):
        shown = "-" if window is None else f"{window:.1f}"
        print(f"{layer:5d}  {mixer:11s}  {shown}")
    print(f"converted layers {record['layers']} ({record['selection']}) into {f.workdir} (step 0); "
          f"fine-tune with: palimpsa-train --config {f.workdir}/experiment.py --workdir {f.workdir} --resume")


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
