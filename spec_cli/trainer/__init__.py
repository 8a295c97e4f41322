"""The trainer behind `spec train` (the stage: spec_cli/stages/train.py). One module per concern:

run.py             `train`: set up, build, restore, loop, tear down; `TrainResult`
loop.py            `train_loop`: the steps, the log / eval / save cadence, stop signals, --max-time
trainer.py         `Trainer`: this rank's draft, objective and optimizer; a micro-batch, a step
draft.py           the draft built through its algorithm, the frozen weights copied from the target
device.py          precision, the attention kernel, activation checkpointing by the memory probe,
                   the wiring over ranks (context parallel, DDP)
checkpoints.py     run.json and the frozen weights, a checkpoint's save and restore (RNG included)
resume.py          --resume: the options from run.json, the batch over other ranks, the checks
metrics.py         the metrics' sums, the train record, the held-out evaluation
log.py             the live view, log.jsonl, TensorBoard, training.png
sources.py         the source of supervision, the schedule of batches, the batches themselves
engine.py          --eval-engine: the engine in the loop, the trainer's side
engine_process.py  its worker process as the trainer sees it; RUN/best

A batch's path: sources.open_batches -> loop._step (Trainer.forward_backward,
Trainer.optimizer_step) -> metrics.Metrics -> log.TrainLogger -> checkpoints.save.
"""
