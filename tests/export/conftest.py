"""The synthetic run and one checked export per format, built once for all the export tests."""

import pytest

from spec_cli.stages import export as stage
from tests.export.drafts import FORMATS, make_run


@pytest.fixture(scope="package")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="package")
def exports(run_dir, tmp_path_factory):
    """One checked export per format (bf16)."""
    root = tmp_path_factory.mktemp("exports")
    return {
        fmt: stage.run(stage.ExportConfig(source=run_dir, format=fmt, output=root / fmt))
        for fmt in FORMATS
    }
