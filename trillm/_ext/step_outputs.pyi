# ext/step_outputs.pyx: the native scheduler's P4 per request (twin:
# trillm/core/step_outputs.py). Its functions are C-level only (cimported by ext/scheduler.pyx
# through ext/step_outputs.pxd): nothing here is for Python; the module is a part of
# trillm._ext.scheduler.
