"""An export's README.md (export/readme.py): the serving command, the target, and the quality measured
at the checkpoint's step."""

import pytest
import torch

from spec_cli.stages import export as stage
from tests.export.drafts import read

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fp16_and_readme(run_dir, tmp_path):
    result = stage.run(
        stage.ExportConfig(
            source=run_dir,
            format="sglang",
            output=tmp_path / "out",
            dtype="fp16",
            target="meta-llama/Llama-3.1-8B-Instruct",
        )
    )
    _, tensors = read(result.output)
    assert tensors["fc.weight"].dtype == torch.float16
    readme = (result.output / "README.md").read_text()
    assert (
        "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path"
    ) in readme
    assert (
        "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3"
        in readme
    )
    assert "EAGLE-3 drafts are served by vLLM 0.32-0.34 and SGLang." in readme
    assert (
        "0.500, 0.300" in readme and "1.650" in readme
    )  # the eval at the checkpoint's step (5), not 9
    assert "t" * 16 in readme and "LlamaForCausalLM" in readme
