"""The tuner: `run` (`tune` itself), `job`, `search`, `trials`, `race`, `study`, `space` and `result`."""
