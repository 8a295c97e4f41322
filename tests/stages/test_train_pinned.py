"""`spec train` pinned through the real CLI: a six-step run of the tiny peaked Llama's feature
cache (tests/conftest.py `train_setup`), fp32 on the CPU, one thread, and the same run stopped by
SIGTERM and continued with --resume. Pinned: every logged loss (train and eval, with the learning
rate and the gradient norm), exactly as log.jsonl holds them; the keys of each kind of log record;
the sha256 of the last checkpoint's weights and optimizer state; its trainer_state.json; the files
of the run folder; the lines the runs print (timings masked); and that the stopped and resumed run
ends with the uninterrupted run's weights, log and files.

The values are those the code gave before the trainer became a package (spec_cli/trainer/), recorded
with torch 2.13.0+cpu; moving the code was to change none of them. A change that moves any of them
must say why (in its commit and CHANGELOG.md); print the new ones with SPEC_PRINT_PINNED=1 -s.
CPUs of another class (AVX2, AVX512, AMX) sum fp32 in another order, so the floats and the weights
are compared to 1e-5 relative; the stopped-and-resumed twin equals the straight run exactly.
"""

import hashlib
import json
import os
import pprint
import re
import signal

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_post_hook

from spec_cli import console
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

# (step, lr, loss, step_loss, grad_norm) of each train record, as log.jsonl holds them
TRAIN = [
    (
        1,
        0.003,
        4.921414375305176,
        [4.947841167449951, 4.9000630378723145, 4.90681266784668],
        6.2354536056518555,
    ),
    (
        2,
        0.003,
        4.248842716217041,
        [4.237423419952393, 4.246521472930908, 4.269586563110352],
        3.839146375656128,
    ),
    (
        3,
        0.002713525491562421,
        3.9776198863983154,
        [3.9644627571105957, 3.9802608489990234, 3.9948770999908447],
        4.238696098327637,
    ),
    (
        4,
        0.0019635254915624212,
        3.9654083251953125,
        [3.9593334197998047, 3.9650919437408447, 3.975297451019287],
        2.7696168422698975,
    ),
    (
        5,
        0.001036474508437579,
        4.117107391357422,
        [4.105470180511475, 4.115367889404297, 4.137465476989746],
        2.83857798576355,
    ),
    (
        6,
        0.000286474508437579,
        4.266874313354492,
        [4.2535786628723145, 4.256696701049805, 4.300371170043945],
        2.963547945022583,
    ),
]
# (step, loss, step_loss) of each eval record
EVAL = [
    (3, 3.760238468647003, [3.7428630590438843, 3.763127386569977, 3.7837772965431213]),
    (6, 3.6556299924850464, [3.638263463973999, 3.657452404499054, 3.6804874539375305]),
]
KEYS = {  # each kind of record's keys, in order
    "train": [
        "split",
        "step",
        "lr",
        "loss",
        "step_loss",
        "acc",
        "acceptance_length",
        "tokens",
        "grad_norm",
        "tokens_per_s",
        "steps_in_record",
        "peak_memory_gb",
        "eta_s",
    ],
    "eval": ["split", "step", "loss", "step_loss", "acc", "acceptance_length", "tokens"],
}
# the last checkpoint's tensors: name -> (sum, sum of absolute values), in float64
WEIGHTS = {
    "d2t": (19143.0, 19143.0),
    "fc.weight": (0.6938220299780369, 158.22353225943516),
    "lm_head.weight": (2.794112830015365, 268.7312644831836),
    "midlayer.hidden_norm.weight": (31.984400391578674, 31.984400391578674),
    "midlayer.input_layernorm.weight": (32.03960573673248, 32.03960573673248),
    "midlayer.mlp.down_proj.weight": (4.605152792748413, 126.11828457443335),
    "midlayer.mlp.gate_proj.weight": (-1.823769821327005, 183.13141595798515),
    "midlayer.mlp.up_proj.weight": (2.8781557679976686, 179.10357422068046),
    "midlayer.post_attention_layernorm.weight": (31.983861088752747, 31.983861088752747),
    "midlayer.self_attn.k_proj.weight": (-2.2357837948948145, 64.4006788971019),
    "midlayer.self_attn.o_proj.weight": (2.1114037085935706, 91.48426459661277),
    "midlayer.self_attn.q_proj.weight": (3.205699094745796, 127.12215645241668),
    "midlayer.self_attn.v_proj.weight": (0.07536245818482712, 62.9862614844169),
    "norm.weight": (31.94653570652008, 31.94653570652008),
    "t2d": (96.0, 96.0),
}
OPTIMIZER = {
    "state.fc.weight.exp_avg": (-0.005706471815891234, 1.1746833116657953),
    "state.fc.weight.exp_avg_sq": (0.009612434465552155, 0.009612434465552155),
    "state.fc.weight.step": (6.0, 6.0),
    "state.lm_head.weight.exp_avg": (-4.062897573930968e-09, 2.1587833387094832),
    "state.lm_head.weight.exp_avg_sq": (0.018645234455025417, 0.018645234455025417),
    "state.lm_head.weight.step": (6.0, 6.0),
    "state.midlayer.hidden_norm.weight.exp_avg": (0.00354081937484807, 0.007537495364431379),
    "state.midlayer.hidden_norm.weight.exp_avg_sq": (
        3.9400405849931985e-05,
        3.9400405849931985e-05,
    ),
    "state.midlayer.hidden_norm.weight.step": (6.0, 6.0),
    "state.midlayer.input_layernorm.weight.exp_avg": (-0.0011086333588536945, 0.003918692572369764),
    "state.midlayer.input_layernorm.weight.exp_avg_sq": (
        1.2006785059526237e-05,
        1.2006785059526237e-05,
    ),
    "state.midlayer.input_layernorm.weight.step": (6.0, 6.0),
    "state.midlayer.mlp.down_proj.weight.exp_avg": (-0.016406518959595218, 1.225370397679736),
    "state.midlayer.mlp.down_proj.weight.exp_avg_sq": (0.011369814004108303, 0.011369814004108303),
    "state.midlayer.mlp.down_proj.weight.step": (6.0, 6.0),
    "state.midlayer.mlp.gate_proj.weight.exp_avg": (0.07609872102440818, 0.6204351924828302),
    "state.midlayer.mlp.gate_proj.weight.exp_avg_sq": (
        0.0033501204400666063,
        0.0033501204400666063,
    ),
    "state.midlayer.mlp.gate_proj.weight.step": (6.0, 6.0),
    "state.midlayer.mlp.up_proj.weight.exp_avg": (0.09897647552446287, 0.7317129647085245),
    "state.midlayer.mlp.up_proj.weight.exp_avg_sq": (0.0040270622680806945, 0.0040270622680806945),
    "state.midlayer.mlp.up_proj.weight.step": (6.0, 6.0),
    "state.midlayer.post_attention_layernorm.weight.exp_avg": (
        -0.0018099239150615176,
        0.02030632486093964,
    ),
    "state.midlayer.post_attention_layernorm.weight.exp_avg_sq": (
        0.00011537941072248259,
        0.00011537941072248259,
    ),
    "state.midlayer.post_attention_layernorm.weight.step": (6.0, 6.0),
    "state.midlayer.self_attn.k_proj.weight.exp_avg": (-0.0036241062139410474, 0.08760148408905621),
    "state.midlayer.self_attn.k_proj.weight.exp_avg_sq": (
        7.89083050368733e-05,
        7.89083050368733e-05,
    ),
    "state.midlayer.self_attn.k_proj.weight.step": (6.0, 6.0),
    "state.midlayer.self_attn.o_proj.weight.exp_avg": (0.03174633194203125, 0.9632331059606258),
    "state.midlayer.self_attn.o_proj.weight.exp_avg_sq": (
        0.008371293321793871,
        0.008371293321793871,
    ),
    "state.midlayer.self_attn.o_proj.weight.step": (6.0, 6.0),
    "state.midlayer.self_attn.q_proj.weight.exp_avg": (0.0033110303768353333, 0.14186628847286897),
    "state.midlayer.self_attn.q_proj.weight.exp_avg_sq": (
        9.015636018364082e-05,
        9.015636018364082e-05,
    ),
    "state.midlayer.self_attn.q_proj.weight.step": (6.0, 6.0),
    "state.midlayer.self_attn.v_proj.weight.exp_avg": (-0.010954138613158193, 0.7213034071208426),
    "state.midlayer.self_attn.v_proj.weight.exp_avg_sq": (
        0.010293890228084024,
        0.010293890228084024,
    ),
    "state.midlayer.self_attn.v_proj.weight.step": (6.0, 6.0),
    "state.norm.weight.exp_avg": (-0.013076827961558735, 0.03628926240176966),
    "state.norm.weight.exp_avg_sq": (0.0002212897903532962, 0.0002212897903532962),
    "state.norm.weight.step": (6.0, 6.0),
}
TRAINER_STATE = {  # the last checkpoint's trainer_state.json
    "epoch": 0,
    "grad_accum": 1,
    "lr": 0.000286474508437579,
    "micro_batches_done": 6,
    "parallel": "single",
    "param_groups": [
        {
            "amsgrad": False,
            "betas": [0.9, 0.95],
            "capturable": False,
            "decoupled_weight_decay": True,
            "differentiable": False,
            "eps": 1e-08,
            "foreach": None,
            "fused": None,
            "lr": 0.000286474508437579,
            "maximize": False,
            "params": [
                "fc.weight",
                "midlayer.input_layernorm.weight",
                "midlayer.hidden_norm.weight",
                "midlayer.self_attn.q_proj.weight",
                "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight",
                "midlayer.self_attn.o_proj.weight",
                "midlayer.post_attention_layernorm.weight",
                "midlayer.mlp.gate_proj.weight",
                "midlayer.mlp.up_proj.weight",
                "midlayer.mlp.down_proj.weight",
                "norm.weight",
                "lm_head.weight",
            ],
            "weight_decay": 0.0,
        }
    ],
    "precision": "fp32",
    "schema_version": 1,
    "step": 6,
    "total_steps": 6,
    "world_size": 1,
}
FILES = [  # of the run folder
    ".spec.lock",
    "checkpoints/step-00000006/config.json",
    "checkpoints/step-00000006/model.safetensors",
    "checkpoints/step-00000006/optimizer.safetensors",
    "checkpoints/step-00000006/rng.safetensors",
    "checkpoints/step-00000006/trainer_state.json",
    "frozen.safetensors",
    "log.jsonl",
    "run.json",
    "training.png",
]
PRINTED = {  # stdout and stderr of each run, lines as `printed` reads them
    "straight": {
        "out": [
            "EAGLE-3 drafts are served by vLLM 0.32-0.34 and SGLang",
            "draft rope: target rope_parameters: theta 10000",
            "training: 15 train / 4 eval batches, 6 steps of 1 micro-batch(es), TTT 3, loss soft-"
            "ce, device cpu, fp32, attention cpu_flash",
            "step 1/6 loss 4.9214 acc 0.000 0.000 0.000 accept len 1.000 T tok/s peak T GB eta T "
            "min",
            "step 2/6 loss 4.2488 acc 0.006 0.000 0.000 accept len 1.006 T tok/s peak T GB eta T "
            "min",
            "step 3/6 loss 3.9776 acc 0.069 0.046 0.040 accept len 1.072 T tok/s peak T GB eta T "
            "min",
            "eval @ 3 loss 3.7602 acc 0.068 0.068 0.068 accept len 1.073",
            "step 4/6 loss 3.9654 acc 0.049 0.049 0.049 accept len 1.051 T tok/s peak T GB eta T "
            "min",
            "step 5/6 loss 4.1171 acc 0.013 0.013 0.013 accept len 1.013 T tok/s peak T GB eta T "
            "min",
            "step 6/6 loss 4.2669 acc 0.018 0.018 0.018 accept len 1.018 T tok/s peak T GB eta T "
            "min",
            "eval @ 6 loss 3.6556 acc 0.068 0.068 0.068 accept len 1.073",
            "train",
            "run RUN",
            "checkpoint RUN/checkpoints/step-00000006",
            "steps 6",
            "time T min",
            "train (last window) loss 4.2669 acc step0 0.018 sim. accept len 1.018",
            "eval loss 3.6556 acc 0.068 0.068 0.068 sim. accept len 1.073",
            "curves RUN/training.png",
        ],
        "err": [],
    },
    "stopped": {
        "out": [
            "EAGLE-3 drafts are served by vLLM 0.32-0.34 and SGLang",
            "draft rope: target rope_parameters: theta 10000",
            "training: 15 train / 4 eval batches, 6 steps of 1 micro-batch(es), TTT 3, loss soft-"
            "ce, device cpu, fp32, attention cpu_flash",
            "step 1/6 loss 4.9214 acc 0.000 0.000 0.000 accept len 1.000 T tok/s peak T GB eta T "
            "min",
            "step 2/6 loss 4.2488 acc 0.006 0.000 0.000 accept len 1.006 T tok/s peak T GB eta T "
            "min",
            "step 3/6 loss 3.9776 acc 0.069 0.046 0.040 accept len 1.072 T tok/s peak T GB eta T "
            "min",
            "stopped by SIGTERM after step 3: saved RUN/checkpoints/step-00000003; rerun with "
            "--resume to continue",
        ],
        "err": [
            "stopped (SIGTERM); finished work is kept: rerun the same command to continue "
            "(regenerate and precompute go on where they stopped, train with --resume)",
        ],
    },
    "resumed": {
        "out": [
            "EAGLE-3 drafts are served by vLLM 0.32-0.34 and SGLang",
            "draft rope: target rope_parameters: theta 10000",
            "resuming from RUN/checkpoints/step-00000003 (step 3)",
            "training: 15 train / 4 eval batches, 6 steps of 1 micro-batch(es), TTT 3, loss soft-"
            "ce, device cpu, fp32, attention cpu_flash",
            "step 4/6 loss 3.9654 acc 0.049 0.049 0.049 accept len 1.051 T tok/s peak T GB eta T "
            "min",
            "step 5/6 loss 4.1171 acc 0.013 0.013 0.013 accept len 1.013 T tok/s peak T GB eta T "
            "min",
            "step 6/6 loss 4.2669 acc 0.018 0.018 0.018 accept len 1.018 T tok/s peak T GB eta T "
            "min",
            "eval @ 6 loss 3.6556 acc 0.068 0.068 0.068 accept len 1.073",
            "train",
            "run RUN",
            "checkpoint RUN/checkpoints/step-00000006",
            "steps 6",
            "time T min",
            "train (last window) loss 4.2669 acc step0 0.018 sim. accept len 1.018",
            "eval loss 3.6556 acc 0.068 0.068 0.068 sim. accept len 1.073",
            "curves RUN/training.png",
        ],
        "err": [],
    },
}


