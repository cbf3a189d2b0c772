# distutils: language = c++
"""Native KV block manager: trillm._ext.kv_cache_manager (twin: trillm/core/kv_cache_manager.py)."""

from cython.operator cimport dereference as cython_deref

include "_kv_core.pxi"
