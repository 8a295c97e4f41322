"""The export tests' synthetic run and checked exports, for the writer's tests here."""

from tests.export.conftest import exports, run_dir  # noqa: F401 (fixtures)
