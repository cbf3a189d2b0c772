"""The sections of tests/support/field_coverage_table.py, one module each."""
