"""The tuner, one job per module: `space` (what is searched), `timing` (how a configuration is measured),
`study` (Optuna storage, study identity), `claims` (which worker measures which configuration, the study's
budget), `result` (what is returned) and `run` (`tune` itself)."""
