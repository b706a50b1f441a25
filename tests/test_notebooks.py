"""Smoke test: every notebooks/*.ipynb executes headless; any cell that raises (the notebooks'
own asserts included) fails that notebook's test. The kernel sees PALIMPSA_NOTEBOOK_SMOKE=1: a
notebook that trains may read it to run the same cells on a shorter budget."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.smoke
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_smoke_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("PALIMPSA_NOTEBOOK_SMOKE", "1")     # the kernel inherits the environment
    notebook = nbformat.read(path, as_version=4)
    # "python3" is ipykernel's native kernel: jupyter_client launches it with sys.executable,
    # so the notebook sees this interpreter (and the installed palimpsa_jax).
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
