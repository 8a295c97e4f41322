"""spec_cli: train speculative-decoding draft models (EAGLE-3, EAGLE-1/2, P-EAGLE, DFlash, DSpark,
MSD) and export them for vLLM and SGLang."""

__version__ = "0.1.0"
