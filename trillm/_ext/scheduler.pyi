# The native scheduler (ext/scheduler.pyx) has the Python twin's API: the twin's classes are its
# types. tests/test_native_contract.py checks the built module against this declaration.
from trillm.core.request_fits import check_request_fits as check_request_fits
from trillm.core.scheduler import Scheduler as Scheduler
