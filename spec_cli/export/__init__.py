"""Engine formats: a draft checkpoint -> a folder vLLM or SGLang serves as is.

    writers.py   the files each engine loads (config.json, model.safetensors), with the rule sources
    engines.py   how each engine reads such a folder, as tables written from its loader (the self-check)
    reader.py    reads a folder with those tables (the self-check's and `spec eval`'s one reader)
    check.py     reads an export back with reader.py and compares it with the checkpoint
    readme.py    the folder's README.md (serving command, target, measured quality)
    source.py    the checkpoint and what its run knows about it
"""

from spec_cli.export.errors import ExportCheckError, ExportError
from spec_cli.export.writers import DTYPES, FORMATS

__all__ = ["DTYPES", "FORMATS", "ExportCheckError", "ExportError"]
