"""The engine: requests, the scheduler that plans each step and books its results, admission,
retraction, policies, stop checks, and the engine process. Torch side.

Importing this package applies the OpenMP thread defaults (see threads) before any engine module
loads torch.
"""
from stemma.engine.threads import apply_defaults

apply_defaults()
