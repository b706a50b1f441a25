"""The distribution: one top-level package (`palimpsa_jax`), the compute core inside it, every
source file shipped, and scripts that import the installed package."""
import configparser
import importlib
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source folder -> the package it installs as
FOLDERS = {"palimpsa_jax": "palimpsa_jax", "kernels": "palimpsa_jax/kernels",
           "experiments": "palimpsa_jax/experiments"}


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    """The file names inside a wheel built from a copy of the source tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "runs", "build", "*.egg-info", "__pycache__", ".hypothesis", ".whl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp / "dist"), str(source)], check=True)
    (wheel,) = (tmp / "dist").glob("palimpsa_jax-*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_installs_one_top_level_package(wheel_files):
    top = {name.split("/")[0] for name in wheel_files}
    assert {t for t in top if not t.endswith(".dist-info")} == {"palimpsa_jax"}
    assert "kernels" not in top and "experiments" not in top
    (top_level,) = [n for n in wheel_files if n.endswith(".dist-info/top_level.txt")]
    assert top_level


def test_every_source_file_is_shipped(wheel_files):
    """Each .py of palimpsa_jax/, kernels/ and experiments/ is in the wheel under its package
    (the package list in setup.cfg is explicit, so a new subpackage must be added there)."""
    shipped = set(wheel_files)
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT / folder).as_posix()
            assert f"{package}/{relative}" in shipped, f"{folder}/{relative} is not installed"


def test_the_compute_core_imports_under_its_own_name():
    from palimpsa_jax import kernels
    assert pathlib.Path(kernels.__file__).parent == ROOT / "kernels"
    assert importlib.util.find_spec("palimpsa_jax.kernels.palimpsa.pallas_gpu") is not None


def test_console_scripts_name_importable_functions():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = [line.split("=", 1) for line in
               config["options.entry_points"]["console_scripts"].strip().splitlines()]
    assert {name.strip() for name, _ in scripts} >= {"palimpsa-train", "palimpsa-sweep",
                                                     "palimpsa-demo"}
    for _, target in scripts:
        module, function = target.strip().split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_each_command_imports_first_in_a_fresh_process_without_starting_a_backend():
    """What a console script (or a spawned data worker re-importing it) does first: import its
    module alone. No import cycle, and no jax array made at import time (that would start the
    accelerator backend in every worker process)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    modules = [line.split("=", 1)[1].split(":")[0].strip() for line in
               config["options.entry_points"]["console_scripts"].strip().splitlines()]
    for module in [*modules, "palimpsa_jax.experiments.mqar.common", "palimpsa_jax.analysis"]:
        check = (f"import {module}; from jax._src import xla_bridge; "
                 f"assert not xla_bridge._backends, 'a backend started at import'")
        result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                                cwd=ROOT.parent)
        assert result.returncode == 0, (module, result.stderr[-2000:])


def test_scripts_import_the_package_not_their_siblings():
    """No benchmark or command edits sys.path or loads a sibling file through importlib."""
    for path in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "palimpsa_jax").rglob("*.py")]:
        text = path.read_text()
        assert "sys.path" not in text, path
        assert "spec_from_file_location" not in text or path.name == "grid.py", path
