"""KV connectors (vLLM's ``--kv-transfer-config``): prompt KV blocks moved between instances.

``config.py`` parses and checks the flag; ``base.py`` declares the two sides of a connector
(the scheduler's, in the engine core; the worker's, beside the paged KV cache);
``storage.py`` is the file format of the shared-storage connector, whose two sides are in
``shared_storage.py``, whose producer bounds the folder's bytes (``disk_budget.py``);
``scheduler_side.py`` extends either scheduler twin to ask a connector
for a waiting request's external tokens. ``trillm/entrypoints/disagg_proxy.py`` puts a
prefill (kv_producer) and a decode (kv_consumer) instance behind one address.

The KV offload tier (vLLM's ``--kv-offloading-size``) is a connector on the same machinery:
``offload.py`` (scheduler side), ``offload_worker.py`` (worker side), ``offload_fit.py`` and
``offload_config.py`` (the flags); ``worker_side.py`` picks the worker's connector.
"""
