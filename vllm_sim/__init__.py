"""vllm-sim: a stand-in for vLLM OpenAI-compatible servers, with vLLM's external contract,
automatic prefix caching and continuous batching, for running kvgate without GPUs."""

__version__ = "0.1.0"
