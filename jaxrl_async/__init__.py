"""jaxrl_async: JAX-native, fully asynchronous RL post-training for LLM reasoning."""

__version__ = "0.1.0"
