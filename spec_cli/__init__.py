"""spec_cli: train EAGLE-3 draft models and export them for vLLM and SGLang."""

__version__ = "0.1.0"
