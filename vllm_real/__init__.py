"""A real vLLM fleet on demand: vLLM's CPU build in its own virtualenv, a tiny model built from code,
and a launcher for N servers. Used by ``make test-real``, ``kvgate up --real-vllm N`` and
``kvgate-bench compare --real-vllm N``; ``make real-vllm`` installs it."""
