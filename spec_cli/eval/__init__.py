"""`spec eval`: real speculative decoding with the draft in PyTorch, measured against the target alone.

target.py       the target with its KV cache and forward hooks on what the draft reads
speculative.py  prefill, verify, accept, and the one decode loop (drafting: the algorithm's)
drafts.py       a draft from a run folder, a checkpoint or an export folder (read as its serving
                engine does)
engine_check.py `spec export`'s engine check: vLLM serving the folder vs this decoder on the checkpoint
prompts.py      MT-bench or a chat file -> conversations of user turns
report.py       acceptance / speed tallies, the table, eval.json and acceptance.png
"""
