"""`tinypipe profile`: measure what the simulator consumes on this machine's device (docs/architecture.md).

- `layers`: one layer of each kind (embed, block, head) run through the interpreter's own FWD / BWD
  handlers, timed and sized -> a `tinypipe.describe.trace.ProfileTrace` per microbatch size.
- `rates`: host <-> device copy rates and their fixed cost, and the host optimizer's rate
  (fused AdamW, the compact planes step) -> `HostRates`, which can rewrite a hardware preset.
- `profile_flags`: the CLI subcommand's options (no torch import); `command`: its main (checks, progress,
  the files written).
"""
