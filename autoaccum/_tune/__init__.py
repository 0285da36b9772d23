"""The tuner, one job per module: `space` (what is searched), `timing` (how a configuration is measured),
`study` (Optuna storage, study identity), `result` (what is returned) and `run` (`tune` itself)."""
