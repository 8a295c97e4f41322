"""Export formats: a draft checkpoint -> a folder a serving engine (vLLM, SGLang) serves as is.

Each draft algorithm writes its own formats (`Algorithm.export`, e.g. spec_cli/draft/eagle3/export.py)
and names the module that reads them back (`Algorithm.export_rules`: eagle3.py for EAGLE-3 and P-EAGLE,
eagle.py for EAGLE-1/2); this package holds those readers, independent of the writers:

    eagle3.py    EAGLE-3 / P-EAGLE exports: the self-check, the format of a folder, the draft it serves

    engines.py   how each engine reads such a folder, as tables written from its loader (the self-check)
    reader.py    reads a folder with those tables (the self-check's and `spec eval`'s one reader)
    check.py     reads an export back with reader.py and compares it with the checkpoint
    readme.py    the folder's README.md (serving command, target, measured quality)
    source.py    the checkpoint and what its run knows about it
"""

from spec_cli.draft import algorithms
from spec_cli.draft.contract import DTYPES
from spec_cli.errors import ExportCheckError, ExportError


def formats() -> tuple[str, ...]:
    """Every --format some registered algorithm writes, in the order they declare them."""
    return tuple(dict.fromkeys(f.name for a in algorithms.ALGORITHMS.values() for f in a.formats))


__all__ = ["DTYPES", "ExportCheckError", "ExportError", "formats"]
