"""Engine formats: a draft checkpoint -> a folder vLLM or SGLang serves as is.

Each draft algorithm writes its own formats (`Algorithm.export`, e.g. spec_cli/draft/eagle3/export.py);
this package reads what was written the way the engines do, independently of the writer:

    engines.py   how each engine reads such a folder, as tables written from its loader (the self-check)
    reader.py    reads a folder with those tables (the self-check's and `spec eval`'s one reader)
    check.py     reads an export back with reader.py and compares it with the checkpoint
    readme.py    the folder's README.md (serving command, target, measured quality)
    source.py    the checkpoint and what its run knows about it
"""

from spec_cli.draft.algorithm import DTYPES
from spec_cli.draft.algorithms import ALGORITHMS
from spec_cli.errors import ExportCheckError, ExportError

FORMATS = tuple(dict.fromkeys(f for algorithm in ALGORITHMS.values() for f in algorithm.formats))

__all__ = ["DTYPES", "FORMATS", "ExportCheckError", "ExportError"]
