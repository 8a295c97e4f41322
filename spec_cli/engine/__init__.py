"""Serving engines run from spec_cli (optional extras): vLLM (`spec_cli.engine.vllm`)."""
