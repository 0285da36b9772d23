"""The tuner: `job` (its arguments, the sizes each knob setting may time), `search` (what to time next), `trials`
(the study's trials, run until its budget is settled, and the race), `race`, `space`, `study` (Optuna storage,
study identity), `timing` and `worker` (how a configuration is measured), `result` and `run` (`tune` itself)."""
