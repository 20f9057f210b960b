"""tinypipe beside its peers (RoundPipe, FSDP2, DeepSpeed ZeRO-3) on the same GPU: `run.py` drives one
script per system; README.md says how to run it and how each system is configured."""
