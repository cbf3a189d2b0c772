# ext/step_plan.pyx: the native scheduler's StepPlan (twin: trillm/core/step_plan.py). Its
# methods are C-level only (cimported by ext/scheduler.pyx through ext/step_plan.pxd): nothing
# here is for Python; the module is a part of trillm._ext.scheduler.
