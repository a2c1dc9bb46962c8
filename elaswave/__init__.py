"""ElasWave: an elastic-native runtime for hybrid-parallel LLM training.

Layers import downward only: bus -> comm -> fabric -> engine -> runtime -> cli.
``model`` and ``data`` are leaf packages any layer may use.
"""

__version__ = "0.1.0"
