# The native KV-cache manager and request record (ext/kv_cache_manager.pyx)
# have the Python twins' API: the twins' classes are their types. tests/test_native_contract.py
# checks the built module against this declaration.
from trillm.core.kv_cache_manager import KVCacheManager as KVCacheManager
from trillm.core.kv_cache_manager import hash_block_tokens as hash_block_tokens
from trillm.core.kv_cache_manager import request_extra_keys as request_extra_keys
from trillm.core.request import Request as Request