def options(setup) -> list[str]:
    return [
        "train",
        "--cache",
        str(setup["cache"]),
        "-v",
        str(setup["vm"]),
        "--ttt-steps",
        "3",
        "--lr",
        "3e-3",
        "--max-steps",
        "6",
        "--log-every",
        "1",
        "--eval-every",
        "3",
        "--save-every",
        "100",
        "--eval-fraction",
        "0.2",
        "--batch-tokens",
        "512",
        "--seed",
        "0",
        "--device",
        "cpu",
        "--precision",
        "fp32",
    ]


def sha256(path) -> str:
    """The tensors' names, dtypes, shapes and bytes in name order (not the file: its header holds
    the run's fingerprints)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(path)).items()):
        digest.update(f"{name} {tensor.dtype} {list(tensor.shape)}\n".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def summary(path) -> dict[str, tuple[float, float]]:
    """name -> (sum, sum of |x|) of each tensor, in float64: what a CPU of another class keeps to
    the last bits."""
    return {
        name: (t.double().sum().item(), t.double().abs().sum().item())
        for name, t in sorted(load_file(str(path)).items())
    }


def same_tensors(got, pinned) -> bool:
    """summary()s equal to fp32's last bits: each sum to 1e-5 of its tensor's sum of |x| (a sum of
    mixed signs keeps the absolute error, not the relative one), each sum of |x| to 1e-5."""
    return got.keys() == pinned.keys() and all(
        abs(got[k][0] - s) <= 1e-5 * a + 1e-9 and got[k][1] == pytest.approx(a, rel=1e-5, abs=1e-9)
        for k, (s, a) in pinned.items()
    )


def close(got, pinned) -> bool:
    """Equal structure, floats to 1e-5 relative (CPU classes differ in fp32's last bits)."""
    if isinstance(pinned, float):
        return got == pytest.approx(pinned, rel=1e-5, abs=1e-7)
    if isinstance(pinned, (list, tuple)):
        return len(got) == len(pinned) and all(close(g, p) for g, p in zip(got, pinned))
    if isinstance(pinned, dict):
        return got.keys() == pinned.keys() and all(close(got[k], v) for k, v in pinned.items())
    return got == pinned


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def numbers(run) -> tuple[list, list]:
    found = records(run)
    train = [r for r in found if r["split"] == "train"]
    return (
        [(r["step"], r["lr"], r["loss"], r["step_loss"], r["grad_norm"]) for r in train],
        [(r["step"], r["loss"], r["step_loss"]) for r in found if r["split"] == "eval"],
    )


def files(run) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


TIMINGS = (
    (r"\d+ tok/s", "T tok/s"),
    (r"peak [\d.]+ GB", "peak T GB"),
    (r"eta [\d.]+ min", "eta T min"),
    (r"time [\d.]+ min", "time T min"),
)


def printed(capsys, run) -> dict[str, list[str]]:
    """stdout's and stderr's lines, one space for any run of whitespace, the run folder as RUN,
    timings as T."""
    out = capsys.readouterr()

    def plain(text: str) -> list[str]:
        lines = []
        for line in text.replace(str(run), "RUN").splitlines():
            line = " ".join(line.split())
            for pattern, mask in TIMINGS:
                line = re.sub(pattern, mask, line)
            if line:
                lines.append(line)
        return lines

    return {"out": plain(out.out), "err": plain(out.err)}


@pytest.fixture
def wide(monkeypatch):
    """Lines as written, not folded at the terminal's width (paths stay whole)."""
    monkeypatch.setattr(console.console, "_width", 1000)
    monkeypatch.setattr(console.err_console, "_width", 1000)


def sigterm_during_update(n: int):
    """SIGTERM to this process during its n-th optimizer update (in-process: deterministic)."""
    done = [0]

    def hook(optimizer, args, kwargs):
        done[0] += 1
        if done[0] == n:
            os.kill(os.getpid(), signal.SIGTERM)

    return register_optimizer_step_post_hook(hook)


def test_a_short_run_and_its_stopped_and_resumed_twin_are_pinned(
    train_setup, tmp_path, capsys, wide
):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    capsys.readouterr()
    assert main([*options(train_setup), "-o", str(straight)]) == 0
    said = {"straight": printed(capsys, straight)}
    last = ckpt.latest_checkpoint(straight)
    got = {
        "TRAIN": numbers(straight)[0],
        "EVAL": numbers(straight)[1],
        "KEYS": {
            split: list(next(r for r in records(straight) if r["split"] == split))
            for split in ("train", "eval")
        },
        "WEIGHTS": summary(last / "model.safetensors"),
        "OPTIMIZER": summary(last / "optimizer.safetensors"),
        "TRAINER_STATE": json.loads((last / "trainer_state.json").read_text()),
        "FILES": files(straight),
    }

    # step 3 evaluates: the stop asked for during its update is answered there, before the
    # evaluation, and step 3 is saved (--save-every 100 saves nothing else)
    handle = sigterm_during_update(3)
    try:
        assert main([*options(train_setup), "-o", str(stopped)]) == 143
    finally:
        handle.remove()
    said["stopped"] = printed(capsys, stopped)
    assert [d.name for d in ckpt.checkpoint_dirs(stopped)] == ["step-00000003"]
    assert main(["train", "--resume", "-o", str(stopped)]) == 0
    said["resumed"] = printed(capsys, stopped)
    got["PRINTED"] = said

    if os.environ.get("SPEC_PRINT_PINNED"):
        print(
            "\n"
            + "\n".join(
                f"{name} = {pprint.pformat(value, width=100)}" for name, value in got.items()
            )
        )
    assert close(got["TRAIN"], TRAIN)
    assert close(got["EVAL"], EVAL)
    assert got["KEYS"] == KEYS
    assert same_tensors(got["WEIGHTS"], WEIGHTS)
    assert same_tensors(got["OPTIMIZER"], OPTIMIZER)
    assert close(got["TRAINER_STATE"], TRAINER_STATE)
    assert got["FILES"] == FILES
    assert said == PRINTED
    # the stopped and resumed run ends where the straight one does: weights, optimizer, log, files
    resumed = ckpt.latest_checkpoint(stopped)
    assert resumed.name == last.name == "step-00000006"
    assert sha256(resumed / "model.safetensors") == sha256(last / "model.safetensors")
    assert sha256(resumed / "optimizer.safetensors") == sha256(last / "optimizer.safetensors")
    assert json.loads((resumed / "trainer_state.json").read_text()) == json.loads(
        (last / "trainer_state.json").read_text()
    )
    assert numbers(stopped) == (
        numbers(straight)[0],
        numbers(straight)[1][1:],
    )  # (the stop came before step 3's evaluation)
    stop_saved = [
        f.replace("step-00000006", "step-00000003") for f in FILES if f.startswith("checkpoints/")
    ]
    assert files(stopped) == sorted(FILES + stop_saved)  # (and the checkpoint the stop saved)
    assert torch.get_num_threads() == 1
