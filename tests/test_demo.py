"""The Quickstart's demo (`palimpsa-demo`) runs on this platform and its backends agree."""
import re

from palimpsa_jax.commands import demo


def test_demo_runs_and_backends_agree(capsys):
    demo.main(["--length", "128", "--heads", "2", "--dk", "8", "--dv", "4", "--recurring", "2"])
    out = capsys.readouterr().out
    errors = [float(x) for x in re.findall(r"relative error of \S+ ([0-9.e+-]+)", out)]
    errors += [float(x) for x in re.findall(r"of gradients ([0-9.e+-]+)", out)]
    assert errors and max(errors) < 1e-4, out
