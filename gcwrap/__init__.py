"""gcwrap: bring a batch job's output home, live, over an unreliable network."""

__version__ = "0.1.0"
