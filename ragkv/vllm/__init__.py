"""ragkv inside vLLM: `RagkvConnector` (ragkv.vllm.connector), a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "RagkvConnector",
                           "kv_connector_module_path": "ragkv.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store_url": "redis://cache:6379/0"}}'

vLLM owns batching, paging, devices and parallelism; ragkv owns the chunk store, the span
finder and fusion. Only `connector.py` imports vLLM; the rest is tested without it.
"""
