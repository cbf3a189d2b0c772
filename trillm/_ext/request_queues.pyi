# ext/request_queues.pyx: the native scheduler's waiting and running queues. Its functions are
# C-level only (cimported by ext/scheduler.pyx through ext/request_queues.pxd): nothing here is
# for Python; the module is a part of trillm._ext.scheduler.
